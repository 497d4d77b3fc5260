"""OpenAI's own examples for structured output and function calling, as its documentation writes
them, through the official client against the real server: the Pydantic `parse` helper on the
bundled gemma-3-270m (a real model, so its JSON reads as an answer), and the function-calling
round trip, which hands back the SDK's own message object, on a tiny model with Qwen's tool
template. What differs from the documentation: the client's base URL, the model's name, a seed,
bounds on the strings' and lists' lengths with a max_tokens above the longest reply they allow (so
every sample ends and parses, whatever a seed draws on whatever CPU), and `tool_choice="required"`
(a random tiny model would not choose a call on its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field
from serving_checks import engine_served
from test_tool_calls import QWEN_TEMPLATE
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings

CONTEXT = 2048
SETTINGS = ContextSettings(n_ctx=CONTEXT, n_batch=256, n_seq_max=1, n_threads=2)


@contextmanager
def _served(path: Path) -> Iterator[tuple[openai.OpenAI, str]]:
    engine = open_engine(path, [1], SETTINGS)
    with engine_served(engine, 1, SETTINGS.n_batch, CONTEXT) as (url, _serving):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        yield client, client.models.list().data[0].id


Short = Annotated[str, Field(max_length=24)]


class CalendarEvent(BaseModel):
    name: Short
    date: Short
    participants: list[Short] = Field(max_length=4)


# The longest reply CalendarEvent's grammar allows, in tokens: every character of a string may be a
# six-character escape (\uXXXX) spelled a byte a token, plus the keys, quotes, commas and spaces.
LONGEST_EVENT_TOKENS = 6 * 24 * 6 + 120


def test_the_structured_outputs_example_parses_into_its_pydantic_model(gemma_path: Path) -> None:
    """At the documentation's temperature (1) a 270M model may write anything the grammar allows:
    with the event's strings and list bounded, every reply ends on its own and parses."""
    with _served(gemma_path) as (client, model):
        for seed in range(3):
            completion = client.chat.completions.parse(
                model=model,
                messages=[
                    {"role": "system", "content": "Extract the event information."},
                    {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."},
                ],
                response_format=CalendarEvent,
                max_tokens=LONGEST_EVENT_TOKENS,
                seed=seed,
            )
            event = completion.choices[0].message.parsed
            assert completion.choices[0].finish_reason == "stop" and isinstance(event, CalendarEvent)


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
                            "maxLength": 24,  # at most 24 × 6 tokens (escapes spelled byte by byte)
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
        model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=256, seed=4
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    tool_call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    args = json.loads(tool_call.function.arguments)  # type: ignore[union-attr]
    result = get_weather(args["location"])

    messages.append(completion.choices[0].message)  # the SDK's own object, as the example appends it
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(result)})
    completion_2 = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8)
    assert completion_2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert completion_2.usage.prompt_tokens > completion.usage.prompt_tokens  # type: ignore[union-attr]
