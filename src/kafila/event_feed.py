"""The host's recent events (a member joined or left, a replan, an incident), kept for `/events`.

The session publishes them (`session.runner.HostRunner`), from its event loop or any thread; the
API streams them to its clients (`api.server`). Neither package imports the other: both import
this. Everything is bounded: the events kept, the clients at once, and each client's backlog —
a client that cannot keep up is dropped (it may reconnect and ask for what it missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kafila.contracts import EventKind, HostEvent
from kafila.untrusted import printable

MAX_KEPT_EVENTS = 256  # the latest events, for a client that connects or reconnects
MAX_EVENT_CLIENTS = 16  # streams at once; more are turned away (503) rather than held
MAX_CLIENT_BACKLOG = 256  # events waiting for one slow client before it is dropped
MAX_EVENT_TEXT = 2000  # characters of an event's text or detail (a member's last lines can be long)


@dataclass(eq=False)
class Subscription:
    """One client's stream: what it had not seen when it came, then each event as it happens.
    `dropped` once it fell MAX_CLIENT_BACKLOG events behind: its stream then ends."""

    backlog: list[HostEvent]
    queue: asyncio.Queue[HostEvent | None]  # None: the feed has closed
    loop: asyncio.AbstractEventLoop
    dropped: bool = False

    def offer(self, event: HostEvent) -> None:
        """On the client's event loop."""
        if self.dropped:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:  # the queue holds events, so its stream is awake and will see this
            self.dropped = True

    def end(self) -> None:
        """On the client's event loop: the stream ends after what it has been sent."""
        self.dropped = True
        with contextlib.suppress(asyncio.QueueFull):  # a full queue's stream is awake anyway
            self.queue.put_nowait(None)


@dataclass
class EventFeed:
    """A capped ring buffer of the host's events, and the clients following it."""

    keep: int = MAX_KEPT_EVENTS
    max_clients: int = MAX_EVENT_CLIENTS
    client_backlog: int = MAX_CLIENT_BACKLOG
    # What an event's texts become before anyone sees them: names and errors from the network in
    # them lose their control characters (and the host's secrets are hidden: `Availability.public`).
    scrub: Callable[[str], str] = field(default=lambda text: printable(text, MAX_EVENT_TEXT, newlines=True))
    _recent: deque[HostEvent] = field(init=False, repr=False)
    _clients: set[Subscription] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last_id: int = 0
    _closed: bool = False

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.keep)

    def publish(self, kind: EventKind, text: str, detail: str = "") -> HostEvent:
        """Keep the event and hand it to every client (safe from any thread)."""
        with self._lock:
            self._last_id += 1
            text, detail = self.scrub(text)[:MAX_EVENT_TEXT], self.scrub(detail)[:MAX_EVENT_TEXT]
            event = HostEvent(id=self._last_id, kind=kind, text=text, detail=detail, at=time.time())
            self._recent.append(event)
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(RuntimeError):  # its loop has closed: the server is stopping
                client.loop.call_soon_threadsafe(client.offer, event)
        return event

    def recent(self, after: int = 0) -> list[HostEvent]:
        with self._lock:
            return [e for e in self._recent if e.id > after]

    def subscribe(self, after: int = 0) -> Subscription | None:
        """A stream of what came after event `after` (those still kept) and all that follows, on
        the running event loop; None when `max_clients` already follow, or the feed has closed."""
        with self._lock:
            if self._closed or len(self._clients) >= self.max_clients:
                return None
            backlog = [e for e in self._recent if e.id > after]
            client = Subscription(backlog, asyncio.Queue(self.client_backlog), asyncio.get_running_loop())
            self._clients.add(client)
            return client

    def close(self) -> None:
        """The host is stopping: end every stream now (the server would otherwise wait for open
        ones, up to its graceful-shutdown bound) and take no more clients."""
        with self._lock:
            self._closed = True
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(RuntimeError):
                client.loop.call_soon_threadsafe(client.end)

    def unsubscribe(self, client: Subscription) -> None:
        with self._lock:
            self._clients.discard(client)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._clients)
