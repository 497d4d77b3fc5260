"""The host's events (`/events`) as server-sent events: each with its id, a heartbeat comment
between them, so proxies keep the stream and a client gone is noticed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from kafila.contracts import HostEvent
from kafila.event_feed import EventFeed, Subscription

EVENT_HEARTBEAT_S = 15.0  # an SSE comment this often: proxies keep the stream, and a client gone is noticed
CAUGHT_UP = b": caught up\n\n"  # after the kept events: a reader of the past knows it has it all


async def event_stream(feed: EventFeed, client: Subscription, heartbeat_s: float) -> AsyncIterator[bytes]:
    """A client's events, each with its id (for Last-Event-ID on reconnect): those kept, a comment
    saying so, then each as it happens. The stream ends when the client falls too far behind, and
    the feed forgets it when the client goes away (the write of the next event or heartbeat fails,
    or the server sees the disconnect)."""
    try:
        yield b"retry: 2000\n\n" + b"".join(sse_event(e) for e in client.backlog) + CAUGHT_UP
        while not client.dropped:
            try:
                event = await asyncio.wait_for(client.queue.get(), heartbeat_s)
            except TimeoutError:
                yield b": heartbeat\n\n"
                continue
            if event is not None and not client.dropped:
                yield sse_event(event)
    finally:
        feed.unsubscribe(client)


def sse_event(event: HostEvent) -> bytes:
    """Unnamed ("message") events: the kind is in the data, so `EventSource.onmessage` sees them all."""
    return f"id: {event.id}\ndata: ".encode() + json.dumps(event.wire(), separators=(",", ":")).encode() + b"\n\n"
