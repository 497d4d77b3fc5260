"""A chat request prepared for the engine without a model: the prompt the template writes, the
grammar the tools or response format ask for, and the reader of the reply (`api.requests`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.api.asks import CallMade, ChatAsk, FunctionTool, OutputFormat, TextAsk, ToolChoice, Turn
from kafila.api.errors import ApiError
from kafila.api.harmony import HarmonyReader
from kafila.api.reasoning import ThinkReader
from kafila.api.requests import prepare_chat, prepare_completion
from kafila.api.schemas import ChatRequest, CompletionRequest
from kafila.api.tool_calls import ToolCallStream
from kafila.serving.chat_template import ChatTemplate

FIXTURES = Path(__file__).parent / "fixtures"
QWEN25 = ChatTemplate((FIXTURES / "qwen2.5-tools.jinja").read_text(), "", "<|im_end|>", "qwen2")
QWEN3 = ChatTemplate((FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text(), "", "<|im_end|>", "qwen3")
HARMONY = ChatTemplate((FIXTURES / "openai-gpt-oss-120b.jinja").read_text(), "", "", "gpt-oss")
PLAIN = ChatTemplate("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "", "", "llama")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def chat(**fields: object) -> ChatAsk:
    return ChatRequest.model_validate({"model": "m", "messages": ASK, **fields}).ask()


def test_a_plain_chat_has_no_grammar_and_no_reader() -> None:
    prepared = prepare_chat(chat(), PLAIN)
    assert prepared.text == "Weather in Oslo?\n" and prepared.add_bos
    assert prepared.grammar is None and prepared.reader is None


def test_offered_tools_are_written_into_the_prompt_and_read_out_of_the_reply() -> None:
    prepared = prepare_chat(chat(tools=[WEATHER]), QWEN25)
    assert '"name": "get_weather"' in prepared.text and "<tools>" in prepared.text
    assert prepared.grammar is not None  # "auto": free text, or calls in the template's syntax
    assert isinstance(prepared.reader, ToolCallStream)
    forced = prepare_chat(chat(tools=[WEATHER], tool_choice="required"), QWEN25)
    assert forced.grammar is not None and forced.grammar != prepared.grammar
    none = prepare_chat(chat(tools=[WEATHER], tool_choice="none"), QWEN25)
    assert "get_weather" not in none.text and none.reader is None


def test_a_thinking_template_is_read_for_its_reasoning_and_harmony_always_for_its_channels() -> None:
    assert isinstance(prepare_chat(chat(), QWEN3).reader, ThinkReader)
    assert isinstance(prepare_chat(chat(tools=[WEATHER]), HARMONY).reader, HarmonyReader)
    assert isinstance(prepare_chat(chat(), HARMONY).reader, HarmonyReader)


def test_a_response_format_asks_for_a_grammar_from_the_first_token() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    prepared = prepare_chat(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}), PLAIN
    )
    assert prepared.grammar is not None and "answer" in prepared.grammar


def test_tools_a_template_cannot_write_are_a_400_naming_tools() -> None:
    with pytest.raises(ApiError) as refused:
        prepare_chat(chat(tools=[WEATHER]), PLAIN)
    assert refused.value.status == 400 and refused.value.param == "tools"


def completion(**fields: object) -> TextAsk:
    return CompletionRequest.model_validate({"model": "m", **fields}).ask()


def test_a_completion_prompt_is_text_to_tokenize_or_ids_of_this_vocabulary() -> None:
    text = prepare_completion(completion(prompt="Once upon a time"), 32)
    assert (text.text, text.tokens, text.grammar) == ("Once upon a time", None, None)
    ids = prepare_completion(completion(prompt=[1, 5, 31]), 32)
    assert (ids.text, ids.tokens) == (None, [1, 5, 31])
    with pytest.raises(ApiError) as refused:
        prepare_completion(completion(prompt=[1, 32]), 32)
    assert refused.value.param == "prompt" and "from 0 to 31" in refused.value.message
    with pytest.raises(ValueError, match="one prompt per request"):
        completion(prompt=["one", "two"])


def test_an_openai_chat_request_reads_into_what_it_asks() -> None:
    """The parser's part: roles as templates know them, calls and results, the tool choice with
    OpenAI's default, the output format, and how to generate."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Look it up."},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "rain"},
    ]
    ask = ChatRequest.model_validate(
        {"model": "m", "messages": messages, "tools": [WEATHER], "max_tokens": 9, "stop": "x", "temperature": 0}
    ).ask()
    assert ask.turns == (
        Turn("system", "Be brief."),
        Turn("user", "Weather in Oslo?"),
        Turn("assistant", "", (CallMade("call_1", "get_weather", '{"city": "Oslo"}'),), reasoning="Look it up."),
        Turn("tool", "rain", call_id="call_1", name="get_weather"),
    )
    assert ask.tools == (FunctionTool("get_weather", "", WEATHER["function"]["parameters"]),)  # type: ignore[index]
    assert ask.choice == ToolChoice("auto") and ask.calling_tools() and ask.forced_tools() == ()
    assert (ask.generation.limit, ask.generation.stops, ask.generation.sampling.temperature) == (9, ("x",), 0.0)
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choice == ToolChoice("required", "get_weather") and named.forced_tools() == named.tools
    assert chat().choice == ToolChoice("none") and not chat().calling_tools()
    assert chat(response_format={"type": "json_object"}).output == OutputFormat("json_object")
