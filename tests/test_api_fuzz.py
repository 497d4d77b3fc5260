"""Any body a client may send gets an answer in OpenAI's shape: the text, or a 4xx naming what is
wrong. Never a 500, a dropped connection or a hang, and the server serves on afterwards.

Hypothesis writes the bodies: the fields the API knows, with values of every JSON type and
range (huge and negative numbers, nested lists, odd strings), fields it does not know, and
bytes that are not JSON at all. The real API app, engine loop and llama.cpp, in this process.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_checks import engine_served
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings

CONTEXT = 128
SETTINGS = ContextSettings(n_ctx=CONTEXT * 2, n_batch=64, n_seq_max=2, n_threads=1)
ROUTES = ("/v1/chat/completions", "/v1/completions")
ANSWERS = {200, 400, 404, 413}  # served, refused, unknown model, too large


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", "llama", n_blocks=2)
    engine = open_engine(model, [2], SETTINGS)
    with engine_served(engine, 2, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        yield url


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
numbers = st.one_of(st.integers(-5, 300), st.floats(-5, 5, allow_nan=False), json_values)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]) | json_values,
            "content": st.text(max_size=60)
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text()}))
            | json_values,
        },
        optional={"name": json_values},
    ),
    max_size=4,
)
# JSON Schema-like objects: the keywords a schema uses, with any values, nested.
schema_keys = st.sampled_from(
    ["type", "properties", "items", "required", "enum", "const", "minimum", "maximum", "maxLength", "pattern",
     "anyOf", "$ref", "additionalProperties", "format", "prefixItems", "minItems", "uniqueItems"]
)  # fmt: skip
schemas = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object"])}
    ),
    lambda inner: st.dictionaries(
        schema_keys, inner | json_values | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_size=4
    ),
    max_leaves=8,
)
prompts = st.one_of(
    st.text(max_size=80),
    st.lists(st.integers(-2, 400), max_size=20),
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=3),
    json_values,
)
OPTIONAL = {
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "seed": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": numbers,
    "logprobs": json_values,
    "top_logprobs": json_values,
    "logit_bias": json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
    | st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": schemas}),
        }
    )
    | json_values,
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function") | json_values,
                "function": st.fixed_dictionaries(
                    {"name": st.sampled_from(["f", "g", "bad name"])},
                    optional={"parameters": schemas | json_values, "description": json_values},
                ),
            }
        ),
        max_size=2,
    )
    | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "parallel_tool_calls": json_values,
    "user": json_values,
    "echo": json_values,
    "suffix": json_values,
    "an_unknown_field": json_values,
}
bodies = st.fixed_dictionaries(
    {"model": st.just("tiny") | json_values},
    optional={"messages": messages, "prompt": prompts, **OPTIONAL},
)

# Near the valid: the right types, values at and past the edges of their ranges, so that most
# requests are served and the sampling, stop and streaming paths run with awkward settings.
edgy = {
    "max_tokens": st.integers(-1, 40) | st.integers(100, 300),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1.2),
    "top_k": st.integers(-1, 600),
    "seed": st.integers(-(2**64), 2**64),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(-1, 7),
    "top_logprobs": st.integers(-1, 22),
}
plain_text = st.text(st.characters(codec="utf-8"), max_size=60)
near_valid_chats = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": plain_text}
            ),
            min_size=1,
            max_size=4,
        ),
    },
    optional=edgy,
)
near_valid_completions = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": plain_text | st.lists(st.integers(0, 300), min_size=1, max_size=20)},
    optional=edgy,
)


def post(base_url: str, route: str, body: bytes) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=60)
    try:
        connection.request("POST", route, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        connection.close()


def check_answer(status: int, kind: str, payload: bytes) -> None:
    event(f"status {status}")
    assert status in ANSWERS, (status, payload[:300])
    if status != 200:
        error = json.loads(payload)["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] == "invalid_request_error", error
        return
    if kind.startswith("text/event-stream"):
        events = [line.removeprefix(b"data: ") for line in payload.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", payload[-300:]
        for data in events[:-1]:
            assert "error" not in json.loads(data), data
        return
    reply: dict[str, Any] = json.loads(payload)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
    assert reply["usage"]["completion_tokens"] >= 0


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_any_json_body_gets_an_openai_answer(base_url: str, route: str, body: dict[str, Any]) -> None:
    check_answer(*post(base_url, route, json.dumps(body).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_near_valid_bodies_are_served_or_refused_cleanly(base_url: str, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(ROUTES))
    body = data.draw(near_valid_chats if route == ROUTES[0] else near_valid_completions)
    check_answer(*post(base_url, route, json.dumps(body).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_get_an_openai_answer(base_url: str, route: str, raw: bytes) -> None:
    check_answer(*post(base_url, route, raw))


def test_the_server_serves_on_after_the_fuzzing(base_url: str) -> None:
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    status, _, payload = post(base_url, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 4
