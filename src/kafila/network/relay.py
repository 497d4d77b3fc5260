"""The rendezvous's UDP relay, for ring edges that cannot go direct.

One allocation is one UDP port shared by the two members of an edge. Each member proves which
side it is with a binding datagram, `HELLO` followed by its 16-byte relay token, sent from the
socket it will use; the relay answers `HELLO_ACK` and a byte saying whether the other side is
bound too. From then on every datagram from one side's bound address goes verbatim to the
other side's bound address: the relay reads no payload and terminates no encryption (QUIC runs
end to end through it). Anything from an address that is not bound is dropped.

The first byte of a binding datagram, 0x10, is neither STUN (0 to 3) nor QUIC (64 and above),
so one member socket can carry STUN, QUIC and relay binding at once, demultiplexed by that byte.

`Relay` is the sans-IO core (datagrams and the current time in, datagrams out); `RelayServer`
is the asyncio shell that owns one socket per allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kafila.network.events import emit
from kafila.network.limits import TokenBucket
from kafila.portability import open_udp_endpoint

Address = tuple[str, int]
# Each allocation's socket asks for this receive buffer: with the kernel's 208 KiB, a stage file
# through the relay overflowed it whenever the rendezvous was off the CPU for a few ms, and each
# drop halved the members' QUIC window (docs/benchmarks.md, "Stage files over a lab edge"). The
# kernel caps it at net.core.rmem_max; it holds memory only while datagrams wait in it.
RECEIVE_BUFFER = 4 << 20
HELLO = 0x10
HELLO_ACK = 0x11
TOKEN_BYTES = 16
HELLO_SIZE = 1 + TOKEN_BYTES
WAITING, PAIRED = 0, 1  # the byte after HELLO_ACK: is the other side bound yet?
log = logging.getLogger("kafila.relay")


def hello(token: bytes) -> bytes:
    """The binding datagram a member sends (and may repeat as a keep-alive) from its socket."""
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a relay token is {TOKEN_BYTES} bytes")
    return bytes([HELLO]) + token


def parse_ack(data: bytes) -> bool | None:
    """True if both sides are bound, False if the relay still waits for the other, None if not an ack."""
    if len(data) != 2 or data[0] != HELLO_ACK or data[1] not in (WAITING, PAIRED):
        return None
    return data[1] == PAIRED


@dataclass(frozen=True)
class RelayLimits:
    bytes_per_s_per_session: float = 8_000_000  # 8 MB/s shared by all of a session's allocations
    burst_bytes: float = 2_000_000
    max_datagram: int = 65_507


@dataclass
class _Side:
    token: bytes
    address: Address | None = None


@dataclass
class Allocation:
    relay_id: str
    session_id: str
    sides: tuple[_Side, _Side]
    counts: dict[str, int] = field(
        default_factory=lambda: {"datagrams": 0, "bytes": 0, "unbound": 0, "unpaired": 0, "over_rate": 0}
    )

    used: bool = False  # forwarded a datagram since the last `Relay.take_used`

    @property
    def paired(self) -> bool:
        return all(side.address is not None for side in self.sides)


class Relay:
    """Which address is bound to which side of which allocation, and the sessions' byte budgets."""

    def __init__(self, limits: RelayLimits | None = None, events: deque[dict[str, Any]] | None = None) -> None:
        self.limits = limits or RelayLimits()
        self.allocations: dict[str, Allocation] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.events: deque[dict[str, Any]] = events if events is not None else deque(maxlen=512)

    def allocate(self, relay_id: str, session_id: str, tokens: tuple[bytes, bytes]) -> Allocation:
        if relay_id in self.allocations:
            raise ValueError(f"relay {relay_id} is already allocated")
        if len(tokens) != 2 or any(len(t) != TOKEN_BYTES for t in tokens) or tokens[0] == tokens[1]:
            raise ValueError(f"an allocation needs two distinct {TOKEN_BYTES}-byte tokens")
        allocation = Allocation(relay_id, session_id, (_Side(tokens[0]), _Side(tokens[1])))
        self.allocations[relay_id] = allocation
        if session_id not in self.buckets:
            self.buckets[session_id] = TokenBucket(self.limits.bytes_per_s_per_session, self.limits.burst_bytes)
        emit(log, "relay_allocated", self.events, relay=relay_id, session=session_id)
        return allocation

    def free(self, relay_id: str) -> bool:
        allocation = self.allocations.pop(relay_id, None)
        if allocation is None:
            return False
        if not any(a.session_id == allocation.session_id for a in self.allocations.values()):
            self.buckets.pop(allocation.session_id, None)
        emit(log, "relay_freed", self.events, relay=relay_id, session=allocation.session_id, **allocation.counts)
        return True

    def datagram(self, relay_id: str, data: bytes, source: Address, now: float) -> list[tuple[bytes, Address]]:
        """What to send, and where, for one datagram that arrived on `relay_id`'s port."""
        allocation = self.allocations.get(relay_id)
        if allocation is None or not data or len(data) > self.limits.max_datagram:
            return []
        if len(data) == HELLO_SIZE and data[0] == HELLO:
            for which, side in enumerate(allocation.sides):
                if hmac.compare_digest(data[1:], side.token):
                    if allocation.sides[1 - which].address == source:  # one socket cannot be both ends
                        return []
                    return [(self._bind(allocation, which, source), source)]
        sides = allocation.sides
        index: int | None = 0 if sides[0].address == source else 1 if sides[1].address == source else None
        if index is None:
            allocation.counts["unbound"] += 1
            return []
        destination = sides[1 - index].address
        if destination is None:
            allocation.counts["unpaired"] += 1
            return []
        if not self.buckets[allocation.session_id].take(len(data), now):
            allocation.counts["over_rate"] += 1
            return []
        allocation.counts["datagrams"] += 1
        allocation.counts["bytes"] += len(data)
        allocation.used = True
        return [(data, destination)]

    def take_used(self) -> list[str]:
        """The allocations that forwarded traffic since the last call (their sessions are alive)."""
        used = [relay_id for relay_id, allocation in self.allocations.items() if allocation.used]
        for relay_id in used:
            self.allocations[relay_id].used = False
        return used

    def _bind(self, allocation: Allocation, index: int, source: Address) -> bytes:
        side = allocation.sides[index]
        if side.address != source:
            event = "relay_bound" if side.address is None else "relay_rebound"
            side.address = source
            emit(log, event, self.events, relay=allocation.relay_id, side=index, address=f"{source[0]}:{source[1]}")
        return bytes([HELLO_ACK, PAIRED if allocation.paired else WAITING])


class _RelaySocket(asyncio.DatagramProtocol):
    def __init__(self, server: RelayServer, relay_id: str) -> None:
        self.server, self.relay_id = server, relay_id
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        if self.transport is None:
            return
        source = (str(addr[0]), int(addr[1]))
        for payload, destination in self.server.core.datagram(self.relay_id, data, source, self.server.clock()):
            self.transport.sendto(payload, destination)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable from a gone peer: not ours to act on
        log.debug("relay %s socket error: %s", self.relay_id, type(exc).__name__)


class RelayServer:
    """The asyncio shell: one UDP socket per allocation, bound on `host` at a port the OS picks."""

    def __init__(
        self, host: str, limits: RelayLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.host = host
        self.clock = clock
        self.core = Relay(limits)
        self._sockets: dict[str, _RelaySocket] = {}

    async def open(self, relay_id: str, session_id: str, tokens: tuple[bytes, bytes]) -> int:
        """Bind a port for one allocation and return it; OSError if none can be bound."""
        transport, protocol = await open_udp_endpoint(lambda: _RelaySocket(self, relay_id), (self.host, 0))
        with contextlib.suppress(OSError):  # a platform that refuses keeps its default
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        try:
            self.core.allocate(relay_id, session_id, tokens)
        except ValueError:
            transport.close()
            raise
        self._sockets[relay_id] = protocol
        return int(transport.get_extra_info("sockname")[1])

    def port(self, relay_id: str) -> int | None:
        protocol = self._sockets.get(relay_id)
        if protocol is None or protocol.transport is None:
            return None
        return int(protocol.transport.get_extra_info("sockname")[1])

    def free(self, relay_id: str) -> None:
        """Close the allocation's port; freeing one that is not open is harmless."""
        protocol = self._sockets.pop(relay_id, None)
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
        self.core.free(relay_id)

    def close(self) -> None:
        for relay_id in list(self._sockets):
            self.free(relay_id)
