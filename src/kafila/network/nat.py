"""Classify this member's NAT against the rendezvous's STUN server (RFC 4787 terms, RFC 5780 tests).

Mapping is tested from one socket: does the NAT keep the same external address and port when
the destination changes address, or port? Filtering is tested from fresh sockets, one per test,
so that no earlier packet has opened the way: will the NAT let in a reply from another address,
or from another port? The answers are O(1) probes per member, whatever the session's size.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, cast

from aioice import stun
from pydantic import BaseModel, ConfigDict

from kafila.contracts import Mapping, NatClass
from kafila.network.stun import CHANGE_IP, CHANGE_PORT, MALFORMED, Address
from kafila.portability import open_udp_endpoint

RETRANSMISSIONS = 2  # 0.5 + 1 + 2 s: a silent filter costs 3.5 s, not aioice's default 31 s
RTT_SAMPLES = 5


class NatReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mapping: Mapping | None
    filtering: Mapping | None
    nat_class: NatClass | None
    mapped_address: str
    local_address: str
    rtt_ms: float
    behind_nat: bool
    notes: list[str]

    def as_output(self) -> dict[str, object]:
        """The `kafila nat --json` contract."""
        return {
            "mapping": self.mapping.value if self.mapping else None,
            "filtering": self.filtering.value if self.filtering else None,
            "class": self.nat_class.value if self.nat_class else None,
            "mapped_address": self.mapped_address,
            "rtt_ms": self.rtt_ms,
            "local_address": self.local_address,
            "behind_nat": self.behind_nat,
            "notes": self.notes,
        }


def classify(mapping: Mapping | None, filtering: Mapping | None) -> NatClass | None:
    """permissive: EIM and EIF; restrictive: endpoint-dependent mapping; ordinary: the rest."""
    if mapping is None:
        return None
    if mapping is not Mapping.ENDPOINT_INDEPENDENT:
        return NatClass.RESTRICTIVE
    if filtering is None:
        return None
    if filtering is Mapping.ENDPOINT_INDEPENDENT:
        return NatClass.PERMISSIVE
    return NatClass.ORDINARY


class _Client(asyncio.DatagramProtocol):
    """One UDP socket that runs STUN transactions and routes responses to them."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self._pending: dict[bytes, stun.Transaction] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        try:
            message = stun.parse_message(data)
        except MALFORMED:
            return
        transaction = self._pending.get(message.transaction_id)
        if transaction is not None:
            transaction.response_received(message, (str(addr[0]), int(addr[1])))

    def send_stun(self, message: stun.Message, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(bytes(message), addr)

    async def binding(self, server: Address, change: int = 0) -> tuple[stun.Message, Address] | None:
        """One binding transaction; None when nothing answers (which is itself an answer)."""
        request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
        if change:
            request.attributes["CHANGE-REQUEST"] = change
        transaction = stun.Transaction(request, server, self, retransmissions=RETRANSMISSIONS)
        self._pending[request.transaction_id] = transaction
        try:
            return await transaction.run()
        except stun.TransactionTimeout:
            return None
        finally:
            del self._pending[request.transaction_id]

    @property
    def local(self) -> Address:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return str(host), int(port)


async def _socket(bind_host: str) -> _Client:
    _, client = await open_udp_endpoint(_Client, (bind_host, 0))
    return client


def _outgoing_address(server: Address) -> str:
    """The local address the system routes toward the server from (connecting UDP sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(server)
        return str(probe.getsockname()[0])


def _mapped(response: stun.Message) -> Address:
    host, port = response.attributes.get("XOR-MAPPED-ADDRESS") or response.attributes["MAPPED-ADDRESS"]
    return str(host), int(port)


@dataclass
class _Findings:
    notes: list[str]
    mapping: Mapping | None = None
    filtering: Mapping | None = None


async def _mapping_tests(client: _Client, server: Address, other: Address | None, first: Address) -> _Findings:
    findings = _Findings(notes=[])
    if other is not None:
        second = await client.binding((other[0], server[1]))
        third = await client.binding(other)
        if second is None or third is None:
            findings.notes.append("the rendezvous's second address did not answer: mapping unknown")
            return findings
        if _mapped(second[0]) == first:
            findings.mapping = Mapping.ENDPOINT_INDEPENDENT
        elif _mapped(third[0]) == _mapped(second[0]):
            findings.mapping = Mapping.ADDRESS_DEPENDENT
        else:
            findings.mapping = Mapping.ADDRESS_AND_PORT_DEPENDENT
        return findings
    # One address: a change of port alone can still expose port-dependent mapping.
    probe = await client.binding(server, change=CHANGE_PORT)
    origin = probe[0].attributes.get("RESPONSE-ORIGIN") if probe else None
    if origin is None:
        findings.notes.append("the rendezvous has one address and answered no change of port: mapping unknown")
        return findings
    second = await client.binding((str(origin[0]), int(origin[1])))
    if second is not None and _mapped(second[0]) != first:
        findings.mapping = Mapping.ADDRESS_AND_PORT_DEPENDENT
    else:
        findings.notes.append(
            "the rendezvous has one address: the mapping does not depend on the port, but whether it "
            "depends on the address cannot be tested (give the rendezvous --alt-address)"
        )
    return findings


async def _filtering_tests(bind_host: str, server: Address, two_addresses: bool, findings: _Findings) -> None:
    """Each test on a fresh socket, both at once, so silence costs one timeout, not two."""
    clients = [await _socket(bind_host) for _ in range(2 if two_addresses else 1)]
    try:
        if two_addresses:
            from_other_address, from_other_port = await asyncio.gather(
                clients[0].binding(server, change=CHANGE_IP | CHANGE_PORT),
                clients[1].binding(server, change=CHANGE_PORT),
            )
            if from_other_address is not None:
                findings.filtering = Mapping.ENDPOINT_INDEPENDENT
            elif from_other_port is not None:
                findings.filtering = Mapping.ADDRESS_DEPENDENT
            else:
                findings.filtering = Mapping.ADDRESS_AND_PORT_DEPENDENT
            return
        from_other_port = await clients[0].binding(server, change=CHANGE_PORT)
        if from_other_port is None:
            findings.filtering = Mapping.ADDRESS_AND_PORT_DEPENDENT
        else:
            findings.notes.append(
                "the rendezvous has one address: replies from another port get in, but whether replies "
                "from another address would cannot be tested"
            )
    finally:
        for client in clients:
            if client.transport is not None:
                client.transport.close()


async def probe_nat(server: Address, bind_host: str = "0.0.0.0") -> NatReport:
    """Run the RFC 5780 tests against a rendezvous's STUN port and classify the result."""
    client = await _socket(bind_host)
    try:
        rtts = []
        first_response: stun.Message | None = None
        for _ in range(RTT_SAMPLES):
            started = time.perf_counter()
            answer = await client.binding(server)
            if answer is None:
                raise ConnectionError(f"no STUN answer from {server[0]}:{server[1]}: is the rendezvous running there?")
            rtts.append((time.perf_counter() - started) * 1e3)
            first_response = first_response or answer[0]
        assert first_response is not None
        first = _mapped(first_response)
        other_attr = first_response.attributes.get("OTHER-ADDRESS")
        other = (str(other_attr[0]), int(other_attr[1])) if other_attr else None
        local = client.local
        findings = await _mapping_tests(client, server, other, first)
    finally:
        if client.transport is not None:
            client.transport.close()
    await _filtering_tests(bind_host, server, other is not None, findings)
    local = (_outgoing_address(server) if local[0] == "0.0.0.0" else local[0], local[1])
    behind_nat = first != local
    return NatReport(
        mapping=findings.mapping,
        filtering=findings.filtering,
        nat_class=classify(findings.mapping, findings.filtering),
        mapped_address=f"{first[0]}:{first[1]}",
        local_address=f"{local[0]}:{local[1]}",
        rtt_ms=statistics.median(rtts),
        behind_nat=behind_nat,
        notes=findings.notes,
    )


def reflexive_address(sock: socket.socket, server: Address, timeout: float = 3.0) -> Address:
    """The address the rendezvous sees this socket as: its server-reflexive candidate.

    Asked from the very socket the member will punch and connect from, so the mapping reported
    is the mapping in use. Blocking, with bounded retransmissions.
    """
    request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
    previous = sock.gettimeout()
    try:
        for wait in (0.25, 0.5, 1.0, timeout):
            sock.sendto(bytes(request), server)
            sock.settimeout(wait)
            try:
                while True:
                    data, _ = sock.recvfrom(2048)
                    try:
                        response = stun.parse_message(data)
                    except MALFORMED:
                        continue
                    if response.transaction_id == request.transaction_id:
                        return _mapped(response)
            except TimeoutError:
                continue
    finally:
        sock.settimeout(previous)
    raise ConnectionError(f"no STUN answer from {server[0]}:{server[1]}")
