"""Several edges per member at once, on loopback, introduced by a real rendezvous (no mocks).

Each member owns one socket (its demux) and advertises it as its candidate; every member calls
`connect_edges` for its peers at the same time. Punches share the socket; relayed edges get a
socket each; every link is pinned QUIC and carries frames both ways.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_link import bound_socket, exchange
from test_rendezvous import capability

from kafila.network import edges as edges_module
from kafila.network.edges import Edge, EdgeError, connect_edges, edge_session, parse_candidates
from kafila.network.identity import Identity, create_identity
from kafila.network.link import DatagramDemux, LinkClosed, LinkConfig
from kafila.network.punch import PROBE
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous
from kafila.wire.frames import DType, Frame, Kind

UNREACHABLE = "127.0.0.1:9"  # nothing answers there: a member advertising only this cannot be punched to
# Three members, the rendezvous and its relay share this process's one event loop, and nothing here
# tests a dead link or how soon frames arrive: an idle bound and a wait for each frame far past what
# a loaded machine stalls that loop (CI, running three tests on two cores, saw a relayed link hear
# nothing for 4.5 s where the bound was 3; with two CPU burners, a frame of the relayed exchanges
# came more than 15 s after the one before)
CONFIG = LinkConfig(idle_timeout_s=60.0)
WAIT_S = 60.0  # the bound on any one await here
MARKER = b"KAFILA-EDGE-SECRET-MARKER"
Address = tuple[str, int]


@dataclass
class Member:
    client: RendezvousClient
    demux: DatagramDemux
    identity: Identity
    sent: list[tuple[bytes, Address]] = field(default_factory=list)  # everything any of its sockets sent

    @property
    def id(self) -> str:
        return self.client.member_id


def run(body: Callable[[], Awaitable[Any]], timeout: float = 240) -> Any:
    return asyncio.run(asyncio.wait_for(body(), timeout))


@asynccontextmanager
async def session(count: int, unreachable: frozenset[int] = frozenset()) -> AsyncIterator[list[Member]]:
    """A real rendezvous and `count` members, each with its own socket; those in `unreachable`
    advertise a dead candidate instead of their socket's address."""
    handle = await start_rendezvous("127.0.0.1", 0, 0)
    members: list[Member] = []
    try:
        for index in range(count):
            sent: list[tuple[bytes, Address]] = []

            def tap(direction: str, data: bytes, address: Address, sent: list[tuple[bytes, Address]] = sent) -> None:
                if direction == "out":
                    sent.append((data, address))

            demux = await DatagramDemux.over(bound_socket(), tap)
            identity = create_identity(name=f"member-{index}")
            port = demux.local_address[1]
            options: dict[str, Any] = {
                "capability": capability(f"member-{index}"),
                "fingerprint": identity.fingerprint,
                "candidates": [UNREACHABLE if index in unreachable else f"127.0.0.1:{port}"],
            }
            if index == 0:
                client = await RendezvousClient.open(handle.url, model="m", expected_members=count, **options)
            else:
                client = await RendezvousClient.join(handle.url, members[0].client.code, **options)
            members.append(Member(client, demux, identity, sent))
        await asyncio.gather(*(m.client.wait_ready(5) for m in members))
        yield members
    finally:
        for member in members:
            await member.client.close()
            member.demux.close()
        await handle.close()


def peers_of(member: Member) -> list[Any]:
    assert member.client.ready is not None
    return [info for info in member.client.ready.members if info.member_id != member.id]


async def connect_all(members: list[Member], timeout_s: float = 10.0) -> list[dict[str, Edge]]:
    return await asyncio.gather(
        *(
            connect_edges(m.client, m.demux, m.identity, m.client.code, peers_of(m), timeout_s, config=CONFIG)
            for m in members
        )
    )


async def exchange_everywhere(members: list[Member], edges: list[dict[str, Edge]]) -> None:
    """1,000 frames each way on every edge, all edges at once."""
    pairs = [(i, j) for i in range(len(members)) for j in range(i + 1, len(members))]
    await asyncio.gather(
        *(
            exchange(edges[i][members[j].id].link, edges[j][members[i].id].link, 1000, DType.F16, WAIT_S)
            for i, j in pairs
        )
    )


async def close_all(edges: list[dict[str, Edge]]) -> None:
    for mine in edges:
        for edge in mine.values():
            await edge.close()
    await asyncio.sleep(0.05)


def test_edge_sessions_are_per_edge_and_order_independent() -> None:
    assert edge_session("42-apple", "m1", "m2") == edge_session("42-apple", "m2", "m1")
    assert len(edge_session("42-apple", "m1", "m2")) == 8
    assert len({edge_session("42-apple", a, b) for a, b in [("m1", "m2"), ("m1", "m3"), ("m2", "m3")]}) == 3
    assert edge_session("42-apple", "m1", "m2") != edge_session("43-apple", "m1", "m2")
    with pytest.raises(ValueError):
        edge_session("s", "m1", "m1")
    assert parse_candidates(["10.0.0.1:5000", "[::1]:6000", "bad", "10.0.0.2:0"]) == [("10.0.0.1", 5000)]


def test_three_members_bring_up_all_their_edges_at_once() -> None:
    async def body() -> None:
        async with session(3) as members:
            started = time.monotonic()
            edges = await connect_all(members)
            took = time.monotonic() - started
            try:
                for member, mine in zip(members, edges, strict=True):
                    assert set(mine) == {m.id for m in members} - {member.id}
                    for peer_id, edge in mine.items():
                        peer = next(m for m in members if m.id == peer_id)
                        assert edge.path == "direct" and edge.peer_id == peer_id
                        assert edge.link.peer_address == peer.demux.local_address
                        assert edge.link.demux is member.demux and edge.relay_socket is None
                assert took < 5, f"three direct edges took {took:.2f} s"
                await exchange_everywhere(members, edges)
                assert not edges_module._routers  # the punch router left with the last call
                assert all(PROBE not in m.demux._handlers for m in members)
            finally:
                await close_all(edges)

    run(body)


def test_unpunchable_edges_go_through_the_relay_and_stay_encrypted() -> None:
    """Members 1 and 2 advertise only a dead address: their edge cannot punch and is relayed,
    while each still punches to member 0 (which hears their probes and answers where they came
    from). So members 1 and 2 each hold one direct and one relayed edge at once."""

    async def body() -> None:
        async with session(3, unreachable=frozenset({1, 2})) as members:
            edges = await connect_all(members, timeout_s=6.0)
            try:
                paths = {
                    (m.id, peer): edge.path
                    for m, mine in zip(members, edges, strict=True)
                    for peer, edge in mine.items()
                }
                a, b, c = (m.id for m in members)
                assert paths == {
                    (a, b): "direct",
                    (a, c): "direct",
                    (b, a): "direct",
                    (b, c): "relayed",
                    (c, a): "direct",
                    (c, b): "relayed",
                }
                relayed = edges[1][c]
                grant = members[1].client.grants[c]
                relay = members[1].client.relay_address(grant)
                assert relayed.link.peer_address == relay and edges[2][b].link.peer_address == relay
                assert relayed.relay_socket is not None and relayed.link.demux is relayed.relay_socket
                assert relayed.relay_socket is not edges[2][b].relay_socket
                # its ring frames answer what its direct edge brings, and the other way round
                assert set(members[1].demux.member_links) == {edges[1][a].link, relayed.link}
                assert relayed.relay_socket.member_links is members[1].demux.member_links
                await exchange_everywhere(members, edges)
                await relayed.link.send(Frame(Kind.PING, 7, payload=MARKER * 4))
                assert (await asyncio.wait_for(edges[2][b].link.receive(), WAIT_S)).payload == MARKER * 4
                to_relay = [data for m in members for data, address in m.sent if address == relay]
                assert len(to_relay) > 100
                assert not any(MARKER in data for data in to_relay)  # the relay saw only ciphertext
                own = relayed.relay_socket
            finally:
                await close_all(edges)
            await asyncio.wait_for(asyncio.shield(own.closed), WAIT_S)  # a relayed edge's socket goes with it

    run(body)


def test_every_edge_relayed_when_nobody_can_be_punched() -> None:
    async def body() -> None:
        async with session(3, unreachable=frozenset({0, 1, 2})) as members:
            edges = await connect_all(members, timeout_s=6.0)
            try:
                assert all(edge.path == "relayed" for mine in edges for edge in mine.values())
                await exchange_everywhere(members, edges)
            finally:
                await close_all(edges)

    run(body)


def test_a_peer_that_never_shows_up_is_an_edge_error_within_the_timeout() -> None:
    """Member 2 never calls. Member 0 fails naming it, and closes its working edge to member 1."""

    async def body() -> None:
        async with session(3) as members:
            first, second, absent = members
            started = time.monotonic()
            # An order, not a duration: a timer on the same loop at twice the timeout, which a
            # loaded machine delays as it delays the give-up.
            twice_the_timeout = asyncio.ensure_future(asyncio.sleep(2 * 3.0))
            results = await asyncio.gather(
                connect_edges(first.client, first.demux, first.identity, first.client.code, peers_of(first), 3.0),
                connect_edges(
                    second.client,
                    second.demux,
                    second.identity,
                    second.client.code,
                    [second.client.members[first.id]],
                    3.0,
                ),
                return_exceptions=True,
            )
            took = time.monotonic() - started
            error, edges = results
            assert isinstance(error, EdgeError), error
            assert error.peer_id == absent.id and set(error.failures) == {absent.id}
            assert absent.id in str(error) and "relay" in str(error)
            assert took >= 3.0, f"gave up after {took:.2f} s, before its timeout"
            assert not twice_the_timeout.done(), f"gave up only after twice its timeout ({took:.2f} s)"
            twice_the_timeout.cancel()
            assert isinstance(edges, dict) and edges[first.id].path == "direct"
            reason = await asyncio.wait_for(asyncio.shield(edges[first.id].link.closed), WAIT_S)
            assert isinstance(reason, LinkClosed)  # all or nothing: member 0 took its edge down
            await edges[first.id].close()
            assert not edges_module._routers

    run(body)
