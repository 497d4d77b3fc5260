"""The openai-agents SDK against a Kafila host, run by its own virtual environment's python
(`.clients/openai-agents`): `python openai_agents_driver.py MODEL_KIND BASE_URL KEY MODEL`, where
MODEL_KIND is `responses` (the SDK's default model, on the Responses API), `responses_streamed`
(the same with `Runner.run_streamed`, its events read to the end), `responses_top_logprobs` (the
first with `ModelSettings(top_logprobs=2)`, which asks for log probabilities) or
`chat_completions` (`OpenAIChatCompletionsModel`). An agent with one `function_tool` runs until
its turn limit of 2; the last line printed is an `AgentRun` as JSON, with what each response
the host stored says of `top_logprobs` on the Responses model.

Only the client's base URL, key and model are the host's; tracing is off (it would export each
run to OpenAI's servers)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import (
    Agent,
    AgentHooks,
    MaxTurnsExceeded,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from client_reports import AgentRun, CallSeen, OutputSent, Turn, weather_report
from openai import AsyncOpenAI

QUESTION = "What is the weather in Oslo?"


async def run(model_kind: str, base_url: str, key: str, model_name: str) -> AgentRun:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    received: list[dict[str, Any]] = []
    top_logprobs: list[int | None] = []
    returned: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        received.append({"city": city})
        returned.append(weather_report(city))
        return returned[-1]

    model: Model = (
        OpenAIChatCompletionsModel(model_name, client)
        if model_kind == "chat_completions"
        else OpenAIResponsesModel(model_name, client)
    )
    hooks = TurnRecorder()
    settings = ModelSettings(top_logprobs=2) if model_kind == "responses_top_logprobs" else ModelSettings()
    agent = Agent(
        name="forecaster", instructions="Answer with the tool.", model=model, tools=[get_weather], hooks=hooks,
        model_settings=settings,
    )  # fmt: skip
    try:
        if model_kind == "responses_streamed":
            async for _ in Runner.run_streamed(agent, QUESTION, max_turns=2).stream_events():
                pass
        else:
            await Runner.run(agent, QUESTION, max_turns=2)
        stopped_by = "final output"
    except MaxTurnsExceeded as stop:
        stopped_by = type(stop).__name__
        details = stop.run_data
        assert details is not None
        for turn, response in zip(hooks.turns, details.raw_responses, strict=False):
            turn.calls = [
                CallSeen(call_id=item.call_id, name=item.name, arguments=json.loads(item.arguments))
                for item in response.output
                if item.type == "function_call"
            ]
        if model_kind != "chat_completions":
            stored = [await client.responses.retrieve(r.response_id) for r in details.raw_responses if r.response_id]
            top_logprobs = [response.top_logprobs for response in stored]
    return AgentRun(turns=hooks.turns, tool_received=received, tool_returned=returned, stopped_by=stopped_by,
                    top_logprobs=top_logprobs)  # fmt: skip


class TurnRecorder(AgentHooks[Any]):
    """Each request's tool outputs, as the SDK hands them to the model."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def on_llm_start(
        self, context: RunContextWrapper[Any], agent: Agent[Any], system_prompt: str | None, input_items: list[Any]
    ) -> None:
        outputs = [
            OutputSent(call_id=item["call_id"], output=str(item["output"]))
            for item in input_items
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        ]
        self.turns.append(Turn(outputs_sent=outputs, calls=[]))


if __name__ == "__main__":
    print(asyncio.run(run(*sys.argv[1:5])).model_dump_json())
