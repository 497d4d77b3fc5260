"""The OpenAI request bodies Kafila accepts, validated strictly at the boundary, and read into
what they ask (`asks`), as every dialect's parser does.

Fields the OpenAI API defines but Kafila does not implement (several choices, logit biases)
are refused with a clear 400 rather than silently ignored; fields it does
not know at all are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

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
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.wire.frames import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_CHAT_TOP_LOGPROBS = MAX_TOP_LOGPROBS  # OpenAI's limits on the alternatives per token: 20 and 5
MAX_COMPLETION_LOGPROBS = 5
ONE_PROMPT = "one prompt per request: this server does not batch prompts in one request"


def stops_at_most(most: int) -> AfterValidator:
    """A body's `stop` (none, one string or a list) with at most `most` strings: past that, a 400 saying so."""

    def few(value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > most:
            raise ValueError(f"at most {most} stop strings")
        return value

    return AfterValidator(few)


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # not OpenAI's, but llama.cpp servers take it
    seed: int | None = None
    stop: Annotated[str | list[str] | None, stops_at_most(MAX_STOP_STRINGS)] = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_alternatives(self) -> int | None:
        """How many alternatives per token to report log probabilities with; None: none asked."""
        return None

    def generation(self) -> Generation:
        return Generation(self.token_limit(), self.sampling(), stop_tuple(self.stop), self.logprob_alternatives())

    def output(self) -> OutputFormat:
        form = self.response_format
        if form is None or form.type == "text":
            return OutputFormat()
        schema = form.json_schema.json_schema if form.json_schema is not None else None
        return OutputFormat(form.type if schema is not None else "json_object", schema)

    def sampling(self) -> SamplingSettings:
        """OpenAI's defaults (temperature 1, top_p 1, no top-k), then whatever the request set."""
        return SamplingSettings(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=(self.seed % 2**32) if self.seed is not None else _fresh_seed(),
        )


def _fresh_seed() -> int:
    return secrets.randbelow(2**32)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """Text, any JSON object, or JSON that a schema accepts: the latter two become a grammar."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type json_schema needs its json_schema")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 64


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    def call(self) -> CallMade:
        return CallMade(self.id, self.function.name, self.function.arguments)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type object")
        return value

    def tool(self) -> FunctionTool:
        return FunctionTool(self.name, self.description or "", self.parameters)


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # What an assistant reasoned before (a reply's own `reasoning_content`, sent back): gpt-oss's
    # template shows it before that turn's tool call, as "thinking"; Qwen 3's reads this name.
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Say which part cannot be taken (an image, audio), not that the content is not a string."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"only text parts are supported; this server cannot take a '{kind[:40]}' part")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def turn(self) -> Turn:
        # "developer" is OpenAI's newer name for the system role; templates know only "system".
        return Turn(
            "system" if self.role == "developer" else self.role,
            self.text(),
            tuple(call.call() for call in self.tool_calls or ()),
            self.tool_call_id,
            self.name if self.role == "tool" else None,
            self.reasoning_content if self.role == "assistant" else None,
        )


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ChatRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tool_choice_or_default(self) -> ToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice("required", self.tool_choice.function.name)
        if self.tool_choice is not None:
            return ToolChoice(self.tool_choice)
        return ToolChoice("auto" if self.tools else "none")

    def ask(self) -> ChatAsk:
        return ChatAsk(
            tuple(message.turn() for message in self.messages),
            self.generation(),
            tuple(tool.function.tool() for tool in self.tools or ()),
            self.tool_choice_or_default(),
            self.parallel_tool_calls is not False,
            self.output(),
        )


class CompletionRequest(Request):
    prompt: str | list[str] | list[int]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: Literal[False] | None = None
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A list of token lists is one prompt per list: take one, refuse several as for strings."""
        if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
            if len(value) != 1:
                raise ValueError(ONE_PROMPT)
            return value[0]
        return value

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def token_limit(self) -> int | None:
        """OpenAI's legacy completions stop at 16 tokens unless told otherwise (chat runs to the end)."""
        return super().token_limit() or COMPLETION_DEFAULT_MAX_TOKENS

    def ask(self) -> TextAsk:
        """What it asks; a ValueError for a prompt that is not one text or one list of ids."""
        return TextAsk(self.prompt_text(), self.generation(), self.output())

    def prompt_text(self) -> str | list[int]:
        if isinstance(self.prompt, str):
            return self.prompt
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise ValueError(ONE_PROMPT)
            return str(self.prompt[0])
        return [int(t) for t in self.prompt]


Request.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()
