"""What a machine brings to a session (`session.presence`), against a real rendezvous on loopback:
the NAT tests a host begins before its event loop runs give the same presence as tests run then."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kafila.contracts import FleetDevice, Mapping, NatBehaviour
from kafila.network.rendezvous_server import start_rendezvous
from kafila.session.presence import NatTests, Presence, RendezvousUnreachable, present

DEVICE = FleetDevice(name="unnamed", memory_gib=8.0, bandwidth_gb_s=50.0, tflops=1.0)


def presences() -> tuple[Presence, Presence]:
    """This machine's presence at a rendezvous with two addresses, once with the NAT tests run as it
    presents itself and once with tests begun before (in their own thread, as `kafila host` does)."""

    async def scenario() -> tuple[Presence, Presence]:
        handle = await start_rendezvous("127.0.0.1", 0, 0, alt_address="127.0.0.2")
        try:
            address = handle.http_address
            begun = NatTests(address)  # its thread runs while this loop goes on
            plain = await present("plain", address, DEVICE, bind_ip="127.0.0.1")
            early = await present("early", address, DEVICE, bind_ip="127.0.0.1", begun=begun)
            for presence in (plain, early):
                presence.sock.close()
            return plain, early
        finally:
            await handle.close()

    return asyncio.run(scenario())


def test_nat_tests_begun_early_give_what_tests_run_on_presenting_give() -> None:
    plain, early = presences()
    open_path = (Mapping.ENDPOINT_INDEPENDENT, Mapping.ENDPOINT_INDEPENDENT)
    for presence in (plain, early):
        nat = presence.capability.nat
        assert isinstance(nat, NatBehaviour) and (nat.mapping, nat.filtering) == open_path
        assert presence.capability.rtt_ms is not None and presence.capability.rtt_ms > 0
    assert (early.url, early.stun) == (plain.url, plain.stun)
    assert early.capability.name == "early" and early.candidates[0].startswith("127.0.0.1:")


def test_nat_tests_begun_against_a_rendezvous_that_is_nowhere_say_so_where_presence_is_asked() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        nowhere = ("127.0.0.1", closed.getsockname()[1])  # bound, never listening: refused

    async def scenario() -> None:
        await present("early", nowhere, DEVICE, bind_ip="127.0.0.1", begun=NatTests(nowhere))

    with pytest.raises(RendezvousUnreachable, match=r"no kafila rendezvous answers at 127\.0\.0\.1"):
        asyncio.run(scenario())
