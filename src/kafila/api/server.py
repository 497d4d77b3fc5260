"""The host's HTTP API, its routes: OpenAI's `/v1`, `/health`, `/status`, `/events`, Prometheus
`/metrics` and the web page.

Handlers validate, render and tokenize on the event loop, then hand a job to the engine loop
and wait on an asyncio queue that the loop's thread feeds. What a request asks of the grammar
and the reader is prepared in `requests`, replies are shaped in `replies`, errors in `errors`,
counts in `telemetry` and the events stream in `events_stream`; what the routes read of the
session is a `served.Served`.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kafila.api.errors import TRY_AGAIN, ApiError, invalid
from kafila.api.events_stream import EVENT_HEARTBEAT_S, event_stream
from kafila.api.guards import BodyRefused, TrustedHosts, json_object
from kafila.api.openai_replies import ChatWriter, CompletionWriter
from kafila.api.replies import ReplyMeter, ReplyWriter, collect, stream_reply
from kafila.api.requests import ServeRequest, prepare_chat, prepare_completion
from kafila.api.schemas import ChatRequest, CompletionRequest
from kafila.api.served import Served
from kafila.api.telemetry import CountRequests, Metrics, route_paths
from kafila.contracts import HostStatus
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
SERVED_ROUTES = (
    "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /health, /status, /events, /metrics "
    "and the web page at /"
)
# The web page's files, in the package (api/static): read once, served as they are.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript"),
    "/ui/app.css": ("app.css", "text/css"),
}
PAGE_HEADERS = {
    # The page loads only its own files and talks only to this server; no one may frame it.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class ApiConfig:
    """What the API is, whatever the session does: the model it names, its context, who may call."""

    model_id: str
    context_per_sequence: int
    api_key: str | None = None
    allowed_hosts: frozenset[str] = frozenset()  # host names it answers to besides addresses and localhost
    event_heartbeat_s: float = EVENT_HEARTBEAT_S
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(serving: Served, config: ApiConfig) -> FastAPI:
    app = FastAPI(title="Kafila", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(serving)

    def authorise(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")

    async def parse(request: Request, schema: type[BaseModel]) -> Any:
        body = await _bounded_body(request)
        try:
            data = json_object(body, request.headers.get("content-type"))
        except BodyRefused as refused:
            code = "unsupported_media_type" if refused.status == 415 else None
            raise ApiError(refused.status, str(refused), "invalid_request_error", code) from None
        try:
            return schema.model_validate(data)
        except ValidationError as error:
            where, _ = first_problem(error)
            raise invalid(one_line(error), param=where or None) from None

    async def ready_ring(model: str) -> ServingHandle:
        """The ring to serve on; during a planned replan, once it is done."""
        if model != config.model_id:
            raise ApiError(
                404, f"The model '{model}' does not exist; this server serves '{config.model_id}'.",
                "invalid_request_error", "model_not_found", "model",
            )  # fmt: skip
        state = serving.state()
        if state.paused and not state.ready:
            metrics.held.inc()
            await serving.until_resumed()
        ring = serving.ring
        if ring is None or ring.error is not None:
            raise _unavailable(serving)
        return ring

    def replanned_since(taken: ServingHandle) -> bool:
        """The host stopped this ring to replan by choice, and the replan runs or is done: a
        request that took it just before can wait for the new ring, as one that comes during the
        pause does, instead of being told the host is shutting down."""
        return serving.state().paused or (serving.ring is not None and taken is not serving.ring)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _no_such_route(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """An unknown path or method in OpenAI's shape, naming what is served here (a newer SDK
        call such as `responses.create` otherwise fails with a bare "Not Found")."""
        if error.status_code not in (404, 405):
            return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=error.headers)
        what = "Invalid URL" if error.status_code == 404 else "Method not allowed"
        message = f"{what} ({request.method} {request.url.path[:200]}); this server serves {SERVED_ROUTES}."
        code = "unknown_url" if error.status_code == 404 else "method_not_allowed"
        response = ApiError(error.status_code, message, "invalid_request_error", code).response()
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        state = serving.state()
        if state.ready:
            return JSONResponse({"status": "ready", "model": config.model_id})
        body: dict[str, Any] = {"status": "failed" if state.failure else "starting", "model": config.model_id}
        body["waiting_for"] = list(state.waiting_for)
        if error := _what_fails(serving):
            body["error"] = error
        return JSONResponse(body, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorise(request)
        return {"object": "list", "data": [_model_card(config)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        authorise(request)
        if model != config.model_id:
            raise ApiError(404, f"The model '{model}' does not exist.", "invalid_request_error", "model_not_found")
        return _model_card(config)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        authorise(request)
        body: ChatRequest = await parse(request, ChatRequest)
        ask = body.ask()
        ring = await ready_ring(body.model)
        prepared = prepare_chat(ask, ring.template)
        prompt = await tokenize(ring, prepared.text, prepared.add_bos, True, "messages")
        logprobs, usage = _openai_options(body)
        writer = ChatWriter(_new_id("chatcmpl-"), config.model_id, logprobs, usage, reader=prepared.reader)
        served = ServeRequest(prompt, "messages", ask.generation, prepared.grammar, body.stream)
        return await serve(request, served, ring, writer)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        authorise(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        try:
            ask = body.ask()
        except ValueError as error:
            raise invalid(str(error), "prompt") from None
        ring = await ready_ring(body.model)
        prepared = prepare_completion(ask, ring.n_vocab())
        prompt = prepared.tokens
        if prompt is None:
            assert prepared.text is not None
            prompt = await tokenize(ring, prepared.text, True, False, "prompt")
        writer = CompletionWriter(_new_id("cmpl-"), config.model_id, *_openai_options(body))
        served = ServeRequest(prompt, "prompt", ask.generation, prepared.grammar, body.stream)
        return await serve(request, served, ring, writer)

    async def tokenize(ring: ServingHandle, text: str, add_special: bool, parse_special: bool, param: str) -> list[int]:
        """Token ids, off the event loop for long texts (8 MB takes seconds, and every stream
        would stall meanwhile); a text too long to fit the context at any tokenizer's longest
        token is refused without tokenizing it at all."""
        context = config.context_per_sequence
        if len(text) > context * MAX_TOKEN_CHARACTERS:
            raise invalid(
                f"This model's maximum context length is {context} tokens. However, your {param} holds "
                f"{len(text)} characters, more than that many tokens can hold.", param, "context_length_exceeded",
            )  # fmt: skip
        try:
            return await tokenize_with(ring, text, add_special, parse_special)
        except StageFailed:  # the host closed this engine meanwhile, to replan
            if not replanned_since(ring):
                raise _unavailable(serving) from None
        ring = await ready_ring(config.model_id)
        try:
            return await tokenize_with(ring, text, add_special, parse_special)
        except StageFailed:
            raise _unavailable(serving) from None

    async def tokenize_with(ring: ServingHandle, text: str, add_special: bool, parse_special: bool) -> list[int]:
        if len(text) <= TOKENIZE_IN_THREAD_CHARACTERS:
            return ring.tokenize(text, add_special, parse_special)
        return await asyncio.to_thread(ring.tokenize, text, add_special, parse_special)

    async def submit(ring: ServingHandle, job: Job, sink: Callable[[RequestEvent], None]) -> ServingHandle:
        """Queue the job on the ring, or on the new ring if a planned replan stopped this one
        since the request took it. Returns the ring the job runs on."""
        if not submitted(ring, job, sink, may_wait=True):
            ring = await ready_ring(config.model_id)
            submitted(ring, job, sink, may_wait=False)
        return ring

    def submitted(ring: ServingHandle, job: Job, sink: Callable[[RequestEvent], None], may_wait: bool) -> bool:
        """False when a planned replan stopped the ring and the caller may wait for the new one."""
        try:
            ring.submit(job, sink)
            return True
        except EngineUnavailable as error:
            if may_wait and replanned_since(ring):
                return False
            raise _unavailable(serving, str(error)) from None
        except ValueError as error:
            raise invalid(str(error)) from None

    async def serve(request: Request, served: ServeRequest, ring: ServingHandle, writer: ReplyWriter) -> Response:
        """Run a request, whatever its dialect, and answer in the writer's shape: whole once it
        ends, or streamed as it comes."""
        context, generation = config.context_per_sequence, served.generation
        if not served.prompt:
            raise invalid("The prompt is empty.", served.param)
        if served.grammar is not None:
            try:
                ring.check_grammar(served.grammar)
            except GrammarRefused as error:
                raise invalid(f"{error}: the schema or tools asked for output it cannot describe") from None
            except StageFailed:
                raise _unavailable(serving) from None
        limit = generation.limit
        if len(served.prompt) >= context or (limit is not None and len(served.prompt) + limit > context):
            asked = f" and {limit} for the completion" if limit is not None else ""
            raise invalid(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(served.prompt)} tokens in the prompt{asked}. Please reduce the length of the prompt or "
                "completion.", served.param, "context_length_exceeded",
            )  # fmt: skip
        request_id = writer.request_id
        sampling = generation.sampling.model_copy(update={"grammar": served.grammar})
        job = Job(request_id, served.prompt, limit or context, sampling, generation.stops, generation.alternatives)
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(event: RequestEvent) -> None:
            event_loop.call_soon_threadsafe(queue.put_nowait, event)

        meter = ReplyMeter(metrics)
        ring = await submit(ring, job, sink)

        def cancel() -> None:
            """On the loop it was submitted to, and on the one serving now, where a broken ring's
            requests go on."""
            ring.cancel(request_id)
            now = serving.ring
            if now is not None and now is not ring:
                now.cancel(request_id)
            if ring.error is not None:  # it broke: the session may hold the request for the next ring
                serving.client_gone(request_id)

        if served.stream:
            return StreamingResponse(
                stream_reply(queue, writer, meter, cancel),
                media_type=writer.media_type,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
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

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        authorise(request)
        ring, state = serving.ring, serving.state()
        now = time.monotonic()
        session = serving.session_status()
        keyed = config.api_key is not None  # the session code is for the key's holder alone
        return HostStatus(
            model=config.model_id,
            ready=state.ready,
            waiting_for=list(state.waiting_for),
            error=_what_fails(serving),
            join=state.join_line if keyed else None,
            context_per_sequence=config.context_per_sequence,
            queue_depth=ring.queued if ring else 0,
            running=ring.running if ring else 0,
            pipeline_waves=ring.waves if ring else None,
            tokens_per_s=round(ring.stats.tokens_per_s(now), 3) if ring else 0.0,
            requests={"finished": ring.stats.finished, "failed": ring.stats.failed} if ring else {},
            stages=ring.stage_report if ring else [],
            incidents=list(state.incidents),
            **{name: getattr(session, name) for name in session.model_fields_set if keyed or name != "code"},
        ).wire()

    @app.get("/events", response_model=None)
    async def events(request: Request) -> Response:
        """The host's events as server-sent events: those kept that came after `Last-Event-ID` (or
        `?after=`), then each as it happens, with a heartbeat comment while nothing does."""
        authorise(request)
        after = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
        if not after.isdigit() or len(after) > 18:
            raise invalid("Last-Event-ID (or after) is the id of an event: a whole number.", "after")
        client = serving.events.subscribe(int(after))
        if client is None and serving.events.closed:
            raise ApiError(503, "The host is shutting down.", "server_error", "shutting_down")
        if client is None:
            raise ApiError(
                503, "Too many clients follow /events; try again later.", "server_error", "too_many_clients",
                headers=TRY_AGAIN,
            )  # fmt: skip
        return StreamingResponse(
            event_stream(serving.events, client, config.event_heartbeat_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    pages = {path: (_page_file(name), kind) for path, (name, kind) in PAGE_FILES.items()}

    async def page(request: Request) -> Response:
        """The web page's files: no secret in them, so no key asked; the routes the page calls ask."""
        body, kind = pages[request.url.path]
        return Response(body, media_type=kind, headers=PAGE_HEADERS)

    for path in PAGE_FILES:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        authorise(request)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(CountRequests, requests=metrics.requests, routes=frozenset(route_paths(app)))
    app.add_middleware(TrustedHosts, allowed=config.allowed_hosts)  # outermost: before anything else
    return app


async def _bounded_body(request: Request) -> bytes:
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


def _page_file(name: str) -> bytes:
    return importlib.resources.files("kafila.api").joinpath("static", name).read_bytes()


async def _client_gone(request: Request) -> None:
    """Returns once the client hangs up. The body has been read, so the server's next message is
    the disconnect; without this, a request whose client gave up would generate to its last token
    (to the whole context, without max_tokens), holding a slot that others queue for."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


def _unavailable(serving: Served, message: str | None = None) -> ApiError:
    """OpenAI's 503, saying why (`message`, or what the session waits for), with what a client
    should do next: while the session gets ready, or replans after its ring broke, try again
    shortly (`Retry-After`); where it cannot serve (the model does not fit, every member failed),
    not at all (`x-should-retry: false`, which the official SDKs heed), since a retry could only
    fail the same way."""
    state, ring = serving.state(), serving.ring
    if message is None and ring is not None and ring.error is not None:
        message = f"The session cannot serve: {ring.error}"
    elif message is None and state.failure:
        message = f"The session cannot serve: {state.failure}"
    elif message is None:
        message = "The session is not ready yet: waiting for " + ", ".join(state.waiting_for or ["the model"]) + "."
    headers = {"x-should-retry": "false"} if state.failure else TRY_AGAIN
    return ApiError(503, message, "server_error", "not_ready", headers=headers)


def _what_fails(serving: Served) -> str | None:
    """Why nothing serves, or why the ring that serves broke."""
    ring = serving.ring
    return serving.state().failure or (ring.error if ring else None)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _openai_options(body: ChatRequest | CompletionRequest) -> tuple[bool, bool]:
    """What an OpenAI request asks of its reply's shape beyond its text: log probabilities, and
    a stream's closing usage chunk."""
    usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return body.logprob_alternatives() is not None, usage


def _model_card(config: ApiConfig) -> dict[str, Any]:
    return {"id": config.model_id, "object": "model", "created": config.created, "owned_by": "kafila"}
