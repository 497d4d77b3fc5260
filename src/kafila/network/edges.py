"""Bring up all of one member's links at once: hole-punched where possible, relayed where not.

A member needs several pinned links at the same time (its ring predecessor, its ring successor
and, for control, the host), and both ends of every edge set it up together. `connect_edges`
does this for one member, one task per peer, all over the member's one `DatagramDemux`:

1. **Punch.** Every edge has its own 8-byte punch session, a hash of the session id and the two
   member ids (the same at both ends, whichever calls it). One router per demux owns the punch
   first bytes (`punch.PROBE`, `punch.ACK`) and hands each packet to the `PunchCore` of its
   session, so any number of punches share the socket. Probes go out through the demux; the
   low-TTL priming packets go straight from the demux's socket (a duplicate of its descriptor)
   with the TTL lowered just for them, as `punch()` does.
2. **Direct link.** If the punch found a path, open the pinned QUIC link on the demux to that
   address, the dialling side chosen by `should_dial`. The punch stays registered until the link
   is up (or fails), so a peer that has not yet heard our acknowledgement still gets one.
   Where both ends' NATs are known and let no punch through (`NatBehaviour.cannot_punch`: the
   planner's rule, from the pairs that never punched in the NAT lab), neither end punches: both
   read the same two NATs and ask for the relay at once, rather than after the punch's timeout.
3. **Relay.** If the punch found nothing, or the direct handshake did not finish within
   `DIRECT_HANDSHAKE_S`, ask the rendezvous for a relay on the edge (granted once the peer asks
   too), bind a fresh UDP socket of this edge's own to it and open the link through it. The
   relay forwards datagrams verbatim, so the link's TLS still runs end to end with the same
   pins. One socket per relayed edge keeps each relay binding (whose acknowledgement byte, 0x11,
   is also the punch probe's) apart from the punches and from every other relayed edge; that
   socket closes with its link.

Everything is bounded by one deadline: a peer that cannot be reached either way within
`timeout_s` is an `EdgeError` naming it, and then every link this call brought up is closed, so
the caller gets either all its edges or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kafila.contracts import NatBehaviour, NatClass
from kafila.network.identity import Identity
from kafila.network.link import (
    Address,
    DatagramDemux,
    Link,
    LinkConfig,
    LinkError,
    bind_relay,
    open_link,
    should_dial,
)
from kafila.network.punch import ACK, PROBE, PunchAttempt, PunchCore, Transmitter, session_of
from kafila.network.rendezvous import MemberInfo
from kafila.network.rendezvous_client import RendezvousClient, RendezvousError
from kafila.portability import ignore_udp_connection_resets

log = logging.getLogger("kafila.edges")

PUNCH_TIMEOUT_S = 4.0  # the most a punch may take; less when the whole timeout is short
PUNCH_SHARE = 0.4  # ...at most this share of it, leaving the rest for the relay
DIRECT_HANDSHAKE_S = 3.0  # a punched path whose QUIC handshake takes longer goes to the relay


class EdgeError(Exception):
    """No link to a peer, neither punched nor relayed, within the timeout.

    `peer_id` names the first peer that failed; `failures` holds every failed peer's reason.
    """

    def __init__(self, peer_id: str, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.peer_id = peer_id
        self.failures = failures if failures is not None else {peer_id: message}


@dataclass(frozen=True)
class Edge:
    """One pinned link to one peer, and how it goes."""

    link: Link
    path: Literal["direct", "relayed"]
    peer_id: str
    # A relayed edge's own socket (closed with its link); a direct edge uses the member's demux.
    relay_socket: DatagramDemux | None = field(default=None, repr=False, compare=False)

    async def close(self, reason: str = "goodbye") -> None:
        """Say goodbye on the link and release the edge's own socket, if it has one."""
        await self.link.close(reason)
        if self.relay_socket is not None:
            self.relay_socket.close()  # a datagram transport sends what it has queued first


def edge_session(session_id: str, a: str, b: str) -> bytes:
    """The 8-byte punch session of the edge between members `a` and `b`, in either order.

    It only tells punches apart, it authenticates nothing (QUIC's pins do that), and it goes
    out in clear text: `session_id` must not be secret (the code's channel half is fine, its
    secret half is not).
    """
    if a == b:
        raise ValueError("an edge joins two different members")
    low, high = sorted((a, b))
    return hashlib.sha256("\0".join(("kafila-punch/1", session_id, low, high)).encode()).digest()[:8]


def parse_candidates(candidates: Sequence[str], family: int = socket.AF_INET) -> list[Address]:
    """`IP:PORT` / `[IPv6]:PORT` candidates that a socket of `family` can send to; others are skipped."""
    version = 6 if family == socket.AF_INET6 else 4
    addresses: list[Address] = []
    for text in candidates:
        host, separator, port = text.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        except ValueError:
            continue
        if separator and port.isdigit() and 0 < int(port) < 65536 and ip.version == version:
            addresses.append((str(ip), int(port)))
    return addresses


class _PunchRouter:
    """Owns the punch first bytes on one demux and routes each packet to its session's attempt."""

    def __init__(self, demux: DatagramDemux) -> None:
        if demux.transport is None:
            raise ValueError("the demux has no socket yet")
        self.demux = demux
        # The transport's socket object only offers setsockopt; a duplicate descriptor is the
        # same socket and can also send the priming packets itself.
        self._raw = demux.transport.get_extra_info("socket").dup()
        self.transmit = Transmitter(self._raw, demux.sendto, demux.tap)
        self.attempts: dict[bytes, PunchAttempt] = {}
        self.users = 0
        demux.register([PROBE, ACK], self._received)

    def add(self, session: bytes, candidates: list[Address]) -> PunchAttempt:
        if session in self.attempts:
            raise ValueError("this edge is already being punched on this socket")
        attempt = PunchAttempt(PunchCore(session=session, candidates=candidates), self.transmit)
        self.attempts[session] = attempt
        return attempt

    def remove(self, session: bytes) -> None:
        self.attempts.pop(session, None)

    def _received(self, data: bytes, source: Address) -> None:
        session = session_of(data)
        attempt = self.attempts.get(session) if session is not None else None
        if attempt is None:  # another edge's late probe, or not a punch packet at all
            self.demux.dropped += 1
            return
        attempt.received(data, source)

    def close(self) -> None:
        self.demux.unregister([PROBE, ACK])
        self._raw.close()


_routers: dict[DatagramDemux, _PunchRouter] = {}


@contextlib.contextmanager
def _punch_router(demux: DatagramDemux) -> Iterator[_PunchRouter]:
    """The demux's router, shared by every `connect_edges` running on it at the time."""
    router = _routers.get(demux)
    if router is None:
        router = _routers[demux] = _PunchRouter(demux)
    router.users += 1
    try:
        yield router
    finally:
        router.users -= 1
        if router.users == 0:
            del _routers[demux]
            router.close()


def _bounded(config: LinkConfig, seconds: float) -> LinkConfig:
    """`config` with its handshake (or wait to be dialled) cut to `seconds`."""
    return config.model_copy(update={"handshake_timeout_s": max(0.05, min(config.handshake_timeout_s, seconds))})


async def _relay_socket(main: DatagramDemux) -> DatagramDemux:
    """A fresh socket for one relayed edge, on the member socket's address and family."""
    host = main.local_address[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind((host, 0))
        ignore_udp_connection_resets(sock)
        sock.setblocking(False)
        return await DatagramDemux.over(sock, main.tap, member_links=main.member_links)
    except BaseException:
        sock.close()
        raise


async def _resolve(address: Address, family: int) -> Address:
    """The relay's IP address: `bind_relay` matches the relay's answers by their source address."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(address[0], address[1], family=family, type=socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"cannot resolve the relay host {address[0]}")
    sockaddr = infos[0][4]
    return (str(sockaddr[0]), int(sockaddr[1]))


@dataclass
class _Context:
    client: RendezvousClient
    demux: DatagramDemux
    identity: Identity
    session_id: str
    config: LinkConfig
    router: _PunchRouter
    deadline: float  # loop time
    punch_timeout: float
    family: int
    own_nat: NatClass | NatBehaviour | None  # this member's, as it reported it to the rendezvous


def _may_punch(own: NatClass | NatBehaviour | None, peer: NatClass | NatBehaviour | None) -> bool:
    """False where both ends' NATs were measured (a behaviour, not a class, which is read as the
    worst it may be) and let no punch through (`NatBehaviour.cannot_punch`): the punch's timeout
    would only delay the relay."""
    if not isinstance(own, NatBehaviour) or not isinstance(peer, NatBehaviour):
        return True
    return not own.cannot_punch(peer)


async def _connect_one(ctx: _Context, peer: MemberInfo) -> Edge:
    """Punch, link directly or else through the relay; `EdgeError` if the deadline passes first."""
    loop = asyncio.get_running_loop()
    peer_id = peer.member_id
    who = f"{peer_id} ({peer.name})"
    notes: list[str] = []
    stage = "punching"
    try:
        dial = should_dial(ctx.identity.fingerprint, peer.fingerprint)
        async with asyncio.timeout_at(ctx.deadline):
            session = edge_session(ctx.session_id, ctx.client.member_id, peer_id)
            attempt = ctx.router.add(session, parse_candidates(peer.candidates, ctx.family))
            try:
                result = await attempt.run(ctx.punch_timeout) if _may_punch(ctx.own_nat, peer.capability.nat) else None
                if result is None:  # both ends read the same two NATs, so both go to the relay at once
                    notes.append("no punch: the two NATs let none through")
                elif result.path is None:
                    notes.append(f"no punch reply within {ctx.punch_timeout:.1f} s")
                else:
                    stage = "on the direct QUIC handshake"
                    remaining = ctx.deadline - loop.time()
                    config = _bounded(ctx.config, min(DIRECT_HANDSHAKE_S, remaining))
                    try:
                        link = await open_link(ctx.demux, result.path, ctx.identity, peer.fingerprint, dial, config)
                    except (LinkError, ValueError) as error:
                        notes.append(f"punched to {result.path[0]}:{result.path[1]}, but the link failed: {error}")
                    else:
                        log.info("edge to %s is direct, via %s:%d", who, *result.path)
                        return Edge(link, "direct", peer_id)
            finally:
                ctx.router.remove(session)  # a failed side stops answering, so both ends agree
            stage = f"waiting for the relay grant ({peer_id} has not asked for it)"
            grant = await ctx.client.request_relay(peer_id, timeout=None)
            relay = await _resolve(ctx.client.relay_address(grant), ctx.family)
            stage = "binding the relay"
            own = await _relay_socket(ctx.demux)
            try:
                await bind_relay(own, relay, bytes.fromhex(grant.relay_token), timeout=ctx.deadline - loop.time())
                stage = "on the QUIC handshake through the relay"
                config = _bounded(ctx.config, ctx.deadline - loop.time())
                link = await open_link(own, relay, ctx.identity, peer.fingerprint, dial, config)
            except BaseException:
                own.close()
                raise
            link.closed.add_done_callback(lambda _: own.close())
            log.info("edge to %s is relayed via %s:%d (%s)", who, *relay, "; ".join(notes))
            return Edge(link, "relayed", peer_id, own)
    except TimeoutError:
        reason = f"timed out {stage}"
    except (LinkError, RendezvousError, OSError, ValueError) as error:
        reason = f"failed {stage}: {error}"
    message = f"no link to {who}: {'; '.join([*notes, reason])}"
    log.warning("%s", message)
    raise EdgeError(peer_id, message)


async def connect_edges(
    client: RendezvousClient,
    demux: DatagramDemux,
    identity: Identity,
    session_id: str,
    peers: Sequence[MemberInfo],
    timeout_s: float = 10.0,
    *,
    config: LinkConfig | None = None,
) -> dict[str, Edge]:
    """Bring up one pinned link to each peer, concurrently: a hole punch over the demux first, the relay if it fails.

    Both ends of every edge call this at about the same time (each with its own list of peers;
    starting within a few hundred milliseconds of each other is what the punch's priming
    tolerates). `demux` is the member's one socket, whose address its candidates advertised;
    `session_id` is any non-secret string every member of the session shares (the code's channel
    half, say); each peer's `fingerprint` is pinned as given, so pass members whose
    fingerprints the trust exchange vouched for. A peer listed twice gets one edge. `config`
    sets the links' timings; handshakes are cut to fit the timeout.

    Returns peer id → `Edge`. Raises `EdgeError` naming the peer if neither path works within
    `timeout_s`; every link this call brought up is then closed.
    """
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    unique: dict[str, MemberInfo] = {}
    for peer in peers:
        if peer.member_id == client.member_id:
            raise ValueError(f"{peer.member_id} is this member: no edge to itself")
        unique.setdefault(peer.member_id, peer)
    if not unique:
        return {}
    loop = asyncio.get_running_loop()
    host = demux.local_address[0]
    with _punch_router(demux) as router:
        ctx = _Context(
            client=client,
            demux=demux,
            identity=identity,
            session_id=session_id,
            config=config or LinkConfig(),
            router=router,
            deadline=loop.time() + timeout_s,
            punch_timeout=min(PUNCH_TIMEOUT_S, PUNCH_SHARE * timeout_s),
            family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            own_nat=own.capability.nat if (own := client.members.get(client.member_id)) is not None else None,
        )
        tasks = {peer_id: asyncio.create_task(_connect_one(ctx, peer)) for peer_id, peer in unique.items()}
        try:
            await asyncio.wait(tasks.values())
        except BaseException:  # cancelled: take everything down with us
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await _close_all([t.result() for t in tasks.values() if not t.cancelled() and t.exception() is None])
            raise
    edges = {peer_id: task.result() for peer_id, task in tasks.items() if task.exception() is None}
    failures: dict[str, EdgeError] = {}
    for peer_id, task in tasks.items():
        error = task.exception()
        if isinstance(error, EdgeError):
            failures[peer_id] = error
        elif error is not None:  # a bug, not an unreachable peer: close what came up and say so
            await _close_all(list(edges.values()))
            raise error
    if failures:
        await _close_all(list(edges.values()))
        first = next(iter(failures))
        message = "; ".join(str(error) for error in failures.values())
        raise EdgeError(first, message, {peer_id: str(error) for peer_id, error in failures.items()})
    return edges


async def _close_all(edges: list[Edge]) -> None:
    for edge in edges:
        await edge.close("the member could not bring up all its edges")
