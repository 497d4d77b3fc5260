"""UDP hole punching between two members, from their candidate addresses.

Both sides send probes to every candidate of the other, starting together; a NAT that sees its
own host's probe go out lets the peer's probes in. Each side answers a probe at the address it
actually came from, not the one STUN reported, which is what lets a cone NAT reach a peer
behind a symmetric one (its mapping toward us differs from the one the rendezvous saw).

Before the first probe each side sends a few "priming" packets with a TTL of 2: they open its
own NAT's mapping toward the peer but expire before the peer's NAT, so that NAT never records
an unanswered inbound flow, which on Linux would move the peer's own mapping and fail the
punch (see shared notes on NAT and QUIC).

`PunchCore` is sans-IO: datagrams and the clock go in, datagrams to send come out. `punch()` is
its asyncio shell over a socket the caller owns (the same one STUN used, so the mapping the
peer was told about is the one in use).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from dataclasses import dataclass, field

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


async def punch(
    sock: socket.socket,
    session: bytes,
    candidates: list[Address],
    timeout: float = 5.0,
    linger: float = 0.5,
) -> PunchResult:
    """Punch from a bound, non-blocking UDP socket; give up after `timeout` seconds.

    After success it keeps answering the peer's probes for `linger` seconds, since the peer may
    not have heard our acknowledgement yet.
    """
    loop = asyncio.get_running_loop()
    core = PunchCore(session=session, candidates=candidates)
    sock.setblocking(False)
    default_ttl = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)

    def send(packets: list[Outgoing]) -> None:
        for packet in packets:
            if packet.ttl is not None:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, packet.ttl)
            try:
                sock.sendto(packet.data, packet.address)
            except OSError:
                pass  # an unreachable candidate is one that simply does not answer
            finally:
                if packet.ttl is not None:
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, default_ttl)

    started = time.monotonic()
    send(core.start(started))
    deadline = started + timeout
    succeeded_at: float | None = None
    while True:
        now = time.monotonic()
        if succeeded_at is None and core.done:
            succeeded_at = now
        if now >= deadline or (succeeded_at is not None and now - succeeded_at >= linger):
            break
        try:
            data, source = await asyncio.wait_for(loop.sock_recvfrom(sock, 2048), PROBE_INTERVAL_S)
            send(core.received(data, (str(source[0]), int(source[1]))))
        except TimeoutError:
            pass
        send(core.tick(time.monotonic()))
    seconds = (succeeded_at if succeeded_at is not None else time.monotonic()) - started
    return PunchResult(core.path, seconds)
