"""pydantic-ai against a Kafila host, run by its own virtual environment's python
(`.clients/pydantic-ai`): `python pydantic_ai_driver.py SCENARIO BASE_URL KEY MODEL`, on its
OpenAI chat model with the host as an OpenAI-compatible provider. SCENARIO:
- `tool`: an agent with one tool, run to a limit of 2 requests; prints an `AgentRun` read from
  the run's messages;
- `responses_tool_logprobs`: the same on `OpenAIResponsesModel` (the Responses API) with
  `openai_logprobs` and `openai_top_logprobs=2`, its `AgentRun` with what each response the host
  stored says of `top_logprobs`;
- `output` / `native_output`: an agent whose `output_type` is a pydantic model, as pydantic-ai
  asks by default (its output tool) or as `NativeOutput` (a JSON schema response format); prints
  a `StructuredAnswer`."""

from __future__ import annotations

import sys
from typing import Any

from client_reports import AgentRun, CallSeen, OutputSent, StructuredAnswer, Turn, weather_report
from openai import OpenAI
from pydantic import BaseModel
from pydantic_ai import (
    Agent,
    ModelRequest,
    ModelResponse,
    NativeOutput,
    ToolCallPart,
    ToolReturnPart,
    UsageLimitExceeded,
    UsageLimits,
    capture_run_messages,
)
from pydantic_ai.models import Model
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel, OpenAIResponsesModelSettings
from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider


class City(BaseModel):
    name: str
    rainy: bool


def tool_run(model: Model, settings: OpenAIResponsesModelSettings | None = None) -> AgentRun:
    received: list[dict[str, Any]] = []
    returned: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        received.append({"city": city})
        returned.append(weather_report(city))
        return returned[-1]

    agent = Agent(model, instructions="Answer with the tool.", tools=[get_weather], model_settings=settings)
    with capture_run_messages() as messages:
        try:
            agent.run_sync("What is the weather in Oslo?", usage_limits=UsageLimits(request_limit=2))
            stopped_by = "final output"
        except UsageLimitExceeded as stop:
            stopped_by = type(stop).__name__
    turns, sent = [], []
    for message in messages:
        if isinstance(message, ModelRequest):
            sent = [
                OutputSent(call_id=part.tool_call_id, output=part.model_response_str())
                for part in message.parts
                if isinstance(part, ToolReturnPart)
            ]
        elif isinstance(message, ModelResponse):
            calls = [
                CallSeen(call_id=part.tool_call_id, name=part.tool_name, arguments=part.args_as_dict())
                for part in message.parts
                if isinstance(part, ToolCallPart)
            ]
            turns.append(Turn(outputs_sent=sent, calls=calls))
    run = AgentRun(turns=turns, tool_received=received, tool_returned=returned, stopped_by=stopped_by)
    if isinstance(model, OpenAIResponsesModel):
        client = OpenAI(base_url=str(model.client.base_url), api_key=model.client.api_key, max_retries=0)
        answers = [m for m in messages if isinstance(m, ModelResponse) and m.provider_response_id]
        run.top_logprobs = [client.responses.retrieve(m.provider_response_id or "").top_logprobs for m in answers]
    return run


def structured(model: OpenAIChatModel, native: bool) -> StructuredAnswer:
    agent = Agent(model, output_type=NativeOutput(City) if native else City)
    answer = agent.run_sync("Is it raining in Oslo?").output
    return StructuredAnswer(type_name=type(answer).__name__, fields=answer.model_dump())


def main(scenario: str, base_url: str, key: str, model_name: str) -> BaseModel:
    provider = OpenAICompatibleProvider("kafila", base_url=base_url, api_key=key)
    if scenario == "responses_tool_logprobs":
        settings = OpenAIResponsesModelSettings(openai_logprobs=True, openai_top_logprobs=2)
        return tool_run(OpenAIResponsesModel(model_name, provider=provider), settings)
    model = OpenAIChatModel(model_name, provider=provider)
    if scenario == "tool":
        return tool_run(model)
    return structured(model, native=scenario == "native_output")


if __name__ == "__main__":
    print(main(*sys.argv[1:5]).model_dump_json())
