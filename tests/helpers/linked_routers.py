"""Two `LinkRouter`s over one real QUIC link on loopback: a host's end and a member's."""

from __future__ import annotations

import asyncio
import socket

from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, LinkConfig, open_link, should_dial
from kafila.session.router import LinkRouter

FAST = LinkConfig(idle_timeout_s=2.0, handshake_timeout_s=3.0)  # a dead peer is seen in seconds


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def linked_routers(config: LinkConfig = FAST) -> tuple[LinkRouter, LinkRouter, list[DatagramDemux]]:
    """The host's router (its peer named "member"), the member's (its peer "host"), and both
    demuxes, for the caller to close."""
    host_id, member_id = create_identity(), create_identity()
    a, b = await DatagramDemux.over(loopback_socket()), await DatagramDemux.over(loopback_socket())
    dial = should_dial(host_id.fingerprint, member_id.fingerprint)
    host_link, member_link = await asyncio.gather(
        open_link(a, b.local_address, host_id, member_id.fingerprint, dial, config),
        open_link(b, a.local_address, member_id, host_id.fingerprint, not dial, config),
    )
    return LinkRouter(host_link, "member"), LinkRouter(member_link, "host"), [a, b]
