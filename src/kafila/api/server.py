"""The host's HTTP API: OpenAI's `/v1` routes, `/health`, `/status` and Prometheus `/metrics`.

Handlers validate, render and tokenize on the event loop, then hand a job to the engine loop
and wait on an asyncio queue that the loop's thread feeds. Every failure a client can cause or
meet is an OpenAI-shaped error body with the status code OpenAI would use, so SDKs raise their
usual exceptions.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import importlib.resources
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kafila.api.guards import BodyRefused, TrustedHosts, json_object
from kafila.api.harmony import HarmonyReader
from kafila.api.reasoning import ThinkReader
from kafila.api.schemas import ChatRequest, CompletionRequest, Tool
from kafila.api.schemas import Request as ApiRequest
from kafila.api.structured import JSON_OBJECT_GRAMMAR_SCHEMA, SchemaRefused, schema_grammar
from kafila.api.tool_calls import (
    Piece,
    Reasoning,
    ReplyReader,
    ToolCallStream,
    ToolSpec,
    mistral_id_of,
    single_call_only,
    tool_call_grammar,
)
from kafila.contracts import HostEvent, HostStatus, Incident, SessionStatus
from kafila.event_feed import EventFeed, Subscription
from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.logprobs import Alternative, TokenLogprob
from kafila.runtime.engine.ring import StageFailed
from kafila.runtime.engine.sampling import GrammarRefused
from kafila.serving.batcher import Finished, FinishReason, Job, RequestEvent, TextDelta
from kafila.serving.chat_template import ChatTemplate, ReplySyntax, TemplateError
from kafila.serving.engine_loop import EngineLoop, EngineUnavailable
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
# What a 503 asks a client to wait before it tries again, while the session gets ready or replans
# after a break (a replan over cached stage files takes a second or two). The official OpenAI SDKs
# retry a 503 twice by default and wait what `Retry-After` says.
RETRY_AFTER_S = 2
_TRY_AGAIN = {"Retry-After": str(RETRY_AFTER_S)}
SERVED_ROUTES = (
    "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /health, /status, /events, /metrics "
    "and the web page at /"
)
EVENT_HEARTBEAT_S = 15.0  # an SSE comment this often: proxies keep the stream, and a client gone is noticed
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


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers or None)


def _invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


@dataclass(frozen=True)
class ApiConfig:
    """What the API is, whatever the session does: the model it names, its context, who may call."""

    model_id: str
    context_per_sequence: int
    api_key: str | None = None
    allowed_hosts: frozenset[str] = frozenset()  # host names it answers to besides addresses and localhost
    event_heartbeat_s: float = EVENT_HEARTBEAT_S
    created: int = field(default_factory=lambda: int(time.time()))


class Served(Protocol):
    """What the routes read of whoever runs the model (`session.availability.Availability`):
    ready or not and why, the engine loop to submit to and cancel on, and the session's status.
    The API only reads it; the session changes it."""

    @property
    def loop(self) -> EngineLoop | None: ...
    @property
    def engine(self) -> Engine | None: ...
    @property
    def template(self) -> ChatTemplate | None: ...
    @property
    def waiting_for(self) -> list[str]: ...
    @property
    def join_line(self) -> str | None: ...
    @property
    def failure(self) -> str | None: ...
    @property
    def paused(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def incidents(self) -> Sequence[Incident]: ...
    @property
    def events(self) -> EventFeed: ...
    async def until_resumed(self) -> None: ...
    def session_status(self) -> SessionStatus: ...
    def client_gone(self, request_id: str) -> None: ...


class _Metrics:
    def __init__(self, serving: Served) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kafila_requests", "Requests by route and HTTP status", ["route", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter("kafila_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "kafila_prompt_tokens_cached", "Prompt tokens an earlier request left in the cache", registry=self.registry
        )
        self.computed_prompt_tokens = Counter(
            "kafila_prompt_tokens_computed", "Prompt tokens every stage computed", registry=self.registry
        )
        self.completion_tokens = Counter("kafila_completion_tokens", "Tokens generated", registry=self.registry)
        self.first_token = Histogram(
            "kafila_time_to_first_token_seconds", "From request to first generated text", registry=self.registry
        )
        self.held = Counter(
            "kafila_requests_held", "Requests that waited for a planned replan, not turned away", registry=self.registry
        )
        queue = Gauge("kafila_queue_depth", "Requests waiting for a slot", registry=self.registry)
        queue.set_function(lambda: serving.loop.queued if serving.loop else 0)
        running = Gauge("kafila_running_requests", "Requests generating now", registry=self.registry)
        running.set_function(lambda: serving.loop.running if serving.loop else 0)
        rate = Gauge("kafila_tokens_per_second", "Generated tokens per second, last 10 s", registry=self.registry)
        rate.set_function(lambda: serving.loop.stats.tokens_per_s(time.monotonic()) if serving.loop else 0.0)
        ready = Gauge("kafila_ready", "1 when every stage is ready", registry=self.registry)
        ready.set_function(lambda: 1.0 if serving.ready else 0.0)
        self.registry.register(_RingCollector(serving))


def _blocks(span: object) -> str | None:
    """A [first, end) block range as the "first-last" label /status and the plan table use."""
    if isinstance(span, list | tuple) and len(span) == 2 and all(isinstance(b, int) for b in span):
        return f"{span[0]}-{span[1] - 1}"
    return None


class _RingCollector(Collector):
    """The ring's measured and predicted stage times and its links' round trips, read from the
    same reports as /status at each scrape, so a dashboard can set measurement against plan."""

    def __init__(self, serving: Served) -> None:
        self.serving = serving

    def collect(self) -> Iterator[Metric]:
        measured = GaugeMetricFamily(
            "kafila_stage_ms_per_token", "Measured decode ms per token of each stage, batched rows included",
            labels=["blocks"],
        )  # fmt: skip
        alone = GaugeMetricFamily(
            "kafila_stage_ms_per_token_alone",
            "Measured ms of each stage's decodes of one token alone, which the plan's prediction prices",
            labels=["blocks"],
        )
        for stage in self.serving.loop.stage_report if self.serving.loop else []:
            span = _blocks(stage.range)
            for family, ms in ((measured, stage.ms_per_token), (alone, stage.ms_per_token_alone)):
                if span is not None and ms is not None:
                    family.add_metric([span], ms)
        predicted = GaugeMetricFamily(
            "kafila_stage_predicted_ms_per_token", "The plan's decode ms per token of each member's stage",
            labels=["member", "blocks"],
        )  # fmt: skip
        rtt = GaugeMetricFamily(
            "kafila_link_rtt_ms", "Round trip of the host's link to each member", labels=["member", "path"]
        )
        for member in self.serving.session_status().members:
            span = _blocks(member.blocks)
            if span is not None and member.predicted_ms_per_token is not None:
                predicted.add_metric([member.name, span], member.predicted_ms_per_token)
            if member.rtt_ms is not None and member.link == "up":  # not one that left
                rtt.add_metric([member.name, member.path or ""], member.rtt_ms)
        yield measured
        yield alone
        yield predicted
        yield rtt


def create_app(serving: Served, config: ApiConfig) -> FastAPI:
    app = FastAPI(title="Kafila", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = _Metrics(serving)

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
            raise _invalid(one_line(error), param=where or None) from None

    async def ready_loop(model: str) -> tuple[EngineLoop, Engine]:
        """The engine to serve with; during a planned replan, once it is done."""
        if model != config.model_id:
            raise ApiError(
                404, f"The model '{model}' does not exist; this server serves '{config.model_id}'.",
                "invalid_request_error", "model_not_found", "model",
            )  # fmt: skip
        if serving.paused and not serving.ready:
            metrics.held.inc()
            await serving.until_resumed()
        loop, engine = serving.loop, serving.engine
        if loop is None or engine is None or loop.error is not None:
            raise _unavailable(serving, _not_ready_text(serving, loop))
        return loop, engine

    def replanned_since(taken: EngineLoop | Engine) -> bool:
        """The host stopped this engine (or its loop) to replan by choice, and the replan runs or
        is done: a request that took it just before can wait for the new ring, as one that comes
        during the pause does, instead of being told the host is shutting down."""
        return serving.paused or (serving.loop is not None and taken not in (serving.loop, serving.engine))

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
        if serving.ready:
            return JSONResponse({"status": "ready", "model": config.model_id})
        body: dict[str, Any] = {"status": "failed" if serving.failure else "starting", "model": config.model_id}
        body["waiting_for"] = serving.waiting_for
        if serving.failure or (serving.loop and serving.loop.error):
            body["error"] = serving.failure or (serving.loop.error if serving.loop else None)
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
        loop, engine = await ready_loop(body.model)
        template = serving.template
        assert template is not None
        calling = body.calling_tools()
        if calling and template.tool_syntax is None:
            raise _invalid(
                "This model's chat template writes no tool-call syntax this server reads (Hermes/Qwen "
                "<tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS] or gpt-oss harmony); send tool_choice "
                "'none' or no tools.", "tools",
            )  # fmt: skip
        syntax = template.reply_syntax
        parallel = body.parallel_tool_calls is not False and not (syntax and single_call_only(syntax))
        grammar = _grammar_of(body, template.tool_syntax, parallel, syntax is ReplySyntax.HARMONY)
        tools = [tool.for_template() for tool in body.tools or []] if calling else None
        mistral = template.tool_syntax in (ReplySyntax.MISTRAL, ReplySyntax.MISTRAL_ARGS)
        try:
            rendered = template.render(
                [m.for_template() for m in body.messages], tools, mistral_id_of if mistral else None
            )
        except TemplateError as error:
            raise _invalid(str(error), "messages") from None
        prompt = await tokenize(engine, rendered.text, not rendered.starts_with_bos, True, "messages")
        held_from_the_start = bool(body.forced_tools()) or (
            body.response_format is not None and body.response_format.type != "text"
        )  # a grammar from the first token: no reasoning first, even where the template opened it
        offered = [tool.function.name for tool in body.tools or []] if calling else None
        reader = reply_reader(template, offered, parallel, rendered.opens_thinking and not held_from_the_start)
        return await _serve(request, body, prompt, loop, chat=True, grammar=grammar, reader=reader)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        authorise(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        loop, engine = await ready_loop(body.model)
        try:
            text = body.prompt_text()
        except ValueError as error:
            raise _invalid(str(error), "prompt") from None
        if isinstance(text, list):
            if any(not 0 <= t < engine.n_vocab() for t in text):
                last = engine.n_vocab() - 1
                raise _invalid(f"prompt token ids must be from 0 to {last}, this model's vocabulary", "prompt")
            prompt = text
        else:
            prompt = await tokenize(engine, text, True, False, "prompt")
        return await _serve(request, body, prompt, loop, chat=False, grammar=_grammar_of(body, None, False, False))

    async def tokenize(engine: Engine, text: str, add_special: bool, parse_special: bool, param: str) -> list[int]:
        """Token ids, off the event loop for long texts (8 MB takes seconds, and every stream
        would stall meanwhile); a text too long to fit the context at any tokenizer's longest
        token is refused without tokenizing it at all."""
        context = config.context_per_sequence
        if len(text) > context * MAX_TOKEN_CHARACTERS:
            raise _invalid(
                f"This model's maximum context length is {context} tokens. However, your {param} holds "
                f"{len(text)} characters, more than that many tokens can hold.", param, "context_length_exceeded",
            )  # fmt: skip
        try:
            return await tokenize_with(engine, text, add_special, parse_special)
        except StageFailed:  # the host closed this engine meanwhile, to replan
            if not replanned_since(engine):
                raise _unavailable(serving, _not_ready_text(serving, serving.loop)) from None
        _, engine = await ready_loop(config.model_id)
        try:
            return await tokenize_with(engine, text, add_special, parse_special)
        except StageFailed:
            raise _unavailable(serving, _not_ready_text(serving, serving.loop)) from None

    async def tokenize_with(engine: Engine, text: str, add_special: bool, parse_special: bool) -> list[int]:
        if len(text) <= TOKENIZE_IN_THREAD_CHARACTERS:
            return engine.tokenize(text, add_special, parse_special)
        return await asyncio.to_thread(engine.tokenize, text, add_special, parse_special)

    async def submit(loop: EngineLoop, job: Job, sink: Callable[[RequestEvent], None]) -> EngineLoop:
        """Queue the job on the loop, or on the new ring's loop if a planned replan stopped this
        one since the request took it. Returns the loop the job runs on."""
        if not submitted(loop, job, sink, may_wait=True):
            loop, _ = await ready_loop(config.model_id)
            submitted(loop, job, sink, may_wait=False)
        return loop

    def submitted(loop: EngineLoop, job: Job, sink: Callable[[RequestEvent], None], may_wait: bool) -> bool:
        """False when a planned replan stopped the loop and the caller may wait for the new one."""
        try:
            loop.submit(job, sink)
            return True
        except EngineUnavailable as error:
            if may_wait and replanned_since(loop):
                return False
            raise _unavailable(serving, str(error)) from None
        except ValueError as error:
            raise _invalid(str(error)) from None

    async def _serve(
        request: Request,
        body: ChatRequest | CompletionRequest,
        prompt: list[int],
        loop: EngineLoop,
        chat: bool,
        grammar: str | None = None,
        reader: ReplyReader | None = None,
    ) -> Response:
        context = config.context_per_sequence
        if not prompt:
            raise _invalid("The prompt is empty.", "prompt" if not chat else "messages")
        if grammar is not None:
            try:
                loop.engine.check_grammar(grammar)
            except GrammarRefused as error:
                raise _invalid(f"{error}: the schema or tools asked for output it cannot describe") from None
            except StageFailed:
                raise _unavailable(serving, _not_ready_text(serving, serving.loop)) from None
        limit = body.token_limit()
        if len(prompt) >= context or (limit is not None and len(prompt) + limit > context):
            asked = f" and {limit} for the completion" if limit is not None else ""
            raise _invalid(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(prompt)} tokens in the prompt{asked}. Please reduce the length of the prompt or completion.",
                "messages" if chat else "prompt", "context_length_exceeded",
            )  # fmt: skip
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        alternatives = body.logprob_alternatives()
        job = Job(request_id, prompt, limit or context, body.sampling(grammar), body.stop_strings(), alternatives)
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(event: RequestEvent) -> None:
            event_loop.call_soon_threadsafe(queue.put_nowait, event)

        loop = await submit(loop, job, sink)
        reply = _Reply(
            request_id, config.model_id, chat, time.monotonic(), metrics, alternatives is not None, reader=reader
        )

        def cancel() -> None:
            """On the loop it was submitted to, and on the one serving now, where a broken ring's
            requests go on."""
            loop.cancel(request_id)
            if serving.loop is not None and serving.loop is not loop:
                serving.loop.cancel(request_id)
            if loop.error is not None:  # its ring broke: the session may hold it for the next one
                serving.client_gone(request_id)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(queue, reply, include_usage, cancel),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collecting = asyncio.ensure_future(reply.collect(queue))
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
        text, finished = collecting.result()
        return JSONResponse(reply.whole(text, finished))

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        authorise(request)
        loop = serving.loop
        now = time.monotonic()
        session = serving.session_status()
        keyed = config.api_key is not None  # the session code is for the key's holder alone
        return HostStatus(
            model=config.model_id,
            ready=serving.ready,
            waiting_for=serving.waiting_for,
            error=serving.failure or (loop.error if loop else None),
            join=serving.join_line if keyed else None,
            context_per_sequence=config.context_per_sequence,
            queue_depth=loop.queued if loop else 0,
            running=loop.running if loop else 0,
            pipeline_waves=loop.engine.depth if loop else None,
            tokens_per_s=round(loop.stats.tokens_per_s(now), 3) if loop else 0.0,
            requests={"finished": loop.stats.finished, "failed": loop.stats.failed} if loop else {},
            stages=loop.stage_report if loop else [],
            incidents=list(serving.incidents),
            **{name: getattr(session, name) for name in session.model_fields_set if keyed or name != "code"},
        ).wire()

    @app.get("/events", response_model=None)
    async def events(request: Request) -> Response:
        """The host's events as server-sent events: those kept that came after `Last-Event-ID` (or
        `?after=`), then each as it happens, with a heartbeat comment while nothing does."""
        authorise(request)
        after = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
        if not after.isdigit() or len(after) > 18:
            raise _invalid("Last-Event-ID (or after) is the id of an event: a whole number.", "after")
        client = serving.events.subscribe(int(after))
        if client is None and serving.events.closed:
            raise ApiError(503, "The host is shutting down.", "server_error", "shutting_down")
        if client is None:
            raise ApiError(
                503, "Too many clients follow /events; try again later.", "server_error", "too_many_clients",
                headers=_TRY_AGAIN,
            )  # fmt: skip
        return StreamingResponse(
            _event_stream(serving.events, client, config.event_heartbeat_s),
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

    app.add_middleware(_CountRequests, requests=metrics.requests, routes=frozenset(_route_paths(app)))
    app.add_middleware(TrustedHosts, allowed=config.allowed_hosts)  # outermost: before anything else
    return app


def _route_paths(app: FastAPI) -> list[str]:
    return [path for route in app.routes if isinstance(path := getattr(route, "path", None), str)]


class _CountRequests:
    """Counts responses by route and status for /metrics.

    Plain ASGI rather than `@app.middleware("http")`: that wrapper passes every chunk of a
    streamed response through a memory stream and another task, a cost paid on every token.
    Paths that are no route count as "other", so random URLs cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, requests: Counter, routes: frozenset[str]) -> None:
        self.app, self.requests, self.routes = app, requests, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.requests.labels(route, str(status)).inc()


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


async def _event_stream(feed: EventFeed, client: Subscription, heartbeat_s: float) -> AsyncIterator[bytes]:
    """A client's events, each with its id (for Last-Event-ID on reconnect). The stream ends when
    the client falls too far behind, and the feed forgets it when the client goes away (the
    write of the next event or heartbeat fails, or the server sees the disconnect)."""
    try:
        yield b"retry: 2000\n\n" + b"".join(_sse_event(e) for e in client.backlog)
        while not client.dropped:
            try:
                event = await asyncio.wait_for(client.queue.get(), heartbeat_s)
            except TimeoutError:
                yield b": heartbeat\n\n"
                continue
            if event is not None and not client.dropped:
                yield _sse_event(event)
    finally:
        feed.unsubscribe(client)


def _sse_event(event: HostEvent) -> bytes:
    """Unnamed ("message") events: the kind is in the data, so `EventSource.onmessage` sees them all."""
    return f"id: {event.id}\ndata: ".encode() + json.dumps(event.wire(), separators=(",", ":")).encode() + b"\n\n"


async def _client_gone(request: Request) -> None:
    """Returns once the client hangs up. The body has been read, so the server's next message is
    the disconnect; without this, a request whose client gave up would generate to its last token
    (to the whole context, without max_tokens), holding a slot that others queue for."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


def _unavailable(serving: Served, message: str) -> ApiError:
    """OpenAI's 503, with what a client should do next: while the session gets ready, or replans
    after its ring broke, try again shortly (`Retry-After`); where it cannot serve (the model does
    not fit, every member failed), not at all (`x-should-retry: false`, which the official SDKs
    heed), since a retry could only fail the same way."""
    headers = {"x-should-retry": "false"} if serving.failure else _TRY_AGAIN
    return ApiError(503, message, "server_error", "not_ready", headers=headers)


def _not_ready_text(serving: Served, loop: EngineLoop | None) -> str:
    if loop is not None and loop.error is not None:
        return f"The session cannot serve: {loop.error}"
    if serving.failure:
        return f"The session cannot serve: {serving.failure}"
    return "The session is not ready yet: waiting for " + ", ".join(serving.waiting_for or ["the model"]) + "."


def _model_card(config: ApiConfig) -> dict[str, Any]:
    return {"id": config.model_id, "object": "model", "created": config.created, "owned_by": "kafila"}


def _grammar_of(body: ApiRequest, syntax: ReplySyntax | None, parallel: bool, harmony: bool) -> str | None:
    """The grammar a request's output must follow: a forced tool call's; else the response
    format's (after a harmony model's final-channel header); else, with tools in "auto", free
    text or calls. Every tool's parameters are converted, used or not, so that a schema this
    server cannot follow is a 400 whatever tool_choice says."""
    calls = None
    if isinstance(body, ChatRequest) and body.tools:
        written = syntax or ReplySyntax.HERMES  # with tool_choice "none" on a model without a syntax
        try:
            calls = tool_call_grammar(written, [_spec(t) for t in body.tools], parallel, forced=False)
            forced = body.forced_tools()
            if forced:
                return tool_call_grammar(written, [_spec(t) for t in forced], parallel, forced=True)
        except SchemaRefused as error:
            raise _invalid(str(error), "tools") from None
    form = body.response_format
    if form is None or form.type == "text":
        return calls if isinstance(body, ChatRequest) and body.calling_tools() else None
    schema = form.json_schema.json_schema if form.json_schema is not None else None
    try:
        return schema_grammar(
            JSON_OBJECT_GRAMMAR_SCHEMA if form.type == "json_object" or schema is None else schema,
            prefix=HARMONY_FINAL if harmony else "",
        )
    except SchemaRefused as error:
        raise _invalid(str(error), "response_format") from None


HARMONY_FINAL = "<|channel|>final<|message|>"  # where a harmony reply's answer begins


def _spec(tool: Tool) -> ToolSpec:
    return ToolSpec(tool.function.name, tool.function.schema_of_arguments())


def reply_reader(
    template: ChatTemplate, offered: Sequence[str] | None, parallel: bool, thinking: bool
) -> ReplyReader | None:
    """How a chat reply is read: a harmony model's always (its channels), a thinking model's for
    its reasoning, others' for calls to the `offered` tools (None: the request calls none);
    `thinking`: the reply starts inside its reasoning."""
    syntax = template.reply_syntax
    if syntax is ReplySyntax.HARMONY:
        return HarmonyReader(offered or (), parallel=parallel)
    answer = ToolCallStream(syntax, parallel) if offered is not None and syntax is not None else None
    return ThinkReader(answer, thinking) if template.thinks else answer


class _TextOffsets:
    """Where each token's text starts in the completion's text, in characters. A token that is
    whole UTF-8 starts where its own text does (after any replacement characters that bytes
    left pending before it turn into); one that is part of a character, where that character
    does (a stray byte's replacement character included)."""

    def __init__(self) -> None:
        self.characters = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, piece: bytes) -> int:
        before = self.characters
        added = len(self.decoder.decode(piece))
        self.characters += added
        try:
            return before + added - len(piece.decode("utf-8"))
        except UnicodeDecodeError:  # part of a character: the one it leaves pending, or the last it completed
            pending = bool(self.decoder.getstate()[0])
            return self.characters if pending else max(before, self.characters - 1)


@dataclass
class _Reply:
    """Shapes one request's events as OpenAI chat or text completion objects."""

    request_id: str
    model: str
    chat: bool
    started: float
    metrics: _Metrics
    logprobs: bool = False  # the request asked for log probabilities
    created: int = field(default_factory=lambda: int(time.time()))
    first_text: bool = True
    gathered: list[TokenLogprob] = field(default_factory=list)  # a whole reply's log probabilities
    offsets: _TextOffsets = field(default_factory=_TextOffsets)
    reader: ReplyReader | None = None  # content, reasoning and calls out of the text

    async def collect(self, queue: asyncio.Queue[RequestEvent]) -> tuple[str, Finished]:
        parts = []
        while True:
            event = await queue.get()
            if isinstance(event, TextDelta):
                self.observe_text()
                parts.append(event.text)
                self.gathered += event.logprobs
            elif isinstance(event, Finished):
                self.observe_end(event)
                return "".join(parts), event
            elif event.code == "ring_failed":  # the host replans: a retry shortly may well be served
                raise ApiError(503, event.message, "server_error", event.code, headers=_TRY_AGAIN)
            else:
                raise ApiError(500, event.message, "server_error", event.code)

    def observe_text(self) -> None:
        if self.first_text:
            self.first_text = False
            self.metrics.first_token.observe(time.monotonic() - self.started)

    def observe_end(self, finished: Finished) -> None:
        self.metrics.prompt_tokens.inc(finished.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(finished.cached_tokens)
        self.metrics.computed_prompt_tokens.inc(finished.prompt_tokens - finished.cached_tokens)
        self.metrics.completion_tokens.inc(finished.completion_tokens)

    @staticmethod
    def usage(finished: Finished) -> dict[str, Any]:
        return {
            "prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finished: Finished) -> dict[str, Any]:
        logprobs = self.logprobs_of(self.gathered)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = finished.reason.value
            if self.reader is not None:
                message["content"], reasoning, calls = self.reader.read_whole(text)
                if reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [c.wire() for c in calls]
                    reason = self.finish_reason(finished, True)
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finished.reason.value, "logprobs": logprobs}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(finished)}

    def chunk(
        self, text: str | None, finish: str | None, role: bool = False, tokens: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        logprobs = self.logprobs_of(tokens) if text is not None and finish is None and not role else None
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return {**self._envelope(True), "choices": [choice]}

    @staticmethod
    def finish_reason(finished: Finished, called: bool) -> str:
        """OpenAI's "tool_calls" where the model ended its turn with calls; "length" stays."""
        return "tool_calls" if called and finished.reason is FinishReason.STOP else finished.reason.value

    def read_chunks(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """Content, reasoning and tool-call deltas as OpenAI's chunks (reasoning as llama.cpp's
        and vLLM's servers send it, `reasoning_content`)."""
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(self.chunk(piece, None))
                continue
            delta: dict[str, Any] = (
                {"reasoning_content": piece.text} if isinstance(piece, Reasoning) else {"tool_calls": [piece.wire()]}
            )
            choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
            out.append({**self._envelope(True), "choices": [choice]})
        return out

    def logprobs_of(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object for these tokens, or None where the request asked for none:
        chat's `content` list, or the legacy completion's parallel lists."""
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {**_chat_token(t.piece, t.logprob), "top_logprobs": [_chat_token(a.piece, a.logprob) for a in t.top]}
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [_token_text(t.piece) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_by_text(t.top) for t in tokens],
            "text_offset": [self.offsets.next(t.piece) for t in tokens],
        }

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage(finished)}


def _token_text(piece: bytes) -> str:
    """A token as text; one that is not whole UTF-8 (part of a character) as OpenAI writes it,
    `bytes:` and its bytes escaped."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _by_text(top: Sequence[Alternative]) -> dict[str, float]:
    """The legacy completion's alternatives, keyed by text, most likely first: of two tokens that
    read the same, the likelier."""
    out: dict[str, float] = {}
    for alternative in top:
        out.setdefault(_token_text(alternative.piece), alternative.logprob)
    return out


def _chat_token(piece: bytes, logprob: float) -> dict[str, Any]:
    return {"token": _token_text(piece), "logprob": logprob, "bytes": list(piece)}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    queue: asyncio.Queue[RequestEvent], reply: _Reply, include_usage: bool, cancel: Callable[[], None]
) -> AsyncIterator[bytes]:
    """Server-sent events: a role chunk, text chunks, a finish chunk, usage if asked, then [DONE].

    Events that queued up while the last write went out leave in one write: each is still its
    own SSE event, but a busy loop pays the response machinery once for them, not per token."""
    try:
        if reply.chat:
            yield _sse(reply.chunk("", None, role=True))
        ended = False
        while not ended:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            out: list[bytes] = []
            for event in events:
                if isinstance(event, TextDelta):
                    reply.observe_text()
                    if reply.reader is not None:  # content, reasoning and calls as the reader releases them
                        out += _read_sse(reply, reply.reader.feed(event.text))
                    else:
                        out.append(_sse(reply.chunk(event.text, None, tokens=event.logprobs)))
                    continue
                if isinstance(event, Finished):
                    reply.observe_end(event)
                    reason = event.reason.value
                    if reply.reader is not None:
                        out += _read_sse(reply, reply.reader.finish())
                        reason = reply.finish_reason(event, reply.reader.calls > 0)
                    out.append(_sse(reply.chunk(None if reply.chat else "", reason)))
                    if include_usage:
                        out.append(_sse(reply.usage_chunk(event)))
                else:
                    error = {"message": event.message, "type": "server_error", "param": None, "code": event.code}
                    out.append(_sse({"error": error}))
                ended = True
                break
            if ended:
                out.append(b"data: [DONE]\n\n")
            yield b"".join(out)
    finally:
        cancel()  # the client went away, or the stream ended: either way the slot is free


def _read_sse(reply: _Reply, pieces: list[Piece]) -> list[bytes]:
    """SSE events for what a reply's reader released."""
    return [_sse(chunk) for chunk in reply.read_chunks(pieces)]
