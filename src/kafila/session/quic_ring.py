"""The host's ring transport over QUIC: the engine thread's blocking calls, run on the event loop.

The engine loop thread owns llama.cpp and blocks on each step; the links live on the asyncio
loop. `QuicRing` bridges them with `run_coroutine_threadsafe`, so `RingEngine` drives a ring of
machines exactly as it drives local processes. A link that goes down, or a ring that stops
answering, surfaces as `StageFailed` naming the member, which fails the requests in flight; a
stage's ERROR frame about one sequence is returned like any frame and fails only that request.
"""

from __future__ import annotations

import asyncio
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
            raise StageFailed("this ring was abandoned for a new plan") from None
        except LinkError as error:
            name = self._first_name if what == "send" else self._last_name
            raise StageFailed(f"the link to {name} is down: {error}") from error
        finally:
            self._pending.discard(future)

    async def _watched(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """The coroutine, unless a ring member's link goes down first."""
        if not self._members:
            return await coroutine
        work = asyncio.ensure_future(coroutine)
        down: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(asyncio.shield(f)): name for name, f in self._members.items()
        }
        waiting: list[asyncio.Future[Any]] = [work, *down]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this step is abandoned: its reader must not outlive it
            for waiter in down:
                waiter.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        name = next(down[w] for w in down if w.done() and not w.cancelled())
        raise StageFailed(f"the link to {name} is down: {self._members[name].result()}")

    def abandon(self) -> None:
        """Stop using this ring: any step waiting on it ends at once, and it takes no more frames,
        so a new ring over the same links is the only reader of their channels."""
        self._abandoned = True
        for future in list(self._pending):
            future.cancel()

    def send(self, frames: Sequence[Frame]) -> None:
        async def send() -> None:
            for frame in frames:
                await self._first.send(frame)

        self._run(send(), "send")

    def receive(self, count: int) -> list[Frame]:
        async def receive() -> list[Frame]:
            got: list[Frame] = []
            while len(got) < count:  # an ERROR for one sequence counts: it fails only that sequence
                got.append(check_ring_error(await self._last.receive(), f"{self._last_name} reported: "))
            return got

        return self._run(receive(), "receive")

    def stats(self) -> list[StageReport]:
        return ring_stats(self)

    def close(self) -> None:
        """The links belong to the session, which closes them; only the ring's own waits end here."""
        self.abandon()
