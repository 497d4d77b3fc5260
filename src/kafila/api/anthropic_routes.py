"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as the
`anthropic` SDK and Claude Code speak it: the body parsed into a `ChatAsk`, prepared by
`requests` as every dialect's is, and answered by `MessagesWriter` in Anthropic's shape (content
blocks, `stop_reason`, named server-sent events); errors in Anthropic's shape under `/v1/messages`.

What Anthropic defines but this server cannot do (images, documents, its server-run tools) is
refused with a 400 that says so; what does not change the answer (`metadata`, `service_tier`,
`cache_control`, a thinking budget) is ignored.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kafila.api.asks import CallMade, ChatAsk, FunctionTool, Generation, OutputFormat, ToolChoice, Turn
from kafila.api.errors import ApiError, invalid
from kafila.api.front import Front, new_id
from kafila.api.replies import sse
from kafila.api.requests import ServeRequest
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCall, ToolCallDelta
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta

ROUTES = "POST /v1/messages, POST /v1/messages/count_tokens"
PATH = "/v1/messages"

MAX_STOP_SEQUENCES = 16
MAX_TOOLS = 128
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # Anthropic allows 128 characters; the call readers read 64
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

# Anthropic's error types by HTTP status (its API answers an overloaded service with 529; a host
# not ready yet is the same to a client: try again shortly).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: ApiError) -> Response:
    """An `ApiError` in Anthropic's shape, with its status and headers (Retry-After, …)."""
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    body = error_body(error_type(error.status), message)
    return JSONResponse(body, status_code=error.status, headers=error.headers or None)


# --- the body --------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _refuse_blocks(value, ("text",))

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


def _refuse_blocks(value: Any, allowed: Sequence[str]) -> Any:
    """Say which block cannot be taken (an image, a document), not that a union failed."""
    if isinstance(value, list):
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                shown = kind[:40]
                if kind in ("image", "document", "search_result", "container_upload"):
                    raise ValueError(f"this server takes text only; it cannot take a '{shown}' block")
                raise ValueError(f"a '{shown}' block is not one this server takes ({', '.join(allowed)})")
    return value


class MessageIn(_Body):
    role: Literal["user", "assistant", "system"]  # (a system message mid-conversation, as Claude Code sends)
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        return _refuse_blocks(value, BLOCK_TYPES)

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolIn(_Body):
    """A tool the client runs: Anthropic's "custom" tool. Its server-run tools (web search, code
    execution, …) carry another type and no schema, and are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    defer_loading: bool | None = None  # not shown to the model until a tool search finds it

    @model_validator(mode="before")
    @classmethod
    def _a_client_tool(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in (None, "custom") and isinstance(value["type"], str):
            raise ValueError(
                f"a '{value['type'][:40]}' tool is one Anthropic runs, and this server runs none: "
                "send tools with an input_schema"
            )
        return value

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("a tool's input_schema must be a JSON Schema of type object")
        return value

    def tool(self) -> FunctionTool:
        return FunctionTool(self.name, self.description or "", self.input_schema)


class ToolChoiceIn(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=128)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceIn:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' names the tool")
        return self


class ThinkingIn(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormatIn(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigIn(_Body):
    """How hard to reason (told to a template that takes it: gpt-oss's), and the output's format."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormatIn | None = None


class CountTokensRequest(_Body):
    """What `count_tokens` reads: a Messages request without its generation settings."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageIn] = Field(min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None
    output_format: OutputFormatIn | None = None  # the structured-outputs beta's name for output_config.format

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return _refuse_blocks(value, ("text",))

    @model_validator(mode="after")
    def _choice_among_tools(self) -> CountTokensRequest:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools share a name")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names '{choice.name}', which is not among the tools")
        if choice is not None and choice.type == "any" and not names:
            raise ValueError("tool_choice 'any' needs tools")
        return self

    def turns(self) -> tuple[Turn, ...]:
        """The conversation as templates read it; an `ApiError` for a tool result whose
        `tool_use_id` no earlier `tool_use` block carries."""
        turns: list[Turn] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            turns.append(Turn("system", text))
        called: dict[str, str] = {}  # each tool_use id so far, and its tool's name
        for index, message in enumerate(self.messages):
            if message.role == "assistant":
                turns.append(_assistant_turn(message.blocks(), called))
            elif message.role == "system":
                turns.append(_system_turn(message.blocks(), index))
            else:
                turns += _user_turns(message.blocks(), called, index)
        return tuple(turns)

    def tool_choice_of(self) -> tuple[ToolChoice, bool]:
        """The choice (Anthropic's default: "auto"), and whether calls may be parallel."""
        choice = self.tool_choice
        parallel = not (choice and choice.disable_parallel_tool_use)
        if choice is None or choice.type == "auto":
            return ToolChoice("auto" if self.tools else "none"), parallel
        if choice.type == "any":
            return ToolChoice("required"), parallel
        if choice.type == "tool":
            return ToolChoice("required", choice.name), parallel
        return ToolChoice("none"), parallel

    def output(self) -> OutputFormat:
        form = self.output_config.format if self.output_config is not None else None
        form = form or self.output_format
        return OutputFormat("json_schema", form.schema_) if form is not None else OutputFormat()

    def generation(self) -> Generation:
        return Generation(None, SamplingSettings())

    def ask(self) -> ChatAsk:
        choice, parallel = self.tool_choice_of()
        # A deferred tool is not in the model's context (Anthropic loads it when a search finds it;
        # this server runs no tool search), so it is not shown to the template either.
        tools = tuple(tool.tool() for tool in self.tools or () if not tool.defer_loading)
        return ChatAsk(
            self.turns(), self.generation(), tools, choice, parallel, self.output(), self.reasons(), self.effort()
        )

    def reasons(self) -> bool | None:
        """`thinking` "enabled" or "disabled" told to a thinking model's template; "adaptive" (or
        none) leaves it to the template. (A budget of thinking tokens is not enforced.)"""
        if self.thinking is None or self.thinking.type == "adaptive":
            return None
        return self.thinking.type == "enabled"

    def effort(self) -> Literal["low", "medium", "high"] | None:
        effort = self.output_config.effort if self.output_config is not None else None
        return "high" if effort in ("xhigh", "max") else effort  # type: ignore[return-value]


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False

    def generation(self) -> Generation:
        """Anthropic's defaults: temperature 1, no top-p or top-k cut."""
        sampling = SamplingSettings(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=secrets.randbelow(2**32),
        )
        stops = tuple(s for s in self.stop_sequences or () if s)
        return Generation(self.max_tokens, sampling, stops)


def _assistant_turn(blocks: Sequence[Any], called: dict[str, str]) -> Turn:
    text, calls, reasoning = [], [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(CallMade(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
            called[block.id] = block.name
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolResultBlock):
            raise invalid("a tool_result block belongs in a user message", "messages")
    return Turn("assistant", "".join(text), tuple(calls), reasoning="".join(reasoning) or None)


def _system_turn(blocks: Sequence[Any], index: int) -> Turn:
    if any(not isinstance(block, TextBlock) for block in blocks):
        raise invalid("a system message holds text blocks only", f"messages.{index}.content")
    return Turn("system", "".join(block.text for block in blocks))


def _user_turns(blocks: Sequence[Any], called: dict[str, str], index: int) -> list[Turn]:
    """A user message's tool results, each a tool turn, and its text, a user turn, in order."""
    turns: list[Turn] = []
    text: list[str] = []
    for at, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                raise invalid(
                    f"unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id[:80]}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in an earlier message.",
                    f"messages.{index}.content.{at}.tool_use_id",
                )
            if text:
                turns.append(Turn("user", "".join(text)))
                text = []
            turns.append(Turn("tool", block.text(), call_id=block.tool_use_id, name=called[block.tool_use_id]))
        elif isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock | ThinkingBlock):
            raise invalid(f"a {block.type} block belongs in an assistant message", f"messages.{index}.content.{at}")
    if text or not turns:
        turns.append(Turn("user", "".join(text)))
    return turns


# --- the reply -------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them ("toolu_…")."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(finished: Finished) -> dict[str, Any]:
    """Anthropic counts the prompt's tokens read from the cache apart from `input_tokens`."""
    return {
        "input_tokens": finished.prompt_tokens - finished.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": finished.cached_tokens,
        "output_tokens": finished.completion_tokens,
    }


def stop_reason(finished: Finished, called: bool) -> tuple[str, str | None]:
    """`stop_reason` and `stop_sequence`."""
    if finished.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if finished.stop is not None:
        return "stop_sequence", finished.stop
    return "end_turn", None


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is (the grammar made them one)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class MessagesWriter:
    """A `message`, or its stream of events: a content block for each run of text, of reasoning
    (`thinking`) and for each tool call (`tool_use`, its input streamed as `input_json_delta`)."""

    request_id: str
    model: str
    prompt_tokens: int
    reader: ReplyReader | None = None
    media_type = "text/event-stream"
    _open: str | None = None  # the kind of block open: "text", "thinking" or "tool_use"
    _index: int = -1
    _called: bool = False
    _space: str = ""  # blank text held until it is known to begin a text block
    _out: list[bytes] = field(default_factory=list)

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.request_id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
        }  # fmt: skip

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        calls: list[ToolCall] = []
        answer: str | None = text
        if self.reader is not None:
            answer, reasoning, calls = self.reader.read_whole(text)
            if reasoning:
                content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if answer:
            content.append({"type": "text", "text": answer})
        for call in calls:
            block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name}
            content.append({**block, "input": arguments_object(call.arguments)})
        reason, sequence = stop_reason(finished, bool(calls))
        return {**self._message(content, reason, sequence), "usage": usage(finished)}

    def opening(self) -> list[bytes]:
        start_usage = {
            "input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }  # fmt: skip
        start = {"type": "message_start", "message": {**self._message([], None, None), "usage": start_usage}}
        return [sse(start, "message_start"), sse({"type": "ping"}, "ping")]

    def delta(self, delta: TextDelta) -> list[bytes]:
        if self.reader is None:
            self._text(delta.text)
        else:
            self._pieces(self.reader.feed(delta.text))
        return self._take()

    def end(self, finished: Finished) -> list[bytes]:
        if self.reader is not None:
            self._pieces(self.reader.finish())
        if self._space and self._index < 0:  # a reply of blank text alone is that text
            self._block("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": self._space})
        self._close()
        reason, sequence = stop_reason(finished, self._called)
        closing = {"stop_reason": reason, "stop_sequence": sequence}
        self._out.append(sse({"type": "message_delta", "delta": closing, "usage": usage(finished)}, "message_delta"))
        self._out.append(sse({"type": "message_stop"}, "message_stop"))
        return self._take()

    def failed(self, failure: RequestFailed) -> list[bytes]:
        kind = "overloaded_error" if failure.code == "ring_failed" else "api_error"
        return [*self._take(), sse(error_body(kind, failure.message), "error")]

    def _take(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def _pieces(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, str):
                self._text(piece)
            elif isinstance(piece, Reasoning):
                self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self._delta({"type": "thinking_delta", "thinking": piece.text})
            else:
                self._call(piece)

    def _text(self, text: str) -> None:
        """Text, in the text block open or a new one; blank text is held until text follows it,
        so that the newlines before a call or after reasoning open no block of their own."""
        if self._open != "text" and (self._space + text).isspace():
            self._space += text
            return
        text, self._space = self._space + text, ""
        if text:
            self._block("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": text})

    def _call(self, piece: ToolCallDelta) -> None:
        if piece.id is not None:
            self._called = True
            self._close()
            start: dict[str, Any] = {"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "input": {}}
            self._block("tool_use", start)
        if piece.arguments:
            self._delta({"type": "input_json_delta", "partial_json": piece.arguments})

    def _block(self, kind: str, start: dict[str, Any]) -> None:
        """Open a block of `kind`, unless one is open already."""
        if self._open == kind:
            return
        self._close()
        self._open, self._index = kind, self._index + 1
        event = {"type": "content_block_start", "index": self._index, "content_block": start}
        self._out.append(sse(event, "content_block_start"))

    def _delta(self, delta: dict[str, Any]) -> None:
        event = {"type": "content_block_delta", "index": self._index, "delta": delta}
        self._out.append(sse(event, "content_block_delta"))

    def _close(self) -> None:
        if self._open is None:
            return
        if self._open == "thinking":
            self._delta({"type": "signature_delta", "signature": ""})
        self._out.append(sse({"type": "content_block_stop", "index": self._index}, "content_block_stop"))
        self._open = None


# --- the routes ------------------------------------------------------------------------------------


def install(app: FastAPI, front: Front) -> None:
    config = front.config
    front.error_shape(PATH, error_response)

    @app.post(PATH, response_model=None)
    async def messages(request: Request) -> Response:
        front.authorise(request)
        body: MessagesRequest = await front.parse(request, MessagesRequest)
        ask = body.ask()
        ring = await front.ready_ring(body.model)
        prepared, prompt = await front.chat_prompt(ring, ask, "messages")
        writer = MessagesWriter(new_id("msg_"), config.model_id, len(prompt), prepared.reader)
        served = ServeRequest(prompt, "messages", ask.generation, prepared.grammar, body.stream)
        return await front.serve(request, served, ring, writer)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        front.authorise(request)
        body: CountTokensRequest = await front.parse(request, CountTokensRequest)
        ask = body.ask()
        ring = await front.ready_ring(body.model)
        _, prompt = await front.chat_prompt(ring, ask, "messages")
        return {"input_tokens": len(prompt)}
