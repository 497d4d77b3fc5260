"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`): its body
parsed into a `ChatAsk`, prepared and served as chat completions are, and the reply written as
output items (reasoning, a message, function calls), whole or as the API's named events.

The conversation is `input` (a string, or items: messages, function calls and their outputs,
reasoning sent back) after `instructions`, continuing a stored response's where
`previous_response_id` names one (`responses_store`). Built-in tools (web search, file search,
…) and inputs this server cannot take (images, files) are refused with a 400 that names them;
fields it does not know are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from kafila.api.asks import CallMade, ChatAsk, FunctionTool, Generation, OutputFormat, ToolChoice, Turn
from kafila.api.errors import ApiError, invalid
from kafila.api.front import Front, bounded_body, new_id
from kafila.api.guards import BodyRefused, json_object
from kafila.api.replies import sse
from kafila.api.requests import ServeRequest, prepare_chat
from kafila.api.responses_store import ResponseStore, StoredResponse
from kafila.api.schemas import FUNCTION_NAME, MAX_TOOLS
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCallDelta
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta

ROUTES = "POST /v1/responses, GET and DELETE /v1/responses/{id}"
MAX_ITEMS = 4096
BUILT_IN_TOOLS = "web_search, file_search, code_interpreter, computer use, image generation, MCP, shell"

# --- the request ---------------------------------------------------------------------------------


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


class FunctionDefinition(_Body):
    type: Literal["function"]
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
    top_logprobs: Literal[0] | None = None
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
        return Generation(self.max_output_tokens, sampling)

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
    body = await bounded_body(request)
    try:
        data = json_object(body, request.headers.get("content-type"))
    except BodyRefused as refused:
        code = "unsupported_media_type" if refused.status == 415 else None
        raise ApiError(refused.status, str(refused), "invalid_request_error", code) from None
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


# --- the reply -----------------------------------------------------------------------------------

Event = tuple[str, dict[str, Any]]


@dataclass
class OutputItems:
    """The response's output items, built as the reply's pieces come (reasoning, text, calls),
    with the events that tell a stream of each: an item opens when its first piece comes and
    closes when a piece of another kind does, or at the end. Whitespace before an item is
    dropped unless a message follows it."""

    items: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None
    _space: str = ""

    def feed(self, pieces: Sequence[Piece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text(piece)
            elif isinstance(piece, Reasoning):
                events += self._reasoning(piece.text)
            else:
                events += self._call(piece)
        return events

    def finish(self, complete: bool) -> list[Event]:
        """Close what is open (incomplete where the reply was cut short); a reply with no item at
        all is a message of what whitespace it wrote, or empty."""
        events = self._text("", force=True) if not self.items else []
        return events + self._close("completed" if complete else "incomplete")

    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"])

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _index(self) -> int:
        return len(self.items) - 1

    def _text(self, text: str, force: bool = False) -> list[Event]:
        if self._kind() != "message" and not force and not text.strip():
            self._space += text
            return []
        events: list[Event] = []
        if self._kind() != "message":
            events += self._begin({"id": new_id("msg_"), "type": "message", "status": "in_progress",
                                   "role": "assistant", "content": []})  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
            text, self._space = self._space + text, ""
        assert self._open is not None
        self._open["_text"] = self._open.get("_text", "") + text
        if text:
            delta = {**self._where(), "content_index": 0, "delta": text, "logprobs": []}
            events.append(("response.output_text.delta", delta))
        return events

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._kind() != "reasoning":
            events += self._begin({"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []})
            part = {"type": "reasoning_text", "text": ""}
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
        assert self._open is not None
        self._open["_text"] = self._open.get("_text", "") + text
        events.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text}))
        return events

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if delta.id is not None:
            events += self._begin({"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                                   "call_id": delta.id, "name": delta.name or "", "arguments": ""})  # fmt: skip
        if self._kind() != "function_call" or not delta.arguments:
            return events
        assert self._open is not None
        self._open["arguments"] += delta.arguments
        events.append(("response.function_call_arguments.delta", {**self._where(), "delta": delta.arguments}))
        return events

    def _begin(self, item: dict[str, Any]) -> list[Event]:
        events = self._close("completed")
        self._space = ""
        self.items.append(item)
        self._open = item
        return [*events, ("response.output_item.added", {"output_index": self._index(), "item": dict(item)})]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index()}

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        item, where = self._open, self._where()
        self._open = None
        events: list[Event] = []
        if item["type"] == "message":
            text = item.pop("_text", "")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            text = item.pop("_text", "")
            part = {"type": "reasoning_text", "text": text}
            events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item["content"] = [part]
        else:
            done = {**where, "name": item["name"], "arguments": item["arguments"]}
            events.append(("response.function_call_arguments.done", done))
        item["status"] = status
        events.append(("response.output_item.done", {"output_index": where["output_index"], "item": dict(item)}))
        return events


@dataclass
class ResponsesWriter:
    """A response, whole or as the API's named server-sent events, each with its sequence number:
    `response.created` and `response.in_progress`, each output item's events, then
    `response.completed` (or `response.incomplete` past max_output_tokens, or `response.failed`).
    `keep`: told the finished response (to store it); `count_tokens`: how many tokens a text is,
    for the usage's reasoning tokens."""

    request_id: str
    model: str
    echo: dict[str, Any]
    reader: ReplyReader | None = None
    keep: Callable[[dict[str, Any]], None] | None = None
    count_tokens: Callable[[str], int] | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: OutputItems = field(default_factory=OutputItems)
    sequence: int = 0
    _closing: list[Event] = field(default_factory=list)  # the output's last events, once it ended
    media_type = "text/event-stream"

    def response(
        self, status: str, finished: Finished | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": None, "model": self.model, "output": [],
            "usage": None, **self.echo,
        }  # fmt: skip
        if finished is not None:
            body["output"] = [dict(item) for item in self.output.items]
            body["usage"] = self._usage(finished)
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            else:
                body["completed_at"] = int(time.time())
        return body

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        self._pieces(self.reader.feed(text) + self.reader.finish() if self.reader is not None else [text])
        return self._ended(finished)[1]

    def opening(self) -> list[bytes]:
        return [self._event("response.created", {"response": self.response("in_progress")}),
                self._event("response.in_progress", {"response": self.response("in_progress")})]  # fmt: skip

    def delta(self, delta: TextDelta) -> list[bytes]:
        return self._events(self._pieces(self.reader.feed(delta.text) if self.reader is not None else [delta.text]))

    def end(self, finished: Finished) -> list[bytes]:
        out = self._events(self._pieces(self.reader.finish())) if self.reader is not None else []
        kind, response = self._ended(finished)
        return [*out, *self._events(self._closing), self._event(kind, {"response": response})]

    def failed(self, failure: RequestFailed) -> list[bytes]:
        error = {"code": "server_error", "message": failure.message}
        return [self._event("response.failed", {"response": self.response("failed", error=error)})]

    def _pieces(self, pieces: Sequence[Piece]) -> list[Event]:
        return self.output.feed(pieces)

    def _ended(self, finished: Finished) -> tuple[str, dict[str, Any]]:
        complete = finished.reason is FinishReason.STOP
        self._closing = self.output.finish(complete)
        response = self.response("completed" if complete else "incomplete", finished)
        if self.keep is not None:
            self.keep(response)
        return ("response.completed" if complete else "response.incomplete"), response

    def _usage(self, finished: Finished) -> dict[str, Any]:
        reasoning = self.output.reasoning_text()
        reasoning_tokens = self.count_tokens(reasoning) if reasoning and self.count_tokens is not None else 0
        return {
            "input_tokens": finished.prompt_tokens,
            # what this prompt computed stays in the cache for the next request that shares it
            "input_tokens_details": {
                "cached_tokens": finished.cached_tokens,
                "cache_write_tokens": finished.prompt_tokens - finished.cached_tokens,
            },
            "output_tokens": finished.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, finished.completion_tokens)},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        }

    def _events(self, events: Sequence[Event]) -> list[bytes]:
        return [self._event(kind, payload) for kind, payload in events]

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse(body, kind)


def conversation_after(response: dict[str, Any], turns: Sequence[Turn], calls: dict[str, str]) -> StoredResponse:
    """What a finished response leaves for one that continues it: its turns, then its output's."""
    said, calls = read_items(ITEMS.validate_python(response["output"]), dict(calls), "output")
    return StoredResponse(response, (*turns, *said), calls)


# --- the routes ----------------------------------------------------------------------------------

PARAMS = {"messages": "input", "response_format": "text.format"}  # the shared layer's names, as this API's


def install(app: FastAPI, front: Front, store: ResponseStore | None = None) -> ResponseStore:
    """The routes, over `store` (a new one by default); returns the store."""
    config = front.config
    kept = store if store is not None else ResponseStore()

    @app.post("/v1/responses", response_model=None)
    async def create(request: Request) -> Response:
        front.authorise(request)
        body = await parse(request)
        earlier: tuple[Turn, ...] = ()
        made: dict[str, str] = {}
        if body.previous_response_id is not None:
            previous = kept.get(body.previous_response_id, "previous_response_id")
            earlier, made = previous.turns, previous.calls
        ask, calls = body.ask(earlier, made)
        ring = await front.ready_ring(body.model)
        try:
            prepared = prepare_chat(ask, ring.template)
        except ApiError as error:
            error.param = PARAMS.get(error.param or "", error.param)
            raise
        prompt = await front.tokenize(ring, prepared.text, prepared.add_bos, True, "input")
        conversation = ask.turns[1:] if body.instructions is not None else ask.turns

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                kept.put(response["id"], conversation_after(response, conversation, calls))

        def count_tokens(text: str) -> int:
            return len(ring.tokenize(text, False, False))

        writer = ResponsesWriter(new_id("resp_"), config.model_id, body.echo(), prepared.reader, keep, count_tokens)
        served = ServeRequest(prompt, "input", ask.generation, prepared.grammar, body.stream)
        try:
            return await front.serve(request, served, ring, writer)
        except ApiError as error:
            error.param = PARAMS.get(error.param or "", error.param)
            raise

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        front.authorise(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise invalid("This server does not replay a stored response as a stream; ask without stream.", "stream")
        return kept.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        front.authorise(request)
        kept.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return kept
