"""What the host's API may serve at each moment, as the session tells it.

The session (`runner.HostRunner`) makes it ready with a ring's engine and loop, or unready with
what it waits for, or paused for a replan it chose (requests then wait rather than be turned
away), or failed with the reason. The API (`api.server`) only reads it, through its `Served`
protocol: neither package imports the other, and `kafila host` hands this to both.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kafila.contracts import Incident, SessionStatus
from kafila.event_feed import EventFeed
from kafila.runtime.engine.engines import Engine
from kafila.serving.batcher import Suspended
from kafila.serving.engine_loop import EngineLoop, Sink, fail_suspended
from kafila.serving.handle import ServedState, ServingHandle
from kafila.untrusted import printable

# How long a request waits for a planned replan (newcomers taken in, a rebalance) before it is
# turned away with 503: a replan streams and loads stage files, which can take minutes.
PLANNED_PAUSE_WAIT_S = 120.0
MAX_INCIDENTS = 16  # the latest things that went wrong, kept for /status
MAX_GONE = 4096  # requests whose clients left while a broken ring's requests waited for the next
HIDDEN_SECRET = "[the session code: on the host's console]"


@dataclass
class Availability:
    """What the host's API may serve now, as the session tells it: once ready, the ring's
    `ServingHandle`; until then, or after a break, what it waits for or why it cannot serve. The
    session changes it; the API reads it (`api.served.Served`)."""

    ring: ServingHandle | None = None
    _last_ring: ServingHandle | None = field(default=None, repr=False)
    waiting_for: list[str] = field(default_factory=lambda: ["the model to load"])
    failure: str | None = None
    describe_session: Callable[[], SessionStatus] = SessionStatus  # the session's part of /status, on demand
    paused: bool = False  # a planned replan runs: requests wait for it rather than be turned away
    pause_wait_s: float = PLANNED_PAUSE_WAIT_S
    _resumed: list[asyncio.Future[None]] = field(default_factory=list, repr=False)
    incidents: deque[Incident] = field(default_factory=lambda: deque(maxlen=MAX_INCIDENTS))
    events: EventFeed = field(default_factory=EventFeed)  # joins, leaves, replans, incidents: for /events
    gone: set[str] = field(default_factory=set)  # request ids whose clients left after their ring broke
    secrets: list[str] = field(default_factory=list)  # never shown on the API's routes (`public`)
    join_line: str | None = None  # `kafila join CODE ...`: shown to the API key's holder alone

    def __post_init__(self) -> None:
        self.events.scrub = self.public

    def keep_secret(self, *secrets: str) -> None:
        """`secrets` (the session code, its secret words) are hidden from now on in everything the
        API shows."""
        self.secrets += [secret for secret in secrets if secret and secret not in self.secrets]
        self.secrets.sort(key=len, reverse=True)  # the whole code first, then its parts

    def public(self, text: str) -> str:
        """`text` as the API may show it to anyone who reaches it: the secrets hidden, no control
        characters (names and errors in it may have come from the network)."""
        for secret in self.secrets:
            text = text.replace(secret, HIDDEN_SECRET)
        return printable(text, newlines=True)

    def session_status(self) -> SessionStatus:
        return self.describe_session()

    def session_described_by(self, source: Callable[[], SessionStatus]) -> None:
        self.describe_session = source

    def client_gone(self, request_id: str) -> None:
        """A request's client left after its ring broke: if the session holds it for the next
        ring, it does not go on there (`still_wanted`)."""
        if len(self.gone) < MAX_GONE:
            self.gone.add(request_id)

    def still_wanted(self, held: Sequence[tuple[Suspended, Sink]]) -> list[tuple[Suspended, Sink]]:
        """The requests a broken ring left that a client still waits for, for the next ring to
        take on; the others end here. Forgets who left: the next ring serves from now."""
        wanted = []
        for suspended, sink in held:
            if suspended.job.request_id in self.gone:
                fail_suspended(suspended, sink, "the client hung up")
            else:
                wanted.append((suspended, sink))
        self.gone.clear()
        return wanted

    def record_incident(self, what: str, detail: str) -> None:
        self.incidents.append(Incident(what=self.public(what), detail=self.public(detail), at=time.time()))
        self.events.publish("incident", what, detail)

    def become_ready(self, engine: Engine, loop: EngineLoop, architecture: str | None) -> None:
        """Serve on `engine` and its `loop`, with the chat template built for them (`ServingHandle.of`)."""
        last = self._last_ring  # the same ring ready again (a pause ended) keeps its handle
        if last is None or last.engine is not engine or last.loop is not loop:
            last = self._last_ring = ServingHandle.of(engine, loop, architecture)
        self.ring = last
        self.waiting_for = []
        self.failure = None
        self.paused = False
        self._wake()

    def become_unready(self, waiting_for: list[str], failure: str | None = None, paused: bool = False) -> None:
        """`paused`: the host chose to replan (it is not broken), so requests that come meanwhile
        wait for the new ring, up to `pause_wait_s`; otherwise they get 503 at once."""
        self.ring = None
        self.waiting_for = [self.public(wait) for wait in waiting_for]
        self.failure = self.public(failure) if failure is not None else None
        self.paused = paused and failure is None
        self._wake()

    def _wake(self) -> None:
        """Let every request waiting on a pause look again (from any thread)."""
        waiters, self._resumed = self._resumed, []
        for waiter in waiters:
            waiter.get_loop().call_soon_threadsafe(_settle, waiter)

    async def until_resumed(self) -> None:
        """Wait while a planned replan runs, up to `pause_wait_s`; the caller then looks at `ready`."""
        deadline = time.monotonic() + self.pause_wait_s
        while self.paused and not self.ready and (remaining := deadline - time.monotonic()) > 0:
            waiter = asyncio.get_running_loop().create_future()
            self._resumed.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                return

    @property
    def ready(self) -> bool:
        return self.ring is not None and self.ring.error is None

    def state(self) -> ServedState:
        return ServedState(
            self.ready, self.paused, self.failure, tuple(self.waiting_for), self.join_line, tuple(self.incidents)
        )

    @property
    def chat_template_source(self) -> str | None:
        """Where the chat template in use came from (the model's own, or a fallback), once ready."""
        return self.ring.template.source if self.ring is not None else None


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
