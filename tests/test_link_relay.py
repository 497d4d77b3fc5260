"""A QUIC link carried by the rendezvous's relay: still pinned end to end, the relay sees ciphertext."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from test_link import FAST, WAIT, bound_socket, exchange, run, shut

from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, LinkDead, bind_relay, open_link, should_dial
from kafila.network.relay import RECEIVE_BUFFER, RelayServer
from kafila.wire.frames import DType, Frame, Kind

MARKER = b"KAFILA-SECRET-ACTIVATION-MARKER"


def test_link_through_the_relay_carries_frames_and_only_ciphertext() -> None:
    async def body() -> None:
        relay = RelayServer("127.0.0.1")
        tokens = (os.urandom(16), os.urandom(16))
        port = await relay.open("edge-1", "session-1", tokens)
        relay_address = ("127.0.0.1", port)
        # a burst waits in the allocation's socket instead of being dropped (docs/benchmarks.md)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as default:
            kernels = default.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        granted = (
            relay._sockets["edge-1"].transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        )
        assert granted >= min(RECEIVE_BUFFER, int(Path("/proc/sys/net/core/rmem_max").read_text())) > kernels
        seen_by_relay: list[bytes] = []

        def tap(direction: str, data: bytes, address: tuple[str, int]) -> None:
            if direction == "out" and address == relay_address:
                seen_by_relay.append(data)

        a = await DatagramDemux.over(bound_socket(), tap)
        b = await DatagramDemux.over(bound_socket(), tap)
        await asyncio.wait_for(
            asyncio.gather(bind_relay(a, relay_address, tokens[0]), bind_relay(b, relay_address, tokens[1])), WAIT
        )
        a_id, b_id = create_identity(), create_identity()
        dial = should_dial(a_id.fingerprint, b_id.fingerprint)
        link_a, link_b = await asyncio.wait_for(
            asyncio.gather(
                open_link(a, relay_address, a_id, b_id.fingerprint, dial, FAST),
                open_link(b, relay_address, b_id, a_id.fingerprint, not dial, FAST),
            ),
            WAIT,
        )
        try:
            await exchange(link_a, link_b, 200, DType.F32)
            secret = Frame(Kind.PING, 7, payload=MARKER * 4)
            await link_a.send(secret)
            assert (await asyncio.wait_for(link_b.receive(), WAIT)).payload == MARKER * 4
            assert len(seen_by_relay) > 100
            assert not any(MARKER in datagram for datagram in seen_by_relay)
        finally:
            await shut(link_a, link_b, a, b)
            relay.close()

    run(body)


def test_an_unpaired_relay_edge_times_out_clearly() -> None:
    async def body() -> None:
        relay = RelayServer("127.0.0.1")
        port = await relay.open("edge-1", "session-1", (os.urandom(16), os.urandom(16)))
        demux = await DatagramDemux.over(bound_socket())
        try:
            try:
                await bind_relay(demux, ("127.0.0.1", port), os.urandom(16), timeout=0.5)
            except LinkDead as error:
                assert "did not pair" in str(error)
            else:
                raise AssertionError("a wrong token must not pair")
        finally:
            demux.close()
            relay.close()

    run(body)
