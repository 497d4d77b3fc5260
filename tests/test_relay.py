"""The UDP relay: the sans-IO core, then real sockets relayed through an allocation granted by signalling."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.contracts import FleetDevice
from kafila.network.limits import TokenBucket
from kafila.network.relay import HELLO, HELLO_ACK, PAIRED, WAITING, Relay, RelayLimits, hello, parse_ack
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous

T = TypeVar("T")
A, B, C = ("192.0.2.1", 4000), ("198.51.100.2", 5000), ("203.0.113.3", 6000)
TA, TB = bytes(range(16)), bytes(range(16, 32))
MARKER = b"KAFILA-MARKER-7f3a"


def bound_relay(limits: RelayLimits | None = None) -> Relay:
    relay = Relay(limits)
    relay.allocate("r-1", "s-1", (TA, TB))
    assert relay.datagram("r-1", hello(TA), A, 0.0) == [(bytes([HELLO_ACK, WAITING]), A)]
    assert relay.datagram("r-1", hello(TB), B, 0.0) == [(bytes([HELLO_ACK, PAIRED]), B)]
    return relay


def test_binding_datagram_format() -> None:
    assert hello(TA) == b"\x10" + TA and HELLO == 0x10
    assert not 0 <= HELLO <= 3 and HELLO < 64  # neither STUN nor QUIC
    with pytest.raises(ValueError, match="16 bytes"):
        hello(b"short")
    assert parse_ack(bytes([HELLO_ACK, WAITING])) is False and parse_ack(bytes([HELLO_ACK, PAIRED])) is True
    for other in (b"", b"\x11", b"\x11\x02", b"\x10\x01", b"\x11\x01\x00"):
        assert parse_ack(other) is None


def test_nothing_is_forwarded_until_both_sides_are_bound() -> None:
    relay = Relay()
    relay.allocate("r-1", "s-1", (TA, TB))
    assert relay.datagram("r-1", b"\x40early", A, 0.0) == []  # not bound yet
    assert relay.datagram("r-1", hello(TA), A, 0.0) == [(bytes([HELLO_ACK, WAITING]), A)]
    assert relay.datagram("r-1", b"\x40alone", A, 0.0) == []  # bound, but nobody to send to
    assert relay.allocations["r-1"].counts == {"datagrams": 0, "bytes": 0, "unbound": 1, "unpaired": 1, "over_rate": 0}


def test_bound_sides_are_forwarded_verbatim_and_strangers_dropped() -> None:
    relay = bound_relay()
    payload = b"\x41" + MARKER + os.urandom(64)
    assert relay.datagram("r-1", payload, A, 1.0) == [(payload, B)]
    assert relay.datagram("r-1", b"\x00\x01stun", B, 1.0) == [(b"\x00\x01stun", A)]
    assert relay.datagram("r-1", payload, C, 1.0) == []
    assert relay.datagram("r-1", hello(bytes(16)), C, 1.0) == []  # a wrong token earns no answer
    opaque = b"\x10" + bytes(16)  # shaped like a binding datagram, but not a token: just data
    assert relay.datagram("r-1", opaque, A, 1.0) == [(opaque, B)]
    assert relay.datagram("r-1", hello(TA), A, 1.0) == [(bytes([HELLO_ACK, PAIRED]), A)]  # a keep-alive, not data
    assert relay.datagram("r-unknown", payload, A, 1.0) == []


def test_one_socket_cannot_be_both_ends() -> None:
    relay = Relay()
    relay.allocate("r-1", "s-1", (TA, TB))
    relay.datagram("r-1", hello(TA), A, 0.0)
    assert relay.datagram("r-1", hello(TB), A, 0.0) == []
    assert relay.allocations["r-1"].sides[1].address is None


def test_a_side_can_rebind_after_its_nat_moves() -> None:
    relay = bound_relay()
    moved = ("192.0.2.1", 4999)
    assert relay.datagram("r-1", hello(TA), moved, 1.0) == [(bytes([HELLO_ACK, PAIRED]), moved)]
    assert relay.datagram("r-1", b"\x40old", A, 1.0) == []
    assert relay.datagram("r-1", b"\x40from B", B, 1.0) == [(b"\x40from B", moved)]


def test_each_session_has_its_own_byte_budget() -> None:
    relay = bound_relay(RelayLimits(bytes_per_s_per_session=1000, burst_bytes=2000))
    relay.allocate("r-2", "s-1", (b"\x01" * 16, b"\x02" * 16))
    relay.allocate("r-3", "s-2", (b"\x03" * 16, b"\x04" * 16))
    for relay_id, (ta, tb) in (("r-2", (b"\x01" * 16, b"\x02" * 16)), ("r-3", (b"\x03" * 16, b"\x04" * 16))):
        relay.datagram(relay_id, hello(ta), A, 0.0)
        relay.datagram(relay_id, hello(tb), B, 0.0)
    block = b"\x40" * 1000
    assert relay.datagram("r-1", block, A, 0.0) and relay.datagram("r-2", block, A, 0.0)
    assert relay.datagram("r-1", block, A, 0.0) == []  # the session's burst is spent, across both allocations
    assert relay.datagram("r-3", block, A, 0.0) == [(block, B)]  # another session is not
    assert relay.datagram("r-1", block, A, 1.0) == [(block, B)]  # a second later, 1000 bytes more
    assert relay.allocations["r-1"].counts["over_rate"] == 1


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=10, burst=20)
    assert bucket.take(20, 0.0) and not bucket.take(1, 0.0)
    assert bucket.take(10, 1.0) and not bucket.take(1, 1.0)
    assert bucket.take(20, 100.0) and not bucket.take(1, 99.0)  # time going backwards gives nothing


def test_freeing_forgets_the_allocation_and_its_budget() -> None:
    relay = bound_relay()
    assert relay.free("r-1") and not relay.free("r-1")
    assert relay.datagram("r-1", b"\x40late", A, 1.0) == [] and relay.buckets == {}


def test_allocations_are_validated() -> None:
    relay = Relay()
    relay.allocate("r-1", "s-1", (TA, TB))
    with pytest.raises(ValueError, match="already"):
        relay.allocate("r-1", "s-1", (TA, TB))
    with pytest.raises(ValueError, match="distinct"):
        relay.allocate("r-2", "s-1", (TA, TA))
    with pytest.raises(ValueError, match="16-byte"):
        relay.allocate("r-3", "s-1", (TA, b"short"))


def test_relay_events_hold_no_tokens_or_payloads() -> None:
    relay = bound_relay()
    relay.datagram("r-1", b"\x41" + MARKER, A, 1.0)
    relay.free("r-1")
    text = repr(list(relay.events))
    assert "relay_bound" in text and "relay_freed" in text
    assert MARKER.decode() not in text and TA.hex() not in text and repr(TA) not in text


@given(
    st.lists(
        st.tuples(
            st.sampled_from([A, B, C, ("192.0.2.1", 4001)]),
            st.binary(max_size=40) | st.sampled_from([hello(TA), hello(TB), hello(bytes(16))]),
            st.floats(0, 10),
        ),
        max_size=40,
    )
)
@settings(max_examples=300, deadline=None)
def test_random_datagrams_never_raise_and_only_bound_sides_are_heard(
    steps: list[tuple[tuple[str, int], bytes, float]],
) -> None:
    relay = Relay(RelayLimits(bytes_per_s_per_session=100, burst_bytes=200))
    allocation = relay.allocate("r-1", "s-1", (TA, TB))
    now = 0.0
    for source, data, advance in steps:
        now += advance
        bound_before = [side.address for side in allocation.sides]
        for payload, destination in relay.datagram("r-1", data, source, now):
            if data in (hello(TA), hello(TB)):  # a binding datagram is answered, never forwarded
                assert parse_ack(payload) is not None and destination == source
            else:
                assert payload == data and source in bound_before and destination in bound_before
                assert destination != source


# -- real sockets ------------------------------------------------------------------------------


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 20) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


class UdpPeer(asyncio.DatagramProtocol):
    """A member's UDP socket on loopback, with a queue of what it hears."""

    def __init__(self) -> None:
        self.heard: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        self.heard.put_nowait((data, (str(addr[0]), int(addr[1]))))

    @classmethod
    async def create(cls) -> UdpPeer:
        _, peer = await asyncio.get_running_loop().create_datagram_endpoint(cls, local_addr=("127.0.0.1", 0))
        return peer

    def send(self, data: bytes, address: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data, address)

    async def receive(self, timeout: float = 2.0) -> bytes:
        data, _ = await asyncio.wait_for(self.heard.get(), timeout)
        return data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def payload(sender: bytes, sequence: int) -> bytes:
    return b"\x41" + sender + struct.pack(">I", sequence) + MARKER + os.urandom(40 + (sequence * 37) % 900)


FP = "ef" * 32


@pytest.mark.parametrize("who_leaves", ["host", "member"])
def test_two_sockets_relayed_through_a_real_allocation(caplog: pytest.LogCaptureFixture, who_leaves: str) -> None:
    caplog.set_level(logging.DEBUG)

    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        peers: list[UdpPeer] = []
        try:
            host = await RendezvousClient.open(
                handle.url,
                model="m",
                expected_members=2,
                capability=FleetDevice(name="h", memory_gib=4),
                fingerprint=FP,
            )
            member = await RendezvousClient.join(
                handle.url, host.code, capability=FleetDevice(name="j", memory_gib=4), fingerprint=FP
            )
            await host.wait_ready(5)
            grant_a, grant_b = await asyncio.gather(host.request_relay("m2", 5), member.request_relay("m1", 5))
            assert grant_a.relay_id == grant_b.relay_id and grant_a.relay_token != grant_b.relay_token
            relay = host.relay_address(grant_a)
            assert relay == ("127.0.0.1", grant_a.port) and handle.relay.port(grant_a.relay_id) == grant_a.port
            a, b, stranger = peers[:] = [await UdpPeer.create() for _ in range(3)]

            a.send(hello(bytes.fromhex(grant_a.relay_token)), relay)
            assert parse_ack(await a.receive()) is False
            b.send(hello(bytes.fromhex(grant_b.relay_token)), relay)
            assert parse_ack(await b.receive()) is True

            stranger.send(hello(os.urandom(16)), relay)
            stranger.send(b"\x41" + MARKER + b" from a stranger", relay)
            sent = {b"A": [payload(b"A", i) for i in range(200)], b"B": [payload(b"B", i) for i in range(200)]}
            heard: dict[bytes, list[bytes]] = {b"A": [], b"B": []}
            for start in range(0, 200, 20):  # windows of 20: socket buffers never overflow on loopback
                for i in range(start, start + 20):
                    a.send(sent[b"A"][i], relay)
                    b.send(sent[b"B"][i], relay)
                for _ in range(20):
                    heard[b"A"].append(await b.receive())
                    heard[b"B"].append(await a.receive())
            assert heard == sent  # intact, in order, and the stranger's datagram is not among them
            with pytest.raises(TimeoutError):
                await stranger.receive(0.3)
            counts = handle.relay.core.allocations[grant_a.relay_id].counts
            assert counts["datagrams"] == 400 and counts["unbound"] >= 1

            leaver = host if who_leaves == "host" else member
            await leaver.leave()
            async with asyncio.timeout(3):
                while handle.relay.port(grant_a.relay_id) is not None:
                    await asyncio.sleep(0.01)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind(("127.0.0.1", grant_a.port))  # the port is free again
            a.send(b"\x41after", relay)
            with pytest.raises(TimeoutError):
                await b.receive(0.3)
            await host.close()
            await member.close()
        finally:
            for peer in peers:
                peer.close()
            await handle.close()

    run(scenario())
    records = caplog.records
    assert any(getattr(r, "kafila_event", {}).get("event") == "relay_freed" for r in records)
    for record in records:
        text = record.getMessage() + repr(record.__dict__)
        assert MARKER.decode() not in text and MARKER.hex() not in text
