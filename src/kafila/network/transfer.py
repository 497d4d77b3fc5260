"""Stage files from the host to a member over a link: offered, resumable, sha256-checked.

The protocol (docs/protocol.md, "Stage files") runs on one sequence id of the control range
(`frames.TRANSFER_SEQUENCE_IDS`, 2**63 and up), so it has one QUIC stream each way:

    sender                                        receiver
    offer {sha256, size, stage, name, chunk, window}  ->
                                              <-  request {have}
    FILE chunks, from byte `have` on               ->
                                              <-  ack {have}           (one per chunk written)
    end                                            ->
                                              <-  verdict {ok, reason}
    abort {reason}: either side, at any point, instead of its next message

`have` is what the receiver already holds: 0, the length of a partial file from an earlier
attempt (rounded down to a whole chunk), or the whole size when its cache holds a file with
that hash, in which case no chunk is sent. The sender keeps at most `window` bytes sent but
not acknowledged, so neither side ever holds more than a window of the file in memory.

Layers, sans-IO first:

- Messages (`Offer`, `Request`, `Ack`, `End`, `Verdict`, `Abort`) travel as JSON payloads of
  `Kind.PING` frames, chunks as `Kind.FILE` frames whose `position` is the chunk's index.
- `SenderCore` and `ReceiverCore` hold a transfer's state and judge every frame; they open no
  file and touch no socket (the receiver's core hashes the bytes it is given).
- `TransferChannel` picks a link's transfer frames out of its other traffic; `route()` is the
  loop that feeds it.
- `send_stage_file` and `receive_stage_file` are the asyncio shells: the file and the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import secrets
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kafila.contracts import CountProgress
from kafila.network.link import LinkError
from kafila.units import DISK_ROOM_HINT, human_bytes
from kafila.wire.frames import TRANSFER_SEQUENCE_IDS, DType, Frame, Kind

log = logging.getLogger("kafila.transfer")

VERSION = 1
CHUNK_SIZE = 1 << 20  # 1 MiB: the sender's default
WINDOW = 8 << 20  # bytes sent but not yet acknowledged, at most: the sender's default
MIN_CHUNK = 4 << 10
MAX_CHUNK = 16 << 20
MAX_WINDOW = 64 << 20  # a receiver refuses an offer that would let more than this be in flight
MAX_MESSAGE = 4096  # bytes of one JSON control message
MAX_CHUNKS = 1 << 32  # chunk indices are the frame's 32-bit `position`
STALL_TIMEOUT_S = 120.0  # nothing heard about a transfer in progress for this long: give up
SUFFIX = ".gguf"  # the slicer's naming: <sha256>.gguf
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class TransferError(Exception):
    """A stage file did not arrive (or was not delivered)."""


class TransferProtocolError(TransferError):
    """The peer broke the transfer protocol: a malformed message, or a chunk out of place."""


class TransferRejected(TransferError):
    """The peer refused or abandoned the transfer, and said why."""


class HashMismatch(TransferError):
    """The bytes received do not hash to the offered sha256; the partial file was discarded."""


def transfer_sequence(number: int) -> int:
    """The `number`th sequence id of the transfer range."""
    if not 0 <= number < len(TRANSFER_SEQUENCE_IDS):
        raise ValueError(f"transfer number {number} out of range")
    return TRANSFER_SEQUENCE_IDS[number]


def new_transfer_sequence() -> int:
    """A fresh sequence id for one transfer attempt, drawn at random from the transfer range.

    Each attempt gets its own, so frames still in flight from an abandoned attempt (chunks
    inside the window, a late ack) can never be taken for the next attempt's.
    """
    return transfer_sequence(secrets.randbelow(len(TRANSFER_SEQUENCE_IDS)))


def is_transfer_frame(frame: Frame) -> bool:
    """Whether a frame belongs to a stage-file transfer: its sequence id is in [2**63, 2**63 + 2**32)."""
    return frame.sequence_id in TRANSFER_SEQUENCE_IDS


def cached_path(cache_dir: Path, sha256: str) -> Path:
    """Where a verified stage file with this hash lives: named like the slicer names its files."""
    return Path(cache_dir) / f"{_check_sha(sha256)}{SUFFIX}"


def partial_path(cache_dir: Path, sha256: str) -> Path:
    return Path(cache_dir) / f"{_check_sha(sha256)}.partial"


def _check_sha(sha256: str) -> str:
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r:.80}")
    return sha256


# --- messages ---
@dataclass(frozen=True)
class Offer:
    sha256: str
    size: int
    stage: int
    name: str
    chunk: int = CHUNK_SIZE
    window: int = WINDOW

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk)


@dataclass(frozen=True)
class Request:
    have: int


@dataclass(frozen=True)
class Ack:
    have: int


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Abort:
    reason: str


Message = Offer | Request | Ack | End | Verdict | Abort


def message_frame(sequence_id: int, message: Message) -> Frame:
    """A control message as a PING frame with a JSON payload."""
    body: dict[str, Any]
    if isinstance(message, Offer):
        body = {"transfer": "offer", "version": VERSION, **message.__dict__}
    elif isinstance(message, Request):
        body = {"transfer": "request", "have": message.have}
    elif isinstance(message, Ack):
        body = {"transfer": "ack", "have": message.have}
    elif isinstance(message, End):
        body = {"transfer": "end"}
    elif isinstance(message, Verdict):
        body = {"transfer": "verdict", "ok": message.ok, "reason": message.reason}
    else:
        body = {"transfer": "abort", "reason": message.reason[:1000]}
    return Frame(Kind.PING, sequence_id, dtype=DType.NONE, payload=json.dumps(body).encode())


def chunk_frame(sequence_id: int, index: int, data: bytes) -> Frame:
    return Frame(Kind.FILE, sequence_id, index, dtype=DType.NONE, payload=data)


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise TransferProtocolError(f"{body.get('transfer')} message: {key!r} must be an integer in [{low}, {high}]")
    return value


def _str(body: dict[str, Any], key: str, limit: int) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise TransferProtocolError(f"{body.get('transfer')} message: {key!r} must be a string of at most {limit}")
    return value


def parse_message(frame: Frame) -> Message:
    """A control message from a PING frame; anything else there is a `TransferProtocolError`."""
    if frame.kind is not Kind.PING:
        raise TransferProtocolError(f"a {frame.kind.name} frame where a transfer message was expected")
    if len(frame.payload) > MAX_MESSAGE:
        raise TransferProtocolError(f"transfer message of {len(frame.payload)} bytes (at most {MAX_MESSAGE})")
    try:
        body = json.loads(frame.payload)
    except ValueError:
        raise TransferProtocolError(f"transfer message is not JSON: {frame.payload[:60]!r}") from None
    if not isinstance(body, dict) or not isinstance(body.get("transfer"), str):
        raise TransferProtocolError(f"transfer message is not an object with a 'transfer' type: {frame.text()[:60]!r}")
    what = body["transfer"]
    if what == "offer":
        if body.get("version") != VERSION:
            version = body.get("version")
            raise TransferProtocolError(f"offer of protocol version {version!r}; this side speaks {VERSION}")
        sha = body.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise TransferProtocolError(f"offer: 'sha256' must be 64 lowercase hex digits, not {sha!r:.80}")
        chunk = _int(body, "chunk", MIN_CHUNK, MAX_CHUNK)
        name = _str(body, "name", 200)
        if not name.isprintable():
            raise TransferProtocolError("offer: 'name' holds control characters")
        return Offer(
            sha,
            _int(body, "size", 0, MAX_CHUNKS * chunk),
            _int(body, "stage", 0, len(TRANSFER_SEQUENCE_IDS) - 1),
            name,
            chunk,
            _int(body, "window", chunk, MAX_WINDOW),
        )
    if what == "request":
        return Request(_int(body, "have", 0, 1 << 62))
    if what == "ack":
        return Ack(_int(body, "have", 0, 1 << 62))
    if what == "end":
        return End()
    if what == "verdict":
        if not isinstance(body.get("ok"), bool):
            raise TransferProtocolError("verdict message: 'ok' must be true or false")
        return Verdict(body["ok"], _str(body, "reason", 1000))
    if what == "abort":
        return Abort(_str(body, "reason", 1000))
    raise TransferProtocolError(f"unknown transfer message {what!r:.40}")


def _peer_error(frame: Frame) -> TransferRejected:
    return TransferRejected(f"the peer's link refused the transfer stream: {frame.text()[:300]}")


# --- sans-IO state machines ---
class SenderCore:
    """One outgoing transfer: which chunk to send next, and what the receiver's frames mean.

    The shell sends `offer_frame()`, then loops: send every chunk `next_chunk()` names (read
    from the file, wrapped by `chunk_frame()`), send `end_frame()` when it has one, stop when
    `done`, else feed the next frame from the receiver to `handle()`.
    """

    def __init__(self, sequence_id: int, offer: Offer) -> None:
        if sequence_id not in TRANSFER_SEQUENCE_IDS:
            raise ValueError(f"sequence {sequence_id} is not in the transfer range [2**63, 2**63 + 2**32)")
        if not MIN_CHUNK <= offer.chunk <= MAX_CHUNK or not offer.chunk <= offer.window <= MAX_WINDOW:
            raise ValueError(f"chunk {offer.chunk} / window {offer.window} out of range")
        self.sequence_id = sequence_id
        self.offer = offer
        self.state = "offered"  # -> sending -> ended -> done
        self.have = 0  # what the receiver held before this attempt
        self.next_offset = 0  # the first byte not yet sent
        self.acked = 0  # bytes the receiver has written
        self.sent = 0  # bytes sent in chunks during this attempt
        self._end_sent = False

    @property
    def done(self) -> bool:
        return self.state == "done"

    def offer_frame(self) -> Frame:
        return message_frame(self.sequence_id, self.offer)

    def next_chunk(self) -> tuple[int, int] | None:
        """(offset, length) of the chunk to send now, or None: all sent, or the window is full."""
        if self.state != "sending" or self.next_offset >= self.offer.size:
            return None
        length = min(self.offer.chunk, self.offer.size - self.next_offset)
        if self.next_offset + length - self.acked > self.offer.window:
            return None
        return self.next_offset, length

    def chunk_frame(self, offset: int, data: bytes) -> Frame:
        expected = self.next_chunk()
        if expected is None or (offset, len(data)) != expected:
            raise ValueError(f"chunk at {offset} of {len(data)} bytes; the next one to send is {expected}")
        self.next_offset += len(data)
        self.sent += len(data)
        return chunk_frame(self.sequence_id, offset // self.offer.chunk, data)

    def end_frame(self) -> Frame | None:
        """The end message, once, when every chunk has been sent."""
        if self.state != "sending" or self.next_offset < self.offer.size or self._end_sent:
            return None
        self._end_sent = True
        self.state = "ended"
        return message_frame(self.sequence_id, End())

    def abort_frame(self, reason: str) -> Frame:
        self.state = "done"
        return message_frame(self.sequence_id, Abort(reason))

    def handle(self, frame: Frame) -> None:
        """Take one frame from the receiver; raises what it says went wrong."""
        if frame.kind is Kind.ERROR:
            raise _peer_error(frame)
        message = parse_message(frame)
        size = self.offer.size
        if isinstance(message, Abort):
            raise TransferRejected(f"the receiver gave up: {message.reason}")
        if isinstance(message, Request) and self.state == "offered":
            if message.have > size or (message.have % self.offer.chunk and message.have != size):
                raise TransferProtocolError(
                    f"request from byte {message.have}: not a chunk boundary within the {size}-byte file"
                )
            self.have = self.acked = self.next_offset = message.have
            self.state = "sending"
        elif isinstance(message, Ack) and self.state in ("sending", "ended"):
            if not self.acked <= message.have <= self.next_offset:
                raise TransferProtocolError(
                    f"ack of {message.have} bytes; {self.acked} were acked before and {self.next_offset} sent"
                )
            self.acked = message.have
        elif isinstance(message, Verdict) and self.state == "ended":
            if not message.ok:
                raise TransferRejected(f"the receiver refused the file: {message.reason}")
            self.acked = size  # a receiver acks every chunk before its verdict, on the same stream
            self.state = "done"
        else:
            raise TransferProtocolError(f"a {type(message).__name__.lower()} message while {self.state}")


class ReceiverCore:
    """One incoming transfer: judges the offer, each chunk and the end; hashes what arrives.

    The shell feeds the first frame to `handle_offer()`, decides how much it holds, feeds those
    bytes to `absorb()`, sends `request_frame(have)`, then feeds every frame to `handle()`:
    chunk data comes back to be written (then send `ack_frame()`), and at the end a `Verdict`
    to send with `verdict_frame()`.
    """

    def __init__(self, sequence_id: int) -> None:
        self.sequence_id = sequence_id
        self.offer: Offer | None = None
        self.state = "new"  # -> offered -> receiving -> ended -> done (once the verdict or an abort is out)
        self.received = 0
        self._acked = 0
        self._cached = False
        self._hash = hashlib.sha256()

    def handle_offer(self, frame: Frame) -> Offer:
        if frame.kind is Kind.ERROR:
            raise _peer_error(frame)
        if frame.kind is Kind.FILE:
            raise TransferProtocolError(f"transfer {frame.sequence_id} began with a FILE chunk, not an offer")
        message = parse_message(frame)
        if isinstance(message, Abort):
            raise TransferRejected(f"the sender gave up: {message.reason}")
        if not isinstance(message, Offer):
            raise TransferProtocolError(f"transfer began with a {type(message).__name__.lower()} message, not an offer")
        self.offer = message
        self.state = "offered"
        return message

    def resumable(self, have: int) -> int:
        """How much of a partial file of `have` bytes can be kept: whole chunks only."""
        assert self.offer is not None
        if have >= self.offer.size:
            return self.offer.size if have == self.offer.size else 0
        return have - have % self.offer.chunk

    def absorb(self, data: bytes) -> None:
        """Bytes already held (a partial file's prefix), hashed before the request is sent."""
        self._hash.update(data)

    def request_frame(self, have: int, cached: bool = False) -> Frame:
        assert self.offer is not None and self.state == "offered"
        if have != self.resumable(have):
            raise ValueError(f"cannot resume from byte {have}")
        self.received = self._acked = have
        self._cached = cached
        self.state = "receiving"
        return message_frame(self.sequence_id, Request(have))

    def handle(self, frame: Frame) -> bytes | Verdict:
        """A chunk's bytes, to append to the file; or, at the end, the verdict on the whole file."""
        assert self.offer is not None
        if frame.kind is Kind.ERROR:
            raise _peer_error(frame)
        if self.state != "receiving":
            raise TransferProtocolError(f"a {frame.kind.name} frame after the transfer ended")
        if frame.kind is Kind.FILE:
            return self._chunk(frame)
        message = parse_message(frame)
        if isinstance(message, Abort):
            raise TransferRejected(f"the sender gave up: {message.reason}")
        if not isinstance(message, End):
            raise TransferProtocolError(f"a {type(message).__name__.lower()} message during the transfer")
        if self.received != self.offer.size:
            raise TransferProtocolError(f"end after {self.received} of the {self.offer.size} bytes offered")
        self.state = "ended"
        if self._cached:
            return Verdict(True, "already cached")
        digest = self._hash.hexdigest()
        if digest != self.offer.sha256:
            expected = self.offer.sha256
            return Verdict(False, f"sha256 of the {self.offer.size} bytes received is {digest}, not {expected}")
        return Verdict(True)

    def _chunk(self, frame: Frame) -> bytes:
        assert self.offer is not None
        chunk, size = self.offer.chunk, self.offer.size
        index, data = frame.position, frame.payload
        offset = index * chunk
        expected = self.received // chunk
        if offset >= size:
            raise TransferProtocolError(f"chunk {index} starts at byte {offset}, past the announced {size} bytes")
        if index < expected:
            raise TransferProtocolError(f"duplicate chunk {index}: chunks up to {expected - 1} have arrived")
        if index > expected:
            raise TransferProtocolError(f"out-of-order chunk {index}: chunk {expected} comes next")
        if len(data) > chunk:
            raise TransferProtocolError(f"oversized chunk {index}: {len(data)} bytes, chunks are {chunk}")
        if len(data) != min(chunk, size - offset):
            raise TransferProtocolError(
                f"chunk {index} holds {len(data)} bytes; it should hold {min(chunk, size - offset)}"
            )
        if offset + len(data) - self._acked > self.offer.window:
            raise TransferProtocolError(f"the sender overran its {self.offer.window}-byte window")
        self._hash.update(data)
        self.received += len(data)
        return data

    def ack_frame(self) -> Frame:
        self._acked = self.received
        return message_frame(self.sequence_id, Ack(self.received))

    def verdict_frame(self, verdict: Verdict) -> Frame:
        self.state = "done"
        return message_frame(self.sequence_id, verdict)

    def abort_frame(self, reason: str) -> Frame:
        self.state = "done"
        return message_frame(self.sequence_id, Abort(reason))


# --- picking transfer frames out of a link's traffic ---
class FrameLink(Protocol):
    """What a transfer needs of a link: a `Link`, or anything shaped like one (a router's channel
    that delivers only this link's transfer frames, say)."""

    async def send(self, frame: Frame) -> None: ...
    async def finish(self, sequence_id: int) -> None: ...
    async def receive(self) -> Frame: ...


class FrameSource(Protocol):
    async def accept(self, timeout: float | None = None, expected: int | None = None) -> int: ...
    def open(self, sequence_id: int) -> None: ...
    async def get(self, sequence_id: int, timeout: float) -> Frame: ...
    def release(self, sequence_id: int) -> None: ...


class TransferChannel:
    """The transfer frames of one link, sorted by sequence id, for transfers sharing the link.

    A link delivers all its frames through one `receive()`. When it carries anything besides
    stage files (activations, control), one reader dispatches them: frames whose sequence id
    is in the control range go to `feed()`, the rest wherever they belong, and the link's end
    goes to `close()`. `route(link, channel, other)` is that reader. Pass the channel to
    `send_stage_file` / `receive_stage_file` as `channel=`; any number of transfers (on
    distinct sequence ids) can then run at once beside the link's other traffic.

    A sender opens its sequence before offering; a frame on any other unknown sequence starts
    an incoming transfer that `accept()` hands to a receiver. Frames of a finished transfer's
    sequence that arrive late are dropped, until an offer starts a new transfer there.
    """

    def __init__(self) -> None:
        self._queues: dict[int, asyncio.Queue[Frame | None]] = {}
        self._incoming: asyncio.Queue[int | None] = asyncio.Queue()
        self._finished: set[int] = set()
        self.error: BaseException | None = None
        self.dropped = 0

    def feed(self, frame: Frame) -> bool:
        """Take a frame if it belongs to a transfer (True), else leave it to the caller (False)."""
        if not is_transfer_frame(frame):
            return False
        queue = self._queues.get(frame.sequence_id)
        if queue is None:
            if frame.sequence_id in self._finished and not _is_offer(frame):
                self.dropped += 1
                log.debug("dropped a late %s frame of finished transfer %d", frame.kind.name, frame.sequence_id)
                return True
            self._finished.discard(frame.sequence_id)
            queue = self._queues[frame.sequence_id] = asyncio.Queue()
            self._incoming.put_nowait(frame.sequence_id)
        queue.put_nowait(frame)
        return True

    def close(self, error: BaseException) -> None:
        """The link is down: every waiting transfer raises `error`."""
        if self.error is None:
            self.error = error
            self._incoming.put_nowait(None)
            for queue in self._queues.values():
                queue.put_nowait(None)

    async def accept(self, timeout: float | None = None, expected: int | None = None) -> int:
        """The sequence id of the next incoming transfer; given `expected`, of that one, the
        transfers offered before it passed over (`receive_stage_file`)."""
        async with asyncio.timeout(timeout):
            while True:
                sequence_id = await self._incoming.get()
                if sequence_id is None:
                    self._incoming.put_nowait(None)
                    assert self.error is not None
                    raise self.error
                if expected is None or sequence_id == expected:
                    return sequence_id
                log.debug("passed over transfer %d, offered before the expected %d", sequence_id, expected)
                self.release(sequence_id)

    def open(self, sequence_id: int) -> None:
        if sequence_id in self._queues:
            raise TransferError(f"a transfer on sequence {sequence_id} is already under way on this link")
        self._finished.discard(sequence_id)
        self._queues[sequence_id] = asyncio.Queue()
        if self.error is not None:
            self._queues[sequence_id].put_nowait(None)

    async def get(self, sequence_id: int, timeout: float) -> Frame:
        queue = self._queues[sequence_id]
        try:
            frame = await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            raise TransferError(f"nothing heard about transfer {sequence_id} for {timeout:.0f} s") from None
        if frame is None:
            queue.put_nowait(None)
            assert self.error is not None
            raise self.error
        return frame

    def release(self, sequence_id: int) -> None:
        if self._queues.pop(sequence_id, None) is not None:
            self._finished.add(sequence_id)


def _is_offer(frame: Frame) -> bool:
    try:
        return isinstance(parse_message(frame), Offer)
    except TransferProtocolError:
        return False


async def route(link: FrameLink, channel: TransferChannel, other: Callable[[Frame], Any]) -> None:
    """Read every frame `link` receives until it goes down: transfer frames to `channel`, the
    rest to `other` (awaited if it returns an awaitable); then close the channel with the
    link's error, so that transfers waiting on it raise it."""
    try:
        while True:
            frame = await link.receive()
            if not channel.feed(frame):
                result = other(frame)
                if inspect.isawaitable(result):
                    await result
    except LinkError as error:
        channel.close(error)
    except BaseException as error:
        channel.close(TransferError(f"the link's frame router stopped: {error!r}"))
        raise


_finished_on: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_next_offer_on: weakref.WeakKeyDictionary[Any, Frame] = weakref.WeakKeyDictionary()


class _LinkSource:
    """A link that carries nothing but one transfer at a time: its frames, read directly.

    Like a `TransferChannel`, it drops late frames of the link's finished transfers. Each
    transfer rides its own stream, so a sender that gives one up and offers the next can have its
    new offer arrive before its abort: that offer ends the transfer under way and waits for the
    link's next `accept`, where reading it as a stray frame lost it and left the sender waiting.
    """

    def __init__(self, link: FrameLink) -> None:
        self.link = link
        self._first: Frame | None = None
        self._finished = _finished_on.setdefault(link, set())

    async def _next(self, sequence_id: int | None, timeout: float | None) -> Frame:
        if sequence_id is None and (offer := _next_offer_on.pop(self.link, None)) is not None:
            return offer
        while True:
            frame = await asyncio.wait_for(self.link.receive(), timeout)
            late = frame.sequence_id != sequence_id and frame.sequence_id in self._finished
            if is_transfer_frame(frame) and late and (sequence_id is not None or not _is_offer(frame)):
                log.debug("dropped a late %s frame of finished transfer %d", frame.kind.name, frame.sequence_id)
                continue
            other = sequence_id is not None and frame.sequence_id != sequence_id
            if is_transfer_frame(frame) and other and _is_offer(frame):
                _next_offer_on[self.link] = frame
                raise TransferRejected(f"the sender gave up: it offered another file (transfer {frame.sequence_id})")
            if not is_transfer_frame(frame) or other:
                raise TransferError(
                    f"a {frame.kind.name} frame of sequence {frame.sequence_id} arrived during a stage-file "
                    "transfer; a link that carries other frames needs a TransferChannel fed by its reader (route())"
                )
            return frame

    async def accept(self, timeout: float | None = None, expected: int | None = None) -> int:
        async with asyncio.timeout(timeout):
            while True:
                first = await self._next(None, None)
                if expected is None or first.sequence_id == expected:
                    break
                log.debug("passed over transfer %d, offered before the expected %d", first.sequence_id, expected)
                self._finished.add(first.sequence_id)  # its later frames are dropped as late
        self._first = first
        self._finished.discard(first.sequence_id)
        return first.sequence_id

    def open(self, sequence_id: int) -> None:
        self._finished.discard(sequence_id)

    async def get(self, sequence_id: int, timeout: float) -> Frame:
        if self._first is not None:
            frame, self._first = self._first, None
            return frame
        try:
            return await self._next(sequence_id, timeout)
        except TimeoutError:
            raise TransferError(f"nothing heard about transfer {sequence_id} for {timeout:.0f} s") from None

    def release(self, sequence_id: int) -> None:
        self._finished.add(sequence_id)


def _reason(side: str, error: BaseException) -> str:
    if isinstance(error, TransferError):
        return str(error)[:500]
    if isinstance(error, asyncio.CancelledError):
        return f"{side} was stopped"
    return f"{side} failed: {error!r}"[:500]


async def _say(link: FrameLink, frame: Frame) -> None:
    """Best effort: the link may already be down, and then the peer knows anyway."""
    with contextlib.suppress(LinkError):
        await link.send(frame)


async def _finish(link: FrameLink, sequence_id: int) -> None:
    with contextlib.suppress(LinkError):
        await link.finish(sequence_id)


# --- the asyncio shells ---
async def send_stage_file(
    link: FrameLink,
    path: Path,
    sha256: str,
    stage_index: int,
    progress: CountProgress | None = None,
    *,
    channel: TransferChannel | None = None,
    sequence_id: int | None = None,
    chunk_size: int = CHUNK_SIZE,
    window: int = WINDOW,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> int:
    """Offer the stage file at `path` (whose hash the caller knows, from the slicer) and stream
    what the receiver lacks; return the bytes of file data actually sent (0 if it had the file).

    Raises `TransferRejected` if the receiver refuses the file (its hash did not match, or it
    gave up), `TransferProtocolError` if it breaks the protocol, the link's `LinkError` if the
    link goes down (the receiver keeps what it wrote, and a later call resumes from there).
    `progress(done, total)` is called with the bytes the receiver holds, up to the total.
    Without `channel`, `link` must deliver nothing but this transfer's frames while it runs: a
    `Link` that carries nothing else, or a link-shaped object (`FrameLink`) that delivers only
    the link's transfer frames, one transfer at a time.
    """
    path = Path(path)
    size = path.stat().st_size
    sequence_id = new_transfer_sequence() if sequence_id is None else sequence_id
    name = "".join(c if c.isprintable() else "?" for c in path.name)[:200]
    offer = Offer(_check_sha(sha256.lower()), size, stage_index, name, chunk_size, window)
    core = SenderCore(sequence_id, offer)
    source: FrameSource = channel if channel is not None else _LinkSource(link)
    source.open(sequence_id)
    reported = -1
    try:
        with path.open("rb") as stream:
            await link.send(core.offer_frame())
            while True:
                while (span := core.next_chunk()) is not None:
                    offset, length = span
                    stream.seek(offset)
                    data = stream.read(length)
                    if len(data) != length:
                        raise TransferError(f"{path} is shorter than the {size} bytes offered")
                    await link.send(core.chunk_frame(offset, data))
                if (end := core.end_frame()) is not None:
                    await link.send(end)
                core.handle(await source.get(sequence_id, stall_timeout_s))
                if progress is not None and core.acked != reported and core.state != "offered":
                    reported = core.acked
                    progress(core.acked, size)
                if core.done:
                    break
        if progress is not None and reported != size:
            progress(size, size)
        return core.sent
    except (TransferRejected, LinkError):  # the receiver said why, or the link is gone
        raise
    except BaseException as error:  # a protocol error, a stall, a file that would not read, a cancel
        if not core.done:
            await _say(link, core.abort_frame(_reason("the sender", error)))
        raise
    finally:
        source.release(sequence_id)
        await _finish(link, sequence_id)


_receiving: set[Path] = set()  # partial files being written in this process


async def receive_stage_file(
    link: FrameLink,
    cache_dir: Path,
    progress: CountProgress | None = None,
    *,
    channel: TransferChannel | None = None,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    accept_timeout_s: float | None = None,
    sequence_id: int | None = None,
) -> Path:
    """Wait for the peer's offer of a stage file and return the verified file in `cache_dir`,
    named `<sha256>.gguf` like the slicer names its files.

    `sequence_id`: the transfer the sender said it would offer (`Assign.transfer`); offers before
    it are of transfers it stopped before this side read them (a member that failed its part
    first), and are passed over, with their aborts, rather than taken and lost to the abort.

    A file with that name and the offered size already there means nothing is sent: pass the
    slicer's output directory, so a member that sliced its own copy of the model receives
    nothing. Otherwise the bytes go to `<sha256>.partial`, which is renamed only once the whole
    file hashes to the offered sha256. A partial file left by an interrupted attempt is kept and
    the next offer of the same hash resumes from its length; one that fails the hash check is
    discarded (`HashMismatch`). `progress(done, total)` is called as bytes arrive, up to the
    total. Without `channel`, `link` must deliver nothing but this transfer's frames while it
    runs (see `send_stage_file`).
    """
    cache_dir = Path(cache_dir)
    source: FrameSource = channel if channel is not None else _LinkSource(link)
    try:
        sequence_id = await source.accept(accept_timeout_s, sequence_id)
    except TimeoutError:
        raise TransferError(f"no stage file was offered within {accept_timeout_s} s") from None
    core = ReceiverCore(sequence_id)
    try:
        offer = core.handle_offer(await source.get(sequence_id, stall_timeout_s))
        final, partial = cached_path(cache_dir, offer.sha256), partial_path(cache_dir, offer.sha256)
        if partial in _receiving:
            raise TransferError(f"already receiving {final.name} on another link")
        _receiving.add(partial)
        try:
            return await _receive(link, source, core, offer, final, partial, progress, stall_timeout_s)
        finally:
            _receiving.discard(partial)
    except (TransferRejected, LinkError):  # the sender said why, or the link is gone
        raise
    except BaseException as error:  # a protocol error, a bad hash, a stall, a full disk, a cancel
        if core.state != "done":
            await _say(link, core.abort_frame(_reason("the receiver", error)))
        raise
    finally:
        source.release(sequence_id)
        await _finish(link, sequence_id)


async def _receive(
    link: FrameLink,
    source: FrameSource,
    core: ReceiverCore,
    offer: Offer,
    final: Path,
    partial: Path,
    progress: CountProgress | None,
    stall_timeout_s: float,
) -> Path:
    sequence_id, size = core.sequence_id, offer.size
    if final.is_file() and final.stat().st_size == size:
        await link.send(core.request_frame(size, cached=True))
        return await _finish_cached(link, source, core, final, progress, stall_timeout_s)
    final.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.is_file() else 0
    have = core.resumable(have)
    free = shutil.disk_usage(final.parent).free
    if size - have > free:
        raise TransferError(
            f"not enough disk space for {final.name} in {final.parent}: {human_bytes(size - have)} needed, "
            f"{human_bytes(free)} free; {DISK_ROOM_HINT}"
        )
    stream = partial.open("r+b" if partial.exists() else "w+b")
    discard = False
    try:
        stream.truncate(have)
        if have:
            await asyncio.to_thread(_absorb_prefix, stream, have, core)
        stream.seek(have)
        await link.send(core.request_frame(have))
        if progress is not None:
            progress(have, size)
        while True:
            result = core.handle(await source.get(sequence_id, stall_timeout_s))
            if isinstance(result, Verdict):
                break
            stream.write(result)
            await link.send(core.ack_frame())
            if progress is not None:
                progress(core.received, size)
        if not result.ok:
            discard = True
            await _say(link, core.verdict_frame(result))
            raise HashMismatch(f"{final.name}: {result.reason}; the partial file was discarded")
        stream.flush()
        await asyncio.to_thread(os.fsync, stream.fileno())
        stream.close()
        os.replace(partial, final)
        await link.send(core.verdict_frame(result))
        return final
    finally:
        stream.close()
        if discard:
            partial.unlink(missing_ok=True)


async def _finish_cached(
    link: FrameLink,
    source: FrameSource,
    core: ReceiverCore,
    final: Path,
    progress: CountProgress | None,
    stall_timeout_s: float,
) -> Path:
    result = core.handle(await source.get(core.sequence_id, stall_timeout_s))
    if not isinstance(result, Verdict):  # the core refuses chunks once it holds the whole file
        raise AssertionError("a chunk for a cached file")
    await link.send(core.verdict_frame(result))
    if progress is not None:
        progress(core.received, core.received)
    return final


def _absorb_prefix(stream: Any, have: int, core: ReceiverCore) -> None:
    """Hash the first `have` bytes of a partial file (in a worker thread: it can be gigabytes)."""
    stream.seek(0)
    left = have
    while left:
        data = stream.read(min(left, 4 << 20))
        if not data:
            raise TransferError("the partial file shrank while it was being read")
        core.absorb(data)
        left -= len(data)
