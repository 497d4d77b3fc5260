"""Structured output: `response_format` json_object and json_schema constrain what the model
writes, through the official client, the real server and llama.cpp's grammar sampler on a tiny
random model. Whatever the schema, a reply that ends on its own parses and validates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from serving_checks import engine_served
from tiny_models import write_tiny_model

from kafila.api.structured import MAX_SCHEMA_COUNT, MAX_SCHEMA_DEPTH, SchemaRefused, relaxed, schema_grammar
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.model import ContextSettings

CONTEXT = 512
SETTINGS = ContextSettings(n_ctx=CONTEXT * 2, n_batch=64, n_seq_max=2, n_threads=1)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = write_tiny_model(tmp_path_factory.mktemp("structured") / "tiny.gguf", "llama", n_blocks=2)
    engine = open_engine(model, [2], SETTINGS)
    with engine_served(engine, 2, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _ascii(schema: dict[str, Any]) -> dict[str, Any]:
    """A random model draws byte tokens at random, and llama.cpp's grammar takes some byte runs
    that are not UTF-8 (overlong forms) as characters; they come back as U+FFFD, which counts
    differently. Real models write UTF-8; here the strings' characters are held to ASCII letters."""
    return {**schema, "pattern": f"^[a-z ]{{0,{schema['maxLength']}}}$"}


# Schemas whose every value is bounded (short strings, few items), so that a random model's
# reply ends well within max_tokens: the grammar leaves it nothing else to do.
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)).map(_ascii),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 99),
    ),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet="abcxyz ", min_size=1, max_size=5), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _array(items: dict[str, Any], most: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": most}


def _object(properties: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": [n for n in required if n in properties]}


values = st.recursive(
    leaves,
    lambda inner: (
        st.builds(_array, inner, st.integers(0, 2))
        | st.builds(_object, st.dictionaries(names, inner, max_size=2), st.lists(names, max_size=2, unique=True))
    ),
    max_leaves=4,
)
schemas = st.builds(
    _object, st.dictionaries(names, values, min_size=1, max_size=3), st.lists(names, max_size=3, unique=True)
)


def longest(schema: dict[str, Any]) -> int:
    """The most characters a reply to `schema` may take under its grammar (a value, then at most one
    space; objects and arrays with a space after each bracket and comma), counted from the schema
    alone: every token spells at least one character, so it bounds the tokens too."""
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"]) + 1
    kind = schema["type"]
    if kind == "string":
        return schema["maxLength"] + 3
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"]))) + 1
    if kind == "boolean":
        return len("false") + 1
    if kind == "array":
        return 4 + schema["maxItems"] * (longest(schema["items"]) + 2)
    return 4 + sum(len(json.dumps(key)) + 4 + longest(value) + 2 for key, value in schema["properties"].items())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 1.0]))
def test_any_schema_s_reply_parses_and_validates(
    client: openai.OpenAI, schema: dict[str, Any], seed: int, temperature: float
) -> None:
    """max_tokens at the longest reply the schema allows: whatever is drawn, the reply ends on its own."""
    assume(longest(schema) <= CONTEXT - 64)  # the prompt's tokens aside
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe it as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}},
        max_tokens=longest(schema), seed=seed, temperature=temperature,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", (schema, choice.message.content)
    assert len(choice.message.content or "") <= longest(schema), (schema, choice.message.content)
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_replies_are_an_object_and_streams_agree(client: openai.OpenAI) -> None:
    """Any object: the grammar may let a random model fill one past max_tokens, but this model,
    greedy (a fixed file and decoding: the same reply every run), closes its object well within
    them, so the reply is certain to end on its own and is asserted to parse as an object; a
    stream of the same request writes the same text."""
    asked: dict[str, Any] = {
        "model": "tiny", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
        "seed": 7, "temperature": 0.0, "response_format": {"type": "json_object"},
    }  # fmt: skip
    whole = client.chat.completions.create(**asked)
    text = whole.choices[0].message.content or ""
    assert text.startswith("{")
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**asked, stream=True) if c.choices
    )
    assert streamed == text


def test_legacy_completions_follow_a_schema_too(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=30, temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


THOUSAND = {"type": "integer", "minimum": 0, "maximum": 999}  # an alternation of 1000 values


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "strange"}, "cannot be turned into a grammar"),
        ({"$ref": "https://example.com/schema.json"}, "cannot be turned into a grammar"),
        ({"type": "string", "maxLength": 10**6}, f"exceeds {MAX_SCHEMA_COUNT}"),
        (json.loads('{"type": "array", "items": ' * 14 + "{}" + "}" * 14), "nests deeper"),
        ({"type": "object", "properties": {f"p{i}": {"description": "x" * 200} for i in range(200)}}, "bytes of JSON"),
        ([1, 2], "valid dictionary"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "properties": {"x": {"type": "number", "maximum": 3}}}, "bounds on a number"),
        ({"type": "integer", "minimum": -4}, "one side only"),
        ({"type": "integer", "minimum": 0, "maximum": 10**6}, "integer range"),
        ({"type": "integer", "maximum": 9}, "one side only"),
        (
            {"type": "object", "properties": {f"n{i}": THOUSAND for i in range(60)}},
            "the grammar for this schema would be",
        ),
    ],
)  # fmt: skip
def test_a_schema_the_server_cannot_follow_is_a_400_naming_why(client: openai.OpenAI, schema: Any, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )  # fmt: skip
    assert says in refused.value.message
    assert refused.value.code is None or refused.value.code != "server_error"


def test_json_schema_without_its_schema_and_unknown_types_are_400s(client: openai.OpenAI) -> None:
    for form in ({"type": "json_schema"}, {"type": "yaml"}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=4,
                response_format=form,  # type: ignore[arg-type]
            )


def test_schema_bounds_are_checked_before_conversion() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaRefused, match="nests deeper"):
        schema_grammar(deep)
    assert "root ::=" in schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert "root ::=" in schema_grammar({"type": "array", "items": {}, "maxItems": 2})  # any items


def test_a_grammar_makes_sampling_take_the_whole_row_and_never_plain_argmax() -> None:
    """A head on a member then samples it itself (the grammar travels in its SAMPLER start)."""
    plain = SamplingSettings(temperature=0.0)
    constrained = SamplingSettings(temperature=0.0, grammar='root ::= "a"')
    assert plain.greedy and plain.top_logits == 1
    assert not constrained.greedy and constrained.needs_whole_row


@pytest.mark.parametrize(
    "pattern", ["^(a?){256}$", "^(a*)+$", "^(x|y?){40}$", "^(ab{0,64}){100}$"], ids=["optional", "star", "alt", "count"]
)
def test_a_pattern_that_would_hold_the_sampler_is_refused_before_it_runs(client: openai.OpenAI, pattern: str) -> None:
    """A repetition of what may match nothing makes llama.cpp's grammar follow every reading of
    every token (one such request held a server for minutes): a 400 naming the pattern."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError, match="pattern"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )  # fmt: skip


def test_a_pattern_with_an_escaped_dot_is_followed() -> None:
    """`\\.` in a pattern is a literal dot (llama-cpp-python's converter wrote `\\.` into a GBNF
    literal, which llama.cpp could not parse: a 400 for a valid pattern)."""
    schema = {"type": "object", "properties": {"host": {"type": "string", "pattern": "^[a-z]{1,8}\\.com$"}}}
    grammar = schema_grammar(schema)
    assert '".com"' in grammar and "\\." not in grammar


def test_a_tools_parameters_lose_only_what_no_grammar_keeps() -> None:
    """`relaxed`: what the grammar can hold stays (small integer ranges, followable patterns,
    small counts, nested schemas); what it cannot goes, wherever it sits."""
    schema = {
        "type": "object",
        "properties": {
            "few": {"type": "integer", "minimum": 1, "maximum": 5},
            "many": {"type": "integer", "minimum": 0, "maximum": 10**9},
            "code": {"type": "string", "pattern": "^[a-z]{2}$", "maxLength": 2},
            "runaway": {"type": "string", "pattern": "(a?){300}", "maxLength": 10**6},
            "rate": {"type": ["number", "null"], "minimum": 0, "exclusiveMaximum": 1},
            "list": {"type": "array", "items": {"anyOf": [{"type": "string", "not": {"const": ""}}]}, "maxItems": 3},
        },
    }
    assert relaxed(schema)["properties"] == {
        "few": {"type": "integer", "minimum": 1, "maximum": 5},
        "many": {"type": "integer"},
        "code": {"type": "string", "pattern": "^[a-z]{2}$", "maxLength": 2},
        "runaway": {"type": "string"},
        "rate": {"type": ["number", "null"]},
        "list": {"type": "array", "items": {"anyOf": [{"type": "string"}]}, "maxItems": 3},
    }
    assert relaxed(schema) != schema and schema["properties"]["many"]["maximum"] == 10**9  # a copy
