"""The Responses API's request body, validated at the boundary (a 400 names the field as this API
names it: `input[2].call_id`) and read into a `ChatAsk`: `input` items after `instructions`, and
the turns of the response it continues."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from kafila.api.asks import CallMade, ChatAsk, Generation, OutputFormat, ToolChoice, Turn
from kafila.api.errors import invalid
from kafila.api.front import json_body
from kafila.api.schemas import MAX_TOOLS
from kafila.api.schemas import FunctionDefinition as ChatFunctionDefinition
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.wire.frames import MAX_TOP_LOGPROBS

MAX_ITEMS = 4096
BUILT_IN_TOOLS = "web_search, file_search, code_interpreter, computer use, image generation, MCP, shell"
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for log probabilities


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class TextPart(_Body):
    type: str
    text: str = ""
    refusal: str | None = None  # an assistant's refusal part, sent back: its text

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value not in (*TEXT_PARTS, "refusal"):
            raise ValueError(f"this server takes text parts only (input_text, output_text); not '{value[:40]}'")
        return value

    def content(self) -> str:
        return self.refusal if self.type == "refusal" and self.refusal is not None else self.text


def _parts(value: Any) -> Any:
    """A string as one text part, so that errors point into the list."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _joined(parts: Sequence[TextPart]) -> str:
    return "".join(part.content() for part in parts)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[TextPart], Field(max_length=MAX_ITEMS)]

    _as_parts = field_validator("content", mode="before")(_parts)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Annotated[list[TextPart], Field(max_length=MAX_ITEMS)]

    _as_parts = field_validator("output", mode="before")(_parts)


class ReasoningItem(_Body):
    """Reasoning an earlier response gave, sent back: its text (`content`), or its summary."""

    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None

    def text(self) -> str:
        return _joined(self.content) if self.content else "\n\n".join(part.text for part in self.summary)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")  # OpenAI's "easy" message: a role and content, no type
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])


class FunctionDefinition(ChatFunctionDefinition):
    """A function tool in this API's flat shape: chat completions' definition, typed beside it."""

    type: Literal["function"]

    def wire(self) -> dict[str, Any]:
        strict = True if self.strict is None else self.strict  # OpenAI's default for function tools
        return {
            "type": "function", "name": self.name, "description": self.description,
            "parameters": self.parameters, "strict": strict,
        }  # fmt: skip


class NamedFunction(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a format of type json_schema needs its name and schema")
        return self

    def wire(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        described = {"description": self.description} if self.description is not None else {}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "strict": self.strict, **described}


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    input: Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    store: bool = True
    stream: bool = False
    tools: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: Annotated[list[str], Field(max_length=64)] | None = None  # what it does not know, it ignores
    background: Literal[False] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        """A string is one user message; an item of a type this server cannot take is named."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, list):
            for index, item in enumerate(value):
                kind = _item_type(item)
                if isinstance(kind, str) and kind not in ITEM_TYPES:
                    raise ValueError(
                        f"input[{index}] is an item of type '{kind[:40]}', which this server cannot take; it "
                        f"takes {', '.join(ITEM_TYPES)} items (item_reference neither: send the item itself)"
                    )
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise ValueError(
                        f"tools[{index}] is the built-in tool '{kind[:40]}', which this server does not have; it "
                        f"runs no built-in tools ({BUILT_IN_TOOLS}): give function tools (type 'function') only"
                    )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
            raise ValueError(
                f"tool_choice of type '{value['type'][:40]}' is not supported; send 'auto', 'required', 'none' or "
                "{'type': 'function', 'name': ...}"
            )
        return value

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ResponsesRequest:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names '{self.tool_choice.name}', which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tool_choice_or_default(self) -> ToolChoice:
        if isinstance(self.tool_choice, NamedFunction):
            return ToolChoice("required", self.tool_choice.name)
        if self.tool_choice is not None:
            return ToolChoice(self.tool_choice)
        return ToolChoice("auto" if self.tools else "none")

    def output(self) -> OutputFormat:
        form = self.text.format if self.text is not None else None
        if form is None or form.type == "text":
            return OutputFormat()
        return OutputFormat(form.type, form.schema_ if form.type == "json_schema" else None)

    def generation(self) -> Generation:
        sampling = SamplingSettings(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0,
            seed=secrets.randbelow(2**32),  # a fresh one: this API takes none
        )
        return Generation(self.max_output_tokens, sampling, alternatives=self.logprob_alternatives())

    def logprob_alternatives(self) -> int | None:
        """Alternatives per token for `output_text`'s log probabilities, which OpenAI sends only
        where `include` names them (`top_logprobs` alone sends none); None: none asked."""
        return (self.top_logprobs or 0) if OUTPUT_TEXT_LOGPROBS in (self.include or ()) else None

    def ask(self, earlier: Sequence[Turn] = (), calls: dict[str, str] | None = None) -> tuple[ChatAsk, dict[str, str]]:
        """What it asks, after the `earlier` turns of the response it continues (whose calls are
        `calls`), and the calls its conversation holds; a 400 for a function call output whose
        call is nowhere before it."""
        turns, calls = read_items(self.input, dict(calls or {}), "input")
        system = (Turn("system", self.instructions),) if self.instructions is not None else ()
        ask = ChatAsk(
            (*system, *earlier, *turns),
            self.generation(),
            tuple(tool.tool() for tool in self.tools or ()),
            self.tool_choice_or_default(),
            self.parallel_tool_calls is not False,
            self.output(),
        )
        return ask, calls

    def echo(self) -> dict[str, Any]:
        """What a response repeats of its request."""
        form = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": form.wire()},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice,
            "tools": [tool.wire() for tool in self.tools or []],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs or 0,
            "truncation": self.truncation or "disabled",
            "metadata": self.metadata or {},
            "user": self.user,
            "background": False,
        }


def read_items(items: Sequence[Item], calls: dict[str, str], param: str) -> tuple[list[Turn], dict[str, str]]:
    """Items as the turns templates read: reasoning goes with the assistant turn after it, function
    calls join the assistant turn before them (its text first), and a call's output is a tool
    turn naming the function. `calls`: the call ids made before, with their names (added to)."""
    turns: list[Turn] = []
    reasoning: str | None = None
    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning + "\n\n" if reasoning else "") + item.text()
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                turns.append(Turn("assistant", _joined(item.content), reasoning=reasoning))
                reasoning = None
            else:
                turns.append(Turn("system" if item.role == "developer" else item.role, _joined(item.content)))
        elif isinstance(item, FunctionCallItem):
            calls[item.call_id] = item.name
            made = CallMade(item.call_id, item.name, item.arguments)
            if turns and turns[-1].role == "assistant" and reasoning is None:
                turns[-1] = replace(turns[-1], calls=(*turns[-1].calls, made))
            else:
                turns.append(Turn("assistant", "", (made,), reasoning=reasoning))
                reasoning = None
        else:
            name = calls.get(item.call_id)
            if name is None:
                raise invalid(
                    f"No function call with call_id '{item.call_id[:100]}' comes before this function_call_output "
                    f"({param}[{index}]): send the function_call item before it, or continue the response that "
                    "made it with previous_response_id.", f"{param}[{index}].call_id",
                )  # fmt: skip
            turns.append(Turn("tool", _joined(item.output), call_id=item.call_id, name=name))
    return turns, calls


def param_of(location: Sequence[int | str]) -> str:
    """A pydantic error's location as the API names the field (`input[2].call_id`), without the
    tags pydantic adds for unions."""
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ITEM_TYPES and not part[0].isupper():
            out += ("." if out else "") + part
    return out


async def parse(request: Request) -> ResponsesRequest:
    """The body, validated; a 400 naming the field at fault as this API names it."""
    data = await json_body(request)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        what = (
            str(first["ctx"]["error"])
            if first["type"] == "value_error" and "error" in first.get("ctx", {})
            else first["msg"]
        )
        where = param_of(first["loc"])
        raise invalid(f"{where}: {what}" if where else what, where or None) from None
