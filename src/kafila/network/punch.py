"""UDP hole punching between two members, from their candidate addresses.

Both sides send probes to every candidate of the other, starting together; a NAT that sees its
own host's probe go out lets the peer's probes in. Each side answers a probe at the address it
actually came from, not the one STUN reported, which is what lets a cone NAT reach a peer
behind a symmetric one (its mapping toward us differs from the one the rendezvous saw).

Before the first probe each side sends a few "priming" packets with a TTL of 2: they open its
own NAT's mapping toward the peer but expire before the peer's NAT, so that NAT never records
an unanswered inbound flow, which on Linux would move the peer's own mapping and fail the
punch (see shared notes on NAT and QUIC).

`PunchCore` is sans-IO: datagrams and the clock go in, datagrams to send come out.
`PunchAttempt` drives one core from asyncio (its clock, pacing and result) and `Transmitter`
sends what it says, giving priming packets their low TTL; both are shared by the two shells:

- `punch()` reads a bound socket itself, for one punch at a time before anything else uses it;
- `kafila.network.edges` feeds many attempts at once from a member's `DatagramDemux`, each
  routed to its core by the session nonce in the packet.

Either way it is the member's own socket (the same one STUN used, so the mapping the peer was
told about is the one in use).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Address = tuple[str, int]
PROBE, ACK = 0x11, 0x12  # first bytes: not STUN (0-3), not QUIC (64 and above), not the relay's
PACKET = struct.Struct("!B8s8s")  # kind, session nonce, sender's nonce
PRIMING_TTL = 2
PRIMING_PACKETS = 3
PRIMING_S = 0.25  # probes wait this long, so a peer that starts a little later has primed first
PROBE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Outgoing:
    data: bytes
    address: Address
    ttl: int | None = None  # None: the socket's default


@dataclass
class PunchCore:
    """One side of one punch attempt."""

    session: bytes  # 8 bytes both sides know from signalling: probes of other punches are ignored
    candidates: list[Address]
    nonce: bytes = field(default_factory=lambda: os.urandom(8))
    started_at: float | None = None
    last_probe: float = -1.0
    path: Address | None = None  # where the peer's packets come from and ours get through
    heard_from: Address | None = None

    def start(self, now: float) -> list[Outgoing]:
        self.started_at = now
        self.last_probe = now
        return self._priming()

    def tick(self, now: float) -> list[Outgoing]:
        if self.started_at is None or self.path is not None or now - self.last_probe < PROBE_INTERVAL_S:
            return []
        self.last_probe = now
        if now - self.started_at < PRIMING_S:
            return self._priming()
        targets = list(self.candidates)
        if self.heard_from is not None and self.heard_from not in targets:
            targets.insert(0, self.heard_from)  # the peer-reflexive address, learned from its probe
        return [Outgoing(self._packet(PROBE), target) for target in targets]

    def _priming(self) -> list[Outgoing]:
        """Low-TTL packets: they open our own NAT toward each candidate and die before the peer's."""
        return [Outgoing(self._packet(PROBE), c, PRIMING_TTL) for c in self.candidates for _ in range(PRIMING_PACKETS)]

    def received(self, data: bytes, source: Address) -> list[Outgoing]:
        if len(data) != PACKET.size:
            return []
        kind, session, sender = PACKET.unpack(data)
        if session != self.session or sender == self.nonce:
            return []
        if kind == PROBE:
            self.heard_from = source
            return [Outgoing(self._packet(ACK), source)]
        if kind == ACK and self.path is None:
            self.path = source
        return []

    @property
    def done(self) -> bool:
        return self.path is not None

    def _packet(self, kind: int) -> bytes:
        return PACKET.pack(kind, self.session, self.nonce)


@dataclass(frozen=True)
class PunchResult:
    path: Address | None
    seconds: float


def is_punch_packet(data: bytes) -> bool:
    return len(data) == PACKET.size and data[0] in (PROBE, ACK)


def session_of(data: bytes) -> bytes | None:
    """The session nonce a punch packet belongs to (what a shared socket routes it by), or None."""
    return data[1:9] if is_punch_packet(data) else None


def _ttl_option(sock: socket.socket) -> tuple[int, int]:
    if sock.family == socket.AF_INET6:
        return socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS
    return socket.IPPROTO_IP, socket.IP_TTL


class Transmitter:
    """Sends a core's output from one UDP socket.

    Ordinary packets go through `send` (by default the socket's own `sendto`; a demux passes
    its transport's). A packet with a TTL goes straight from `sock` with the socket's TTL lowered
    just for that call and restored before anything else can run, so no other datagram on the
    socket ever leaves with it. Send errors are swallowed: an unreachable candidate is one that
    simply does not answer.
    """

    def __init__(
        self,
        sock: socket.socket,
        send: Callable[[bytes, Address], None] | None = None,
        tap: Callable[[str, bytes, Address], None] | None = None,
    ) -> None:
        self.sock = sock
        self.send = send or self._sendto
        self.tap = tap  # sees the low-TTL packets that bypass `send`
        self._level, self._option = _ttl_option(sock)
        self.default_ttl = sock.getsockopt(self._level, self._option)

    def _sendto(self, data: bytes, address: Address) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendto(data, address)

    def __call__(self, packets: list[Outgoing]) -> None:
        for packet in packets:
            if packet.ttl is None:
                self.send(packet.data, packet.address)
                continue
            try:
                self.sock.setsockopt(self._level, self._option, packet.ttl)
                if self.tap is not None:
                    self.tap("out", packet.data, packet.address)
                self.sock.sendto(packet.data, packet.address)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(self._level, self._option, self.default_ttl)


class PunchAttempt:
    """The asyncio side of one `PunchCore`: feed it datagrams with `received`, await `run`."""

    def __init__(self, core: PunchCore, transmit: Callable[[list[Outgoing]], None]) -> None:
        self.core = core
        self.transmit = transmit
        self._woken = asyncio.Event()

    def received(self, data: bytes, source: Address) -> None:
        was_done = self.core.done
        self.transmit(self.core.received(data, source))
        if self.core.done and not was_done:
            self._woken.set()

    async def run(self, timeout: float, linger: float = 0.0) -> PunchResult:
        """Prime, probe until a path answers or `timeout` passes; then keep going `linger` seconds.

        Lingering only matters to a caller that stops feeding the attempt when `run` returns:
        the peer may not have heard our acknowledgement yet and is still probing.
        """
        started = time.monotonic()
        self.transmit(self.core.start(started))
        deadline = started + timeout
        succeeded_at: float | None = None
        while True:
            now = time.monotonic()
            if succeeded_at is None and self.core.done:
                succeeded_at = now
            if now >= deadline or (succeeded_at is not None and now - succeeded_at >= linger):
                break
            self._woken.clear()
            with contextlib.suppress(TimeoutError):
                wait = PROBE_INTERVAL_S if succeeded_at is None else min(PROBE_INTERVAL_S, linger)
                await asyncio.wait_for(self._woken.wait(), min(wait, max(0.0, deadline - now)))
            self.transmit(self.core.tick(time.monotonic()))
        seconds = (succeeded_at if succeeded_at is not None else time.monotonic()) - started
        return PunchResult(self.core.path, seconds)


def _address(addr: Any) -> Address:
    return (str(addr[0]), int(addr[1]))


async def punch(
    sock: socket.socket,
    session: bytes,
    candidates: list[Address],
    timeout: float = 5.0,
    linger: float = 0.5,
) -> PunchResult:
    """Punch from a bound, non-blocking UDP socket; give up after `timeout` seconds.

    This reads the socket itself, so it is one punch at a time on a socket nothing else reads
    yet. After success it keeps answering the peer's probes for `linger` seconds, since the
    peer may not have heard our acknowledgement yet.
    """
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    attempt = PunchAttempt(PunchCore(session=session, candidates=candidates), Transmitter(sock))

    async def read() -> None:
        while True:
            try:
                data, source = await loop.sock_recvfrom(sock, 2048)
            except OSError:  # an ICMP error surfaced on some platforms: not ours to act on
                await asyncio.sleep(PROBE_INTERVAL_S)
                continue
            attempt.received(data, _address(source))

    reader = asyncio.create_task(read())
    try:
        return await attempt.run(timeout, linger)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
