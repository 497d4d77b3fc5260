"""STUN on the rendezvous: RFC 5389 binding and RFC 5780 behaviour discovery.

The message codec is aioice's; what is here is the part aioice has no server for. The core,
`StunResponder`, is sans-IO: given a datagram and the local endpoint it arrived on, it returns
the reply and the local endpoint to send it from. It counts each source against its rate before
it parses anything, so a flood costs a lookup per datagram, not a parse. `StunServer` is the
thin shell that owns the sockets: two ports on the primary address and, when a second address
is configured, the same two ports on it (RFC 5780 needs all four to answer CHANGE-REQUEST). It
reads them in a thread of its own, as fast as the kernel hands datagrams over: a UDP flood
then costs STUN its own reads and never turns of the signalling's event loop, and a member's
request is read before the socket's buffer overflows with the flood.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from aioice import stun

from kafila.network.limits import RateByAddress, address_group
from kafila.portability import bind_udp_socket

Address = tuple[str, int]
CHANGE_IP = 0x04
CHANGE_PORT = 0x02
MAX_DATAGRAM = 2048
READ_BATCH = 256  # datagrams read from one socket before the others' turn
RECEIVE_BUFFER = 4 << 20  # asked of the kernel for each socket (Linux caps it at net.core.rmem_max)
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
        if not self.rates.allow(address_group(source[0]), now):  # before parsing: a flood costs a lookup
            self.counts["rate_limited"] += 1
            return None
        try:
            request = stun.parse_message(data)
        except MALFORMED as error:  # malformed: never answered
            log.debug("malformed STUN datagram from %s: %s", source[0], error)
            self.counts["ignored"] += 1
            return None
        if request.message_method != stun.Method.BINDING or request.message_class != stun.Class.REQUEST:
            self.counts["ignored"] += 1
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


class StunServer:
    """The shell: one UDP socket per endpoint, read in a thread of its own; each reply leaves from
    the endpoint it was asked to come from."""

    def __init__(self, responder: StunResponder, sockets: dict[Address, socket.socket]) -> None:
        self.responder = responder
        self._sockets = sockets
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="stun", daemon=True)
        self._thread.start()

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
        bound: dict[Address, socket.socket] = {}
        try:
            primary = await bind_udp_socket((address, port))
            port = primary.getsockname()[1]
            bound[(address, port)] = primary
            alt = await bind_udp_socket((address, alt_port))
            alt_port = alt.getsockname()[1]
            bound[(address, alt_port)] = alt
            if alt_address is not None:
                for p in (port, alt_port):
                    bound[(alt_address, p)] = await bind_udp_socket((alt_address, p))
        except BaseException:
            for sock in bound.values():
                sock.close()
            raise
        for sock in bound.values():
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        endpoints = StunEndpoints(address, port, alt_port, alt_address)
        responder = StunResponder(endpoints) if rates is None else StunResponder(endpoints, rates=rates)
        return cls(responder, bound)

    @property
    def endpoints(self) -> StunEndpoints:
        return self.responder.endpoints

    def close(self) -> None:
        """Stop the reading thread, then close the sockets; calling it again does nothing."""
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_writer.send(b"x")
            self._thread.join(timeout=5)
        for sock in (*self._sockets.values(), self._wake_reader, self._wake_writer):
            sock.close()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            for local, sock in self._sockets.items():
                selector.register(sock, selectors.EVENT_READ, local)
            selector.register(self._wake_reader, selectors.EVENT_READ, None)
            while True:
                for key, _ in selector.select():
                    if key.data is None:
                        return
                    self._read(self._sockets[key.data], key.data)

    def _read(self, sock: socket.socket, local: Address) -> None:
        """What the socket holds now, up to a batch, answering what the responder answers; then the
        other sockets and a request to stop get their turn, however long a flood on this one lasts."""
        for _ in range(READ_BATCH):
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # an ICMP error from an earlier reply, or the socket closing
                log.debug("STUN socket %s:%d: %s", local[0], local[1], error)
                return
            if len(data) > MAX_DATAGRAM or not data or data[0] > 3:  # STUN's first byte is 0 to 3
                continue
            source = (str(addr[0]), int(addr[1]))
            answer = self.responder.handle(data, source, local, time.monotonic())
            if answer is not None:
                payload, reply_from = answer
                out = self._sockets.get(reply_from)
                if out is not None:
                    with contextlib.suppress(OSError):
                        out.sendto(payload, source)
