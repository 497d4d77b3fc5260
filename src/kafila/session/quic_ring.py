"""The host's ring transport over QUIC: the engine thread's blocking calls, run on the event loop.

The engine loop thread owns llama.cpp and blocks on each step; the links live on the asyncio
loop. `QuicRing` bridges them, so `RingEngine` drives a ring of machines exactly as it drives
local processes: a send is a plain callback on the loop, which the engine thread waits for (a
send not waited for left when the engine next let go of the GIL, after its own Python work: the
tokens' delivery came back onto each token's path), a receive a coroutine whose answer it waits
for. A link that goes down, or a ring that stops answering, surfaces as `StageFailed` naming the
member, which fails the requests in flight; a stage's ERROR frame about one sequence is returned
like any frame and fails only that request.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kafila.contracts import StageReport
from kafila.network.link import LinkError
from kafila.runtime.engine.ring import StageFailed, check_ring_error, ring_stats
from kafila.session.router import Channel, FrameSink
from kafila.wire.frames import Frame

T = TypeVar("T")
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
        self._pending: set[Future[Any]] = set()
        self._abandoned = False
        self._down: str | None = None  # why the first member link that went down did (set on the loop)
        self._refused: Exception | None = None  # why the loop could not send frames handed to it
        self._sending: set[threading.Event] = set()  # sends waiting on the loop, for `abandon`
        self._waiting: set[asyncio.Task[Any]] = set()  # the steps waiting on the loop, for `_member_down`
        self._watches = {name: functools.partial(self._member_down, name) for name in self._members}
        loop.call_soon_threadsafe(self._watch_members, True)  # built on the engine's thread, or on the loop

    def _run(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        if self._abandoned:
            coroutine.close()
            raise StageFailed("this ring was abandoned for a new plan")
        future = asyncio.run_coroutine_threadsafe(self._watched(coroutine), self._loop)
        self._pending.add(future)
        try:
            return future.result(STEP_TIMEOUT_S)
        except FutureTimeout:
            future.cancel()
            raise StageFailed(f"the ring did not answer within {STEP_TIMEOUT_S:.0f} s ({what})") from None
        except CancelledError:
            if self._down is not None:
                raise StageFailed(self._down) from None
            raise StageFailed("this ring was abandoned for a new plan") from None
        except LinkError as error:
            raise StageFailed(f"the link to {self._last_name} is down: {error}") from error
        finally:
            self._pending.discard(future)

    def _watch_members(self, watch: bool) -> None:
        """On the loop: a member link that goes down ends the step waiting on the ring at once.
        One callback per link for the ring's life (until it is abandoned), not a watch a step."""
        for name, closed in self._members.items():
            if watch:
                closed.add_done_callback(self._watches[name])
            else:
                closed.remove_done_callback(self._watches[name])

    def _member_down(self, name: str, closed: asyncio.Future[LinkError]) -> None:
        if self._down is None:
            reason = "its session ended" if closed.cancelled() else str(closed.result())
            self._down = f"the link to {name} is down: {reason}"
        for task in list(self._waiting):
            task.cancel()

    async def _watched(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """The coroutine, unless a ring member's link is down, or goes down first (`_member_down`
        cancels it; `_run` then says which)."""
        if self._down is not None:
            coroutine.close()
            raise StageFailed(self._down)
        if self._refused is not None:
            coroutine.close()
            raise self._refusal()
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await coroutine
        finally:
            self._waiting.discard(task)

    def _refusal(self) -> Exception:
        error = self._refused
        assert error is not None
        if isinstance(error, LinkError):
            return StageFailed(f"the link to {self._first_name} is down: {error}")
        return error

    def _send_now(self, frames: Sequence[Frame], sent: threading.Event) -> None:
        """On the loop, in the order the engine handed them over."""
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
        for future in list(self._pending):
            future.cancel()
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
        async def receive() -> list[Frame]:
            got: list[Frame] = []
            while len(got) < count:  # an ERROR for one sequence counts: it fails only that sequence
                frame = self._last.receive_nowait() or await self._last.receive()
                got.append(check_ring_error(frame, f"{self._last_name} reported: "))
            return got

        return self._run(receive(), "receive")

    def stats(self) -> list[StageReport]:
        return ring_stats(self)

    def close(self) -> None:
        """The links belong to the session, which closes them; only the ring's own waits end here."""
        self.abandon()
