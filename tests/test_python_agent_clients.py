"""The Python agent frameworks people point at an OpenAI-compatible server, each the real package in
its own virtual environment (`.clients/`, pinned, made by `.ci/python-clients`, which .ci/run
runs) and driven as a subprocess by a script in tests/helpers, unchanged but for base URL, key and
model: the openai-agents SDK (its default Responses model and its chat-completions model),
pydantic-ai (its OpenAI chat model with the host as provider) and langchain-openai (`ChatOpenAI`).

Tool calls run on the tiny model that always calls (agent_models, the Codex test's host): the
framework runs its tool with the model's arguments and sends the output back, and the host pairs
it with its call and answers with another call, where the test stops the run (the model would call
forever). Text runs on gemma-3-270m (the Ollama tests' host), whose greedy text has margins no
batch's rounding turns."""

from __future__ import annotations

import openai
import pytest
from client_reports import AgentRun, ChatTexts, StructuredAnswer, Turn, weather_report
from python_clients import run_driver
from test_ollama_api import GEMMA, Served, gemma
from test_responses_api import KEY, codex_host

CALLER = "tiny-caller"  # codex_host's model
__all__ = ["codex_host", "gemma"]  # the fixtures, imported to be used here


def check_two_turns_with_the_tool(run: AgentRun) -> None:
    """Two requests: the first carries no output and its reply calls the tool; the tool runs with the
    call's arguments; the second request carries its return under the call's id, and its reply
    calls again."""
    said = run.model_dump_json()
    assert len(run.turns) == 2, said
    first, second = run.turns
    assert first.outputs_sent == [] and len(first.calls) == 1 and len(second.calls) == 1, said
    call = first.calls[0]
    assert call.name == "get_weather" and call.arguments == {"city": ""}, said
    assert run.tool_received[0] == call.arguments and run.tool_returned[0] == weather_report(""), said
    assert [(sent.call_id, sent.output) for sent in second.outputs_sent] == [(call.call_id, run.tool_returned[0])], said


@pytest.mark.parametrize(
    "model_kind", ["responses", "responses_streamed", "responses_top_logprobs", "chat_completions"]
)
def test_openai_agents_runs_its_function_tool(codex_host: str, model_kind: str) -> None:
    """`Runner.run` on the SDK's default model (`OpenAIResponsesModel`, the Responses API), the same
    with `Runner.run_streamed`, the first with `ModelSettings(top_logprobs=2)` (which the host
    takes, with the include the SDK adds, and its stored responses repeat; the replies are calls,
    whose tokens carry no log probabilities), and on `OpenAIChatCompletionsModel`: two turns, the
    tool's output sent in the second, then the SDK's own turn limit stops the run."""
    run = run_driver("openai-agents", "openai_agents_driver.py", AgentRun, model_kind, f"{codex_host}/v1", KEY, CALLER)
    check_two_turns_with_the_tool(run)
    assert run.stopped_by == "MaxTurnsExceeded" and len(run.tool_received) == 2
    expected = {"responses_top_logprobs": [2, 2], "chat_completions": []}.get(model_kind, [0, 0])
    assert run.top_logprobs == expected, run


@pytest.mark.parametrize("scenario", ["tool", "responses_tool_logprobs"])
def test_pydantic_ai_runs_its_tool_and_the_messages_hold_its_return(codex_host: str, scenario: str) -> None:
    """An `Agent` with a tool on `OpenAIChatModel` with the host as its provider, and on
    `OpenAIResponsesModel` asking for log probabilities (`openai_logprobs`, `openai_top_logprobs`:
    the host takes them, and its stored responses repeat top_logprobs): the run's messages
    (`capture_run_messages`) hold the call, the tool's return under its id in the next request, and
    that request's reply, another call, where the request limit of 2 stops the run."""
    run = run_driver("pydantic-ai", "pydantic_ai_driver.py", AgentRun, scenario, f"{codex_host}/v1", KEY, CALLER)
    check_two_turns_with_the_tool(run)
    assert run.stopped_by == "UsageLimitExceeded"
    assert run.top_logprobs == ([2, 2] if scenario == "responses_tool_logprobs" else []), run


@pytest.mark.parametrize("scenario", ["output", "native_output"])
def test_pydantic_ai_answers_with_its_output_type(codex_host: str, scenario: str) -> None:
    """`output_type` a pydantic model, as pydantic-ai asks by default (its output tool, called by
    the grammar of tool choice "required") and as `NativeOutput` (a json_schema response format):
    the answer is the model's object, held by the grammar to its schema (each string closed at
    once by the tiny model)."""
    answer = run_driver("pydantic-ai", "pydantic_ai_driver.py", StructuredAnswer, scenario, f"{codex_host}/v1", KEY,
                        CALLER)  # fmt: skip
    assert answer.type_name == "City" and answer.fields["name"] == "", answer
    assert isinstance(answer.fields["rainy"], bool), answer


PROMPT, TOKENS = "The capital of France is", 24


def test_langchain_invoke_and_stream_give_the_sdks_greedy_text(gemma: Served) -> None:
    """`ChatOpenAI` at temperature 0 (its `max_tokens` sent as `max_completion_tokens`), invoked and
    streamed: the same text as the openai SDK's chat completion of the same prompt, the stream in
    more than one chunk."""
    texts = run_driver("langchain-openai", "langchain_openai_driver.py", ChatTexts, "text", f"{gemma.url}/v1", "-",
                       GEMMA, PROMPT, str(TOKENS))  # fmt: skip
    client = openai.OpenAI(base_url=f"{gemma.url}/v1", api_key="-", max_retries=0)
    asked = client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=TOKENS
    )
    expected = asked.choices[0].message.content
    assert expected and texts.invoked == expected and texts.streamed == expected, (texts, expected)
    assert texts.text_chunks > 1


def test_langchain_bind_tools_reads_the_call_with_parsed_arguments(codex_host: str) -> None:
    turn = run_driver("langchain-openai", "langchain_openai_driver.py", Turn, "tools", f"{codex_host}/v1", KEY, CALLER)
    assert [(call.name, call.arguments) for call in turn.calls] == [("GetWeather", {"city": ""})], turn
    assert turn.calls[0].call_id.startswith("call_"), turn


def test_langchain_structured_output_is_the_pydantic_object(codex_host: str) -> None:
    """`with_structured_output(City)`, by its default method: a json_schema response format."""
    answer = run_driver("langchain-openai", "langchain_openai_driver.py", StructuredAnswer, "structured",
                        f"{codex_host}/v1", KEY, CALLER)  # fmt: skip
    assert answer.type_name == "City" and answer.fields["name"] == "", answer
    assert isinstance(answer.fields["rainy"], bool), answer
