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
import contextlib
from dataclasses import dataclass
from typing import Literal, Protocol

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


class FrameSink(Protocol):
    async def send(self, frame: Frame) -> None: ...
    def send_now(self, frame: Frame) -> None:
        """The same, from a plain callback on the loop: how the host's engine thread hands frames over."""
        ...


class LocalChannel:
    """Frames this process hands to itself: a host's engine feeding the host's own stage."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Frame] = asyncio.Queue()

    async def send(self, frame: Frame) -> None:
        self._queue.put_nowait(frame)

    def send_now(self, frame: Frame) -> None:
        self._queue.put_nowait(frame)

    async def receive(self) -> Frame:
        return await self._queue.get()

    def receive_nowait(self) -> Frame | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


class Channel:
    """One kind of a link's traffic, with the link's interface."""

    def __init__(self, link: Link, traffic: Traffic, bound: int | None = None) -> None:
        self.link, self.traffic, self.bound = link, traffic, bound
        self._queue: asyncio.Queue[Frame | None] = asyncio.Queue()
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

    def _taken(self, frame: Frame) -> Frame:
        self.held_bytes -= frame.wire_bytes
        self.link.release(frame)
        return frame

    def _put(self, frame: Frame | None) -> bool:
        """Hold a frame for the reader; False if that takes this channel past its bound."""
        if frame is not None:
            self.held_bytes += frame.wire_bytes
        self._queue.put_nowait(frame)
        return self.bound is None or self.held_bytes <= self.bound


class LinkRouter:
    def __init__(self, link: Link, peer_id: str, bounds: ChannelBounds | None = None) -> None:
        self.link, self.peer_id = link, peer_id
        bounds = bounds or ChannelBounds()
        link.release_on_receive = False  # a frame counts against the link until a channel's reader takes it
        self.control = Channel(link, "control", bounds.control)
        self.transfer = Channel(link, "transfer", bounds.transfer)
        self.activation = Channel(link, "activation")
        self._task = asyncio.create_task(self._route(), name=f"router-{peer_id}")

    async def _route(self) -> None:
        channels = {"control": self.control, "transfer": self.transfer, "activation": self.activation}
        try:
            async for frame in self.link.frames():
                channel = channels[traffic_of(frame)]
                if not channel._put(frame):
                    why = f"{channel.held_bytes:,} bytes of {channel.traffic} traffic unread, past {channel.bound:,}"
                    self.link.send_away(LinkOverBound(why))
                    return
        finally:
            for channel in (self.control, self.transfer, self.activation):
                channel._put(None)

    async def send_control(self, message: ControlMessage) -> None:
        await self.link.send(control_frame(message))

    async def next_control(self, timeout: float | None = None) -> ControlMessage:
        """The next control message; LinkError once the link is down, ControlError if malformed."""
        frame = await asyncio.wait_for(self.control.receive(), timeout)
        return parse_control(frame)

    async def close(self, reason: str = "goodbye") -> None:
        await self.link.close(reason)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
