"""One link's frames, split by sequence id into control, file and activation traffic.

A link between the host and a member carries three things at once: control messages on one
reserved stream, stage files on reserved transfer streams, and activations for request slots.
Each gets its own queue, so a 200 MB transfer never delays a control message and a stage
never sees a frame that is not an activation. A `Channel` looks like a link to its user
(`send`, `receive`, `finish`), so code written for a link runs unchanged on one kind of its
traffic.

The router reads its link all the time, whoever reads its channels. A frame counts against the
link's bound (`LinkConfig.max_held_bytes`) until a channel's reader takes it, and each channel
holds at most its own share (`ChannelBounds`): a peer that sends what nobody here reads, or
faster than it is read, is sent away (`LinkOverBound`) once it passes either bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from kafila.network.link import Link, LinkClosed, LinkError, LinkOverBound
from kafila.network.transfer import MAX_CHUNK, MAX_WINDOW
from kafila.wire.control import (
    CONTROL_SEQUENCE,
    MAX_CONTROL_BYTES,
    ControlMessage,
    control_frame,
    parse_control,
)
from kafila.wire.frames import Frame

TRANSFER_SEQUENCES = range(2**63, 2**64 - 1)  # below the control stream, above any request slot
Traffic = Literal["control", "transfer", "activation"]
_Held = TypeVar("_Held", bound=Frame | None)  # what a channel queues: frames, and for a link's, its end (None)


@dataclass(frozen=True)
class ChannelBounds:
    """The bytes each kind of traffic may hold unread; activations are bound by the link alone."""

    control: int = 16 * MAX_CONTROL_BYTES  # a few messages at a time is all a peer ever has to say
    transfer: int = MAX_WINDOW + MAX_CHUNK  # a transfer's whole window, and the chunk that crosses it


def traffic_of(frame: Frame) -> Traffic:
    if frame.sequence_id == CONTROL_SEQUENCE:
        return "control"
    if frame.sequence_id in TRANSFER_SEQUENCES:
        return "transfer"
    return "activation"


class FrameSource(Protocol):
    """Where a stage's frames come from: a link's activations, or this process itself."""

    async def receive(self) -> Frame: ...
    def receive_nowait(self) -> Frame | None: ...
    def hand_to(self, sink: Callable[[Frame | None], None]) -> None:
        """From now on (frames already here first) each frame goes to `sink` as it comes, on the
        loop, and None once nothing more comes."""
        ...

    def take_back(self, sink: Callable[[Frame | None], None]) -> None:
        """Frames no longer go to `sink` (if they still do: a later reader's sink stays), but wait
        for `receive`."""
        ...

    def taken(self, frame: Frame) -> None:
        """A frame handed to a sink is done with: it no longer counts against the link's bound."""
        ...


class FrameFeed:
    """Frames from the event loop to one thread that blocks for them: a stage's thread reads its
    predecessor's frames here as the link delivers them (`FrameSource.hand_to`), without a task,
    a queue and an executor call on the loop between them. `put` never blocks: what the feed
    holds counts against the link's bound until the thread's answer has gone (`FrameSource.taken`)."""

    def __init__(self) -> None:
        self._frames: deque[Frame] = deque()
        self._ended = False  # nothing more comes: the frames held are still taken
        self._stopped = False  # the reader is to stop now: the frames held are left
        self._ready = threading.Condition(threading.Lock())

    def put(self, frame: Frame | None) -> None:
        """A frame for the reader, or None: nothing more comes after the frames held."""
        with self._ready:
            if frame is None:
                self._ended = True
            else:
                self._frames.append(frame)
            self._ready.notify()

    def stop(self) -> None:
        """The reader's next `take` returns None, whatever is held (see `left`)."""
        with self._ready:
            self._stopped = True
            self._ready.notify()

    def take(self, abandoned: Callable[[], bool] = lambda: False, every_s: float = 0.25) -> list[Frame] | None:
        """Every frame here, in order, once there is one; None once ended and empty, or stopped, or
        once `abandoned()`, asked every `every_s` while nothing comes: a reader whose owner went
        away without a word (a task cancelled on a loop that never runs again) still ends, and
        its thread with it."""
        with self._ready:
            while not (self._frames or self._ended or self._stopped):
                if not self._ready.wait(every_s) and abandoned():
                    return None
            if self._stopped or not self._frames:
                return None
            frames = list(self._frames)
            self._frames.clear()
            return frames

    def left(self) -> list[Frame]:
        """The frames no reader took (a stopped one's), which are then gone from the feed."""
        with self._ready:
            frames = list(self._frames)
            self._frames.clear()
            return frames


class FrameSink(Protocol):
    async def send(self, frame: Frame) -> None: ...
    def send_now(self, frame: Frame) -> None:
        """The same, from a plain callback on the loop: how the host's engine thread hands frames over."""
        ...


class _HandsOver(Generic[_Held]):
    """A frame source that may hand its frames to a sink (`FrameSource.hand_to`) instead of queueing them."""

    _queue: asyncio.Queue[_Held]  # what waits for `receive`; a None there is the end, which stays
    _sink: Callable[[Frame | None], None] | None  # each subclass's own, None until `hand_to`

    def hand_to(self, sink: Callable[[Frame | None], None]) -> None:
        """Frames go to `sink` as they come (those already here first), until `take_back`; the end
        goes to it too, and stays here for `receive`."""
        while not self._queue.empty():
            frame = self._queue.get_nowait()
            if frame is None:
                self._queue.put_nowait(frame)
                sink(frame)
                break
            sink(frame)
        self._sink = sink

    def take_back(self, sink: Callable[[Frame | None], None]) -> None:
        if self._sink == sink:
            self._sink = None


class LocalChannel(_HandsOver[Frame]):
    """Frames this process hands to itself: a host's engine feeding the host's own stage. Nothing
    ends them: no None is ever queued."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Frame] = asyncio.Queue()
        self._sink: Callable[[Frame | None], None] | None = None

    async def send(self, frame: Frame) -> None:
        self.send_now(frame)

    def send_now(self, frame: Frame) -> None:
        if self._sink is None:
            self._queue.put_nowait(frame)
        else:
            self._sink(frame)

    def taken(self, frame: Frame) -> None:
        """Nothing to release: this process's own frames count against no link."""

    async def receive(self) -> Frame:
        return await self._queue.get()

    def receive_nowait(self) -> Frame | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


class Channel(_HandsOver[Frame | None]):
    """One kind of a link's traffic, with the link's interface. Frames handed to a sink (as the
    router sorts them) count against the link, and this channel's bound, until `taken`."""

    def __init__(self, link: Link, traffic: Traffic, bound: int | None = None) -> None:
        self.link, self.traffic, self.bound = link, traffic, bound
        self._queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._sink: Callable[[Frame | None], None] | None = None
        self.held_bytes = 0

    @property
    def closed(self) -> asyncio.Future[LinkError]:
        return self.link.closed

    async def send(self, frame: Frame) -> None:
        self.link.send_now(frame)

    def send_now(self, frame: Frame) -> None:
        self.link.send_now(frame)

    async def finish(self, sequence_id: int) -> None:
        await self.link.finish(sequence_id)

    async def receive(self) -> Frame:
        frame = await self._queue.get()
        if frame is None:
            self._queue.put_nowait(None)
            raise self.link.closed.result() if self.link.closed.done() else LinkClosed("the router stopped")
        return self._taken(frame)

    def receive_nowait(self) -> Frame | None:
        """A frame already here, or None: how a stage gathers what arrived together into one batch."""
        try:
            frame = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if frame is None:
            self._queue.put_nowait(None)
            return None
        return self._taken(frame)

    def drain(self) -> int:
        """Discard frames already here (a broken ring's leftovers); the link's end marker stays."""
        dropped = 0
        while self.receive_nowait() is not None:
            dropped += 1
        return dropped

    def taken(self, frame: Frame) -> None:
        self._taken(frame)

    def _taken(self, frame: Frame) -> Frame:
        self.held_bytes -= frame.wire_bytes
        self.link.release(frame)
        return frame

    def _put(self, frame: Frame | None) -> bool:
        """Hold a frame for the reader (or hand it to the sink); False if that takes this channel
        past its bound."""
        if frame is not None:
            self.held_bytes += frame.wire_bytes
        if frame is None or self._sink is None:
            self._queue.put_nowait(frame)
        if self._sink is not None:
            self._sink(frame)
        return self.bound is None or self.held_bytes <= self.bound


class LinkRouter:
    """Sorts a link's frames into its channels as they arrive, on the loop (`Link.deliver_to`)."""

    def __init__(self, link: Link, peer_id: str, bounds: ChannelBounds | None = None) -> None:
        self.link, self.peer_id = link, peer_id
        bounds = bounds or ChannelBounds()
        self.control = Channel(link, "control", bounds.control)
        self.transfer = Channel(link, "transfer", bounds.transfer)
        self.activation = Channel(link, "activation")
        self._channels = {"control": self.control, "transfer": self.transfer, "activation": self.activation}
        self._routing = True
        link.deliver_to(self._route)  # a frame counts against the link until a channel's reader takes it

    def _route(self, frame: Frame | None) -> None:
        if not self._routing:  # sent away: the link is going down, and nothing more is read
            return
        if frame is None:
            self._stop()
            return
        channel = self._channels[traffic_of(frame)]
        if not channel._put(frame):
            why = f"{channel.held_bytes:,} bytes of {channel.traffic} traffic unread, past {channel.bound:,}"
            self._stop()
            self.link.send_away(LinkOverBound(why))

    def _stop(self) -> None:
        """Each channel's reader learns that nothing more comes, once it has read what came."""
        if self._routing:
            self._routing = False
            for channel in self._channels.values():
                channel._put(None)

    async def send_control(self, message: ControlMessage) -> None:
        await self.link.send(control_frame(message))

    async def next_control(self, timeout: float | None = None) -> ControlMessage:
        """The next control message; LinkError once the link is down, ControlError if malformed."""
        frame = await asyncio.wait_for(self.control.receive(), timeout)
        return parse_control(frame)

    async def close(self, reason: str = "goodbye") -> None:
        await self.link.close(reason)
        self._stop()
