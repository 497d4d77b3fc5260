"""OpenAI's Responses API through the official `openai` SDK and the real server, on a tiny qwen3
model with Qwen's tool template (tests/test_tool_calls.py): `responses.create` whole and streamed,
a function call's round trip through `function_call_output` (sent back, or continued with
`previous_response_id`), `responses.parse` with a pydantic model, `GET` and `DELETE`, the key,
greedy text equal to chat completions', and bad input as a clear 4xx, never a 500. The SDK's
own types (openai.types.responses) are the oracle of every shape. The parser, the writer and the
store alone are tested without a model first."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import jsonschema
import openai
import pytest
from agent_models import write_tool_caller
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field
from serving_checks import engine_served
from test_tool_calls import QWEN_TEMPLATE, SETTINGS, WEATHER
from tiny_models import write_tiny_model
from waiting import until
from word_tokens import word_tokens

from kafila.api.asks import CallMade, Turn
from kafila.api.errors import ApiError
from kafila.api.openai_replies import ChatWriter
from kafila.api.reasoning import ThinkReader
from kafila.api.requests import prepare_chat
from kafila.api.responses_replies import ResponsesWriter
from kafila.api.responses_schemas import ResponsesRequest, param_of
from kafila.api.responses_store import ResponseStore, StoredResponse
from kafila.api.schemas import ChatRequest
from kafila.api.server import ApiConfig
from kafila.api.tool_calls import ToolCallStream
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta
from kafila.serving.chat_template import ReplySyntax
from kafila.session.availability import Availability

CONTEXT = 2048
KEY = "sk-kafila-test"
# Each event type's own class in the SDK (its union is discriminated by `type`, which pydantic
# alone does not know).
EVENTS = {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(get_args(ResponseStreamEvent)[0])}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
CHAT_TOOLS: list[Any] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
CONVERSATION: list[Any] = [
    {"role": "user", "content": "hello world"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "the model"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "and the "}, {"type": "input_text", "text": "parts"}]},
]
CHAT_CONVERSATION: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the model"},
    {"role": "user", "content": "and the parts"},
]


# --- the parser, the writer and the store, without a model -----------------------------------------


def body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": CONVERSATION, **fields})


OSLO = '{"city": "Oslo"}'


def test_input_reads_into_the_turns_templates_read() -> None:
    ask, calls = body(
        instructions="Be brief.",
        input=[
            *CONVERSATION,
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": OSLO},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "noon"}]},
            {"role": "developer", "content": "Answer now."},
        ],
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=7, temperature=0.5, top_p=0.9,
    ).ask()  # fmt: skip
    assert ask.turns == (
        Turn("system", "Be brief."),
        Turn("user", "hello world"),
        Turn("assistant", "the model"),
        Turn("user", "and the parts"),
        Turn("assistant", "Let me see.", (CallMade("c1", "get_time", "{}"), CallMade("c2", "get_weather", OSLO)),
             reasoning="Hm."),
        Turn("tool", "rain", call_id="c2", name="get_weather"),
        Turn("tool", "noon", call_id="c1", name="get_time"),
        Turn("system", "Answer now."),
    )  # fmt: skip
    assert calls == {"c1": "get_time", "c2": "get_weather"}
    assert ask.choice.mode == "required" and ask.choice.name == "get_time" and not ask.parallel_calls
    assert ask.output.kind == "json_schema" and ask.output.schema == WEATHER
    generation = ask.generation
    assert generation.limit == 7 and generation.sampling.temperature == 0.5 and generation.sampling.top_p == 0.9
    assert [tool.name for tool in ask.tools] == ["get_weather", "get_time"]
    plain, _ = body(input="hi").ask()
    assert plain.turns == (Turn("user", "hi"),) and plain.choice.mode == "none" and plain.generation.limit is None


def test_a_call_output_finds_its_call_in_the_response_it_continues_or_is_refused() -> None:
    earlier = (Turn("user", "hi"), Turn("assistant", "", (CallMade("c9", "get_time", "{}"),)))
    output = [{"type": "function_call_output", "call_id": "c9", "output": "noon"}]
    ask, _ = body(input=output, instructions="New.").ask(earlier, {"c9": "get_time"})
    assert ask.turns == (Turn("system", "New."), *earlier, Turn("tool", "noon", call_id="c9", name="get_time"))
    with pytest.raises(ApiError) as refused:
        body(input=output).ask()
    assert refused.value.status == 400 and refused.value.param == "input[0].call_id" and "c9" in refused.value.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool 'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "built-in tool 'file_search'"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
        ({"tool_choice": "required"}, None, "needs tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "type 'input_image'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type", "text parts"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "required"),
        ({"input": []}, "input", "at least 1"),
        ({"max_output_tokens": "many"}, "max_output_tokens", "integer"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "name and schema"),
        ({"background": True}, "background", "False"),
        ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"top_logprobs": "3"}, "top_logprobs", "valid integer"),
    ],
)
def test_what_this_server_cannot_do_is_refused_naming_the_field(
    fields: dict[str, Any], param: str | None, words: str
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        body(**fields)
    error = refused.value.errors()[0]
    assert param_of(error["loc"]) == (param or "")
    assert words in str(refused.value)


def events_of(stream: Sequence[bytes]) -> list[Any]:
    """Server-sent events as the SDK's types, each `event:` name the same as its type."""
    out = []
    for chunk in b"".join(stream).decode().split("\n\n"):
        if not chunk:
            continue
        name, data = chunk.split("\n")
        parsed = json.loads(data.removeprefix("data: "))
        assert name == f"event: {parsed['type']}"
        out.append(EVENTS[parsed["type"]].model_validate(parsed))
    return out


def writer(reader: Any = None, kept: list[dict[str, Any]] | None = None) -> ResponsesWriter:
    echo = body().echo()
    return ResponsesWriter("resp_1", "m", echo, reader, None if kept is None else kept.append, len)


THOUGHT = (
    '<think>Look it up.</think>\n\nSure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)


def test_a_stream_tells_reasoning_text_and_a_call_in_the_documented_order() -> None:
    kept: list[dict[str, Any]] = []
    written = writer(ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False), kept)
    stream = written.opening()
    for start in range(0, len(THOUGHT), 5):
        stream += written.delta(TextDelta("r", THOUGHT[start : start + 5]))
    stream += written.end(Finished("r", FinishReason.STOP, 30, 20, cached_tokens=4))
    events = events_of(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    distinct = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert distinct == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
    ]
    reasoning, message, call = final.output
    assert reasoning.content[0].text == "Look it up." and message.content[0].text.strip() == "Sure."
    assert (
        call.name == "get_time" and json.loads(call.arguments) == {"zone": "UTC"} and call.call_id.startswith("call_")
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (30, 20, 50)
    assert usage.input_tokens_details.cached_tokens == 4 and usage.output_tokens_details.reasoning_tokens == len(
        "Look it up."
    )
    assert [Response.model_validate(response) for response in kept] == [final]
    whole = writer(ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False))
    response = Response.model_validate(whole.whole(THOUGHT, Finished("r", FinishReason.STOP, 30, 20), ()))
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text.strip() == "Sure."


def test_a_reply_cut_short_is_incomplete_and_a_failure_fails() -> None:
    written = writer()
    stream = [
        *written.opening(),
        *written.delta(TextDelta("r", " partial")),
        *written.end(Finished("r", FinishReason.LENGTH, 3, 2)),
    ]
    events = events_of(stream)
    assert events[-1].type == "response.incomplete"
    response = events[-1].response
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == " partial"
    failed = writer()
    events = events_of([*failed.opening(), *failed.failed(RequestFailed("r", "the ring broke"))])
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error.message == "the ring broke"
    empty = Response.model_validate(writer().whole("", Finished("r", FinishReason.STOP, 3, 1), ()))
    assert [item.type for item in empty.output] == ["message"] and empty.output_text == ""


def test_top_logprobs_asks_for_log_probabilities_only_with_include() -> None:
    include = ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert body(top_logprobs=3, include=include).ask()[0].generation.alternatives == 3
    assert body(include=include).ask()[0].generation.alternatives == 0
    assert body(top_logprobs=3).ask()[0].generation.alternatives is None  # OpenAI sends none without include
    assert body(top_logprobs=20).echo()["top_logprobs"] == 20 and body().echo()["top_logprobs"] == 0


def logprobs_of(part_or_event: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in part_or_event.logprobs]


def test_output_text_carries_its_own_tokens_log_probabilities_not_reasonings_or_calls() -> None:
    """Each token is one word, space, punctuation or marker of the reply; the message's text gets
    exactly the tokens whose text it is, whole and streamed, in each event's shape."""
    texts, tokens = word_tokens(THOUGHT)
    written = writer(ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False))
    stream = written.opening()
    for start in range(0, len(tokens), 2):
        stream += written.delta(TextDelta("r", "".join(texts[start : start + 2]), tuple(tokens[start : start + 2])))
    stream += written.end(Finished("r", FinishReason.STOP, 30, len(tokens)))
    events = events_of(stream)
    message = events[-1].response.output[1].content[0]
    assert message.text.strip() == "Sure."
    assert "".join(t.token for t in message.logprobs) == message.text  # its own tokens, and only those
    assert [t.bytes for t in message.logprobs] == [list(t.token.encode()) for t in message.logprobs]
    expected = [(t.piece.decode(), t.logprob, [(a.piece.decode(), a.logprob) for a in t.top]) for t in tokens]
    first = texts.index("Sure")  # the reader drops the whitespace after </think>, and its token with it
    assert logprobs_of(message) == expected[first : first + len(message.logprobs)]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [x for e in deltas for x in logprobs_of(e)] == logprobs_of(message)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert logprobs_of(done) == logprobs_of(message)
    (part_done,) = [e for e in events if e.type == "response.content_part.done" and e.part.type == "output_text"]
    assert part_done.part.logprobs == message.logprobs
    whole = writer(ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False))
    response = Response.model_validate(whole.whole(THOUGHT, Finished("r", FinishReason.STOP, 30, 20), tokens))
    assert response.output[1].content[0].logprobs == message.logprobs


def test_a_token_that_splits_a_character_goes_with_the_text_it_completes() -> None:
    """The engine releases a character's text with its last byte's token: all the tokens go out
    with it, each written as OpenAI writes a part of a character."""
    tokens = (TokenLogprob(1, b"Caf", -0.1), TokenLogprob(2, b"\xc3", -0.2), TokenLogprob(3, b"\xa9!", -0.3))
    written = writer()
    events = events_of([
        *written.opening(),
        *written.delta(TextDelta("r", "Caf", tokens[:1])),
        *written.delta(TextDelta("r", "é!", tokens[1:])),
        *written.end(Finished("r", FinishReason.STOP, 3, 3)),
    ])  # fmt: skip
    part = events[-1].response.output[0].content[0]
    assert part.text == "Café!" and [t.token for t in part.logprobs] == ["Caf", "bytes:\\xc3", "bytes:\\xa9\\x21"]
    assert [t.bytes for t in part.logprobs] == [list(b"Caf"), [0xC3], [0xA9, 0x21]]
    deltas = [logprobs_of(e) for e in events if e.type == "response.output_text.delta"]
    assert [len(d) for d in deltas] == [1, 2]
    plain = Response.model_validate(writer().whole("Café!", Finished("r", FinishReason.STOP, 3, 3), ()))
    assert plain.output[0].content[0].logprobs == []  # none asked: none sent


def chunks_of(stream: Sequence[bytes]) -> list[ChatCompletionChunk]:
    """A chat completion stream's chunks as the SDK's type, up to `[DONE]`."""
    data = [chunk.removeprefix("data: ") for chunk in b"".join(stream).decode().split("\n\n") if chunk]
    assert data[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate_json(chunk) for chunk in data[:-1]]


def test_chat_content_carries_its_own_tokens_log_probabilities_not_reasonings_or_calls() -> None:
    """Chat completions read their reply with the same `TokenTexts`: each `content` delta carries
    exactly the tokens whose text it is; `reasoning_content` and tool-call deltas carry none, as
    OpenAI's; the whole reply's `logprobs.content` is what the stream's content carried."""
    texts, tokens = word_tokens(THOUGHT)

    def chat_writer() -> ChatWriter:
        return ChatWriter("chatcmpl-1", "m", True, reader=ThinkReader(ToolCallStream(ReplySyntax.HERMES, True), False))

    written = chat_writer()
    stream = written.opening()
    for start in range(0, len(tokens), 2):
        stream += written.delta(TextDelta("r", "".join(texts[start : start + 2]), tuple(tokens[start : start + 2])))
    stream += written.end(Finished("r", FinishReason.STOP, 30, len(tokens)))
    choices = [chunk.choices[0] for chunk in chunks_of(stream) if chunk.choices]
    reasoning = [c for c in choices if (c.delta.model_extra or {}).get("reasoning_content")]
    calls = [c for c in choices if c.delta.tool_calls]
    assert reasoning and calls and all(c.logprobs is None for c in reasoning + calls)
    text = "".join(c.delta.content or "" for c in choices)
    assert text.strip() == "Sure."
    carried = [t for c in choices if c.logprobs is not None for t in c.logprobs.content or []]
    assert "".join(t.token for t in carried) == text  # its own tokens, and only those
    expected = [(t.piece.decode(), t.logprob, [(a.piece.decode(), a.logprob) for a in t.top]) for t in tokens]
    first = texts.index("Sure")  # the reader drops the whitespace after </think>, and its token with it
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in carried] == expected[
        first : first + len(carried)
    ]
    reply = ChatCompletion.model_validate(
        chat_writer().whole(THOUGHT, Finished("r", FinishReason.STOP, 30, 20), tokens)
    )
    choice = reply.choices[0]
    assert choice.message.content == "Sure." and choice.message.tool_calls and choice.finish_reason == "tool_calls"
    assert choice.logprobs is not None and choice.logprobs.content == carried


def test_the_store_is_bounded_in_count_and_bytes_and_says_why_an_id_is_missing() -> None:
    store = ResponseStore(max_count=2, max_bytes=2000)

    def stored(n: int, text: str = "") -> StoredResponse:
        return StoredResponse({"id": f"resp_{n}"}, (Turn("user", text),), {})

    for n in range(3):
        store.put(f"resp_{n}", stored(n))
    assert len(store) == 2 and store.get("resp_2").response["id"] == "resp_2"
    with pytest.raises(ApiError) as missing:
        store.get("resp_0", "previous_response_id")
    error = missing.value
    assert error.status == 404 and error.param == "previous_response_id" and "resp_0" in error.message
    assert "expired" in error.message and "last 2" in error.message
    store.put("resp_older", stored(8, "x" * 1500))
    store.put("resp_big", stored(9, "x" * 1500))
    assert len(store) == 1 and store.bytes <= 2000 and store.get("resp_big")
    store.put("resp_huge", stored(9, "x" * 5000))
    with pytest.raises(ApiError, match="expired"):
        store.get("resp_huge")
    store.delete("resp_big")
    with pytest.raises(ApiError, match="deleted"):
        store.get("resp_big")
    with pytest.raises(ApiError, match="never stored"):
        store.get("resp_nobody")
    assert store.bytes == 0


# --- through the SDK and the real server ----------------------------------------------------------


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Availability]]:
    """The tiny qwen3 model with Qwen's tool template, served with an API key."""
    path = write_tiny_model(tmp_path_factory.mktemp("responses") / "q.gguf", "qwen3", 2, chat_template=QWEN_TEMPLATE)
    config = ApiConfig(model_id="tiny", context_per_sequence=CONTEXT, api_key=KEY)
    with engine_served(open_engine(path, [2], SETTINGS), 2, SETTINGS.n_batch, CONTEXT, config) as served:
        yield served


@pytest.fixture(scope="module")
def client(host: tuple[str, Availability]) -> openai.OpenAI:
    return openai.OpenAI(base_url=host[0] + "/v1", api_key=KEY, max_retries=0)


def raw_create(client: openai.OpenAI, **asked: Any) -> Response:
    """`responses.create`'s JSON, validated strictly against the SDK's type."""
    raw = client.responses.with_raw_response.create(**asked)
    return Response.model_validate(raw.http_response.json())


def test_create_answers_with_a_message_and_usage(client: openai.OpenAI) -> None:
    response = raw_create(
        client, model="tiny", instructions="Be brief.", input=CONVERSATION, max_output_tokens=6, temperature=0,
        metadata={"who": "test"},
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status in ("completed", "incomplete") and response.instructions == "Be brief."
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.role == "assistant" and message.id.startswith("msg_") and message.content[0].type == "output_text"
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= 6 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = client.responses.create(
        model="tiny", instructions="Be brief.", input=CONVERSATION, max_output_tokens=6, temperature=0
    )
    assert again.output_text == response.output_text
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0  # the prefix was reused
    assert response.metadata == {"who": "test"}


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="count to one hundred", max_output_tokens=3, temperature=0)
    if response.status == "incomplete":  # (a random tiny model may end at once)
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage is not None and response.usage.output_tokens == 3


def test_greedy_text_equals_chat_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    expected = client.chat.completions.create(model="tiny", messages=CHAT_CONVERSATION, max_tokens=24, temperature=0)
    text = expected.choices[0].message.content
    response = client.responses.create(
        model="tiny", instructions="Be brief.", input=CONVERSATION, max_output_tokens=24, temperature=0
    )
    assert response.output_text == text
    with client.responses.stream(
        model="tiny", instructions="Be brief.", input=CONVERSATION, max_output_tokens=24, temperature=0
    ) as stream:
        events = list(stream)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    # (the SDK's `get_final_response` wants `response.completed`: past max_output_tokens it is `response.incomplete`)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == f"response.{response.status}"
    assert deltas == text and final.output_text == text


LOGPROBS = "message.output_text.logprobs"


def same_logprobs(got: Sequence[Any], expected: Sequence[Any], with_bytes: bool) -> None:
    """The same tokens with the same log probabilities (to 1e-4), and the same alternatives."""
    assert [t.token for t in got] == [t.token for t in expected]
    assert got and all(abs(g.logprob - e.logprob) <= 1e-4 for g, e in zip(got, expected, strict=True))
    for g, e in zip(got, expected, strict=True):
        assert [a.token for a in g.top_logprobs] == [a.token for a in e.top_logprobs]
        assert all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(g.top_logprobs, e.top_logprobs, strict=True))
        if with_bytes:
            assert g.bytes == e.bytes and [a.bytes for a in g.top_logprobs] == [a.bytes for a in e.top_logprobs]


@pytest.mark.parametrize("with_tools", [False, True])
def test_log_probabilities_equal_chat_completions_whole_and_streamed(client: openai.OpenAI, with_tools: bool) -> None:
    """Greedy, as chat completions give them for the same prompt; with tools offered, the reply
    (text: the random model never calls) is read for calls first. The prompt is computed once
    first, so that each request reuses it from the cache alike: a prompt computed whole and one
    computed after a cached prefix differ in their logits' rounding (by up to 0.03 in a log
    probability on this random model, chat completions against themselves)."""
    tools: dict[str, Any] = {"tools": TOOLS} if with_tools else {}
    chat_tools: dict[str, Any] = {"tools": CHAT_TOOLS} if with_tools else {}
    client.chat.completions.create(model="tiny", messages=CHAT_CONVERSATION, max_tokens=1, **chat_tools)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT_CONVERSATION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
        **chat_tools,
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert not chat.choices[0].message.tool_calls
    expected = chat.choices[0].logprobs.content
    asked: dict[str, Any] = {
        "model": "tiny", "instructions": "Be brief.", "input": CONVERSATION, "max_output_tokens": 12,
        "temperature": 0, "top_logprobs": 3, "include": [LOGPROBS], **tools,
    }  # fmt: skip
    response = raw_create(client, **asked)
    assert response.top_logprobs == 3
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.text == chat.choices[0].message.content and part.logprobs is not None
    same_logprobs(part.logprobs, expected, with_bytes=True)
    for token in part.logprobs:
        alternatives = [a.logprob for a in token.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    same_logprobs(deltas, expected, with_bytes=False)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    same_logprobs(done.logprobs, expected, with_bytes=False)
    streamed = events[-1].response.output[0].content[0]  # type: ignore[union-attr]
    same_logprobs(streamed.logprobs, expected, with_bytes=True)


def test_chat_streamed_with_tools_offered_carries_the_whole_replys_log_probabilities(
    host: tuple[str, Availability], client: openai.OpenAI
) -> None:
    """With tools offered the reply is read for calls (text: the random model never calls); the
    stream's content deltas carry the tokens the whole reply's content does (to 1e-4), every token
    generated, and where the texts are the same, the same as the prompt's ids sent to
    /v1/completions (no reader, no grammar) give. The prompt is computed once first, as above, so
    that each request reuses it alike."""
    asked: dict[str, Any] = {
        "model": "tiny", "messages": CHAT_CONVERSATION, "max_tokens": 12, "temperature": 0, "logprobs": True,
        "top_logprobs": 3, "tools": CHAT_TOOLS,
    }  # fmt: skip
    ring = host[1].ring
    assert ring is not None
    prepared = prepare_chat(ChatRequest.model_validate(asked).ask(), ring.template)
    assert prepared.reader is not None
    prompt = ring.tokenize(prepared.text, prepared.add_bos, True)
    client.chat.completions.create(model="tiny", messages=CHAT_CONVERSATION, max_tokens=1, tools=CHAT_TOOLS)
    whole = client.chat.completions.create(**asked)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens > 0
    choice = whole.choices[0]
    assert not choice.message.tool_calls and choice.logprobs is not None and choice.logprobs.content is not None
    expected = choice.logprobs.content
    assert len(expected) == whole.usage.completion_tokens
    assert b"".join(bytes(t.bytes or []) for t in expected).decode(errors="replace") == choice.message.content
    chunks = [chunk for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content
    streamed = [t for chunk in chunks if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content or []]
    same_logprobs(streamed, expected, with_bytes=True)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    assert plain.usage is not None and plain.usage.prompt_tokens_details is not None
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    logprobs = plain.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    # The tools' grammar holds the text to whole characters, so the texts part where the random
    # model's likeliest token would not continue one; up to there they are the same tokens.
    same = 0
    while same < min(len(expected), len(logprobs.tokens)) and logprobs.tokens[same] == expected[same].token:
        same += 1
    assert same > 0
    assert all(abs(p - t.logprob) <= 1e-4 for p, t in zip(logprobs.token_logprobs[:same], expected[:same], strict=True))


def test_without_include_no_log_probabilities_are_sent(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {"model": "tiny", "input": "hello", "max_output_tokens": 4, "temperature": 0}
    response = raw_create(client, **asked, top_logprobs=2)  # OpenAI's way: top_logprobs alone asks for none
    assert response.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    with client.responses.stream(**asked, top_logprobs=2) as stream:
        events = list(stream)
    texts = [e for e in events if e.type in ("response.output_text.delta", "response.output_text.done")]
    assert texts and all(e.logprobs == [] for e in texts)


def test_a_stream_is_the_documented_event_sequence(host: tuple[str, Availability], client: openai.OpenAI) -> None:
    asked = {"model": "tiny", "input": "hello", "max_output_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", host[0] + "/v1/responses", json=asked, headers={"Authorization": f"Bearer {KEY}"}) as got:
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
        events = events_of([got.read()])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
    ]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == events[-4].text
    sdk_kinds = [event.type for event in client.responses.create(**asked)]
    assert sdk_kinds[0] == "response.created" and sdk_kinds[-1] == kinds[-1]


def test_a_function_call_goes_round_through_its_output_and_previous_response_id(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": "tiny", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "max_output_tokens": 200, "temperature": 0,
    }  # fmt: skip
    first = raw_create(client, input="Weather in Paris?", **asked)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert call.name in ("get_weather", "get_time")
    if call.name == "get_weather":
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sun"}'}
    sent_back = client.responses.create(
        model="tiny", tools=TOOLS, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump() for item in first.output], output],
    )  # fmt: skip
    continued = client.responses.create(
        model="tiny", tools=TOOLS, max_output_tokens=8, temperature=0, previous_response_id=first.id, input=[output]
    )
    assert continued.previous_response_id == first.id
    assert sent_back.usage is not None and continued.usage is not None and first.usage is not None
    assert continued.usage.input_tokens == sent_back.usage.input_tokens > first.usage.input_tokens
    assert continued.output_text == sent_back.output_text
    with client.responses.stream(input="Weather in Paris?", **asked) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    streamed_call = streamed.output[-1]
    assert streamed_call.type == "function_call" and streamed_call.arguments == arguments == call.arguments


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lagos"]
    days: int = Field(ge=1, le=7)


def test_parse_reads_the_answer_into_a_pydantic_model(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model="tiny", input="Forecast for Oslo as JSON", text_format=Forecast, max_output_tokens=200, temperature=0
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Forecast)
    shape = client.responses.create(
        model="tiny", input="Any JSON object", text={"format": {"type": "json_object"}}, max_output_tokens=200,
        temperature=0,
    )  # fmt: skip
    if shape.status == "completed":  # (else max_output_tokens cut it: a random model may write a long key)
        assert isinstance(json.loads(shape.output_text), dict)
    assert shape.output_text.lstrip().startswith("{")


def test_get_returns_a_stored_response_and_delete_removes_it(client: openai.OpenAI) -> None:
    made = client.responses.create(model="tiny", input="hello", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match="deleted"):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError, match="deleted"):
        client.responses.create(model="tiny", input="again", previous_response_id=made.id, max_output_tokens=2)
    unstored = client.responses.create(model="tiny", input="hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(unstored.id)
    assert missing.value.body["code"] == "not_found" and unstored.id in missing.value.message  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nothing", max_output_tokens=2)
    assert unknown.value.body["param"] == "previous_response_id" and "resp_nothing" in unknown.value.message  # type: ignore[index]


def test_the_key_guards_every_route(host: tuple[str, Availability]) -> None:
    wrong = openai.OpenAI(base_url=host[0] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="tiny", input="hi", max_output_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.retrieve("resp_x")
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.delete("resp_x")


NOPE = {"type": "nope"}
BAD: list[tuple[Any, int, str | None]] = [
    ({"input": "hi"}, 400, "model"),
    ({"model": "tiny"}, 400, "input"),
    ({"model": "tiny", "input": 5}, 400, "input"),
    ({"model": "tiny", "input": [{"role": "captain", "content": "x"}]}, 400, "input[0].role"),
    ({"model": "tiny", "input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools[0].name"),
    ({"model": "tiny", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[0].call_id"),
    ({"model": "tiny", "input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"model": "other", "input": "x"}, 404, "model"),
    ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": NOPE}}}, 400,
     None),
    ({"model": "tiny", "input": "x", "max_output_tokens": 5000}, 400, "input"),
    ({"model": "tiny", "input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, 400,
     "top_logprobs"),
    ([1, 2], 400, None),
]  # fmt: skip


@pytest.mark.parametrize(("data", "status", "param"), BAD)
def test_bad_input_is_a_clear_4xx_in_openais_shape(
    host: tuple[str, Availability], data: Any, status: int, param: str | None
) -> None:
    got = httpx.post(host[0] + "/v1/responses", json=data, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_an_abandoned_stream_frees_its_slot(host: tuple[str, Availability], client: openai.OpenAI) -> None:
    url, serving = host
    asked = {"model": "tiny", "input": CONVERSATION, "max_output_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=asked, headers={"Authorization": f"Bearer {KEY}"}) as got:
        assert got.status_code == 200
        lines = got.iter_lines()
        assert next(lines) == "event: response.created"
        assert any(line == "event: response.output_text.delta" for line in lines)  # it is generating
        # (the tiny model may write its 1500 tokens within the second: the slot may be free already)
    until(lambda: serving.ring is not None and serving.ring.running == 0, "the abandoned stream's slot is free")
    again = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    assert again.usage is not None and again.usage.output_tokens <= 3


# --- Codex CLI, the real agent --------------------------------------------------------------------

CODEX = Path(__file__).parent.parent / ".agents" / "node_modules" / ".bin" / "codex"  # .ci/run installs it
# Codex's request (its instructions as developer messages, its four function tools) is about
# 27,000 characters, which the tiny vocabulary spells in about 25,000 tokens: room for that and
# the turns after it.
CODEX_CONTEXT = 32768
CODEX_CONFIG = """\
model = "tiny-caller"
model_provider = "kafila"
model_context_window = {context}
web_search = "disabled"
check_for_update_on_startup = false
[analytics]
enabled = false
[feedback]
enabled = false
[features]
goals = false
plugins = false
remote_plugin = false
[agents]
enabled = false
[model_providers.kafila]
name = "Kafila"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "KAFILA_API_KEY"
"""


@pytest.fixture(scope="module")
def codex_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A host serving the tiny model that makes tool calls (agent_models), its names led by "e"."""
    settings = ContextSettings(n_ctx=CODEX_CONTEXT, n_batch=512, n_seq_max=1, n_threads=2)
    path = write_tool_caller(tmp_path_factory.mktemp("codex") / "caller.gguf", prefer=(("e", 5.0),))
    config = ApiConfig(model_id="tiny-caller", context_per_sequence=CODEX_CONTEXT, api_key=KEY)
    with engine_served(open_engine(path, [2], settings), 1, settings.n_batch, CODEX_CONTEXT, config) as (url, _):
        yield url


@pytest.mark.timeout(420)
def test_codex_runs_its_shell_tool_and_sends_the_output_back(codex_host: str, tmp_path: Path) -> None:
    """`codex exec` against the host on the Responses API (streamed, store false): the model's
    call runs as Codex's shell tool (exec_command, its command held by the grammar to an empty
    string, so nothing runs but `bash -lc ''`), and its output comes back as a
    function_call_output that the host pairs with the call and answers with another call, which
    runs too. The tiny model would call forever, and Codex has no turn limit, so the test stops
    it there (by its process id). Codex is told the host (a model provider with wire_api
    "responses"), key and model, with its own settings for the rest: a read-only sandbox and no
    approvals, no web search (a built-in tool), no sub-agent or goal tools, no update check,
    analytics, feedback or plugin sync (its only other traffic, a look-up of github.com)."""
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX} (.ci/run installs it with npm)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(CODEX_CONFIG.format(context=CODEX_CONTEXT, url=codex_host))
    environment = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "CODEX_HOME": str(home),
        "KAFILA_API_KEY": KEY,
    }  # fmt: skip
    command = [
        str(CODEX), "exec", "--json", "--strict-config", "--skip-git-repo-check", "--sandbox", "read-only",
        "--cd", str(work), "List the files here.",
    ]  # fmt: skip
    agent = subprocess.Popen(
        command, cwd=work, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    try:
        assert agent.stdout is not None
        for line in agent.stdout:  # (pytest-timeout bounds this, should Codex hang)
            if line.startswith("{"):
                events.append(json.loads(line))
            ran = [e for e in events if e["type"] == "item.completed" and e["item"]["type"] == "command_execution"]
            if len(ran) == 2 or (events and events[-1]["type"] in ("turn.completed", "turn.failed", "error")):
                break
    finally:
        agent.terminate()
        _, errors = agent.communicate(timeout=30)
    said = f"stderr: {errors[-3000:]}; events: {json.dumps(events)[-4000:]}"
    ran = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "command_execution"]
    assert len(ran) == 2, said
    for item in ran:
        assert item["command"] == "/bin/bash -lc ''" and item["exit_code"] == 0 and item["status"] == "completed", said
    assert list(work.iterdir()) == []
