"""The host's ring transport over QUIC: the engine thread's blocking calls, run on the event loop.

The engine loop thread owns llama.cpp and blocks on each step; the links live on the asyncio
loop. `QuicRing` bridges them with `run_coroutine_threadsafe`, so `RingEngine` drives a ring of
machines exactly as it drives local processes. A link that goes down, or a ring that stops
answering, surfaces as `StageFailed` naming the member, which fails the requests in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kafila.network.frames import Frame, Kind
from kafila.network.link import LinkError
from kafila.runtime.pipeline import StageFailed, ring_stats
from kafila.session.router import Channel

T = TypeVar("T")
STEP_TIMEOUT_S = 120.0  # a long prompt on a slow member; a dead one is caught sooner by its link


class QuicRing:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, first: Channel, first_name: str, last: Channel, last_name: str
    ) -> None:
        """`first`: activations to the member holding block 0; `last`: activations back from the last one."""
        self._loop = loop
        self._first, self._first_name = first, first_name
        self._last, self._last_name = last, last_name

    def _run(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(STEP_TIMEOUT_S)
        except FutureTimeout:
            future.cancel()
            raise StageFailed(f"the ring did not answer within {STEP_TIMEOUT_S:.0f} s ({what})") from None
        except LinkError as error:
            name = self._first_name if what == "send" else self._last_name
            raise StageFailed(f"the link to {name} is down: {error}") from error

    def send(self, frames: Sequence[Frame]) -> None:
        async def send() -> None:
            for frame in frames:
                await self._first.send(frame)

        self._run(send(), "send")

    def receive(self, count: int) -> list[Frame]:
        async def receive() -> list[Frame]:
            got: list[Frame] = []
            while len(got) < count:
                frame = await self._last.receive()
                if frame.kind is Kind.ERROR:
                    raise StageFailed(f"{self._last_name} reported: {frame.text()}")
                got.append(frame)
            return got

        return self._run(receive(), "receive")

    def stats(self) -> list[dict[str, object]]:
        return ring_stats(self)

    def close(self) -> None:
        """The links belong to the session, which closes them; nothing is owned here."""
