"""STUN on the rendezvous: RFC 5389 binding and RFC 5780 behaviour discovery.

The message codec is aioice's; what is here is the part aioice has no server for. The core,
`StunResponder`, is sans-IO: given a datagram and the local endpoint it arrived on, it returns
the reply and the local endpoint to send it from. `StunServer` is the thin asyncio shell that
owns the sockets: two ports on the primary address and, when a second address is configured,
the same two ports on it (RFC 5780 needs all four to answer CHANGE-REQUEST).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any, cast

from aioice import stun

from kafila.network.limits import RateByAddress, address_group
from kafila.portability import open_udp_endpoint

Address = tuple[str, int]
CHANGE_IP = 0x04
CHANGE_PORT = 0x02
MAX_DATAGRAM = 2048
# An answer is about 3× its request, so an attacker who spoofs a victim's address could use the
# rendezvous to multiply its traffic: answers per source address are rate-limited. A member's
# whole NAT classification asks a dozen or so, with retries, within a few seconds.
ANSWERS_PER_S = 10.0
ANSWER_BURST = 50.0
MAX_TRACKED_SOURCES = 65_536
# What aioice's parser raises on malformed input: an attribute of the wrong size (CHANGE-REQUEST
# in 3 bytes, say) fails in `struct.unpack`, whose error is not a ValueError.
MALFORMED = (ValueError, KeyError, IndexError, struct.error)
log = logging.getLogger("kafila.stun")


@dataclass(frozen=True)
class StunEndpoints:
    """The server's addresses: a primary and an alternate port, and perhaps an alternate IP."""

    address: str
    port: int
    alt_port: int
    alt_address: str | None = None

    def local(self) -> list[Address]:
        addresses = [self.address] + ([self.alt_address] if self.alt_address else [])
        return [(a, p) for a in addresses for p in (self.port, self.alt_port)]

    def swap(self, received_on: Address, change_ip: bool, change_port: bool) -> Address | None:
        """The endpoint a CHANGE-REQUEST asks the reply to come from, or None if there is none."""
        host, port = received_on
        if change_ip:
            if self.alt_address is None:
                return None
            host = self.alt_address if host == self.address else self.address
        if change_port:
            port = self.alt_port if port == self.port else self.port
        return host, port

    def other(self, received_on: Address) -> Address | None:
        """OTHER-ADDRESS: only with a real second address, or clients misread their filtering."""
        return self.swap(received_on, change_ip=True, change_port=True)


@dataclass
class StunResponder:
    """Answers binding requests; ignores everything else, since replies to garbage feed attacks."""

    endpoints: StunEndpoints
    counts: dict[str, int] = field(
        default_factory=lambda: {"answered": 0, "ignored": 0, "refused": 0, "rate_limited": 0}
    )
    rates: RateByAddress = field(
        default_factory=lambda: RateByAddress(ANSWERS_PER_S, ANSWER_BURST, MAX_TRACKED_SOURCES)
    )

    def handle(self, data: bytes, source: Address, received_on: Address, now: float) -> tuple[bytes, Address] | None:
        try:
            request = stun.parse_message(data)
        except MALFORMED as error:  # malformed: never answered
            log.debug("malformed STUN datagram from %s: %s", source[0], error)
            self.counts["ignored"] += 1
            return None
        if request.message_method != stun.Method.BINDING or request.message_class != stun.Class.REQUEST:
            self.counts["ignored"] += 1
            return None
        if not self.rates.allow(address_group(source[0]), now):
            self.counts["rate_limited"] += 1
            return None
        flags = request.attributes.get("CHANGE-REQUEST", 0)
        reply_from = self.endpoints.swap(received_on, bool(flags & CHANGE_IP), bool(flags & CHANGE_PORT))
        if reply_from is None:  # change of IP asked of a server with one address
            self.counts["refused"] += 1
            refusal = stun.Message(stun.Method.BINDING, stun.Class.ERROR, request.transaction_id)
            refusal.attributes["ERROR-CODE"] = (420, "No alternate address to change to")
            refusal.add_fingerprint()
            return bytes(refusal), received_on
        response = stun.Message(stun.Method.BINDING, stun.Class.RESPONSE, request.transaction_id)
        response.attributes["XOR-MAPPED-ADDRESS"] = source
        response.attributes["MAPPED-ADDRESS"] = source
        response.attributes["RESPONSE-ORIGIN"] = reply_from
        other = self.endpoints.other(received_on)
        if other is not None:
            response.attributes["OTHER-ADDRESS"] = other
        response.add_fingerprint()
        self.counts["answered"] += 1
        return bytes(response), reply_from


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, server: StunServer, local: Address) -> None:
        self.server, self.local = server, local
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        if len(data) > MAX_DATAGRAM or not data or data[0] > 3:  # STUN's first byte is 0 to 3
            return
        responder = self.server.responder
        if responder is None:  # still binding its other sockets
            return
        source = (str(addr[0]), int(addr[1]))
        answer = responder.handle(data, source, self.local, time.monotonic())
        if answer is not None:
            payload, reply_from = answer
            self.server.send_from(reply_from, payload, source)


class StunServer:
    """The asyncio shell: one UDP socket per endpoint, replies sent from the one asked for."""

    def __init__(self) -> None:
        self.responder: StunResponder | None = None
        self._sockets: dict[Address, _Socket] = {}

    @classmethod
    async def start(
        cls,
        address: str,
        port: int,
        alt_port: int = 0,
        alt_address: str | None = None,
        rates: RateByAddress | None = None,
    ) -> StunServer:
        """Bind every endpoint; a port of 0 picks a free one (the alternate port then matches on both IPs).
        `rates`: answers allowed per source (default: ANSWERS_PER_S, ANSWER_BURST)."""
        server = cls()
        bound: dict[Address, _Socket] = {}
        try:
            primary = await open_udp_endpoint(lambda: _Socket(server, ("", 0)), (address, port))
            port = primary[0].get_extra_info("sockname")[1]
            bound[(address, port)] = primary[1]
            alt = await open_udp_endpoint(lambda: _Socket(server, ("", 0)), (address, alt_port))
            alt_port = alt[0].get_extra_info("sockname")[1]
            bound[(address, alt_port)] = alt[1]
            if alt_address is not None:
                for p in (port, alt_port):
                    _, protocol = await open_udp_endpoint(lambda: _Socket(server, ("", 0)), (alt_address, p))
                    bound[(alt_address, p)] = protocol
        except BaseException:
            for protocol in bound.values():
                if protocol.transport is not None:
                    protocol.transport.close()
            raise
        for local, protocol in bound.items():
            protocol.local = local
        endpoints = StunEndpoints(address, port, alt_port, alt_address)
        server.responder = StunResponder(endpoints) if rates is None else StunResponder(endpoints, rates=rates)
        server._sockets = bound
        return server

    @property
    def endpoints(self) -> StunEndpoints:
        assert self.responder is not None, "start() the server first"
        return self.responder.endpoints

    def send_from(self, local: Address, payload: bytes, destination: Address) -> None:
        protocol = self._sockets.get(local)
        if protocol is not None and protocol.transport is not None:
            protocol.transport.sendto(payload, destination)

    def close(self) -> None:
        for protocol in self._sockets.values():
            if protocol.transport is not None:
                protocol.transport.close()
