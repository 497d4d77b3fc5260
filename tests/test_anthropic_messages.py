"""Anthropic's Messages API through the official `anthropic` SDK and the real server, on a tiny
qwen3 model with Qwen's tool template (tests/test_tool_calls.py): `messages.create` and
`messages.stream`, a `tool_use`/`tool_result` round trip, `count_tokens`, the key as `x-api-key`,
greedy text equal to chat completions', and bad input in Anthropic's error shape, never a 500.
The parser and the writer alone are tested without a model first."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from agent_models import write_tool_caller
from serving_checks import engine_served
from test_tool_calls import QWEN_TEMPLATE, SETTINGS, WEATHER
from tiny_models import write_tiny_model
from waiting import until

from kafila.api.anthropic_routes import MessagesRequest, MessagesWriter, error_response
from kafila.api.asks import CallMade, Turn
from kafila.api.errors import ApiError
from kafila.api.reasoning import ThinkReader
from kafila.api.requests import prepare_chat
from kafila.api.server import ApiConfig
from kafila.api.tool_calls import ToolCallStream
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta
from kafila.serving.chat_template import ChatTemplate, ReplySyntax
from kafila.session.availability import Availability

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3 = ChatTemplate((FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text(), "", "<|im_end|>", "qwen3")
CONTEXT = 2048
KEY = "sk-kafila-test"
# Greedy: the SDK's 2.x releases no longer name the sampling fields, which the API still takes.
GREEDY = {"temperature": 0}
TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Forecast", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the model"},
    {"role": "user", "content": [{"type": "text", "text": "and the "}, {"type": "text", "text": "block"}]},
]


# --- the parser and the writer, without a model ---------------------------------------------------


def body(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 10, "messages": CONVERSATION, **fields})


def test_system_blocks_text_and_tool_results_read_into_template_turns() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask.", "signature": "s"}, call]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "noon"}]},
                {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    ask = body(system=system, messages=messages, metadata={"user_id": "u"}, service_tier="auto").ask()
    assert ask.turns == (
        Turn("system", "Be brief."),
        Turn("user", "What time is it?"),
        Turn("assistant", "", (CallMade("toolu_1", "get_time", '{"zone": "UTC"}'),), reasoning="Ask."),
        Turn("tool", "noon", call_id="toolu_1", name="get_time"),
        Turn("user", "Thanks."),
    )
    assert ask.generation.limit == 10 and ask.generation.sampling.temperature == 1.0


def test_a_system_message_mid_conversation_and_deferred_tools_as_claude_code_sends_them() -> None:
    """Claude Code sends a system message after the first user message, and a placeholder tool
    with `defer_loading` (its definition is loaded only when a tool search finds it): the first is
    a system turn, the second is not shown to the model."""
    messages = [*CONVERSATION[:1], {"role": "system", "content": [{"type": "text", "text": "Note."}]}]
    deferred = {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}
    ask = body(messages=messages, tools=[*TOOLS, deferred]).ask()
    assert ask.turns == (Turn("user", "hello world"), Turn("system", "Note."))
    assert [tool.name for tool in ask.tools] == ["get_weather", "get_time"]


def test_tool_choice_sampling_and_stops_map_to_the_ask() -> None:
    ask = body(
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        temperature=0, top_p=0.5, top_k=3, stop_sequences=["\n\n", "END"],
    ).ask()  # fmt: skip
    assert ask.choice.mode == "required" and ask.choice.name == "get_time" and not ask.parallel_calls
    assert [tool.name for tool in ask.tools] == ["get_time", "get_weather"][::-1]
    sampling = ask.generation.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, 3)
    assert ask.generation.stops == ("\n\n", "END")
    assert body(tools=TOOLS).ask().choice.mode == "auto"
    assert body(tools=TOOLS, tool_choice={"type": "any"}).ask().choice.mode == "required"
    assert body(tools=TOOLS, tool_choice={"type": "none"}).ask().calling_tools() is False


def test_thinking_sent_back_reaches_a_thinking_template() -> None:
    call = {"type": "tool_use", "id": "toolu_9", "name": "get_time", "input": {}}
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need the clock.", "signature": ""}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "noon"}]},
    ]
    prepared = prepare_chat(body(messages=messages, tools=TOOLS, thinking={"type": "enabled"}).ask(), QWEN3)
    assert "<think>\nNeed the clock.\n</think>" in prepared.text and "noon" in prepared.text


def test_thinking_disabled_or_enabled_is_told_to_the_template_and_effort_too() -> None:
    ask = [{"role": "user", "content": "Hi"}]
    assert prepare_chat(body(messages=ask, thinking={"type": "disabled"}).ask(), QWEN3).text.endswith(
        "<think>\n\n</think>\n\n"
    )
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}):
        assert not prepare_chat(body(messages=ask, thinking=thinking).ask(), QWEN3).text.endswith("</think>\n\n")
    assert body(output_config={"effort": "max"}).ask().effort == "high"
    assert body(output_config={"effort": "low"}).ask().effort == "low"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' block"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "runs none"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ],
)
def test_bad_bodies_are_refused_by_the_parser(fields: dict[str, Any], says: str) -> None:
    data = {"model": "m", "max_tokens": 10, "messages": CONVERSATION, **fields}
    data = {name: value for name, value in data.items() if value is not None}
    with pytest.raises(ValueError, match=says):
        MessagesRequest.model_validate(data)


def test_a_result_for_an_unknown_tool_use_is_refused() -> None:
    messages = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
    with pytest.raises(ApiError) as refused:
        body(messages=messages).ask()
    response = error_response(refused.value)
    assert response.status_code == 400
    error = json.loads(bytes(response.body))
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "toolu_x" in error["error"]["message"]


def events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Server-sent events as (name, data); the name is the data's type, as Anthropic's are."""
    out = []
    for frame in b"".join(chunks).decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in out)
    return out


def finished(reason: FinishReason = FinishReason.STOP, stop: str | None = None) -> Finished:
    return Finished("r", reason, prompt_tokens=20, completion_tokens=7, cached_tokens=5, stop=stop)


def stream_of(writer: MessagesWriter, pieces: list[str], end: Finished) -> list[tuple[str, dict[str, Any]]]:
    chunks = writer.opening()
    for piece in pieces:
        chunks += writer.delta(TextDelta("r", piece))
    return events(chunks + writer.end(end))


def test_a_thinking_model_s_stream_is_a_thinking_block_then_a_text_block() -> None:
    writer = MessagesWriter("msg_1", "m", 20, ThinkReader(None, opened=False))
    out = stream_of(writer, ["<th", "ink>\nHm", "m.\n</think>\n\n", "Hi", " there"], finished())
    names = [name for name, _ in out]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert out[2][1]["content_block"]["type"] == "thinking"
    thought = "".join(d["delta"].get("thinking", "") for n, d in out if n == "content_block_delta")
    said = "".join(d["delta"].get("text", "") for n, d in out if n == "content_block_delta")
    assert thought.strip() == "Hmm." and said == "Hi there"
    starts = [d for n, d in out if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "text")]
    assert names.count("content_block_stop") == 2 and names[-2:] == ["message_delta", "message_stop"]
    closing = out[-2][1]
    assert closing["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert closing["usage"]["input_tokens"] == 15 and closing["usage"]["cache_read_input_tokens"] == 5


def test_a_streamed_call_is_a_tool_use_block_with_its_input_as_json_deltas() -> None:
    writer = MessagesWriter("msg_1", "m", 20, ToolCallStream(ReplySyntax.HERMES))
    text = '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    out = stream_of(writer, [text[i : i + 5] for i in range(0, len(text), 5)], finished())
    starts = [d["content_block"] for n, d in out if n == "content_block_start"]
    assert len(starts) == 1 and starts[0]["type"] == "tool_use" and starts[0]["name"] == "get_time"
    assert starts[0]["id"].startswith("toolu_")
    partial = "".join(d["delta"]["partial_json"] for n, d in out if n == "content_block_delta")
    assert json.loads(partial) == {"zone": "UTC"}
    assert out[-2][1]["delta"]["stop_reason"] == "tool_use"
    whole = MessagesWriter("msg_1", "m", 20, ToolCallStream(ReplySyntax.HERMES)).whole(text, finished(), ())
    assert whole["content"] == [{"type": "tool_use", "id": whole["content"][0]["id"], "name": "get_time",
                                 "input": {"zone": "UTC"}}]  # fmt: skip
    assert whole["stop_reason"] == "tool_use"


def test_stop_reasons_and_the_stop_sequence() -> None:
    writer = MessagesWriter("msg_1", "m", 20)
    assert writer.whole("a", finished(stop="END"), ())["stop_sequence"] == "END"
    assert writer.whole("a", finished(stop="END"), ())["stop_reason"] == "stop_sequence"
    assert writer.whole("a", finished(FinishReason.LENGTH), ())["stop_reason"] == "max_tokens"
    assert writer.whole("a", finished(), ())["stop_reason"] == "end_turn"


def test_a_failure_mid_stream_is_an_error_event() -> None:
    writer = MessagesWriter("msg_1", "m", 20)
    chunks = writer.opening() + writer.delta(TextDelta("r", "Hi")) + writer.failed(RequestFailed("r", "it broke"))
    name, data = events(chunks)[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error", "message": "it broke"}}


# --- through the SDK and the real server ----------------------------------------------------------


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Availability]]:
    """The tiny qwen3 model with Qwen's tool template, served with an API key."""
    path = write_tiny_model(tmp_path_factory.mktemp("anthropic") / "q.gguf", "qwen3", 2, chat_template=QWEN_TEMPLATE)
    config = ApiConfig(model_id="tiny", context_per_sequence=CONTEXT, api_key=KEY)
    with engine_served(open_engine(path, [2], SETTINGS), 2, SETTINGS.n_batch, CONTEXT, config) as served:
        yield served


@pytest.fixture(scope="module")
def client(host: tuple[str, Availability]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=host[0], api_key=KEY, max_retries=0)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="tiny", max_tokens=8, system="Be brief.", messages=CONVERSATION, extra_body=GREEDY,
        metadata={"user_id": "someone"},
    )  # fmt: skip
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny" and message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] in (["text"], [])
    assert message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=CONVERSATION)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_greedy_text_equals_chat_completions_whole_and_streamed(
    host: tuple[str, Availability], client: anthropic.Anthropic
) -> None:
    chat = openai.OpenAI(base_url=host[0] + "/v1", api_key=KEY, max_retries=0)
    expected = chat.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *CONVERSATION],  # type: ignore[list-item]
    ).choices[0].message.content  # fmt: skip
    asked: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "extra_body": GREEDY, "system": "Be brief."}
    assert text_of(client.messages.create(messages=CONVERSATION, **asked)) == expected
    with client.messages.stream(messages=CONVERSATION, **asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert text_of(final) == expected and final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)


def test_a_stop_sequence_ends_the_text_and_is_named(client: anthropic.Anthropic) -> None:
    asked: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "extra_body": GREEDY, "messages": CONVERSATION}
    free = text_of(client.messages.create(**asked))
    stop = next(free[i : i + 2] for i in range(2, len(free) - 2) if "\ufffd" not in free[i : i + 2])
    for stream in (False, True):
        message = client.messages.create(stop_sequences=["never-written", stop], stream=False, **asked)
        if stream:
            with client.messages.stream(stop_sequences=["never-written", stop], **asked) as streamed:
                message = streamed.get_final_message()
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert text_of(message) == free[: free.index(stop)]


def test_output_config_s_schema_holds_the_reply(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    form = {"format": {"type": "json_schema", "schema": schema}}
    message = client.messages.create(model="tiny", max_tokens=60, messages=CONVERSATION, output_config=form)  # type: ignore[arg-type]
    if message.stop_reason == "end_turn":  # (a reply cut at max_tokens is a prefix of one)
        jsonschema.validate(json.loads(text_of(message)), schema)
    assert text_of(message).lstrip().startswith("{")


def test_a_tool_use_and_its_result_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(
        model="tiny", max_tokens=200, messages=ask, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, extra_body=GREEDY,
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    answered = [
        *ask,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]},
    ]
    reply = client.messages.create(model="tiny", max_tokens=6, messages=answered, tools=TOOLS)  # type: ignore[arg-type]
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > message.usage.input_tokens


def test_a_streamed_tool_use_carries_its_input_as_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="tiny", max_tokens=200, tools=TOOLS[:1], extra_body=GREEDY,  # type: ignore[arg-type]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:  # fmt: skip
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and "input_json_delta" in deltas
    uses = [block for block in final.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)


def test_the_key_is_taken_as_x_api_key_or_bearer_and_a_wrong_one_is_refused(host: tuple[str, Availability]) -> None:
    url = host[0]
    asked: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "messages": CONVERSATION}
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(**asked).usage.output_tokens <= 2
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**asked)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def _post(url: str, data: Any, path: str = "/v1/messages?beta=true", **headers: str) -> httpx.Response:
    content = data if isinstance(data, bytes) else json.dumps(data).encode()
    sent = {"x-api-key": KEY, "content-type": "application/json", "anthropic-version": "2023-06-01", **headers}
    return httpx.post(url + path, content=content, headers=sent, timeout=60)


@pytest.mark.parametrize(
    ("data", "status", "kind"),
    [
        ({"model": "tiny", "messages": CONVERSATION}, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "tiny", "max_tokens": "ten", "messages": CONVERSATION}, 400, "invalid_request_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": "hello"}, 400, "invalid_request_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, 400,
         "invalid_request_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
         "invalid_request_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
         400, "invalid_request_error"),
        ({"model": "claude-opus-4", "max_tokens": 5, "messages": CONVERSATION}, 404, "not_found_error"),
        ({"model": "tiny", "max_tokens": 1_000_000, "messages": CONVERSATION}, 400, "invalid_request_error"),
        ({"model": "tiny", "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        (b"{not json", 400, "invalid_request_error"),
        ([1, 2], 400, "invalid_request_error"),
    ],
)  # fmt: skip
def test_bad_input_gets_anthropics_error_shape(
    host: tuple[str, Availability], data: Any, status: int, kind: str
) -> None:
    """The same bodies to count_tokens, which needs no max_tokens: answered, or refused alike."""
    for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens"):
        response = _post(host[0], data, path)
        assert response.status_code < 500, response.text
        if path.endswith("beta=true"):
            assert response.status_code == status, response.text
        if response.status_code >= 400:
            error = response.json()
            assert set(error) == {"type", "error"} and error["type"] == "error", error
            assert set(error["error"]) == {"type", "message"} and error["error"]["message"], error
            assert error["error"]["type"] == kind, error


def test_the_sdk_raises_its_own_errors_from_anthropics_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=CONVERSATION)
    assert "tiny" in missing.value.message
    bad = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=5, messages=bad)  # type: ignore[arg-type]
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_other_methods_and_paths_under_messages_answer_in_anthropics_shape(host: tuple[str, Availability]) -> None:
    response = httpx.get(host[0] + "/v1/messages", headers={"x-api-key": KEY})
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    response = _post(host[0], {}, "/v1/messages/batches")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_an_abandoned_stream_frees_its_slot(host: tuple[str, Availability], client: anthropic.Anthropic) -> None:
    url, serving = host
    asked = {"model": "tiny", "max_tokens": 1500, "temperature": 0, "stream": True, "messages": CONVERSATION}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", url + "/v1/messages", json=asked, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        until(lambda: serving.ring is not None and serving.ring.running == 1, "the stream is generating")
    until(lambda: serving.ring is not None and serving.ring.running == 0, "the abandoned stream's slot is free")
    again = client.messages.create(model="tiny", max_tokens=3, messages=CONVERSATION)
    assert again.usage.output_tokens <= 3


# --- Claude Code, the real agent ------------------------------------------------------------------

CLAUDE_CODE = Path(__file__).parent.parent / ".agents" / "node_modules" / ".bin" / "claude"  # .ci/run installs it
AGENT_CONTEXT = 16384  # Claude Code's system prompt and the Write tool: about 9,000 tiny tokens (one a byte)


@pytest.fixture(scope="module")
def caller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A host serving the tiny model that makes a tool call (agent_models), with a key."""
    settings = ContextSettings(n_ctx=AGENT_CONTEXT, n_batch=512, n_seq_max=1, n_threads=2)
    engine = open_engine(write_tool_caller(tmp_path_factory.mktemp("caller") / "caller.gguf"), [2], settings)
    config = ApiConfig(model_id="tiny-caller", context_per_sequence=AGENT_CONTEXT, api_key=KEY)
    with engine_served(engine, 1, settings.n_batch, AGENT_CONTEXT, config) as (url, _serving):
        yield url


@pytest.mark.timeout(420)
def test_claude_code_makes_a_tool_call_and_sends_its_result_back(caller: str, tmp_path: Path) -> None:
    """`claude -p` against the host, one turn with a tool call: the call it is answered with runs
    (Write, held by the grammar to empty strings, which Claude Code refuses as a directory) and
    its result comes back as a `tool_result`, which the host reads and answers (with another call,
    where `--max-turns 2` stops it). Claude Code is told only the host's address, key and model,
    with its own settings for the rest: no telemetry or other traffic, its output within the
    context (it asks 32,000 tokens), and the Write tool alone (a prompt of 9,000 tiny tokens rather
    than about 80,000 with all its tools)."""
    if not CLAUDE_CODE.exists():
        pytest.skip(f"Claude Code is not installed at {CLAUDE_CODE} (.ci/run installs it with npm)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    environment = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": caller,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": "tiny-caller",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
    }
    command = [
        str(CLAUDE_CODE), "-p", "Write hello to a file.", "--tools", "Write", "--max-turns", "2",
        "--output-format", "stream-json", "--verbose",
    ]  # fmt: skip
    done = subprocess.run(command, check=False, cwd=work, env=environment, capture_output=True, text=True, timeout=360)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    said = f"exit {done.returncode}; stderr: {done.stderr[-2000:]}; stdout: {done.stdout[-4000:]}"
    blocks = [(line["type"], block) for line in lines if line["type"] in ("assistant", "user")
              for block in line["message"]["content"]]  # fmt: skip
    uses = [block for kind, block in blocks if kind == "assistant" and block["type"] == "tool_use"]
    results = [block for kind, block in blocks if kind == "user" and block["type"] == "tool_result"]
    assert len(uses) == 2 and all(use["name"] == "Write" and use["id"].startswith("toolu_") for use in uses), said
    assert uses[0]["input"] == {"file_path": "", "content": ""}, said
    assert [result["tool_use_id"] for result in results] == [use["id"] for use in uses], said
    final = lines[-1]
    assert final["type"] == "result" and final["subtype"] == "error_max_turns", said
    assert list(work.iterdir()) == []  # nothing written
