"""The Ollama API's request bodies, validated at the boundary and read into what they ask
(`asks`): options with Ollama's defaults and refusals, messages, tools, tool results paired to
their calls."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from kafila.api.asks import (
    CallMade,
    ChatAsk,
    FunctionTool,
    Generation,
    OutputFormat,
    TextAsk,
    ToolChoice,
    Turn,
    stop_tuple,
)
from kafila.api.errors import invalid
from kafila.api.schemas import FUNCTION_NAME, MAX_TOOLS, stops_at_most
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.wire.frames import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16

# Fields Ollama does not define are ignored, as its server ignores them.
BODY = ConfigDict(extra="ignore", allow_inf_nan=False)


class Options(BaseModel):
    """`options`: the sampler's settings this server has, and the context. Unknown keys and the
    runner's (`num_gpu`, `num_thread`, …) are ignored, as Ollama ignores what it does not know."""

    model_config = BODY

    num_predict: StrictInt | None = None  # 0 or less: no limit (to the end of the context)
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=10.0)] | None = None
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    seed: StrictInt | None = None  # negative: a random one, as Ollama's -1
    stop: Annotated[str | list[str] | None, stops_at_most(MAX_STOP_STRINGS)] = None
    repeat_penalty: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1: the whole context
    presence_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2.0, le=2.0)] | None = None
    num_ctx: Annotated[StrictInt, Field(ge=1)] | None = None
    min_p: StrictFloat | StrictInt | None = None
    typical_p: StrictFloat | StrictInt | None = None
    mirostat: StrictInt | None = None

    @field_validator("min_p")
    @classmethod
    def _no_min_p(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("this server's sampler has no min_p; leave it out or 0")
        return value

    @field_validator("typical_p")
    @classmethod
    def _no_typical_p(cls, value: float | None) -> float | None:
        if value is not None and value != 1:
            raise ValueError("this server's sampler has no typical_p; leave it out or 1")
        return value

    @field_validator("mirostat")
    @classmethod
    def _no_mirostat(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("this server's sampler has no mirostat; leave it out or 0")
        return value

    def generation(self, context: int, alternatives: int | None) -> Generation:
        limit = self.num_predict if self.num_predict is not None and self.num_predict > 0 else None
        return Generation(limit, self.sampling(context), stop_tuple(self.stop), alternatives)

    def sampling(self, context: int) -> SamplingSettings:
        """Ollama's defaults, then whatever `options` set."""
        last_n = context if self.repeat_last_n == -1 else self.repeat_last_n
        return SamplingSettings(
            temperature=0.8 if self.temperature is None else self.temperature,
            top_k=40 if self.top_k is None else self.top_k,
            top_p=0.9 if self.top_p is None else self.top_p,
            repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
            repeat_last_n=64 if last_n is None else last_n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed % 2**32 if self.seed is not None and self.seed >= 0 else _fresh_seed(),
        )


def _fresh_seed() -> int:
    return secrets.randbelow(2**32)


def refuse_images(value: Any) -> Any:
    if value:
        raise ValueError("images are not supported: this server serves a text-only model")
    return value


class CallFunction(BaseModel):
    model_config = BODY

    name: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments", mode="before")
    @classmethod
    def _an_object(cls, value: Any) -> Any:
        """An object, as Ollama sends it; JSON text of one, as OpenAI-shaped messages carry it, is read."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("a tool call's arguments must be a JSON object") from None
        return value


class CallIn(BaseModel):
    """A call an earlier assistant turn made, as Ollama sends it back: arguments as an object."""

    model_config = BODY

    id: str | None = Field(default=None, max_length=256)
    function: CallFunction


class Message(BaseModel):
    model_config = BODY

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[CallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_name: str | None = Field(default=None, max_length=64)
    tool_call_id: str | None = Field(default=None, max_length=256)

    @field_validator("images")
    @classmethod
    def _no_images(cls, value: list[Any] | None) -> list[Any] | None:
        return refuse_images(value)


class FunctionIn(BaseModel):
    model_config = BODY

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type object")
        return value


class ToolIn(BaseModel):
    model_config = BODY

    type: Literal["function"] = "function"
    function: FunctionIn


class Body(BaseModel):
    """What `/api/chat` and `/api/generate` share."""

    model_config = BODY

    model: str = Field(min_length=1, max_length=256)
    stream: StrictBool | None = None  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    think: StrictBool | Literal["low", "medium", "high"] | None = None
    keep_alive: str | StrictInt | StrictFloat | None = None  # the model stays while the session serves
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError('format must be "json" or a JSON schema (an object)')
        return value

    def streams(self) -> bool:
        return self.stream is not False

    def output(self) -> OutputFormat:
        if self.format == "json":
            return OutputFormat("json_object")
        if isinstance(self.format, dict):
            return OutputFormat("json_schema", self.format)
        return OutputFormat()

    def alternatives(self) -> int | None:
        """How many alternatives per token to report log probabilities with; None: none asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking(self) -> tuple[bool | None, Literal["low", "medium", "high"] | None]:
        """What the template is told of reasoning: `think` false turns it off where the template
        can (Qwen 3's `enable_thinking`), a level sets the effort where it takes one (gpt-oss)."""
        if isinstance(self.think, str):
            return True, self.think
        return self.think, None

    def generation(self, context: int) -> Generation:
        options = self.options or Options()
        if options.num_ctx is not None and options.num_ctx > context:
            raise invalid(
                f"options.num_ctx is {options.num_ctx}, more than this session's context of {context} tokens; "
                f"ask for {context} or less (or leave num_ctx out)", "options.num_ctx", "context_length_exceeded",
            )  # fmt: skip
        return options.generation(context, self.alternatives())


class ChatBody(Body):
    messages: list[Message] | None = Field(default=None, max_length=4096)
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[ToolIn] | None) -> list[ToolIn] | None:
        names = [tool.function.name for tool in value or []]
        if len(set(names)) != len(names):
            raise ValueError("two functions share a name")
        return value

    def ask(self, context: int) -> ChatAsk:
        """What it asks; an `ApiError` (400) for a tool result that answers no call made."""
        tools = tuple(
            FunctionTool(t.function.name, t.function.description or "", t.function.parameters) for t in self.tools or ()
        )
        turns = conversation(self.messages or [], {tool.name for tool in tools})
        choice = ToolChoice("auto" if tools else "none")
        thinking, effort = self.thinking()
        return ChatAsk(turns, self.generation(context), tools, choice, True, self.output(), thinking, effort)


class GenerateBody(Body):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[StrictInt] | None = None
    raw: StrictBool | None = None
    images: list[Any] | None = None

    @field_validator("images")
    @classmethod
    def _no_images(cls, value: list[Any] | None) -> list[Any] | None:
        return refuse_images(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill in the middle) is not supported by this server")
        return value

    @field_validator("template")
    @classmethod
    def _no_template(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(
                "a template of the request's own is not supported: this server renders the model's own "
                "template; send raw: true with the prompt already templated instead"
            )
        return value

    @field_validator("context")
    @classmethod
    def _no_context(cls, value: list[int] | None) -> list[int] | None:
        if value:
            raise ValueError(
                "context (a previous reply's token ids) is not supported by this server; send the whole "
                "conversation to /api/chat instead"
            )
        return value

    def ask(self, context: int) -> ChatAsk | TextAsk:
        """The prompt as it is (`raw`), or as the model's template writes it for a user's message
        after the `system` one."""
        generation = self.generation(context)
        if self.raw:
            return TextAsk(self.prompt or "", generation, self.output())
        turns = ((Turn("system", self.system),) if self.system else ()) + (Turn("user", self.prompt or ""),)
        thinking, effort = self.thinking()
        return ChatAsk(turns, generation, output=self.output(), thinking=thinking, effort=effort)


class ShowBody(BaseModel):
    model_config = BODY

    model: str | None = Field(default=None, min_length=1, max_length=256)
    name: str | None = Field(default=None, min_length=1, max_length=256)  # older clients' name for it


def conversation(messages: Sequence[Message], offered: set[str]) -> tuple[Turn, ...]:
    """The turns as templates read them. Ollama's calls carry no ids: each gets one, and a tool
    result answers the call its `tool_call_id` names, else the first call not yet answered of
    the last assistant turn that calls `tool_name` (or any, without one)."""
    turns: list[Turn] = []
    made: list[CallMade] = []
    waiting: list[CallMade] = []  # the last assistant turn's calls not yet answered
    for index, message in enumerate(messages):
        content = message.content or ""
        if message.role == "assistant":
            calls = tuple(
                CallMade(call.id or f"call_{index}_{k}", call.function.name, json.dumps(call.function.arguments))
                for k, call in enumerate(message.tool_calls or ())
            )
            made += calls
            waiting = list(calls)
            turns.append(Turn("assistant", content, calls, reasoning=message.thinking))
        elif message.role == "tool":
            answered = _answered(message, made, waiting, offered, index)
            name = message.tool_name or (answered.name if answered else None)
            call_id = answered.id if answered else message.tool_call_id
            turns.append(Turn("tool", content, call_id=call_id, name=name))
        else:
            turns.append(Turn(message.role, content))
    return tuple(turns)


def _answered(
    message: Message, made: list[CallMade], waiting: list[CallMade], offered: set[str], index: int
) -> CallMade | None:
    where = f"messages.{index}"
    if message.tool_call_id is not None:
        call = next((c for c in made if c.id == message.tool_call_id), None)
        if call is None:
            raise invalid(f"{where}: tool_call_id '{message.tool_call_id[:64]}' answers no earlier tool call", where)
    elif message.tool_name is not None:
        call = next((c for c in waiting if c.name == message.tool_name), None)
        if call is None and message.tool_name not in offered and all(c.name != message.tool_name for c in made):
            raise invalid(
                f"{where}: tool_name '{message.tool_name}' names neither a tool offered nor one an earlier turn called",
                where,
            )  # fmt: skip
    else:
        call = waiting[0] if waiting else None
    if call is not None and call in waiting:
        waiting.remove(call)
    return call
