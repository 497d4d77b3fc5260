"""The API's checks before a request's meaning is read, as pure functions (the running server
is tested with them in test_serve_api)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafila.api.guards import MAX_JSON_DEPTH, BodyRefused, depth, host_allowed, json_object


def test_only_json_bodies_are_taken() -> None:
    assert json_object(b'{"a": 1}', "application/json") == {"a": 1}
    assert json_object(b'{"a": 1}', "Application/JSON; charset=utf-8") == {"a": 1}
    for kind in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        with pytest.raises(BodyRefused) as refused:
            json_object(b'{"a": 1}', kind)
        assert refused.value.status == 415


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "could not parse"),
        (b"[1, 2]", "JSON object"),
        (b"\xff\xfe", "could not parse"),
        (b'{"a": "\\ud800"}', "surrogate"),
        (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", "nests deeper"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
    ],
)
def test_what_no_tokenizer_or_parser_can_take_is_a_400(body: bytes, says: str) -> None:
    with pytest.raises(BodyRefused, match=says) as refused:
        json_object(body, "application/json")
    assert refused.value.status == 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=30,
)


def reference_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


@given(json_values)
def test_depth_counts_nesting_as_recursion_would(value: object) -> None:
    assert depth(value) == reference_depth(value)
    body = json.dumps({"v": value}).encode()
    assert json_object(body, "application/json") == {"v": value}  # within the bound: taken as it is


def test_depth_stops_looking_past_the_bound() -> None:
    deep: object = 0
    for _ in range(10 * MAX_JSON_DEPTH):
        deep = [deep]
    assert depth(deep) == MAX_JSON_DEPTH + 1


@pytest.mark.parametrize(
    "host",
    [None, "localhost", "localhost:8080", "LOCALHOST.", "api.localhost", "127.0.0.1:8080", "192.168.1.20",
     "[::1]:8080", "[fe80::1]", "kafila.lan:8080"],
)  # fmt: skip
def test_addresses_localhost_and_allowed_names_are_answered(host: str | None) -> None:
    assert host_allowed(host, {"kafila.lan"})


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8080", "localhost.attacker.example", "127.0.0.1.nip"]
)
def test_any_other_name_is_refused(host: str) -> None:
    assert not host_allowed(host, {"kafila.lan"})
