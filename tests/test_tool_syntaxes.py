"""Tool calls in every syntax the server reads besides Hermes (tests/test_tool_calls.py): Llama 3.x
JSON, Mistral's `[TOOL_CALLS]` list (Nemo) and `[TOOL_CALLS]name[ARGS]` (Small 3.2), and gpt-oss's
harmony, each through the official client and the real server on a tiny model that carries the
family's own chat template (tests/fixtures) and its special tokens; and gpt-oss's channels read
into content and reasoning."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_checks import engine_served
from test_tool_calls import (
    ASK,
    CONTEXT,
    EXTRA_RESULT_TOKENS,
    LONGER_RESULT,
    RESULT,
    SCHEMAS,
    SETTINGS,
    TOOLS,
    WEATHER,
    served_or_refused,
    split_tool_calls,
    tool_requests,
)
from tiny_models import write_tiny_model

from kafila.api.harmony import HarmonyReader
from kafila.api.reasoning import ThinkReader
from kafila.api.requests import reply_reader
from kafila.api.schemas import Message, Tool
from kafila.api.tool_calls import (
    ToolCallStream,
    ToolSpec,
    gather,
    mistral_id_of,
    tool_call_grammar,
)
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.chat_template import ChatTemplate, ReplySyntax

FIXTURES = Path(__file__).parent / "fixtures"
MISTRAL_TOKENS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
MISTRAL_RESULTS = ("[TOOL_RESULTS]", "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Family:
    syntax: ReplySyntax
    arch: str
    template: str  # a file in tests/fixtures
    specials: tuple[str, ...]
    opening: str  # what a model writes to begin a call in "auto"
    system: str | None = None  # Mistral Small's default system message alone is thousands of tiny tokens
    reasons: bool = False  # the opening reasons first ("Checking."), in <think> or on harmony's analysis channel


FAMILIES = {
    "qwen3": Family(
        ReplySyntax.HERMES, "qwen3", "Qwen-Qwen3-0.6B.jinja", ("<think>", "</think>", "<|im_start|>", "<|im_end|>"),
        "<think>\nChecking.\n</think>\n\n<tool_call>", reasons=True,
    ),
    "llama3": Family(
        ReplySyntax.LLAMA3, "llama", "meta-llama-Llama-3.1-8B-Instruct.jinja",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        '{"name": "',
    ),
    "mistral-nemo": Family(
        ReplySyntax.MISTRAL, "llama", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        MISTRAL_TOKENS + MISTRAL_RESULTS, "Let me see. [TOOL_CALLS]",
    ),
    "mistral-small": Family(
        ReplySyntax.MISTRAL_ARGS, "llama", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        (*MISTRAL_TOKENS, *MISTRAL_RESULTS, "[ARGS]", "[CALL_ID]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
         "[TOOL_CONTENT]"),
        "[TOOL_CALLS]", system="Be brief.",
    ),
    "gpt-oss": Family(
        ReplySyntax.HARMONY, "gpt-oss", "openai-gpt-oss-120b.jinja", ("<|constrain|>",),
        # (the recipient in the role: the tiny tokenizer would write "<|channel|> commentary", with a space)
        "<|channel|>analysis<|message|>Checking.<|end|><|start|>assistant to=functions.",
        reasons=True,
    ),
}  # fmt: skip


def _model(family: Family, path: Path) -> Path:
    template = (FIXTURES / family.template).read_text()
    return write_tiny_model(path, family.arch, n_blocks=2, chat_template=template, extra_specials=family.specials)


def _ask(family: Family) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": family.system}] if family.system else []) + ASK


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Family, Any]]:
    family = FAMILIES[request.param]
    engine = open_engine(_model(family, tmp_path_factory.mktemp(request.param) / "m.gguf"), [2], SETTINGS)
    with engine_served(engine, 2, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        yield family, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _valid_call(family: Family, call: Any, names: set[str]) -> None:
    assert call.type == "function"
    if family.syntax in (ReplySyntax.MISTRAL, ReplySyntax.MISTRAL_ARGS):
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id)  # Mistral's templates take no other ids
    else:
        assert call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2])
def test_a_forced_call_is_read_and_its_result_goes_back_through_the_template(
    served: tuple[Family, openai.OpenAI], seed: int
) -> None:
    family, client = served
    reply = client.chat.completions.create(
        model="tiny", messages=_ask(family), tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=200, seed=seed, temperature=1.0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls"
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1
    _valid_call(family, calls[0], set(SCHEMAS))
    for call_id in (calls[0].id, "call_from_another_server"):  # Mistral's: any client id is mapped to 9
        sent = calls[0].model_copy(update={"id": call_id})

        def answered(result: str, max_tokens: int, call_id: str = call_id, sent: Any = sent) -> Any:
            return client.chat.completions.create(
                model="tiny", max_tokens=max_tokens, seed=seed, tools=TOOLS,  # type: ignore[arg-type]
                messages=[
                    *_ask(family),
                    {"role": "assistant", "content": None, "tool_calls": [sent.model_dump()]},  # type: ignore[misc]
                    {"role": "tool", "tool_call_id": call_id, "content": result},
                ],
            )  # fmt: skip

        answer = answered(RESULT, 6)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens  # type: ignore[union-attr]
        longer = answered(LONGER_RESULT, 1)  # the result is in the prompt: nine digits more, nine tokens more
        assert longer.usage.prompt_tokens - answer.usage.prompt_tokens == EXTRA_RESULT_TOKENS, call_id


def test_a_named_call_streams_in_openais_delta_shape(served: tuple[Family, openai.OpenAI]) -> None:
    family, client = served
    asked: dict[str, Any] = {
        "model": "tiny", "messages": _ask(family), "tools": TOOLS, "max_tokens": 120, "temperature": 0.0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
    }  # fmt: skip
    whole = client.chat.completions.create(**asked)
    (call,) = whole.choices[0].message.tool_calls or []
    _valid_call(family, call, {"get_weather"})
    built = {"id": "", "name": "", "arguments": ""}
    reasons = []
    for chunk in client.chat.completions.create(**asked, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            assert piece.index == 0
            built["id"] += piece.id or ""
            built["name"] += piece.function.name if piece.function and piece.function.name else ""
            built["arguments"] += piece.function.arguments if piece.function and piece.function.arguments else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (built["name"], json.loads(built["arguments"])) == (call.function.name, json.loads(call.function.arguments))
    assert built["id"] and reasons[-1] == "tool_calls"


def test_tools_in_auto_are_answered_with_text_or_valid_calls(served: tuple[Family, openai.OpenAI]) -> None:
    family, client = served
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=_ask(family), tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=40, seed=seed, temperature=1.0,
        )  # fmt: skip
        message = reply.choices[0].message
        for call in message.tool_calls or []:
            assert call.function.name in SCHEMAS
        assert message.tool_calls or isinstance(message.content, str)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_in_auto_a_call_the_model_opens_is_held_to_its_schema(tmp_path: Path, name: str) -> None:
    """Logits that force the family's opening (its special tokens among them), then random ones:
    the grammar holds the rest to the tool's schema and the reply reads back as the call."""
    family = FAMILIES[name]
    engine = open_engine(_model(family, tmp_path / "m.gguf"), [2], SETTINGS)
    template = ChatTemplate(engine.chat_template(), *engine.special_text(), family.arch)
    assert template.tool_syntax is family.syntax
    engine.show_special(template.shown_tokens)
    grammar = tool_call_grammar(family.syntax, [ToolSpec("get_weather", WEATHER)], parallel=False, forced=False)
    sampler = engine.sampler(SamplingSettings(temperature=1.0, top_k=0, seed=5, grammar=grammar))
    rng = np.random.default_rng(1)
    try:
        written = engine.tokenize(family.opening, add_special=False, parse_special=True)
        for token in written:
            logits = rng.normal(size=engine.n_vocab()).astype(np.float32)
            logits[token] = 100.0
            assert sampler.sample(logits) == token  # free text, and the opening, are the model's to write
        for _ in range(300):
            token = sampler.sample(rng.normal(size=engine.n_vocab()).astype(np.float32) * 4)
            if engine.is_end(token):
                break
            written.append(token)
        else:
            pytest.fail("the grammar never ended the call")
        text = engine.detokenize(written)
        reader = reply_reader(template, ["get_weather"], parallel=False, thinking=False)
        assert reader is not None
        content, reasoning, calls = gather(reader.feed(text) + reader.finish())
        # (the tiny tokenizer writes a word after a special token with a space: " Checking")
        assert reasoning.strip() == ("Checking." if family.reasons else ""), text
        assert content.strip() in ("", "Let me see.") and len(calls) == 1, text
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    finally:
        sampler.close()
        engine.close()


@pytest.mark.parametrize("served", ["gpt-oss"], indirect=True)
def test_gpt_oss_answers_a_schema_on_its_final_channel(served: tuple[Family, openai.OpenAI]) -> None:
    """The grammar writes the final channel's header before the JSON; the reader shows the JSON alone."""
    _, client = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )  # fmt: skip
    content = reply.choices[0].message.content
    assert content is not None and "<|" not in content
    jsonschema.validate(json.loads(content), schema)


# Pure readers: any syntax's reply, fed in pieces of any size, adds up to the same content and calls.

READS = [
    (ReplySyntax.LLAMA3, '{"name": "f", "parameters": {"a": [1, {"b": "}"}]}}', "", [("f", {"a": [1, {"b": "}"}]})]),
    (ReplySyntax.LLAMA3, '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),
    (ReplySyntax.LLAMA3, 'I think {"name": "f", "parameters": {}}', 'I think {"name": "f", "parameters": {}}', []),
    (ReplySyntax.LLAMA3, '{"x": 1}', '{"x": 1}', []),
    (
        ReplySyntax.MISTRAL,
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": "}]"}}, {"name": "g", "arguments": {}, "id": "a1"}]',
        "Sure.", [("f", {"a": "}]"}), ("g", {})],
    ),
    (ReplySyntax.MISTRAL, '[TOOL_CALLS][{"arguments": {"a": 1}, "name": "f"}]', "", [("f", {"a": 1})]),
    (ReplySyntax.MISTRAL, "[TOOL_CALLS] no list", "[TOOL_CALLS] no list", []),
    (
        ReplySyntax.MISTRAL_ARGS,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[CALL_ID]abc123XYZ[ARGS]{}',
        "", [("get_weather", {"city": "Paris"}), ("g", {})],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), READS)
def test_each_syntax_reads_the_same_whole_and_in_pieces(
    syntax: ReplySyntax, text: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    for size in (1, 2, 5, len(text)):
        stream = ToolCallStream(syntax)
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])] + stream.finish()
        got_content, _, got_calls = gather(pieces)
        assert got_content.strip() == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len(split_tool_calls(text, syntax, parallel=False)[1]) == min(1, len(calls))


HARMONY_READS = [
    (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.",
        "Answer.", "Think.", [],
    ),
    (
        "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "", "Need it.", [("get_weather", {"city": "Paris"})],
    ),
    (' to=functions.f<|channel|>commentary json<|message|>{"a": 1}', "", "", [("f", {"a": 1})]),
    ("<|channel|>commentary to=browser.search<|message|>{}<|end|>", "", "", []),  # a call nobody offered
    ('<|channel|>commentary to=functions.set_alarm json<|message|>{"at": 7}<|end|>', "", "", []),  # nor this
    # Text run on past an offered name is not read into it (a tool the client never offered).
    ('<|channel|>commentary to=functions.get_weatherjson<|message|>{"a": 1}', "", "", [("get_weather", {"a": 1})]),
    ("plain words", "plain words", "", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "reasoning", "calls"), HARMONY_READS)
def test_harmony_reads_channels_and_calls_whole_and_in_pieces(
    text: str, content: str, reasoning: str, calls: list[tuple[str, Any]]
) -> None:
    for size in (1, 3, len(text)):
        reader = HarmonyReader(("get_weather", "f"))
        pieces = [p for i in range(0, len(text), size) for p in reader.feed(text[i : i + size])] + reader.finish()
        got = gather(pieces)
        assert (got[0], got[1]) == (content, reasoning)
        assert [(c.name, json.loads(c.arguments)) for c in got[2]] == calls


def test_mistral_ids_keep_their_pairing() -> None:
    assert mistral_id_of("abc123XYZ") == "abc123XYZ"
    mapped = mistral_id_of("call_0123456789abcdef01234567")
    assert re.fullmatch("[A-Za-z0-9]{9}", mapped) and mapped == mistral_id_of("call_0123456789abcdef01234567")
    assert mapped != mistral_id_of("call_other")


def test_each_template_is_known_by_its_syntax() -> None:
    for family in FAMILIES.values():
        assert ChatTemplate((FIXTURES / family.template).read_text(), "<s>", "</s>", family.arch).tool_syntax is (
            family.syntax
        )
    qwen = (FIXTURES / "qwen2.5-tools.jinja").read_text()
    assert ChatTemplate(qwen, "", "<|im_end|>", "qwen3").tool_syntax is ReplySyntax.HERMES
    assert ChatTemplate(None, "", "", "gpt-oss").reply_syntax is ReplySyntax.HARMONY  # channels, but no tools


def test_gpt_oss_shows_the_reasoning_sent_back_before_its_call() -> None:
    """A harmony reply's `reasoning_content`, sent back with its call, is the analysis the template
    writes before that call (it drops it once a final answer follows)."""
    template = ChatTemplate((FIXTURES / FAMILIES["gpt-oss"].template).read_text(), "", "", "gpt-oss")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "reasoning_content": "Need the time.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    tools = [Tool.model_validate(t).function.tool().for_template() for t in TOOLS]
    text = template.render([Message.model_validate(m).turn().for_template() for m in turns], tools).text
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the time.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>'
    ) in text


def cut(text: str, sizes: list[int]) -> list[str]:
    """`text` in pieces of these sizes, and the rest."""
    pieces, at = [], 0
    for size in sizes:
        pieces.append(text[at : at + size])
        at += size
    return [*pieces, text[at:]]


MARKERS = {
    ReplySyntax.HERMES: ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', "\n"],
    ReplySyntax.LLAMA3: ["<|python_tag|>", '{"name": "f", "parameters": ', " "],
    ReplySyntax.MISTRAL: ["[TOOL_CALLS]", '[{"name": "f", "arguments": ', ", ", "]"],
    ReplySyntax.MISTRAL_ARGS: ["[TOOL_CALLS]", "f", "[ARGS]", "[CALL_ID]"],
    ReplySyntax.HARMONY: ["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>", " to=functions.f"],
}
fragments = st.sampled_from(["{", "}", "[", "]", '"', "\\", "a", ":", ",", " ", "é"])


@settings(max_examples=200, deadline=None)
@given(
    syntax=st.sampled_from(list(ReplySyntax)),
    data=st.data(),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=30),
)
def test_any_text_reads_the_same_in_any_pieces(syntax: ReplySyntax, data: st.DataObject, cuts: list[int]) -> None:
    """Whatever a model writes, in whatever pieces it arrives: no error, and the same content,
    reasoning and calls as the whole text read at once (call ids aside)."""
    parts = data.draw(st.lists(st.sampled_from(MARKERS[syntax]) | fragments, max_size=40))
    text = "".join(parts)

    def read(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
        reader = HarmonyReader(("f",)) if syntax is ReplySyntax.HARMONY else ToolCallStream(syntax)
        out = [p for piece in pieces for p in reader.feed(piece)] + reader.finish()
        content, reasoning, calls = gather(out)
        return content, reasoning, [(c.name, c.arguments) for c in calls]

    assert read(cut(text, cuts)) == read([text])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(asked=tool_requests)
def test_any_tools_in_any_syntax_are_served_or_refused_with_a_400(
    served: tuple[Family, openai.OpenAI], asked: dict[str, Any]
) -> None:
    family, client = served
    served_or_refused(client, {"model": "tiny", "messages": _ask(family), "max_tokens": 24, **asked})


THINKING = [
    ("<think>\nWeigh it.\n</think>\n\nThe answer.", False, False, "The answer.", "Weigh it.", []),
    ("Weigh it.</think>The answer.", True, False, "The answer.", "Weigh it.", []),  # the template opened it
    ("No reasoning at all.", False, False, "No reasoning at all.", "", []),
    (
        '<think>Call it.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": "</think>"}}\n</tool_call>',
        False, True, "", "Call it.", [("f", {"a": "</think>"})],
    ),
    ("<think>cut off mid-thought", False, False, "", "cut off mid-thought", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "opened", "calling", "content", "reasoning", "calls"), THINKING)
def test_a_thinking_model_s_reasoning_is_read_apart_from_its_answer(
    text: str, opened: bool, calling: bool, content: str, reasoning: str, calls: list[tuple[str, Any]]
) -> None:
    for size in (1, 4, len(text)):
        reader = ThinkReader(ToolCallStream(ReplySyntax.HERMES) if calling else None, opened)
        pieces = [p for i in range(0, len(text), size) for p in reader.feed(text[i : i + size])] + reader.finish()
        got = gather(pieces)
        assert (got[0].strip(), got[1].strip()) == (content, reasoning)
        assert [(c.name, json.loads(c.arguments)) for c in got[2]] == calls
        assert reader.calls == len(calls)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "a"]) | fragments),
    opened=st.booleans(),
    calling=st.booleans(),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=30),
)
def test_any_thinking_text_reads_the_same_in_any_pieces(
    parts: list[str], opened: bool, calling: bool, cuts: list[int]
) -> None:
    text = "".join(parts)

    def read(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
        reader = ThinkReader(ToolCallStream(ReplySyntax.HERMES) if calling else None, opened)
        content, reasoning, calls = gather([p for piece in pieces for p in reader.feed(piece)] + reader.finish())
        return content, reasoning, [(c.name, c.arguments) for c in calls]

    assert read(cut(text, cuts)) == read([text])
