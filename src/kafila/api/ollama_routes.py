"""The Ollama API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`): its bodies read into what they ask (`asks`), prepared as any dialect's are
(`requests`), and answered in Ollama's shape: JSON lines (`application/x-ndjson`) as the reply
comes by default, one JSON object with `stream: false`, errors as `{"error": "..."}`.

Model names: the served model answers to its Ollama name, the model id with the tag `:latest`
(`gemma-3-270m-q4_k_m:latest`; an id that has a tag of its own keeps it), and to the bare id;
any other name is a 404, as Ollama answers a model it has not pulled.

Sampling follows Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, no repeat penalty:
ollama/ollama#17679 dropped its old 1.1), a random seed unless `options.seed` sets one, and no
token limit unless `num_predict` sets one. Options Ollama knows that change how the model runs
on a machine (`num_gpu`, `num_thread`, `num_batch`, …) are ignored, as are unknown ones;
`num_ctx` past the session's context, and samplers this server does not have (`min_p`,
`typical_p`, `mirostat`) set to anything but their neutral value, are a 400. So are what this
server cannot honour: `images`, generate's `template`, `context` and `suffix`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from kafila.api.asks import CallMade, ChatAsk, FunctionTool, Generation, OutputFormat, TextAsk, ToolChoice, Turn
from kafila.api.errors import ApiError, invalid
from kafila.api.front import ApiConfig, Front, new_id
from kafila.api.openai_replies import token_text
from kafila.api.requests import ServeRequest, prepare_chat, prepare_completion
from kafila.api.schemas import FUNCTION_NAME, MAX_TOOLS
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCall, ToolCallDelta
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.batcher import Finished, RequestFailed, TextDelta
from kafila.serving.chat_template import ReplySyntax
from kafila.serving.handle import ServingHandle
from kafila.wire.frames import MAX_TOP_LOGPROBS

ROUTES = "POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/ps, GET /api/version"
NDJSON = "application/x-ndjson"
# The Ollama release whose API this follows: clients gate features on it (`think`, tool calls,
# structured output), so it names Ollama's version, not Kafila's.
OLLAMA_VERSION = "0.12.6"
MAX_STOP_STRINGS = 16
# A model Ollama keeps loaded for ever says so with a far expiry; this one stays while the session serves.
LOADED_UNTIL = "2318-01-01T00:00:00Z"


# --- names -----------------------------------------------------------------------------------------


def ollama_name(model_id: str) -> str:
    """The served model's Ollama name: its id with the tag `:latest`, unless the id has a tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else f"{model_id}:latest"


def served_id(name: str, config: ApiConfig) -> str:
    """The served model's id, for its Ollama name or the id itself; a 404 for any other name."""
    if name in (config.model_id, ollama_name(config.model_id)):
        return config.model_id
    raise ApiError(
        404, f'model "{name[:256]}" not found; this server serves "{ollama_name(config.model_id)}"',
        "invalid_request_error", "model_not_found", "model",
    )  # fmt: skip


# --- bodies ----------------------------------------------------------------------------------------

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
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1: the whole context
    presence_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[StrictFloat | StrictInt, Field(ge=-2.0, le=2.0)] | None = None
    num_ctx: Annotated[StrictInt, Field(ge=1)] | None = None
    min_p: StrictFloat | StrictInt | None = None
    typical_p: StrictFloat | StrictInt | None = None
    mirostat: StrictInt | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

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
        stops = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return Generation(limit, self.sampling(context), stops, alternatives)

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


# --- replies ---------------------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def ollama_logprobs(tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    def one(piece: bytes, logprob: float) -> dict[str, Any]:
        return {"token": token_text(piece), "logprob": logprob, "bytes": list(piece)}

    return [{**one(t.piece, t.logprob), "top_logprobs": [one(a.piece, a.logprob) for a in t.top]} for t in tokens]


def call_object(call: ToolCall, index: int) -> dict[str, Any] | None:
    """A call as Ollama carries it, its arguments an object; None where they are not one (the
    token limit cut them)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


@dataclass
class OllamaWriter:
    """`/api/chat`'s and `/api/generate`'s reply, whole or as JSON lines. The reader, where there
    is one, splits the text into content, reasoning (`thinking`, shown where `think` is not
    false) and tool calls, which go out whole, each once its arguments are written, as Ollama's
    do. The last line has `done: true`, the reason, and Ollama's counters (durations in ns)."""

    request_id: str
    model: str  # the name the client asked for
    chat: bool  # /api/chat's shape (`message`), else /api/generate's (`response`)
    reader: ReplyReader | None = None
    show_thinking: bool = True
    logprobs: bool = False
    media_type = NDJSON
    started: int = field(default_factory=time.monotonic_ns)
    first_text: int | None = None
    calls: dict[int, list[str]] = field(default_factory=dict)  # index: id, name, arguments so far
    sent_calls: int = 0

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content: str | None = text
        reasoning, calls = "", list[ToolCall]()
        if self.reader is not None:
            content, reasoning, calls = self.reader.read_whole(text)
        written = [c for c in (call_object(call, i) for i, call in enumerate(calls)) if c is not None]
        reply = self._envelope(content or "", reasoning if self.show_thinking else "", written)
        if self.logprobs:
            reply["logprobs"] = ollama_logprobs(logprobs)
        return {**reply, **self._closing(finished, streamed=False)}

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: TextDelta) -> list[bytes]:
        if self.first_text is None:
            self.first_text = time.monotonic_ns()
        pieces: list[Piece] = [delta.text] if self.reader is None else self.reader.feed(delta.text)
        out = self._pieces(pieces)
        if self.logprobs and delta.logprobs:
            tokens = ollama_logprobs(delta.logprobs)
            if out:  # on the first line this delta makes; else on a line of their own
                first = json.loads(out[0])
                out[0] = line({**first, "logprobs": tokens})
            else:
                out.append(line({**self._envelope("", "", []), "logprobs": tokens}))
        return out

    def end(self, finished: Finished) -> list[bytes]:
        out = self._pieces(self.reader.finish()) if self.reader is not None else []
        out += self._calls_done(len(self.calls))
        return [*out, line({**self._envelope("", "", []), **self._closing(finished, streamed=True)})]

    def failed(self, failure: RequestFailed) -> list[bytes]:
        return [line({"error": failure.message})]

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    out.append(line(self._envelope(piece, "", [])))
            elif isinstance(piece, Reasoning):
                if piece.text and self.show_thinking:
                    out.append(line(self._envelope("", piece.text, [])))
            else:
                out += self._call_piece(piece)
        return out

    def _call_piece(self, piece: ToolCallDelta) -> list[bytes]:
        out = []
        if piece.index not in self.calls:
            out = self._calls_done(piece.index)  # a new call: those before it are written
            self.calls[piece.index] = [piece.id or "", piece.name or "", ""]
        self.calls[piece.index][2] += piece.arguments
        return out

    def _calls_done(self, upto: int) -> list[bytes]:
        """The calls before `upto` not yet sent, each on a line of its own."""
        out = []
        while self.sent_calls < upto:
            call_id, name, arguments = self.calls[self.sent_calls]
            written = call_object(ToolCall(call_id, name, arguments), self.sent_calls)
            if written is not None:
                out.append(line(self._envelope("", "", [written])))
            self.sent_calls += 1
        return out

    def _envelope(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        reply: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            reply["message"] = message
        else:
            reply["response"] = text
            if thinking:
                reply["thinking"] = thinking
        reply["done"] = False  # the last line's closing says otherwise
        return reply

    def _closing(self, finished: Finished, streamed: bool) -> dict[str, Any]:
        """`done`, its reason, and the counters. Durations are measured from the request's start;
        a whole reply has no time of its first token, so it splits none between the prompt and
        the reply."""
        ended = time.monotonic_ns()
        counters: dict[str, Any] = {
            "done": True,
            "done_reason": finished.reason.value,
            "total_duration": ended - self.started,
            "load_duration": 0,
            "prompt_eval_count": finished.prompt_tokens,
            "eval_count": finished.completion_tokens,
        }
        if streamed:
            first = self.first_text or ended
            counters["prompt_eval_duration"] = first - self.started
            counters["eval_duration"] = ended - first
        return counters


def loaded(model: str, chat: bool, keep_alive: Any) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate, which clients send to load a model
    (or, with `keep_alive: 0`, to unload it): this one is loaded while the session serves."""
    reason = "unload" if keep_alive in (0, "0", "0s", "0m") else "load"
    reply: dict[str, Any] = {"model": model, "created_at": now_iso()}
    reply |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {**reply, "done": True, "done_reason": reason}


# --- routes ----------------------------------------------------------------------------------------


def error_body(error: ApiError) -> Response:
    """Ollama's error shape: the message alone."""
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers or None)


def install(app: FastAPI, front: Front) -> None:
    config = front.config
    front.error_shape("/api/", error_body)

    @app.get("/api/version")
    async def version() -> dict[str, Any]:
        """Open, as /health is: clients ask it to tell whether a server is there."""
        return {"version": OLLAMA_VERSION}

    async def here() -> Response:
        """`HEAD /` is how the Ollama CLI tells that a server is there (`GET /` is the web page)."""
        return Response(status_code=200)

    for path in ("/", "/api/version"):
        app.add_api_route(path, here, methods=["HEAD"], include_in_schema=False)

    @app.get("/api/tags")
    async def tags(request: Request) -> dict[str, Any]:
        front.authorise(request)
        return {"models": [model_entry(config, front.serving.ring)]}

    @app.get("/api/ps")
    async def ps(request: Request) -> dict[str, Any]:
        """The model is loaded while a ring serves it."""
        front.authorise(request)
        ring = front.serving.ring
        if ring is None or ring.error is not None:
            return {"models": []}
        entry = model_entry(config, ring)
        del entry["modified_at"]
        loaded_entry = {
            **entry,
            "expires_at": LOADED_UNTIL,
            "size_vram": 0,
            "context_length": config.context_per_sequence,
        }
        return {"models": [loaded_entry]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        front.authorise(request)
        body: ShowBody = await front.parse(request, ShowBody)
        name = body.model or body.name
        if name is None:
            raise invalid("model is required", "model")
        ring = await front.ready_ring(served_id(name, config))
        return model_card(config, ring)

    @app.post("/api/chat", response_model=None)
    async def chat(request: Request) -> Response:
        front.authorise(request)
        body: ChatBody = await front.parse(request, ChatBody)
        model_id = served_id(body.model, config)
        if not body.messages:
            return JSONResponse(loaded(body.model, True, body.keep_alive))
        ask = body.ask(config.context_per_sequence)
        ring = await front.ready_ring(model_id)
        show_thinking = thinking_asked(body.think, body.model, ring)
        prepared = prepare_chat(ask, ring.template)
        prompt = await front.tokenize(ring, prepared.text, prepared.add_bos, True, "messages")
        writer = OllamaWriter(new_id("chat-"), body.model, True, prepared.reader, show_thinking, body.logprobs is True)
        served = ServeRequest(prompt, "messages", ask.generation, prepared.grammar, body.streams())
        return await front.serve(request, served, ring, writer)

    @app.post("/api/generate", response_model=None)
    async def generate(request: Request) -> Response:
        front.authorise(request)
        body: GenerateBody = await front.parse(request, GenerateBody)
        model_id = served_id(body.model, config)
        if not body.prompt:
            return JSONResponse(loaded(body.model, False, body.keep_alive))
        ask = body.ask(config.context_per_sequence)
        ring = await front.ready_ring(model_id)
        logprobs = body.logprobs is True
        if isinstance(ask, TextAsk):
            completion = prepare_completion(ask, ring.n_vocab())
            assert completion.text is not None
            prompt = await front.tokenize(ring, completion.text, True, False, "prompt")
            writer = OllamaWriter(new_id("gen-"), body.model, False, None, True, logprobs)
            served = ServeRequest(prompt, "prompt", ask.generation, completion.grammar, body.streams())
            return await front.serve(request, served, ring, writer)
        show_thinking = thinking_asked(body.think, body.model, ring)
        prepared = prepare_chat(ask, ring.template)
        prompt = await front.tokenize(ring, prepared.text, prepared.add_bos, True, "prompt")
        writer = OllamaWriter(new_id("gen-"), body.model, False, prepared.reader, show_thinking, logprobs)
        served = ServeRequest(prompt, "prompt", ask.generation, prepared.grammar, body.streams())
        return await front.serve(request, served, ring, writer)


def thinks(ring: ServingHandle) -> bool:
    template = ring.template
    return template.thinks or template.reply_syntax is ReplySyntax.HARMONY


def thinking_asked(think: bool | str | None, name: str, ring: ServingHandle) -> bool:
    """Whether the reply shows the model's reasoning (`thinking`): unless `think` is false. A
    model that does not think cannot be asked to (a 400, as Ollama's)."""
    if think not in (None, False) and not thinks(ring):
        raise invalid(f'"{name[:256]}" does not support thinking: its chat template writes no reasoning', "think")
    return think is not False


def capabilities(ring: ServingHandle) -> list[str]:
    found = ["completion"]
    if ring.template.tool_syntax is not None:
        found.append("tools")
    if thinks(ring):
        found.append("thinking")
    return found


def details(ring: ServingHandle | None) -> dict[str, Any]:
    family = (ring.architecture if ring is not None else None) or ""
    return {
        "parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
        "parameter_size": "", "quantization_level": "",
    }  # fmt: skip


def model_entry(config: ApiConfig, ring: ServingHandle | None) -> dict[str, Any]:
    """The model as `/api/tags` lists it. Its digest names the served id (Kafila serves no blobs);
    its size on disk is not known here, so 0."""
    name = ollama_name(config.model_id)
    return {
        "name": name, "model": name,
        "modified_at": datetime.fromtimestamp(config.created, UTC).isoformat().replace("+00:00", "Z"),
        "size": 0, "digest": hashlib.sha256(config.model_id.encode()).hexdigest(), "details": details(ring),
    }  # fmt: skip


def model_card(config: ApiConfig, ring: ServingHandle) -> dict[str, Any]:
    """`/api/show`: what the model can do (`capabilities`, which clients read to offer tools and
    thinking), its architecture and context (`model_info`), and its chat template (Jinja, as
    the GGUF file holds it, not a Go template)."""
    architecture = ring.architecture or "unknown"
    info = {"general.architecture": architecture, f"{architecture}.context_length": config.context_per_sequence}
    return {
        "license": "", "modelfile": f"# Served by Kafila\nFROM {config.model_id}\n", "parameters": "",
        "template": ring.engine.chat_template() or "", "details": details(ring), "model_info": info,
        "capabilities": capabilities(ring),
        "modified_at": datetime.fromtimestamp(config.created, UTC).isoformat().replace("+00:00", "Z"),
    }  # fmt: skip
