"""Classify this member's NAT against the rendezvous's STUN server (RFC 4787 terms, RFC 5780 tests).

Mapping is tested from one socket: does the NAT keep the same external address and port when
the destination changes address, or port? Filtering is tested from fresh sockets, one per test,
so that no earlier packet has opened the way: will the NAT let in a reply from another address,
or from another port? The answers are O(1) probes per member, whatever the session's size.

A NAT that filters answers a filtering test with silence, so how long silence is waited for
is what classifying it costs, for every host and member behind one before it can join. The
rendezvous answers a change request at once, from the address or port asked, so a reply that
the NAT lets in comes back about one round trip after its request: the tests wait a few of the
slowest round trips just measured to the same rendezvous (`silence_window`), and send the
request again within that time, so that one lost datagram does not read as a filter.
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

RETRANSMISSIONS = 2  # 0.5 + 1 + 2 s: an answer that does not come costs 3.5 s, not aioice's default 31 s
RTT_SAMPLES = 5
# A filtering test's wait for silence: SILENCE_RTTS of the slowest measured round trips, at least
# SILENCE_FLOOR_S (a loaded machine's scheduling, not the path, delays a reply by tenths of a
# second) and at most SILENCE_CAP_S (the fixed three tries of before); its request is sent
# SILENCE_SENDS times over the window's first half, each copy with half the window to come back.
SILENCE_RTTS = 4.0
SILENCE_FLOOR_S = 0.5
SILENCE_CAP_S = 3.5
SILENCE_SENDS = 3


def silence_window(rtts_ms: list[float]) -> float:
    """Seconds a filtering test waits for a reply before taking silence for a filter."""
    slowest_s = max(rtts_ms, default=0.0) / 1e3
    return min(SILENCE_CAP_S, max(SILENCE_FLOOR_S, SILENCE_RTTS * slowest_s))


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


class _Answer:
    """Where a filtering test's answer lands: the first response to its request, whichever copy."""

    def __init__(self) -> None:
        self.future: asyncio.Future[tuple[stun.Message, Address]] = asyncio.get_running_loop().create_future()

    def response_received(self, message: stun.Message, addr: Address) -> None:
        if self.future.done():
            return
        if message.message_class == stun.Class.RESPONSE:
            self.future.set_result((message, addr))
        else:  # as a stun.Transaction fails on an error response
            self.future.set_exception(stun.TransactionFailed(message))


class _Client(asyncio.DatagramProtocol):
    """One UDP socket that runs STUN transactions and routes responses to them."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self._pending: dict[bytes, stun.Transaction | _Answer] = {}

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

    async def binding_within(
        self, server: Address, change: int, window_s: float
    ) -> tuple[stun.Message, Address] | None:
        """One binding request with a CHANGE-REQUEST, sent SILENCE_SENDS times over the first half of
        `window_s`; None when no answer has come by its end."""
        request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
        request.attributes["CHANGE-REQUEST"] = change
        answer = _Answer()
        self._pending[request.transaction_id] = answer
        loop = asyncio.get_running_loop()
        started = loop.time()
        sends_at = [window_s / 2 * n / (SILENCE_SENDS - 1) for n in range(SILENCE_SENDS)]
        try:
            for n in range(SILENCE_SENDS):
                self.send_stun(request, server)
                until = started + (sends_at[n + 1] if n + 1 < SILENCE_SENDS else window_s)
                done, _ = await asyncio.wait({answer.future}, timeout=max(0.0, until - loop.time()))
                if done:
                    return answer.future.result()
            return None
        finally:
            del self._pending[request.transaction_id]
            answer.future.cancel()  # nobody waits on it any more; a late answer is dropped

    @property
    def local(self) -> Address:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return str(host), int(port)


async def _socket(bind_host: str) -> _Client:
    _, client = await open_udp_endpoint(_Client, (bind_host, 0))
    return client


def outgoing_address(server: Address) -> str:
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


async def _filtering_tests(bind_host: str, server: Address, two_addresses: bool, window_s: float) -> _Findings:
    """Each test on a fresh socket, both at once, so silence costs one `window_s`, not two."""
    findings = _Findings(notes=[])
    clients = [await _socket(bind_host) for _ in range(2 if two_addresses else 1)]
    try:
        if two_addresses:
            from_other_address, from_other_port = await asyncio.gather(
                clients[0].binding_within(server, CHANGE_IP | CHANGE_PORT, window_s),
                clients[1].binding_within(server, CHANGE_PORT, window_s),
            )
            if from_other_address is not None:
                findings.filtering = Mapping.ENDPOINT_INDEPENDENT
            elif from_other_port is not None:
                findings.filtering = Mapping.ADDRESS_DEPENDENT
            else:
                findings.filtering = Mapping.ADDRESS_AND_PORT_DEPENDENT
            return findings
        from_other_port = await clients[0].binding_within(server, CHANGE_PORT, window_s)
        if from_other_port is None:
            findings.filtering = Mapping.ADDRESS_AND_PORT_DEPENDENT
        else:
            findings.notes.append(
                "the rendezvous has one address: replies from another port get in, but whether replies "
                "from another address would cannot be tested"
            )
        return findings
    finally:
        for client in clients:
            if client.transport is not None:
                client.transport.close()


async def probe_nat(server: Address, bind_host: str = "0.0.0.0") -> NatReport:
    """Run the RFC 5780 tests against a rendezvous's STUN port and classify the result: the round
    trips first, then the mapping tests and the filtering tests at once (their sockets differ, and
    the filtering tests' wait is taken from the round trips)."""
    client = await _socket(bind_host)
    try:
        rtts: list[float] = []
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
        tests = [
            asyncio.ensure_future(_mapping_tests(client, server, other, first)),
            asyncio.ensure_future(_filtering_tests(bind_host, server, other is not None, silence_window(rtts))),
        ]
        try:
            mapped, filtered = await asyncio.gather(*tests)
        finally:  # one failing ends the other, its sockets closed
            for test in tests:
                test.cancel()
            await asyncio.gather(*tests, return_exceptions=True)
    finally:
        if client.transport is not None:
            client.transport.close()
    findings = _Findings(mapped.notes + filtered.notes, mapped.mapping, filtered.filtering)
    local = (outgoing_address(server) if local[0] == "0.0.0.0" else local[0], local[1])
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
