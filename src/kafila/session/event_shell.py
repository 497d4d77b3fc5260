"""The asyncio shell around the host's session core, as aioquic's is around a connection: take
what happened from one queue, hand it to the core, carry out what the core decides, and wait
again until the core's next deadline. Nothing here decides."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from kafila.session.lifecycle import Command, Event

WATCH_ERRORS_TOLERATED = 25  # the same error on this many turns running ends the watching


class Core(Protocol):
    def handle(self, event: Event) -> list[Command]: ...
    def next_deadline(self) -> float: ...


class EventShell:
    """One queue of events; `watch` hands the core what came and a look (`look()`, what is a state
    rather than a happening), until `going_on()` ends. Commands that need no waiting are `tell`-ed
    at once; those in `followed` take time, and are carried out in order in the background
    (`carry_out`), each answer handed on in turn, so what happens meanwhile is still heard."""

    def __init__(
        self,
        core: Core,
        look: Callable[[], Event],
        tell: Callable[[Command], None],
        carry_out: Callable[[Command], Awaitable[list[Event]]],
        followed: tuple[type, ...],
        incident: Callable[[str, str], None],
    ) -> None:
        self.core, self.look, self.tell, self.carry_out = core, look, tell, carry_out
        self.followed, self.incident = followed, incident
        # Bounded by what can push: one per admission, one per stage's report of each ring, and
        # one wake-up (`None`) however many come before it is read.
        self.events: asyncio.Queue[Event | None] = asyncio.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None  # where other threads' wake-ups go
        self.following: asyncio.Task[None] | None = None
        self._later: deque[Command] = deque()  # commands that take time, in order
        self._woken = False

    def push(self, event: Event) -> None:
        self.events.put_nowait(event)

    def wake(self) -> None:
        """Something changed that the next look shows: wake the watcher, once however many come."""
        if not self._woken:
            self._woken = True
            self.events.put_nowait(None)

    def wake_from_thread(self) -> None:
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody watches
                loop.call_soon_threadsafe(self.wake)

    async def watch(self, going_on: Callable[[], bool]) -> None:
        """Until `going_on()` ends: wait for what happens, or for the core's next deadline, and
        hand the core what came and a look.

        One bad turn (a member's hostile text in an error, a message nobody foresaw) is an
        incident, not the end of watching: the same error WATCH_ERRORS_TOLERATED turns running
        ends it, as it cannot recover by itself."""
        repeated, last = 0, ""
        while going_on():
            happened = await self._next_events()
            try:
                self.hand([*happened, self.look()])
                repeated = 0
            except Exception as error:
                text = f"{type(error).__name__}: {error}"
                repeated = repeated + 1 if text == last else 1
                last = text
                if repeated >= WATCH_ERRORS_TOLERATED:
                    raise
                if repeated == 1:
                    self.incident("the host met an error watching its session", text)
                await asyncio.sleep(0.2)  # not a busy loop while the same error repeats

    async def _next_events(self) -> list[Event]:
        """What was pushed, waiting for the first until the core's next deadline."""
        if self.events.empty():
            try:
                timeout = max(0.0, self.core.next_deadline() - time.monotonic())
                self.events.put_nowait(await asyncio.wait_for(self.events.get(), timeout))
            except TimeoutError:
                return []
        self._woken = False
        batch = [self.events.get_nowait() for _ in range(self.events.qsize())]
        return [event for event in batch if event is not None]

    def hand(self, events: Sequence[Event]) -> None:
        """Hand the core events: tell what needs no waiting, follow what takes time."""
        for event in events:
            for command in self.core.handle(event):
                if isinstance(command, self.followed):
                    self._later.append(command)
                else:
                    self.tell(command)
        if self._later and (self.following is None or self.following.done()):
            self.following = asyncio.create_task(self._follow(), name="kafila-host-follows")

    def hand_now(self, events: Sequence[Event]) -> None:
        """Hand the core events whose commands need no waiting (a callback's, a signal handler's)."""
        for event in events:
            for command in self.core.handle(event):
                self.tell(command)

    async def drive(self, events: Sequence[Event]) -> None:
        """Hand the core events and wait until what they set off is done (before anything watches)."""
        self.hand(events)
        while self.following is not None and not self.following.done():
            await self.following

    async def _follow(self) -> None:
        while self._later:
            command = self._later.popleft()
            try:
                answers = await self.carry_out(command)
            except Exception as error:
                self.incident("the host met an error carrying out its decision", f"{type(error).__name__}: {error}")
                continue
            self.hand(answers)
            self.wake()  # the answer may have moved the core's deadline: the watcher re-arms

    async def stop(self) -> None:
        """End what is being carried out (a deployment under way, say) and wake the watcher to end."""
        self.wake()
        following, self.following = self.following, None
        self._later.clear()
        if following is not None:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await following
