"""Fuzzing every network surface over real loopback sockets, with seeded inputs and bounded counts.

The surfaces: a live QUIC link's UDP socket, the streams of an established link, the STUN
server, and the rendezvous (WebSocket signalling, its HTTP port and a relay port). Each test
checks more than "nothing raised":

- every bad input earned the refusal its protocol defines: an ERROR frame on the offending
  stream, an `error` message on the WebSocket, or, where answering garbage would only feed
  reflection attacks (UDP: QUIC, STUN, relay), a silent drop the test can count;
- the surface serves a correct request afterwards (a frame round trip, a STUN answer, a session
  that becomes ready, a relayed datagram);
- no exception escaped into the event loop: asyncio only logs an exception raised by a protocol
  callback, so each test installs a handler that collects them and fails on any.

Inputs come from `random.Random(SEED + n)`, so a failure replays exactly; change SEED locally to
explore further. All waits are bounded: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import websockets
from aioice import stun
from test_link import FAST, WAIT, bound_socket, exchange, pair, run, shut
from test_relay import UdpPeer
from test_rendezvous import FP, capability, join_message, open_message
from waiting import until_async

from kafila.network.identity import create_identity
from kafila.network.limits import RateByAddress
from kafila.network.link import DatagramDemux, Link, Rejected, open_link, should_dial
from kafila.network.relay import HELLO, HELLO_ACK, hello, parse_ack
from kafila.network.rendezvous import CLOSE_POLICY
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous
from kafila.network.stun import MAX_DATAGRAM, StunServer
from kafila.wire.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_HIDDEN,
    MAX_PAYLOAD,
    MAX_TOKENS,
    VERSION,
    DType,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
)

SEED = 5  # the number; any other replays as well
CASE_WAIT = 5.0  # the bound on one fuzz case's answer

Address = tuple[str, int]


def watch_loop() -> list[dict[str, Any]]:
    """Collect what asyncio would only log: exceptions raised by protocol callbacks and tasks."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    return errors


def counting_tap(counts: dict[Any, int], key: Any) -> Callable[[str, bytes, Address], None]:
    """A demux tap that counts the datagrams coming in."""

    def tap(way: str, data: bytes, address: Address) -> None:
        counts[key] += int(way == "in")

    return tap


async def assert_silent(sock: socket.socket, wait: float = 0.2) -> None:
    await asyncio.sleep(wait)
    with pytest.raises(BlockingIOError):
        sock.recvfrom(65536)


async def count_reaches(counter: Callable[[], int], target: int, what: str, at_least: bool = False) -> None:
    """Poll a counter the code under test keeps until it equals (or reaches) `target`; fail, never hang."""
    reached = (lambda: counter() >= target) if at_least else (lambda: counter() == target)
    await until_async(reached, lambda: f"{what} ({counter()} of {target})", CASE_WAIT, 0.002)


# -- datagrams at a live link --------------------------------------------------------------------


def quic_garbage(rng: random.Random, corpus: list[bytes]) -> bytes:
    """QUIC-range datagrams: random, and real packets truncated, bit-flipped, replayed or re-typed."""
    real = bytearray(rng.choice(corpus))
    what = rng.randrange(6)
    if what == 0:
        return bytes([rng.randrange(64, 256)]) + rng.randbytes(rng.randrange(0, 1400))
    if what == 1:
        return bytes(real[: rng.randrange(1, len(real))])
    if what == 2:
        for _ in range(rng.randint(1, 8)):
            real[rng.randrange(len(real))] ^= 1 << rng.randrange(8)
        real[0] |= 0x40  # keep it in QUIC's range, so it reaches the connection
        return bytes(real)
    if what == 3:
        return bytes(real)  # a replay: decrypts, but is a duplicate
    if what == 4:
        real[0] = rng.choice([0x40, 0x5F, 0x80 | 0x40, 0xC0, 0xD0, 0xE0, 0xF0, 0xFF])  # another packet type
        if real[0] & 0x80 and len(real) >= 5 and rng.random() < 0.5:
            real[1:5] = rng.choice([b"\x00\x00\x00\x00", b"\xff\x00\x00\x1d", rng.randbytes(4)])  # odd versions
        return bytes(real)
    return bytes(real) + rng.randbytes(rng.randrange(1, 200))  # a real packet with junk coalesced after it


def stranger_garbage(rng: random.Random, corpus: list[bytes]) -> bytes:
    """Anything, of every first-byte range, from an address no link or handler is registered for."""
    what = rng.randrange(7)
    if what == 0:
        return b""
    if what == 1:  # STUN-looking: a real binding request, or random bytes behind a STUN first byte
        if rng.random() < 0.5:
            return bytes(stun.Message(stun.Method.BINDING, stun.Class.REQUEST, transaction_id=rng.randbytes(12)))
        return bytes([rng.randrange(0, 4)]) + rng.randbytes(rng.randrange(0, 200))
    if what == 2:  # relay-looking: binding, ack and punch shapes
        return rng.choice(
            [
                hello(rng.randbytes(16)),
                bytes([HELLO_ACK, rng.randrange(0, 3)]),
                bytes([rng.randrange(0x10, 0x13)]) + rng.randbytes(rng.randrange(0, 60)),
            ]
        )
    if what == 3:  # no protocol's range
        return bytes([rng.choice([*range(4, 0x10), *range(0x13, 64)])]) + rng.randbytes(rng.randrange(0, 100))
    return quic_garbage(rng, corpus)  # QUIC from an address that has no link


def test_garbage_datagrams_at_a_live_link_are_dropped_and_the_link_goes_on() -> None:
    """From the peer's own address, garbage reaches QUIC itself; from a stranger, the demux."""

    async def go() -> None:
        errors = watch_loop()
        corpus: list[bytes] = []
        a, b, link_a, link_b = await pair(tap=lambda _, data, __: corpus.append(data))
        assert isinstance(link_a, Link) and isinstance(link_b, Link)
        await exchange(link_a, link_b, 20, DType.F16)  # real packets of every kind, both ways, to mutate
        corpus = list(corpus)
        heard = {a: 0, b: 0}
        a.tap, b.tap = counting_tap(heard, a), counting_tap(heard, b)
        rng = random.Random(SEED)
        for _ in range(40):  # 1,280 datagrams, each side hit from the other's address
            before = dict(heard)
            for _ in range(16):
                b.sendto(quic_garbage(rng, corpus), a.local_address)
                a.sendto(quic_garbage(rng, corpus), b.local_address)
            await count_reaches(lambda: heard[a], before[a] + 16, "garbage delivered to a", at_least=True)
            await count_reaches(lambda: heard[b], before[b] + 16, "garbage delivered to b", at_least=True)
        assert not link_a.closed.done() and not link_b.closed.done()
        assert not link_a.rejected and not link_b.rejected  # QUIC discards it all: no stream saw a byte
        assert link_a._queue.empty() and link_b._queue.empty()

        stranger = bound_socket()  # a plain socket: asyncio's transports never send an empty datagram
        for window in range(50):  # 800 datagrams of every range from an unknown address: each is dropped
            dropped = a.dropped
            for _ in range(16):
                stranger.sendto(stranger_garbage(rng, corpus), a.local_address)
            await count_reaches(lambda: a.dropped, dropped + 16, f"window {window}: every datagram counted as dropped")
        await assert_silent(stranger)  # no answer to any of it: no reflection
        stranger.close()

        await exchange(link_a, link_b, 100, DType.F32)  # the link still carries frames, both ways
        assert not link_a.closed.done() and not link_b.closed.done()
        assert not link_a.rejected and not link_b.rejected
        await shut(link_a, link_b, a, b)
        assert errors == []

    run(go)


def initial_shaped(rng: random.Random) -> bytes:
    """A datagram that parses as a client's first Initial (long header, 1200 bytes and more) but is not one."""
    version = rng.choice([0x00000001, 0x6B3343CF, 0xFF00001D, 0x1A2A3A4A, rng.randrange(2**32)])
    dcid, scid = rng.randbytes(rng.choice([0, 8, 20])), rng.randbytes(rng.choice([0, 8]))
    head = bytes([0xC0 | rng.randrange(4)]) + struct.pack("!I", version) + bytes([len(dcid)]) + dcid
    return head + bytes([len(scid)]) + scid + rng.randbytes(rng.randint(1200, 1400))


def test_garbage_before_the_handshake_does_not_stop_the_link_coming_up() -> None:
    """The listener takes the first Initial from the dialler's address; garbage shaped like one came first."""

    async def go() -> None:
        errors = watch_loop()
        ids = create_identity(), create_identity()
        dialler_id, listener_id = ids if should_dial(ids[0].fingerprint, ids[1].fingerprint) else ids[::-1]
        heard = {"listener": 0}
        listener = await DatagramDemux.over(bound_socket(), counting_tap(heard, "listener"))
        dialler = await DatagramDemux.over(bound_socket())
        opening = asyncio.ensure_future(
            open_link(listener, dialler.local_address, listener_id, dialler_id.fingerprint, False, FAST)
        )
        rng = random.Random(SEED + 4)
        sent = 0
        for _ in range(4):  # from the dialler's own socket, as a spoofer or a stale mapping would send
            for _ in range(16):
                dialler.sendto(
                    rng.choice([initial_shaped(rng), quic_garbage(rng, [initial_shaped(rng)])]), listener.local_address
                )
            sent += 16
            await count_reaches(lambda: heard["listener"], sent, "garbage delivered")
        assert not opening.done()
        link_d = await open_link(dialler, listener.local_address, dialler_id, listener_id.fingerprint, True, FAST)
        link_l = await asyncio.wait_for(opening, WAIT)
        await exchange(link_d, link_l, 50, DType.F32)
        await shut(link_d, link_l, dialler, listener)
        assert errors == []

    run(go)


# -- malformed frames on the streams of a live link ----------------------------------------------


UNKNOWN_KINDS = [k for k in range(256) if k not in set(Kind)]
UNKNOWN_DTYPES = [d for d in range(256) if d not in set(DType)]


def header(
    kind: int = Kind.DECODE,
    dtype: int = DType.F32,
    seq: int = 5,
    pos: int = 0,
    n: int = 1,
    hidden: int = 8,
    length: int | None = None,
    magic: bytes = MAGIC,
    version: int = VERSION,
) -> bytes:
    if length is None:
        length = n * hidden * (4 if dtype == DType.F32 else 2)
    return HEADER.pack(magic, version, kind, dtype, 0, 0, seq, pos, n, hidden, length)


def good_frame(rng: random.Random, seq: int, pos: int = 0) -> Frame:
    kind = rng.choice([Kind.PREFILL, Kind.DECODE, Kind.RESULT, Kind.PING, Kind.ERROR])
    if kind in (Kind.PREFILL, Kind.DECODE):
        states = np.asarray(rng.choices(range(-9, 9), k=8 * 3), dtype=np.float32).reshape(3, 8)
        return Frame.of_hidden(kind, seq, pos, states, rng.choice([DType.F32, DType.F16]))
    if kind is Kind.RESULT:
        return Frame.of_tokens(seq, pos, [rng.randrange(1000) for _ in range(rng.randint(0, 5))])
    return Frame(kind, seq, payload=rng.randbytes(rng.randint(0, 40)))


@dataclass
class StreamCase:
    """Bytes for one new stream, whether to end it, why the receiver refuses it, what it delivers first."""

    label: str
    data: bytes
    end: bool
    why: str
    delivered: list[Frame] = field(default_factory=list)


def stream_case(rng: random.Random) -> StreamCase:
    seq = rng.randrange(1, 2**64)
    what = rng.randrange(10)
    if what == 0:
        data = rng.randbytes(rng.randint(1, 300))
        if data[:2] == MAGIC:
            data = b"XX" + data[2:]
        if len(data) < HEADER_SIZE:  # not even a header: only the stream's end shows it is short
            return StreamCase("random, short", data, True, "stream ended inside a frame")
        return StreamCase("random", data, rng.random() < 0.5, "bad magic")
    if what == 1:
        frames = [good_frame(rng, seq, pos) for pos in range(rng.randint(0, 2))]
        last = good_frame(rng, seq, len(frames)).encode()
        data = b"".join(f.encode() for f in frames) + last[: rng.randrange(1, len(last))]
        return StreamCase("truncated", data, True, "stream ended inside a frame", frames)
    if what == 2:
        length = rng.randrange(MAX_PAYLOAD + 1, 2**32)
        data = header(kind=Kind.PING, dtype=DType.NONE, seq=seq, n=0, hidden=0, length=length)
        return StreamCase(
            "oversized payload", data + rng.randbytes(rng.randrange(0, 100)), rng.random() < 0.5, "exceeds"
        )
    if what == 3:
        n, hidden = rng.choice([(MAX_TOKENS + rng.randrange(1, 2**20), 8), (1, MAX_HIDDEN + rng.randrange(1, 2**20))])
        data = header(seq=seq, n=n, hidden=hidden, length=rng.randrange(0, 4096))
        return StreamCase("oversized tensor", data, rng.random() < 0.5, "exceeds the limits")
    if what == 4:
        n, hidden, dtype = rng.randint(1, 8), rng.randint(1, 4096), rng.choice([DType.F32, DType.F16])
        right = n * hidden * (4 if dtype is DType.F32 else 2)
        length = rng.choice([right + rng.choice([-2, -1, 1, 2, 4]), n * (hidden + 1) * 4, 0])
        data = header(rng.choice([Kind.PREFILL, Kind.DECODE]), dtype, seq, 0, n, hidden, max(0, length))
        return StreamCase("wrong hidden size", data, rng.random() < 0.5, "does not hold")
    if what == 5:
        bad = rng.choice(["none", "i32", "unknown", "tokens"])
        if bad == "unknown":
            data = header(dtype=rng.choice(UNKNOWN_DTYPES), seq=seq, length=32)
            return StreamCase("unknown dtype", data, False, "is not a valid DType")
        if bad == "tokens":
            data = header(Kind.RESULT, DType.I32, seq, 0, 3, 0, rng.choice([0, 4, 8, 13, 16]))
            return StreamCase("token ids of the wrong length", data, False, "3 token ids")
        dtype = DType.NONE if bad == "none" else DType.I32
        data = header(rng.choice([Kind.PREFILL, Kind.DECODE]), dtype, seq, 0, 1, 8, 32)
        return StreamCase("hidden states of a wrong dtype", data, False, "f32 or f16")
    if what == 6:
        data = header(kind=rng.choice(UNKNOWN_KINDS), seq=seq)
        return StreamCase("unknown kind", data, False, "is not a valid Kind")
    if what == 7:
        data = header(seq=seq, version=rng.choice([0, *range(2, 256)]))
        return StreamCase("wrong version", data, False, "this peer speaks version 1")
    if what == 8:  # one stream per sequence: a frame of another sequence is out of order here
        first = good_frame(rng, seq)
        intruder = good_frame(rng, seq ^ rng.randrange(1, 2**32), 1)
        data = first.encode() + intruder.encode()
        return StreamCase("another sequence's frame", data, rng.random() < 0.5, "frame of sequence", [first])
    while True:  # a valid frame with its header damaged, kept if the decoder refuses it
        raw = bytearray(good_frame(rng, seq).encode())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(HEADER_SIZE)] = rng.randrange(256)
        try:
            FrameDecoder().feed(bytes(raw))
        except FrameError as error:
            return StreamCase("damaged header", bytes(raw), rng.random() < 0.5, str(error))


def test_each_malformed_stream_gets_an_error_frame_and_the_link_goes_on() -> None:
    """More bad streams than QUIC's 128-stream limit, each way: a rejected stream must free its slot."""

    async def go() -> None:
        errors = watch_loop()
        a, b, link_a, link_b = await pair()
        assert isinstance(link_a, Link) and isinstance(link_b, Link)
        rng = random.Random(SEED + 1)
        steady = 424242  # a sequence whose stream stays open through all of it
        position = 0
        labels: set[str] = set()
        for i in range(600):
            case = stream_case(rng)
            labels.add(case.label)
            sender, receiver = (link_a, link_b) if i % 2 == 0 else (link_b, link_a)
            stream = await sender.send_raw(case.data, end=case.end)
            for frame in case.delivered:  # what came before the fault is delivered, in order
                assert await asyncio.wait_for(receiver.receive(), CASE_WAIT) == frame, case.label
            error = await asyncio.wait_for(sender.receive(), CASE_WAIT)
            assert error.kind is Kind.ERROR and case.why in error.text(), (case.label, error.text())
            assert receiver.rejected[-1] == Rejected(stream, error.text()), case.label
            if i % 25 == 0:  # a healthy stream, open from the start, carries on through all of it
                frame = good_frame(rng, steady, position)
                position += 1
                await link_a.send(frame)
                assert await asyncio.wait_for(link_b.receive(), CASE_WAIT) == frame
        assert link_a.rejections == link_b.rejections == 300
        assert len(labels) >= 10  # every kind of fault was tried
        await exchange(link_a, link_b, 100, DType.F16)  # and new sequences, both ways
        assert not link_a.closed.done() and not link_b.closed.done()
        assert link_a._queue.empty() and link_b._queue.empty()  # no stray frames delivered
        await shut(link_a, link_b, a, b)
        assert errors == []

    run(go)


def bad_reply(rng: random.Random, sequence: int) -> tuple[bytes, bool, str] | None:
    """What a peer must not write on the reply side of our stream (bytes, end it?, why), or None: reset it."""
    what = rng.randrange(5)
    if what == 0:
        data = rng.randbytes(rng.randint(HEADER_SIZE, 200))
        return (b"XX" + data[2:] if data[:2] == MAGIC else data), False, "bad magic"
    if what == 1:
        frame = good_frame(rng, sequence)
        return (
            (frame if frame.kind is not Kind.ERROR else Frame(Kind.CANCEL, sequence)).encode(),
            False,
            "only an ERROR",
        )
    if what == 2:
        error = Frame(Kind.ERROR, sequence, payload=b"no").encode()
        return error[: rng.randrange(1, len(error))], True, "stream ended inside a frame"
    if what == 3:
        return header(kind=rng.choice(UNKNOWN_KINDS), seq=sequence), False, "is not a valid Kind"
    return None


def test_garbage_on_the_reply_side_of_a_stream_is_refused_and_the_stream_goes_on() -> None:
    """A stream's reverse half carries only the receiver's ERROR replies; a peer that writes anything else
    there (as a buggy or hostile peer could) is stopped on that half, and the sequence's frames still flow."""

    async def go() -> None:
        errors = watch_loop()
        a, b, link_a, link_b = await pair()
        assert isinstance(link_a, Link) and isinstance(link_b, Link)
        rng = random.Random(SEED + 5)
        refused = 0
        for sequence in range(1, 201):  # more than QUIC's 128 streams: each one must be freed
            opening = good_frame(rng, sequence)
            await link_a.send(opening)
            assert await asyncio.wait_for(link_b.receive(), CASE_WAIT) == opening
            stream = link_a.core._outbound[sequence]
            quic = link_b.core.quic
            assert quic is not None  # the peer misbehaves: it writes on a's stream itself
            reply = bad_reply(rng, sequence)
            if reply is None:  # or abandons that half outright: no fault, but a's next frame needs a new stream
                quic.reset_stream(stream, 0x99)
                link_b._transmit()
                await count_reaches(lambda: len(link_a.core._outbound), 0, f"sequence {sequence}: the reset seen")
                assert link_a.rejections == refused
            else:
                data, end, why = reply
                quic.send_stream_data(stream, data, end_stream=end)
                link_b._transmit()
                await count_reaches(lambda: link_a.rejections, refused + 1, f"sequence {sequence}: the reply refused")
                assert link_a.rejected[-1].stream_id == stream and why in link_a.rejected[-1].reason
                refused += 1
            following = good_frame(rng, sequence, 1)  # the sequence goes on (on a new stream if b ended this one)
            await link_a.send(following)
            assert await asyncio.wait_for(link_b.receive(), CASE_WAIT) == following
            await link_a.finish(sequence)  # done with it: its streams must all be freed
        assert link_a._queue.empty() and not link_b.rejected  # nothing of it was delivered as a frame
        await exchange(link_a, link_b, 100, DType.F32)
        assert not link_a.closed.done() and not link_b.closed.done()
        await shut(link_a, link_b, a, b)
        assert errors == []

    run(go)


# -- the STUN server -------------------------------------------------------------------------------


def stun_datagram(rng: random.Random) -> bytes:
    """A real STUN message from aioice, then perhaps truncated, damaged, extended or inflated."""
    method, kind = rng.choice(
        [(stun.Method.BINDING, stun.Class.REQUEST)] * 5
        + [
            (stun.Method.BINDING, stun.Class.INDICATION),
            (stun.Method.BINDING, stun.Class.RESPONSE),
            (stun.Method.BINDING, stun.Class.ERROR),
            (stun.Method.ALLOCATE, stun.Class.REQUEST),
            (stun.Method.REFRESH, stun.Class.REQUEST),
        ]
    )
    message = stun.Message(method, kind, transaction_id=rng.randbytes(12))
    if rng.random() < 0.5:
        message.attributes["CHANGE-REQUEST"] = rng.choice([0, 2, 4, 6])
    if rng.random() < 0.3:
        message.attributes["SOFTWARE"] = "".join(rng.choices("kafila fuzz é€", k=rng.randint(0, 30)))
    if rng.random() < 0.2:
        message.attributes["PRIORITY"] = rng.randrange(2**32)
    if rng.random() < 0.2:
        message.attributes["ICE-CONTROLLING"] = rng.randrange(2**64)
    if rng.random() < 0.2:
        message.add_message_integrity(rng.randbytes(16))
    if rng.random() < 0.3:
        message.add_fingerprint()
    data = bytearray(bytes(message))
    what = rng.randrange(7)
    if what == 1:
        del data[rng.randrange(len(data)) :]
    elif what == 2:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif what == 3:  # an attribute aioice knows, with a value of the wrong size, and a header that agrees
        kind_code = rng.choice(list(stun.ATTRIBUTES_BY_TYPE))
        value = rng.randbytes(rng.choice([0, 1, 2, 3, 5, 7, 9, 21, 40]))
        data += struct.pack("!HH", kind_code, len(value)) + value + bytes(-len(value) % 4)
        struct.pack_into("!H", data, 2, len(data) - 20)
    elif what == 4:
        struct.pack_into("!H", data, 2, rng.randrange(2**16))
    elif what == 5:  # random bytes behind a plausible STUN header
        body = rng.randbytes(rng.randrange(0, 120))
        data = bytearray(struct.pack("!HHI", rng.randrange(0, 0x400), len(body), 0x2112A442) + rng.randbytes(12) + body)
    elif what == 6:  # bigger than the server reads
        data += bytes(MAX_DATAGRAM)
        struct.pack_into("!H", data, 2, len(data) - 20)
    return bytes(data)


def binding_request_id(data: bytes) -> bytes | None:
    """The transaction id if `data` is a binding request the server must answer, else None."""
    try:
        message = stun.parse_message(data)
    except Exception:  # the oracle is aioice's own parser: whatever it cannot read gets no answer
        return None
    if message.message_method != stun.Method.BINDING or message.message_class != stun.Class.REQUEST:
        return None
    return message.transaction_id


def test_the_stun_server_answers_only_binding_requests_and_survives_the_rest() -> None:
    async def go() -> None:
        errors = watch_loop()
        unlimited = RateByAddress(rate=1e9, burst=1e9, max_tracked=16)  # the rate limit has its own test
        server = await StunServer.start("127.0.0.1", 0, 0, "127.0.0.2", rates=unlimited)
        assert server.responder is not None
        target = (server.endpoints.address, server.endpoints.port)
        client = await UdpPeer.create()
        assert client.transport is not None
        me = client.transport.get_extra_info("sockname")[:2]
        rng = random.Random(SEED + 2)
        read_by_responder = answerable = probes = 0
        try:
            for batch in range(150):  # 1,200 fuzzed datagrams, each batch followed by a plain request
                expected: list[bytes] = []
                for _ in range(8):
                    data = stun_datagram(rng)
                    client.send(data, target)
                    if 0 < len(data) <= MAX_DATAGRAM and data[0] <= 3:
                        read_by_responder += 1
                        tid = binding_request_id(data)
                        if tid is not None:
                            expected.append(tid)
                probe = stun.Message(stun.Method.BINDING, stun.Class.REQUEST, transaction_id=rng.randbytes(12))
                client.send(bytes(probe), target)
                probes += 1
                answered: list[bytes] = []
                while True:  # replies leave in the order the requests came, so the probe's comes last
                    reply = stun.parse_message(await client.receive(CASE_WAIT))
                    assert reply.message_class == stun.Class.RESPONSE
                    assert reply.attributes["XOR-MAPPED-ADDRESS"] == me
                    if reply.transaction_id == probe.transaction_id:
                        break
                    answered.append(reply.transaction_id)
                assert answered == expected, f"batch {batch}"
                answerable += len(expected)
            with pytest.raises(TimeoutError):
                await client.receive(0.2)
            counts = server.responder.counts
            assert counts["answered"] == answerable + probes
            assert counts["ignored"] == read_by_responder - answerable  # each refused, none crashed it
            assert counts["refused"] == 0
            assert 20 < answerable < read_by_responder - 100  # both outcomes were well exercised
        finally:
            client.close()
            server.close()
        assert errors == []

    run(go)


# -- the rendezvous: signalling, HTTP and a relay port ---------------------------------------------

Code = set[str]
MALFORMED, INVALID, TOO_LARGE, NOT_JOINED = {"malformed"}, {"invalid_message"}, {"too_large"}, {"not_joined"}


def valid_message(rng: random.Random) -> dict[str, Any]:
    token = "t" * rng.randint(16, 40)
    return rng.choice(
        [
            open_message(rng.randint(2, 5)),
            join_message("1-able-acorn", "x"),
            {"type": "ping", "token": token, "nonce": rng.randrange(100)},
            {"type": "relay_request", "token": token, "peer": "m2"},
            {"type": "leave", "token": token},
        ]
    )


WRONG_FOR = {  # JSON values of another type than the field's, that strict validation must refuse
    str: [3, 2.5, True, None, [1], {"a": 1}],
    int: ["3", 2.5, True, None, [3], {}],
    dict: ["x", 7, None, [1]],
    list: ["127.0.0.1:4000", 7, None, {"a": "b"}],
}
REQUIRED = {
    "open": ["model", "expected_members", "capability", "candidates", "fingerprint"],
    "join": ["code", "capability", "candidates", "fingerprint"],
    "ping": ["token"],
    "relay_request": ["token", "peer"],
    "leave": ["token"],
}


def bad_signal(rng: random.Random) -> tuple[str | bytes, Code, str | None]:
    """A WebSocket message the rendezvous must refuse, the error codes it may answer and the `request` it names."""
    what = rng.randrange(10)
    message = valid_message(rng)
    text = json.dumps(message)
    if what == 0:
        return rng.choice([rng.randbytes(rng.randint(0, 300)), text.encode()]), MALFORMED, None  # binary frames
    if what == 1:
        return text[: rng.randrange(1, len(text))], MALFORMED, None  # a proper prefix of an object is never JSON
    if what == 2:
        return "x" + "".join(chr(rng.randrange(0x20, 0xD800)) for _ in range(rng.randint(0, 200))), MALFORMED, None
    if what == 3:
        size = rng.randint(16 * 1024 + 1, 300_000)
        return rng.choice([json.dumps({**message, "pad": "p" * size}), "é" * (size // 2 + 1)]), TOO_LARGE, None
    if what == 4:
        return (
            json.dumps({**message, "type": rng.choice(["opened", "", "OPEN", "error", 1, None, [], {}])}),
            INVALID,
            None,
        )
    if what == 5:
        field = rng.choice(REQUIRED[message["type"]])
        wrong = rng.choice(WRONG_FOR[type(message[field])])
        return json.dumps({**message, field: wrong}), INVALID, None
    if what == 6:
        change = rng.choice([{"extra": 1}, {"version": 2}, {"fingerprint": "ab" * 31}, {"expected_members": 1}])
        return json.dumps({**open_message(), **change}), INVALID, None
    if what == 7:
        return (
            rng.choice(["[" * rng.randint(300, 16_000), "9" * rng.randint(5000, 16_000), "{" * 5000]),
            MALFORMED,
            None,
        )
    if what == 8:
        return rng.choice([json.dumps(rng.choice([1, "open", [], None, 2.5, True])), "{}"]), INVALID, None
    kind = rng.choice(["ping", "leave", "relay_request"])  # valid, but from a connection in no session
    member = {"type": kind, "token": "t" * 20} | ({"peer": "m1"} if kind == "relay_request" else {})
    return json.dumps(member), NOT_JOINED, kind


async def refused(raw: Any, data: str | bytes, codes: Code, request: str | None = None) -> None:
    await raw.send(data)
    answer = json.loads(await asyncio.wait_for(raw.recv(), CASE_WAIT))
    assert answer["type"] == "error" and answer["code"] in codes, (str(data)[:80], answer)
    assert answer["message"] and answer["request"] == request


async def closed_for_strikes(raw: Any) -> None:
    with pytest.raises(websockets.ConnectionClosed):
        await asyncio.wait_for(raw.recv(), CASE_WAIT)
    assert raw.close_code == CLOSE_POLICY


async def fuzz_http(port: int, rng: random.Random) -> None:
    """Raw bytes at the signalling port: an HTTP error or a close, never a hang or a crash."""
    for data in [
        rng.randbytes(300),
        UPGRADE[: rng.randrange(10, len(UPGRADE) - 4)],
        b"GET /v1/session HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01" + rng.randbytes(200),  # a TLS hello at a plain-HTTP port
    ]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        try:
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), CASE_WAIT)  # until the server closes
        except ConnectionResetError:  # closed with our bytes unread: a refusal too
            answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:60]
        writer.close()


UPGRADE = (
    b"GET /v1/session HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def ws_frame(opcode: int, payload: bytes, fin: bool = True, masked: bool = True, rsv: int = 0) -> bytes:
    """One WebSocket frame as a client writes it (RFC 6455 section 5.2), or breaks it."""
    first = (0x80 if fin else 0) | rsv << 4 | opcode
    mask_bit = 0x80 if masked else 0
    if len(payload) < 126:
        head = bytes([first, mask_bit | len(payload)])
    else:
        head = bytes([first, mask_bit | 126]) + struct.pack("!H", len(payload))
    if not masked:
        return head + payload
    key = bytes([0x5A, 0x17, 0xC3, 0x08])
    return head + key + bytes(c ^ key[i % 4] for i, c in enumerate(payload))


def bad_ws_frame(rng: random.Random) -> tuple[bytes, set[int]]:
    """A frame that breaks the WebSocket protocol, and the close codes that may answer it (none: cut short)."""
    text = rng.randbytes(rng.randint(0, 40))
    what = rng.randrange(8)
    if what == 0:
        return ws_frame(1, b"\xff" + text), {1007}  # a text frame that is not UTF-8
    if what == 1:
        return ws_frame(rng.choice([3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF]), text), {1002}
    if what == 2:
        return ws_frame(rng.choice([1, 2]), text, rsv=rng.randint(1, 7)), {1002}
    if what == 3:
        return ws_frame(rng.choice([1, 2]), text, masked=False), {1002}
    if what == 4:
        return ws_frame(0, text), {1002}  # a continuation with nothing to continue
    if what == 5:
        return ws_frame(rng.choice([8, 9, 0xA]), rng.randbytes(rng.randint(126, 400))), {1002}  # control > 125
    if what == 6:
        return ws_frame(rng.choice([9, 0xA]), text, fin=False), {1002}  # a fragmented control frame
    frame = ws_frame(rng.choice([1, 2]), rng.randbytes(rng.randint(10, 300)))
    return frame[: rng.randrange(1, len(frame))], set()  # cut short, then our side closes


async def fuzz_websocket_frames(port: int, rng: random.Random) -> None:
    """Frames that break RFC 6455 itself, below the JSON: the connection is closed with a code, never hangs."""
    for _ in range(40):
        data, codes = bad_ws_frame(rng)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(UPGRADE)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CASE_WAIT)).startswith(b"HTTP/1.1 101")
        writer.write(data)
        if not codes:
            writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), CASE_WAIT)  # until the server closes the connection
        writer.close()
        if not codes:
            assert answer == b""
            continue
        assert answer[0] == 0x88 and struct.unpack("!H", answer[2:4])[0] in codes, (data[:20], answer[:40])


def test_the_rendezvous_refuses_every_bad_message_and_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)

    async def go() -> None:
        errors = watch_loop()
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            strikes = handle.core.limits.max_strikes
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=capability("h"), fingerprint=FP
            )
            rng = random.Random(SEED + 3)
            for _ in range(60):  # 300 bad messages; each connection is closed after its fifth
                async with websockets.connect(handle.url, max_size=None) as raw:
                    for _ in range(strikes):
                        await refused(raw, *bad_signal(rng))
                    await closed_for_strikes(raw)

            async with websockets.connect(handle.url) as raw:  # bad messages from a member of a session
                await raw.send(json.dumps(open_message(3, name="fuzzer")))
                opened = json.loads(await asyncio.wait_for(raw.recv(), CASE_WAIT))
                assert opened["type"] == "opened"
                token = opened["token"]
                await refused(raw, json.dumps({"type": "ping", "token": "x" * 30}), {"bad_token"}, "ping")
                await refused(raw, json.dumps({"type": "relay_request", "token": token, "peer": 2}), INVALID)
                await refused(raw, json.dumps(open_message(2)), {"already_joined"}, "open")
                await refused(raw, json.dumps(join_message(host.code, "again")), {"already_joined"}, "join")
                await refused(raw, json.dumps({"type": "ping", "token": token, "nonce": -1}), INVALID)
                await closed_for_strikes(raw)  # the fuzzer's session ends with it

            async with websockets.connect(handle.url, max_size=None) as raw:  # past the WebSocket layer's cap
                await raw.send(rng.choice([b"\x00", "y"]) * (2 << 20))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(raw.recv(), CASE_WAIT)
                assert raw.close_code == 1009
            await fuzz_http(handle.http_address[1], rng)
            await fuzz_websocket_frames(handle.http_address[1], rng)

            # still serving: the host's session fills and becomes ready
            assert await host.ping(CASE_WAIT) < 2
            member = await RendezvousClient.join(handle.url, host.code, capability=capability("j"), fingerprint=FP)
            assert (await member.wait_ready(CASE_WAIT)).host == "m1"
            await count_reaches(lambda: handle.core.stats()["connections"], 2, "the fuzzers' connections are gone")
            assert handle.core.stats()["sessions"] == 1

            await fuzz_relay(handle, host, member, rng)
            await host.close()
            await member.close()
        finally:
            await handle.close()
        assert errors == []

    run(go)
    # ours only: uvicorn logs a traceback at ERROR for a text frame that is not UTF-8 (then closes it, 1007)
    ours = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kafila")]
    assert ours == []


async def fuzz_relay(handle: Any, host: RendezvousClient, member: RendezvousClient, rng: random.Random) -> None:
    """Random UDP at a granted relay port: a stranger is never heard; bound ends are relayed verbatim."""
    grant_a, grant_b = await asyncio.gather(host.request_relay("m2", CASE_WAIT), member.request_relay("m1", CASE_WAIT))
    relay = host.relay_address(grant_a)
    counts = handle.relay.core.allocations[grant_a.relay_id].counts
    token_a, token_b = bytes.fromhex(grant_a.relay_token), bytes.fromhex(grant_b.relay_token)
    a, b = [await UdpPeer.create() for _ in range(2)]
    stranger = bound_socket()  # a plain socket, which can send empty datagrams
    try:
        a.send(hello(token_a), relay)
        assert parse_ack(await a.receive(CASE_WAIT)) is False
        b.send(hello(token_b), relay)
        assert parse_ack(await b.receive(CASE_WAIT)) is True

        unbound = 0
        for _ in range(20):  # 320 datagrams from an address bound to neither end
            before = counts["unbound"]
            window = 0
            for _ in range(16):
                data = rng.choice(
                    [
                        b"",
                        rng.randbytes(rng.randint(1, 1400)),
                        hello(rng.randbytes(16)),
                        bytes([HELLO]) + rng.choice([token_a, token_b])[: rng.randrange(16)],  # cut tokens
                        hello(rng.choice([token_a, token_b])) + rng.randbytes(rng.randint(1, 4)),  # overlong
                        bytes([HELLO_ACK, rng.randrange(3)]),
                    ]
                )
                stranger.sendto(data, relay)
                window += bool(data)  # an empty datagram is not even counted
            unbound += window
            await count_reaches(lambda: counts["unbound"], before + window, "each stranger datagram dropped")
        assert counts["datagrams"] == 0 and counts["unbound"] == unbound

        forwarded = [rng.randbytes(rng.randint(1, 1200)) for _ in range(100)]  # bound ends: any bytes go through
        for start in range(0, len(forwarded), 20):
            for data in forwarded[start : start + 20]:
                a.send(data, relay)
            for data in forwarded[start : start + 20]:
                assert await b.receive(CASE_WAIT) == data  # nothing of the stranger's came before
        b.send(b"\x41back", relay)
        assert await a.receive(CASE_WAIT) == b"\x41back"
        assert counts["datagrams"] == len(forwarded) + 1
        await assert_silent(stranger)
    finally:
        for peer in (a, b, stranger):
            peer.close()
