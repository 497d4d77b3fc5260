"""Replies in whatever dialect, pure but for reading the engine loop's queue: a whole reply
gathered from its events, or its events written as a stream as they come. How each dialect
shapes them is its `ReplyWriter` (OpenAI's in `openai_replies`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafila.api.errors import TRY_AGAIN, ApiError
from kafila.api.telemetry import Metrics
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.serving.batcher import Finished, RequestEvent, RequestFailed, TextDelta


class ReplyWriter(Protocol):
    """One dialect's shape of one request's reply: the whole of it, or the stream's bytes, framed
    (server-sent events, or Ollama's JSON lines) as `media_type` says."""

    request_id: str
    media_type: str

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    def delta(self, delta: TextDelta) -> list[bytes]: ...

    def end(self, finished: Finished) -> list[bytes]: ...

    def failed(self, failure: RequestFailed) -> list[bytes]: ...


@dataclass
class ReplyMeter:
    """A reply's part in the counters: its time to first text, and its tokens once it ends."""

    metrics: Metrics
    started: float = field(default_factory=time.monotonic)
    first_text: bool = True

    def text(self) -> None:
        if self.first_text:
            self.first_text = False
            self.metrics.first_token.observe(time.monotonic() - self.started)

    def end(self, finished: Finished) -> None:
        self.metrics.prompt_tokens.inc(finished.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(finished.cached_tokens)
        self.metrics.computed_prompt_tokens.inc(finished.prompt_tokens - finished.cached_tokens)
        self.metrics.completion_tokens.inc(finished.completion_tokens)


@dataclass(frozen=True)
class Gathered:
    """A whole reply: its text, how it ended, and its tokens' log probabilities where asked."""

    text: str
    finished: Finished
    logprobs: tuple[TokenLogprob, ...]


async def collect(queue: asyncio.Queue[RequestEvent], meter: ReplyMeter) -> Gathered:
    """The reply's events until it ends; a failure as an `ApiError`."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        event = await queue.get()
        if isinstance(event, TextDelta):
            meter.text()
            parts.append(event.text)
            logprobs += event.logprobs
        elif isinstance(event, Finished):
            meter.end(event)
            return Gathered("".join(parts), event, tuple(logprobs))
        else:
            raise failure_error(event)


def failure_error(failure: RequestFailed) -> ApiError:
    if failure.code == "ring_failed":  # the host replans: a retry shortly may well be served
        return ApiError(503, failure.message, "server_error", failure.code, headers=TRY_AGAIN)
    return ApiError(500, failure.message, "server_error", failure.code)


async def stream_reply(
    queue: asyncio.Queue[RequestEvent], writer: ReplyWriter, meter: ReplyMeter, cancel: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The writer's opening, then its bytes for each event until the reply ends.

    Events that queued up while the last write went out leave in one write: each is still its
    own event on the wire, but a busy loop pays the response machinery once for them, not per
    token."""
    try:
        opening = writer.opening()
        if opening:
            yield b"".join(opening)
        ended = False
        while not ended:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            out: list[bytes] = []
            for event in events:
                if isinstance(event, TextDelta):
                    meter.text()
                    out += writer.delta(event)
                    continue
                if isinstance(event, Finished):
                    meter.end(event)
                    out += writer.end(event)
                else:
                    out += writer.failed(event)
                ended = True
                break
            yield b"".join(out)
    finally:
        cancel()  # the client went away, or the stream ended: either way the slot is free


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event; `event`: its type, for dialects that name them."""
    named = f"event: {event}\n".encode() if event is not None else b""
    return named + b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
