"""What the API counts for Prometheus (`/metrics`): requests by route and outcome, tokens,
times, and the ring's stages as the session last measured them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kafila.api.served import Served

# Which API dialect a route belongs to, by its path's start: for counting, in /metrics and /status.
DIALECT_PATHS = (
    ("/v1/chat/completions", "openai chat"),
    ("/v1/completions", "openai completions"),
    ("/v1/responses", "openai responses"),
    ("/v1/messages", "anthropic messages"),
    ("/api/", "ollama"),
)


def dialect_of(path: str) -> str | None:
    return next((name for prefix, name in DIALECT_PATHS if path.startswith(prefix)), None)


class Metrics:
    def __init__(self, serving: Served) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kafila_requests", "Requests by route and HTTP status", ["route", "status"], registry=self.registry
        )
        self.dialect_requests = Counter(
            "kafila_dialect_requests", "Requests by API dialect", ["dialect"], registry=self.registry
        )
        self.by_dialect: dict[str, int] = {}  # the same counts, for /status
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
        queue.set_function(lambda: ring.queued if (ring := serving.ring) else 0)
        running = Gauge("kafila_running_requests", "Requests generating now", registry=self.registry)
        running.set_function(lambda: ring.running if (ring := serving.ring) else 0)
        rate = Gauge("kafila_tokens_per_second", "Generated tokens per second, last 10 s", registry=self.registry)
        rate.set_function(lambda: ring.stats.tokens_per_s(time.monotonic()) if (ring := serving.ring) else 0.0)
        drafts = {
            "drafted_tokens": "Tokens drafted and sent round the ring to be checked (speculative decoding)",
            "accepted_tokens": "Drafted tokens the model's own choice confirmed",
            "accepted_per_trip": "Drafted tokens kept per trip that carried drafts",
            "mean_window": "Drafted tokens per trip that carried drafts",
            "waves_behind": "Waves of drafts sent behind another of the same request's still in the ring",
            "waves_stale": "Waves behind a rejected draft, their rows cut unread",
        }
        for name, what in drafts.items():
            gauge = Gauge(f"kafila_speculation_{name}", what, registry=self.registry)
            gauge.set_function(partial(_speculation, serving, name))
        ready = Gauge("kafila_ready", "1 when every stage is ready", registry=self.registry)
        ready.set_function(lambda: 1.0 if serving.state().ready else 0.0)
        self.registry.register(RingCollector(serving))


def _speculation(serving: Served, name: str) -> float:
    """One of /status's speculation figures (`SpeculationStatus`) of the ring serving now, or 0."""
    ring = serving.ring
    return float(getattr(ring.speculation, name)) if ring is not None else 0.0


def _blocks(span: object) -> str | None:
    """A [first, end) block range as the "first-last" label /status and the plan table use."""
    if isinstance(span, list | tuple) and len(span) == 2 and all(isinstance(b, int) for b in span):
        return f"{span[0]}-{span[1] - 1}"
    return None


class RingCollector(Collector):
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
        ring = self.serving.ring
        for stage in ring.stage_report if ring else []:
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


def route_paths(app: FastAPI) -> list[str]:
    return [path for route in app.routes if isinstance(path := getattr(route, "path", None), str)]


class CountRequests:
    """Counts responses by route and status, and by dialect, for /metrics and /status.

    Plain ASGI rather than `@app.middleware("http")`: that wrapper passes every chunk of a
    streamed response through a memory stream and another task, a cost paid on every token.
    Paths that are no route count as "other", so random URLs cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

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
            self.metrics.requests.labels(route, str(status)).inc()
            if route != "other" and (dialect := dialect_of(route)) is not None:
                self.metrics.dialect_requests.labels(dialect).inc()
                self.metrics.by_dialect[dialect] = self.metrics.by_dialect.get(dialect, 0) + 1
