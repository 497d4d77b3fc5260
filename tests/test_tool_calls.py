"""Tool calling as OpenAI defines it, through the official client and the real server, on a tiny
qwen3 model that carries a Qwen tool-capable chat template: the template is shown the tools, a
forced call is held by a grammar to the tool's schema, the reply is read into `tool_calls`, and the
call and its result go back through the template for the next turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_checks import engine_served
from test_api_fuzz import json_values, post, schemas
from tiny_models import write_tiny_model

from kafila.api.schemas import Message
from kafila.api.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, ToolSpec, tool_call_grammar
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.chat_template import ChatTemplate, ReplySyntax

HERMES = ReplySyntax.HERMES

CONTEXT = 2048  # the tiny vocabulary spells the tools prompt mostly byte by byte: ~1000 tokens
SETTINGS = ContextSettings(n_ctx=CONTEXT * 2, n_batch=256, n_seq_max=2, n_threads=1)
QWEN_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2.5-tools.jinja").read_text()

BAD_TYPE = {"type": "object", "properties": {"a": {"type": "nope"}}}
HUGE_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "x" * 400} for i in range(99)},
}
# An agent's description of its own tool, with constraints no grammar here keeps (Claude Code's
# and Codex's tools have each of these): served, the call held to the rest.
AGENT_TOOL = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 524288},
        "offset": {"type": "integer", "exclusiveMinimum": 0},
        "lines": {"type": "integer", "minimum": 1, "maximum": 9007199254740991},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "mode": {"type": "string", "enum": ["read", "write"]},
        "args": {"description": "Any value, passed on verbatim."},  # no type: any value (Claude Code's Workflow)
    },
    "required": ["path", "mode"],
    "additionalProperties": False,
}
# A tool's result, and the same with nine more digits: the tiny vocabulary has no piece with a
# digit (tests/helpers/tiny_models.py), so each is one byte token, and JSON escaping leaves digits
# as they are. A prompt that holds the result is longer by exactly those nine tokens.
RESULT = '{"forecast": "sun", "code": 7}'
LONGER_RESULT = '{"forecast": "sun", "code": 7123456789}'
EXTRA_RESULT_TOKENS = 9
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lagos"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5, "pattern": "^[A-Za-z/]{0,5}$"}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def split_tool_calls(text: str, syntax: ReplySyntax, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if there is none besides the calls) and its tool calls."""
    content, _, calls = ToolCallStream(syntax, parallel).read_whole(text)
    return content, calls


def _served(path: Path) -> Iterator[openai.OpenAI]:
    engine = open_engine(path, [2], SETTINGS)
    with engine_served(engine, 2, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = tmp_path_factory.mktemp("tools") / "qwen.gguf"
    yield from _served(write_tiny_model(path, "qwen3", n_blocks=2, chat_template=QWEN_TEMPLATE))


@pytest.fixture(scope="module")
def plain_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A model without a chat template of its own: llama.cpp's built-in one knows no tools."""
    yield from _served(write_tiny_model(tmp_path_factory.mktemp("plain") / "plain.gguf", "llama", n_blocks=2))


def _valid_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_a_forced_call_s_arguments_validate_and_its_result_goes_back(
    client: openai.OpenAI, choice: Any, seed: int
) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,  # type: ignore[arg-type]
        max_tokens=200, seed=seed, temperature=1.0,
    )  # fmt: skip
    choice_out = reply.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    calls = choice_out.message.tool_calls or []
    assert len(calls) == 1
    names = {"get_time"} if isinstance(choice, dict) else set(SCHEMAS)
    _valid_call(calls[0], names)

    def answered(result: str, max_tokens: int) -> Any:
        return client.chat.completions.create(
            model="tiny", max_tokens=max_tokens, seed=seed, tools=TOOLS,  # type: ignore[arg-type]
            messages=[
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in calls]},  # type: ignore[misc]
                {"role": "tool", "tool_call_id": calls[0].id, "content": result},
            ],
        )  # fmt: skip

    answer = answered(RESULT, 8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens  # type: ignore[union-attr]
    longer = answered(LONGER_RESULT, 1)
    assert longer.usage.prompt_tokens - answer.usage.prompt_tokens == EXTRA_RESULT_TOKENS  # the result is in the prompt


def test_an_agents_tool_with_constraints_no_grammar_keeps_is_served_and_held_to_the_rest(
    client: openai.OpenAI,
) -> None:
    """The grammar drops what it cannot keep of a tool's parameters (the agent checks its own
    calls), and holds the call to everything else: types, properties, required keys, enums."""
    tool = {"type": "function", "function": {"name": "read_file", "parameters": AGENT_TOOL}}
    kept = {
        **AGENT_TOOL,
        "properties": {
            "path": {"type": "string"},
            "offset": {"type": "integer"},
            "lines": {"type": "integer"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"type": "string", "enum": ["read", "write"]},
            "args": {"description": "Any value, passed on verbatim."},
        },
    }
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[tool], tool_choice="required", max_tokens=300, seed=seed,  # type: ignore[list-item]
            temperature=1.0,
        )  # fmt: skip
        calls = reply.choices[0].message.tool_calls or []
        if reply.choices[0].finish_reason == "length":
            continue  # cut off inside its arguments: nothing to check
        assert len(calls) >= 1 and all(call.function.name == "read_file" for call in calls)  # type: ignore[union-attr]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), kept)  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="maxLength 524288"):  # a response format stays strict
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": AGENT_TOOL}},
        )  # fmt: skip


def test_parallel_calls_and_their_stream_in_openais_delta_shape(client: openai.OpenAI) -> None:
    """The stream's deltas (index, id, name, then argument pieces) add up to the whole reply's calls."""
    asked: dict[str, Any] = {
        "model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 160, "seed": 11, "temperature": 0.0,
    }  # fmt: skip
    whole = client.chat.completions.create(**asked)
    calls = whole.choices[0].message.tool_calls or []
    assert calls
    finished = calls if whole.choices[0].finish_reason == "tool_calls" else calls[:-1]  # max_tokens may cut the last
    assert finished
    for call in finished:
        _valid_call(call, set(SCHEMAS))
    built: dict[int, dict[str, str]] = {}
    reasons = []
    argument_pieces = 0
    for chunk in client.chat.completions.create(**asked, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            entry = built.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += piece.id or ""
            entry["name"] += piece.function.name if piece.function and piece.function.name else ""
            entry["arguments"] += piece.function.arguments if piece.function and piece.function.arguments else ""
            argument_pieces += bool(piece.function and piece.function.arguments)
        reasons.append(chunk.choices[0].finish_reason)
    assert [(b["name"], b["arguments"]) for _, b in sorted(built.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert all(b["id"].startswith("call_") for b in built.values())
    assert argument_pieces > 2 * len(calls)  # the arguments stream as they are written
    expected_reason = whole.choices[0].finish_reason
    assert reasons[-1] == expected_reason and expected_reason in ("tool_calls", "length")


functions = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])}, optional={"parameters": schemas | json_values, "strict": json_values}
)
tool_lists = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": functions}), max_size=3)


# The tool-related parts of a chat request, at random: tools (or any JSON in their place), a choice,
# parallel or not, streamed or not.
tool_requests = st.fixed_dictionaries(
    {
        "tools": tool_lists | json_values,
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
        | json_values,
        "parallel_tool_calls": st.booleans(),
        "stream": st.booleans(),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(asked=tool_requests)
def test_any_tools_are_served_or_refused_with_a_400(client: openai.OpenAI, asked: dict[str, Any]) -> None:
    """Random tool lists and parameter schemas to a model that takes tools: an answer, or a 400."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 24, **asked}
    event(f"status {served_or_refused(client, body)}")


def served_or_refused(client: openai.OpenAI, body: dict[str, Any]) -> int:
    """Posts a chat request as it is: its status, having checked it is an answer in OpenAI's shape
    (streamed to its end without an error where asked) or a 400 that blames the request."""
    status, _, payload = post(
        str(client.base_url).removesuffix("/v1/"), "/v1/chat/completions", json.dumps(body).encode()
    )
    assert status in (200, 400), payload[:300]
    if status == 400:
        assert json.loads(payload)["error"]["type"] == "invalid_request_error"
    elif body.get("stream"):
        assert payload.rstrip().endswith(b"data: [DONE]") and b'"error"' not in payload
    else:
        assert json.loads(payload)["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    return status


def test_tool_choice_none_writes_plain_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=12,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        ([{"type": "retrieval"}], "auto", "function"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "pattern"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "auto", "type object"),
        ([{"type": "function", "function": {"name": "f", "parameters": BAD_TYPE}}], "auto", "into a grammar"),
        ([{"type": "function", "function": {"name": "f", "parameters": HUGE_SCHEMA}}], "required", "bytes of JSON"),
        (TOOLS, {"type": "function", "function": {"name": "absent"}}, "not among the tools"),
        (TOOLS + TOOLS[:1], "auto", "share a name"),
        (None, "required", "needs tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_fault(client: openai.OpenAI, tools: Any, choice: Any, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=4)
    assert says in refused.value.message


def test_a_model_whose_template_has_no_tool_syntax_refuses_tools_but_not_tool_choice_none(
    plain_client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="tool-call syntax"):
        plain_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)  # type: ignore[arg-type]
    reply = plain_client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content is not None


def test_the_template_renders_tools_calls_and_results() -> None:
    template = ChatTemplate(QWEN_TEMPLATE, "", "<|im_end|>", "qwen3")
    assert template.tool_syntax == HERMES
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "noon"}
    messages = [Message.model_validate(m) for m in (*ASK, {"role": "assistant", "tool_calls": [call]}, result)]
    text = template.render([m.turn().for_template() for m in messages], TOOLS).text
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text


def test_hermes_blocks_split_from_text_whole_and_in_any_pieces() -> None:
    """Fed in pieces of any size, the stream's deltas add up to the whole reply's calls; the first
    call's arguments leave as they come, the second (arguments before name) whole at its end."""
    text = (
        'Let me look.<tool_call>\n{"name": "a", "arguments": {"x": {"y": 1}} }\n</tool_call>\n'
        '<tool_call>\n{"arguments": "{}", "name": "b"}\n</tool_call>'
    )
    content, calls = split_tool_calls(text, HERMES)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": {"y": 1}}'), ("b", "{}")]
    assert len(split_tool_calls(text, HERMES, parallel=False)[1]) == 1
    for size in (1, 3, 7):
        stream = ToolCallStream(HERMES)
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])] + stream.finish()
        assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look."
        deltas = [p for p in pieces if isinstance(p, ToolCallDelta)]
        assert [d.name for d in deltas if d.id is not None] == ["a", "b"]
        for index, call in enumerate(calls):
            assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments
        if size == 1:
            assert sum(d.index == 0 and d.id is None for d in deltas) > 5  # streamed, not whole
    assert split_tool_calls("<tool_call>not json</tool_call> and <tool_", HERMES) == (
        "<tool_call>not json</tool_call> and <tool_",
        [],
    )
    assert split_tool_calls("plain", HERMES) == ("plain", [])
    cut = '<tool_call>\n{"name": "a", "arguments": {"x": {"y": 1}} }\n</tool_c'  # max_tokens came first
    assert [c.arguments for c in split_tool_calls(cut, HERMES)[1]] == ['{"x": {"y": 1}}']
    unfinished = '<tool_call>\n{"name": "a", "arguments": {"x": {"y": 1}'
    assert [c.arguments for c in split_tool_calls(unfinished, HERMES)[1]] == ['{"x": {"y": 1}']  # its own "}" kept


def test_the_call_grammar_names_each_tool_once_per_block() -> None:
    grammar = tool_call_grammar(HERMES, [ToolSpec("f", {"type": "object"})], parallel=False, forced=True)
    assert grammar.count("<tool_call>") == 1 and '\\"name\\": \\"f\\"' in grammar
