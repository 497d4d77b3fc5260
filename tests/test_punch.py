"""Hole punching: the sans-IO core, and two real sockets on loopback (the lab tests real NATs)."""

from __future__ import annotations

import asyncio
import socket

from kafila.network.punch import ACK, PACKET, PRIMING_S, PRIMING_TTL, PROBE, PunchCore, punch

PEER = ("198.51.100.9", 5000)
SESSION = b"s" * 8


def test_start_primes_with_a_low_ttl_then_probes() -> None:
    core = PunchCore(session=SESSION, candidates=[PEER, ("192.0.2.9", 5000)])
    priming = core.start(0.0)
    assert len(priming) == 6 and all(p.ttl == PRIMING_TTL for p in priming)
    assert all(PACKET.unpack(p.data)[0] == PROBE for p in priming)
    assert core.tick(0.01) == []  # paced
    assert all(p.ttl == PRIMING_TTL for p in core.tick(0.06))  # still priming
    probes = core.tick(PRIMING_S + 0.01)
    assert {p.address for p in probes} == {PEER, ("192.0.2.9", 5000)} and all(p.ttl is None for p in probes)


def test_a_probe_is_answered_where_it_came_from_and_an_ack_completes() -> None:
    core = PunchCore(session=SESSION, candidates=[PEER])
    core.start(0.0)
    reflexive = ("198.51.100.9", 61000)  # the peer's NAT picked another port toward us
    (ack,) = core.received(PACKET.pack(PROBE, SESSION, b"p" * 8), reflexive)
    assert ack.address == reflexive and PACKET.unpack(ack.data)[0] == ACK
    assert reflexive in {p.address for p in core.tick(1.0)}  # probed from now on as well
    assert core.received(PACKET.pack(ACK, SESSION, b"p" * 8), reflexive) == []
    assert core.done and core.path == reflexive


def test_foreign_own_and_garbage_packets_are_ignored() -> None:
    core = PunchCore(session=SESSION, candidates=[PEER])
    core.start(0.0)
    assert core.received(PACKET.pack(ACK, b"x" * 8, b"p" * 8), PEER) == []
    assert core.received(PACKET.pack(ACK, SESSION, core.nonce), PEER) == []  # our own, looped back
    assert core.received(b"\x11garbage", PEER) == [] and core.received(b"", PEER) == []
    assert not core.done


def test_two_sockets_punch_on_loopback() -> None:
    async def run() -> tuple:
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        try:
            unreachable = ("127.0.0.1", 9)
            return await asyncio.gather(
                punch(a, SESSION, [unreachable, b.getsockname()], timeout=5),
                punch(b, SESSION, [a.getsockname()], timeout=5),
            )
        finally:
            a.close()
            b.close()

    first, second = asyncio.run(run())
    assert first.path is not None and second.path is not None
    assert first.seconds < 2 and second.seconds < 2


def test_nobody_there_gives_up_in_time() -> None:
    async def run():
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        try:
            return await punch(sock, SESSION, [("127.0.0.1", 9)], timeout=0.5)
        finally:
            sock.close()

    result = asyncio.run(run())
    assert result.path is None and 0.5 <= result.seconds < 1.5
