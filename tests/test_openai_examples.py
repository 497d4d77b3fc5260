"""OpenAI's own examples for structured output and function calling, as its documentation writes
them, through the official client against the real server: the Pydantic `parse` helper on the
bundled gemma-3-270m (a real model, so its JSON reads as an answer), and the function-calling
round trip, which hands back the SDK's own message object, on a tiny model with Qwen's tool
template. What differs from the documentation: the client's base URL, the model's name, a seed
and a max_tokens (a small model may loop), `tool_choice="required"` (a random tiny model would
not choose a call on its own) and a bound on the location's length."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel
from serving_checks import engine_served
from test_tool_calls import QWEN_TEMPLATE
from tiny_models import write_tiny_model

from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.pipeline import open_engine

CONTEXT = 2048
SETTINGS = ContextSettings(n_ctx=CONTEXT, n_batch=256, n_seq_max=1, n_threads=2)


@contextmanager
def _served(path: Path) -> Iterator[tuple[openai.OpenAI, str]]:
    engine = open_engine(path, [1], SETTINGS)
    with engine_served(engine, 1, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        yield client, client.models.list().data[0].id


class CalendarEvent(BaseModel):
    name: str
    date: str
    participants: list[str]


def test_the_structured_outputs_example_parses_into_its_pydantic_model(gemma_path: Path) -> None:
    """A 270M model at the documentation's temperature (1) sometimes loops until max_tokens (the
    SDK then raises LengthFinishReasonError, as it would with any server); every answer that ends
    parses, and a few seeds give one."""
    parsed = []
    with _served(gemma_path) as (client, model):
        for seed in range(8):
            try:
                completion = client.chat.completions.parse(
                    model=model,
                    messages=[
                        {"role": "system", "content": "Extract the event information."},
                        {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."},
                    ],
                    response_format=CalendarEvent,
                    max_tokens=300,
                    seed=seed,
                )
            except openai.LengthFinishReasonError:
                continue
            event = completion.choices[0].message.parsed
            assert completion.choices[0].finish_reason == "stop" and isinstance(event, CalendarEvent)
            parsed.append(event)
            if len(parsed) == 2:
                break
    assert len(parsed) == 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    path = tmp_path_factory.mktemp("examples") / "qwen.gguf"
    with _served(write_tiny_model(path, "qwen3", n_blocks=2, chat_template=QWEN_TEMPLATE)) as served:
        yield served


def get_weather(location: str) -> str:
    return f"It is 14 degrees in {location}."


def test_the_function_calling_example_makes_its_round_trip(qwen: tuple[openai.OpenAI, str]) -> None:
    client, model = qwen
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get current temperature for a given location.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {
                            "type": "string",
                            "description": "City and country e.g. Bogotá, Colombia",
                            "maxLength": 24,  # a random model's string ends well within max_tokens
                        }
                    },
                    "required": ["location"],
                    "additionalProperties": False,
                },
                "strict": True,
            },
        }
    ]
    messages: list = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    completion = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=120, seed=4
    )
    tool_call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    args = json.loads(tool_call.function.arguments)  # type: ignore[union-attr]
    result = get_weather(args["location"])

    messages.append(completion.choices[0].message)  # the SDK's own object, as the example appends it
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(result)})
    completion_2 = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8)
    assert completion_2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert completion_2.usage.prompt_tokens > completion.usage.prompt_tokens  # type: ignore[union-attr]
