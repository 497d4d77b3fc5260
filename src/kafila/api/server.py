"""The host's HTTP API: the app, its error handling, and the routes that are not a dialect's:
`/health`, `/status`, `/events`, Prometheus `/metrics` and the web page.

Each dialect adds its own routes (`openai_routes`) over what they share, a `front.Front`:
handlers validate, render and tokenize on the event loop, then hand a job to the engine loop
and wait on an asyncio queue that the loop's thread feeds. What the routes read of the session
is a `served.Served`.
"""

from __future__ import annotations

import importlib.resources
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kafila.api import anthropic_routes, ollama_routes, openai_routes, responses_routes
from kafila.api.errors import TRY_AGAIN, ApiError, invalid
from kafila.api.events_stream import event_stream
from kafila.api.front import STREAM_HEADERS, ApiConfig, Front
from kafila.api.guards import TrustedHosts
from kafila.api.served import Served
from kafila.api.telemetry import CountRequests, Metrics, route_paths
from kafila.contracts import HostStatus

__all__ = ["ApiConfig", "create_app"]

SERVED_ROUTES = (
    f"{openai_routes.ROUTES}, {responses_routes.ROUTES}, {anthropic_routes.ROUTES}, {ollama_routes.ROUTES}, "
    "/health, /status, /events, /metrics and the web page at /"
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


def create_app(serving: Served, config: ApiConfig) -> FastAPI:
    app = FastAPI(title="Kafila", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(serving)
    front = Front(serving, config, metrics)
    authorise = front.authorise

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> Response:
        return front.error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _no_such_route(request: Request, error: StarletteHTTPException) -> Response:
        """An unknown path or method in OpenAI's shape, naming what is served here (a newer SDK
        call such as `responses.create` otherwise fails with a bare "Not Found")."""
        if error.status_code not in (404, 405):
            return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=error.headers)
        what = "Invalid URL" if error.status_code == 404 else "Method not allowed"
        message = f"{what} ({request.method} {request.url.path[:200]}); this server serves {SERVED_ROUTES}."
        code = "unknown_url" if error.status_code == 404 else "method_not_allowed"
        response = front.error_response(request, ApiError(error.status_code, message, "invalid_request_error", code))
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        state = serving.state()
        if state.ready:
            return JSONResponse({"status": "ready", "model": config.model_id})
        body: dict[str, Any] = {"status": "failed" if state.failure else "starting", "model": config.model_id}
        body["waiting_for"] = list(state.waiting_for)
        if error := front.what_fails():
            body["error"] = error
        return JSONResponse(body, status_code=503)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        authorise(request)
        ring, state = serving.ring, serving.state()
        now = time.monotonic()
        session = serving.session_status()
        keyed = config.api_key is not None  # the session code is for the key's holder alone
        stages, cover = ring.covered_report if ring else ([], None)
        return HostStatus(
            model=config.model_id,
            ready=state.ready,
            waiting_for=list(state.waiting_for),
            error=front.what_fails(),
            join=state.join_line if keyed else None,
            context_per_sequence=config.context_per_sequence,
            queue_depth=ring.queued if ring else 0,
            running=ring.running if ring else 0,
            pipeline_waves=ring.waves if ring else None,
            tokens_per_s=round(ring.stats.tokens_per_s(now), 3) if ring else 0.0,
            requests={"finished": ring.stats.finished, "failed": ring.stats.failed} if ring else {},
            requests_by_dialect=dict(metrics.by_dialect),
            stages=stages,
            stages_cover=cover,
            incidents=list(state.incidents),
            speculation=ring.speculation if ring else None,
            prefill=ring.prefill if ring else None,
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
        stream = event_stream(serving.events, client, config.event_heartbeat_s)
        return StreamingResponse(stream, media_type="text/event-stream", headers=STREAM_HEADERS)

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

    openai_routes.install(app, front)
    responses_routes.install(app, front)
    anthropic_routes.install(app, front)
    ollama_routes.install(app, front)
    app.add_middleware(CountRequests, metrics=metrics, routes=frozenset(route_paths(app)))
    app.add_middleware(TrustedHosts, allowed=config.allowed_hosts)  # outermost: before anything else
    return app


def _page_file(name: str) -> bytes:
    return importlib.resources.files("kafila.api").joinpath("static", name).read_bytes()
