"""What every dialect's routes share: who may call, reading a body, the ring to serve on, the
prompt's tokens, and `serve`, which runs a prepared request and answers in the dialect's shape.

A dialect's module (`openai_routes`, …) adds its routes with `install(app, front)`: it parses
its body into an ask (`asks`), prepares it (`requests`), and hands `serve` the result with its
`ReplyWriter`. Its errors keep its own shape by the path prefix it registers (`error_shape`).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kafila.api.asks import ChatAsk
from kafila.api.errors import TRY_AGAIN, ApiError, invalid
from kafila.api.events_stream import EVENT_HEARTBEAT_S
from kafila.api.guards import BodyRefused, json_object
from kafila.api.replies import ReplyMeter, ReplyWriter, collect, stream_reply
from kafila.api.requests import PreparedChat, ServeRequest, prepare_chat
from kafila.api.served import Served
from kafila.api.telemetry import Metrics
from kafila.runtime.engine.ring import StageFailed
from kafila.runtime.engine.sampling import GrammarRefused
from kafila.serving.batcher import Job, RequestEvent
from kafila.serving.engine_loop import EngineUnavailable
from kafila.serving.handle import ServingHandle
from kafila.validation import first_problem, one_line

# A whole context of text (a token is a few bytes) with room to spare: 131,072 tokens of chat
# take about half a MiB of JSON.
MAX_BODY_BYTES = 16 << 20
MAX_DRAINED_BYTES = 1 << 30
# No tokenizer in use has a token longer than this many characters (the longest are runs of
# spaces or symbols, up to a few hundred bytes), so a longer text than the context times this
# cannot fit, whatever it holds.
MAX_TOKEN_CHARACTERS = 1024
TOKENIZE_IN_THREAD_CHARACTERS = 1 << 15
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ErrorShape = Callable[[ApiError], Response]


@dataclass(frozen=True)
class ApiConfig:
    """What the API is, whatever the session does: the model it names, its context, who may call."""

    model_id: str
    context_per_sequence: int
    api_key: str | None = None
    allowed_hosts: frozenset[str] = frozenset()  # host names it answers to besides addresses and localhost
    event_heartbeat_s: float = EVENT_HEARTBEAT_S
    created: int = field(default_factory=lambda: int(time.time()))


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class Front:
    """The session as every dialect's routes use it."""

    def __init__(self, serving: Served, config: ApiConfig, metrics: Metrics) -> None:
        self.serving, self.config, self.metrics = serving, config, metrics
        self._error_shapes: list[tuple[str, ErrorShape]] = []

    def error_shape(self, path_prefix: str, shape: ErrorShape) -> None:
        """Errors on paths under `path_prefix` in a dialect's own shape (OpenAI's elsewhere)."""
        self._error_shapes.append((path_prefix, shape))

    def error_response(self, request: Request, error: ApiError) -> Response:
        path = request.url.path
        for prefix, shape in self._error_shapes:
            if path.startswith(prefix):
                return shape(error)
        return error.response()

    def authorise(self, request: Request) -> None:
        """The API key, as a Bearer token or (as Anthropic's clients send it) `x-api-key`."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        offered = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(offered.encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")

    async def parse(self, request: Request, schema: type[BaseModel]) -> Any:
        data = await json_body(request)
        try:
            return schema.model_validate(data)
        except ValidationError as error:
            where, _ = first_problem(error)
            raise invalid(one_line(error), param=where or None) from None

    async def ready_ring(self, model: str) -> ServingHandle:
        """The ring to serve on; during a planned replan, once it is done."""
        if model != self.config.model_id:
            raise ApiError(
                404, f"The model '{model}' does not exist; this server serves '{self.config.model_id}'.",
                "invalid_request_error", "model_not_found", "model",
            )  # fmt: skip
        state = self.serving.state()
        if state.paused and not state.ready:
            self.metrics.held.inc()
            await self.serving.until_resumed()
        ring = self.serving.ring
        if ring is None or ring.error is not None:
            raise self.unavailable()
        return ring

    def replanned_since(self, taken: ServingHandle) -> bool:
        """The host stopped this ring to replan by choice, and the replan runs or is done: a
        request that took it just before can wait for the new ring, as one that comes during the
        pause does, instead of being told the host is shutting down."""
        return self.serving.state().paused or (self.serving.ring is not None and taken is not self.serving.ring)

    async def tokenize(
        self, ring: ServingHandle, text: str, add_special: bool, parse_special: bool, param: str
    ) -> list[int]:
        """Token ids, off the event loop for long texts (8 MB takes seconds, and every stream
        would stall meanwhile); a text too long to fit the context at any tokenizer's longest
        token is refused without tokenizing it at all."""
        context = self.config.context_per_sequence
        if len(text) > context * MAX_TOKEN_CHARACTERS:
            raise invalid(
                f"This model's maximum context length is {context} tokens. However, your {param} holds "
                f"{len(text)} characters, more than that many tokens can hold.", param, "context_length_exceeded",
            )  # fmt: skip
        try:
            return await _tokenize_with(ring, text, add_special, parse_special)
        except StageFailed:  # the host closed this engine meanwhile, to replan
            if not self.replanned_since(ring):
                raise self.unavailable() from None
        ring = await self.ready_ring(self.config.model_id)
        try:
            return await _tokenize_with(ring, text, add_special, parse_special)
        except StageFailed:
            raise self.unavailable() from None

    async def chat_prompt(self, ring: ServingHandle, ask: ChatAsk, param: str) -> tuple[PreparedChat, list[int]]:
        """A chat ask rendered by the ring's template (`requests.prepare_chat`) and its prompt's
        token ids; `param`: the request's field that holds the conversation, for errors."""
        prepared = prepare_chat(ask, ring.template)
        return prepared, await self.tokenize(ring, prepared.text, prepared.add_bos, True, param)

    async def serve(self, request: Request, served: ServeRequest, ring: ServingHandle, writer: ReplyWriter) -> Response:
        """Run a request, whatever its dialect, and answer in the writer's shape: whole once it
        ends, or streamed as it comes."""
        self._check(served, ring)
        generation, context = served.generation, self.config.context_per_sequence
        request_id = writer.request_id
        sampling = generation.sampling.model_copy(update={"grammar": served.grammar})
        limit = generation.limit or context
        job = Job(request_id, served.prompt, limit, sampling, generation.stops, generation.alternatives)
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(event: RequestEvent) -> None:
            event_loop.call_soon_threadsafe(queue.put_nowait, event)

        meter = ReplyMeter(self.metrics)
        ring = await self._submit(ring, job, sink)

        def cancel() -> None:
            """On the loop it was submitted to, and on the one serving now, where a broken ring's
            requests go on."""
            ring.cancel(request_id)
            now = self.serving.ring
            if now is not None and now is not ring:
                now.cancel(request_id)
            if ring.error is not None:  # it broke: the session may hold the request for the next ring
                self.serving.client_gone(request_id)

        if served.stream:
            stream = stream_reply(queue, writer, meter, cancel)
            return StreamingResponse(stream, media_type=writer.media_type, headers=STREAM_HEADERS)
        collecting = asyncio.ensure_future(collect(queue, meter))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():  # the client hung up (or the server is stopping): stop making it
                collecting.cancel()
                await asyncio.wait({collecting})  # cancelled once it has run again, not at cancel()
            cancel()  # a no-op once finished; frees the slot if the client went away
        if collecting.cancelled():
            return Response(status_code=499)  # nobody is left to read it
        gathered = collecting.result()
        return JSONResponse(writer.whole(gathered.text, gathered.finished, gathered.logprobs))

    def _check(self, served: ServeRequest, ring: ServingHandle) -> None:
        """A 400 for an empty prompt, a grammar llama.cpp cannot parse, or more than the context."""
        context, limit = self.config.context_per_sequence, served.generation.limit
        if not served.prompt:
            raise invalid("The prompt is empty.", served.param)
        if served.grammar is not None:
            try:
                ring.check_grammar(served.grammar)
            except GrammarRefused as error:
                raise invalid(f"{error}: the schema or tools asked for output it cannot describe") from None
            except StageFailed:
                raise self.unavailable() from None
        if len(served.prompt) >= context or (limit is not None and len(served.prompt) + limit > context):
            asked = f" and {limit} for the completion" if limit is not None else ""
            raise invalid(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(served.prompt)} tokens in the prompt{asked}. Please reduce the length of the prompt or "
                "completion.", served.param, "context_length_exceeded",
            )  # fmt: skip

    async def _submit(self, ring: ServingHandle, job: Job, sink: Callable[[RequestEvent], None]) -> ServingHandle:
        """Queue the job on the ring, or on the new ring if a planned replan stopped this one
        since the request took it. Returns the ring the job runs on."""
        if not self._submitted(ring, job, sink, may_wait=True):
            ring = await self.ready_ring(self.config.model_id)
            self._submitted(ring, job, sink, may_wait=False)
        return ring

    def _submitted(self, ring: ServingHandle, job: Job, sink: Callable[[RequestEvent], None], may_wait: bool) -> bool:
        """False when a planned replan stopped the ring and the caller may wait for the new one."""
        try:
            ring.submit(job, sink)
            return True
        except EngineUnavailable as error:
            if may_wait and self.replanned_since(ring):
                return False
            raise self.unavailable(str(error)) from None
        except ValueError as error:
            raise invalid(str(error)) from None

    def unavailable(self, message: str | None = None) -> ApiError:
        """A 503, saying why (`message`, or what the session waits for), with what a client
        should do next: while the session gets ready, or replans after its ring broke, try again
        shortly (`Retry-After`); where it cannot serve (the model does not fit, every member
        failed), not at all (`x-should-retry: false`, which the official SDKs heed), since a
        retry could only fail the same way."""
        state, ring = self.serving.state(), self.serving.ring
        if message is None and ring is not None and ring.error is not None:
            message = f"The session cannot serve: {ring.error}"
        elif message is None and state.failure:
            message = f"The session cannot serve: {state.failure}"
        elif message is None:
            waiting = ", ".join(state.waiting_for or ["the model"])
            message = f"The session is not ready yet: waiting for {waiting}."
        headers = {"x-should-retry": "false"} if state.failure else TRY_AGAIN
        return ApiError(503, message, "server_error", "not_ready", headers=headers)

    def what_fails(self) -> str | None:
        """Why nothing serves, or why the ring that serves broke."""
        ring = self.serving.ring
        return self.serving.state().failure or (ring.error if ring else None)


async def _tokenize_with(ring: ServingHandle, text: str, add_special: bool, parse_special: bool) -> list[int]:
    if len(text) <= TOKENIZE_IN_THREAD_CHARACTERS:
        return ring.tokenize(text, add_special, parse_special)
    return await asyncio.to_thread(ring.tokenize, text, add_special, parse_special)


async def json_body(request: Request) -> Any:
    """The body's JSON object, bounded (`bounded_body`) and sent as JSON (`guards.json_object`)."""
    body = await bounded_body(request)
    try:
        return json_object(body, request.headers.get("content-type"))
    except BodyRefused as refused:
        code = "unsupported_media_type" if refused.status == 415 else None
        raise ApiError(refused.status, str(refused), "invalid_request_error", code) from None


async def bounded_body(request: Request) -> bytes:
    """The request body, refused with a 413 past MAX_BODY_BYTES: a prompt is tokenized whole
    before its length can be checked against the context. The rest of an oversized body is read
    and dropped (up to MAX_DRAINED_BYTES), so that a client still sending it gets the 413 rather
    than a reset connection."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
        elif size > MAX_DRAINED_BYTES:
            break
    if size > MAX_BODY_BYTES:
        raise ApiError(
            413, f"The request body exceeds {MAX_BODY_BYTES >> 20} MiB.", "invalid_request_error", "request_too_large"
        )
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Returns once the client hangs up. The body has been read, so the server's next message is
    the disconnect; without this, a request whose client gave up would generate to its last token
    (to the whole context, without max_tokens), holding a slot that others queue for."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)
