"""The host's ring transport over QUIC: the engine thread's blocking calls, run on the event loop.

The engine loop thread owns llama.cpp and blocks on each step; the links live on the asyncio
loop. `QuicRing` bridges them, so `RingEngine` drives a ring of machines exactly as it drives
local processes: a send is a plain callback on the loop, which the engine thread waits for (a
send not waited for left when the engine next let go of the GIL, after its own Python work: the
tokens' delivery came back onto each token's path). A receive takes the frames the last stage's
link hands straight to the engine thread (`FrameFeed`), with no task or future on the loop between
them. A link that goes down, or a ring that stops answering, surfaces as `StageFailed` naming the
member, which fails the requests in flight; a stage's ERROR frame about one sequence is returned
like any frame and fails only that request.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

from kafila.contracts import StageReport
from kafila.network.link import LinkError
from kafila.runtime.engine.ring import StageFailed, check_ring_error, ring_stats
from kafila.session.router import Channel, FrameFeed, FrameSink
from kafila.wire.frames import Frame

STEP_TIMEOUT_S = 120.0  # a long prompt on a slow member; a dead one is caught sooner by its link


class QuicRing:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        first: FrameSink,
        first_name: str,
        last: Channel,
        last_name: str,
        members: Mapping[str, asyncio.Future[LinkError]] | None = None,
    ) -> None:
        """`first`: activations to the stage holding block 0 (a member's link, or this host's own stage);
        `last`: what comes back from the last stage (hidden states, or a head's logits);
        `members`: every ring member's link-closed future, by name, so a step waiting on the ring
        ends as soon as any member's link goes down, not when the step times out."""
        self._loop = loop
        self._first, self._first_name = first, first_name
        self._last, self._last_name = last, last_name
        self._members = dict(members or {})
        self._abandoned = False
        self._down: str | None = None  # why the first member link that went down did (set on the loop)
        self._refused: Exception | None = None  # why the loop could not send frames handed to it
        self._sending: set[threading.Event] = set()  # sends waiting on the loop, for `abandon`
        self._feed = FrameFeed()  # what the last stage's link brings, for the engine thread
        self._arrived: deque[Frame] = deque()  # taken from the feed, not yet returned (the engine's)
        self._unreleased: list[Frame] = []  # taken from the feed, still counted against the link (`_release`)
        self._watches = {name: functools.partial(self._member_down, name) for name in self._members}
        loop.call_soon_threadsafe(self._watch_members, True)  # built on the engine's thread, or on the loop

    def _watch_members(self, watch: bool) -> None:
        """On the loop: a member link that goes down ends the receive waiting on the ring at once.
        One callback per link for the ring's life (until it is abandoned), not a watch a step; and
        the last stage's frames go to this ring's feed until then."""
        for name, closed in self._members.items():
            if watch:
                closed.add_done_callback(self._watches[name])
            else:
                closed.remove_done_callback(self._watches[name])
        if watch and not self._abandoned:
            self._last.hand_to(self._feed.put)
        elif not watch:
            self._last.take_back(self._feed.put)
            self._arrived.clear()  # a broken ring's frames: the next ring must not see them
            self._unreleased.extend(self._feed.left())
            self._release()

    def _member_down(self, name: str, closed: asyncio.Future[LinkError]) -> None:
        if self._down is None:
            reason = "its session ended" if closed.cancelled() else str(closed.result())
            self._down = f"the link to {name} is down: {reason}"
        self._feed.stop()

    def _release(self) -> None:
        """On the loop: the frames the engine took no longer count against the last link's bound."""
        taken, self._unreleased = self._unreleased, []
        for frame in taken:
            self._last.taken(frame)

    def _refusal(self) -> Exception:
        error = self._refused
        assert error is not None
        if isinstance(error, LinkError):
            return StageFailed(f"the link to {self._first_name} is down: {error}")
        return error

    def _send_now(self, frames: Sequence[Frame], sent: threading.Event) -> None:
        """On the loop, in the order the engine handed them over; the frames it took since the last
        send are released here, with no wake-up of the loop of their own."""
        self._release()
        try:
            if not self._abandoned and self._refused is None:
                for frame in frames:
                    self._first.send_now(frame)
        except Exception as error:  # the waiting engine raises it, and so does every call after
            self._refused = error
        finally:
            sent.set()

    def abandon(self) -> None:
        """Stop using this ring: any step waiting on it ends at once, and it takes no more frames,
        so a new ring over the same links is the only reader of their channels."""
        self._abandoned = True
        self._feed.stop()
        for sending in list(self._sending):
            sending.set()
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._watch_members, False)

    def send(self, frames: Sequence[Frame]) -> None:
        """The frames out in turn, by a plain callback on the loop (no task, no future), once it
        has run: they leave before the engine's next Python work."""
        if self._down is not None:
            raise StageFailed(self._down)
        sent = threading.Event()
        self._sending.add(sent)
        try:
            if not self._abandoned:
                self._loop.call_soon_threadsafe(self._send_now, list(frames), sent)
                if not sent.wait(STEP_TIMEOUT_S):
                    raise StageFailed(f"the ring did not take frames within {STEP_TIMEOUT_S:.0f} s (send)")
        finally:
            self._sending.discard(sent)
        if self._abandoned:
            raise StageFailed("this ring was abandoned for a new plan")
        if self._refused is not None:
            raise self._refusal()

    def receive(self, count: int) -> list[Frame]:
        """The next `count` frames from the last stage, on the engine's thread; an ERROR for one
        sequence counts (it fails only that sequence)."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        got: list[Frame] = []
        while len(got) < count:
            if not self._arrived:
                self._check_receiving()
                frames = self._feed.take(lambda: time.monotonic() > deadline)
                if frames is None:
                    self._check_receiving()
                    raise StageFailed(self._ended_why(deadline))
                self._unreleased.extend(frames)  # released on the loop at the next send
                self._arrived.extend(frames)
            frame = self._arrived.popleft()
            got.append(check_ring_error(frame, f"{self._last_name} reported: "))
        return got

    def _check_receiving(self) -> None:
        if self._abandoned:
            raise StageFailed("this ring was abandoned for a new plan")
        if self._down is not None:
            raise StageFailed(self._down)
        if self._refused is not None:
            raise self._refusal()

    def _ended_why(self, deadline: float) -> str:
        closed = self._last.closed
        if closed.done() and not closed.cancelled():
            return f"the link to {self._last_name} is down: {closed.result()}"
        if time.monotonic() > deadline:
            return f"the ring did not answer within {STEP_TIMEOUT_S:.0f} s (receive)"
        return f"the link to {self._last_name} is down"

    def stats(self) -> list[StageReport]:
        return ring_stats(self)

    def close(self) -> None:
        """The links belong to the session, which closes them; only the ring's own waits end here."""
        self.abandon()
