"""LAN discovery: the sans-IO core, a real embedded rendezvous found over loopback, broadcast
between two network namespaces on one LAN, and `kafila join CODE` without `--rendezvous`."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from natlab_fixtures import NatLab, natlab_required  # noqa: F401
from waiting import line_from

from kafila.network.discovery import (
    MAGIC,
    MAX_DATAGRAM_BYTES,
    MIN_REQUEST_BYTES,
    VERSION,
    DiscoveryError,
    DiscoveryLimits,
    DiscoveryResponder,
    decode_answer,
    decode_request,
    default_destinations,
    discover,
    encode_answer,
    encode_request,
    new_nonce,
    parse_route_broadcasts,
)
from kafila.network.rendezvous import Rendezvous
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous

T = TypeVar("T")
FP = "ab" * 32
CHANNEL = "7-crimson-harbor"
OTHER = "8-crimson-harbor"
LAN_IP = "192.168.1.20"


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 20) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


def responder(host: str | None = None, limits: DiscoveryLimits | None = None) -> DiscoveryResponder:
    return DiscoveryResponder(lambda channel: channel == CHANNEL, 8470, host, limits)


def capability(name: str) -> dict[str, Any]:
    return {"name": name, "memory_gib": 8.0}


async def open_session(url: str) -> RendezvousClient:
    return await RendezvousClient.open(url, model="m", expected_members=2, capability=capability("h"), fingerprint=FP)


# --- the sans-IO core ---------------------------------------------------------------------------


def test_a_request_for_a_held_channel_is_answered_with_the_nonce_and_port() -> None:
    nonce = new_nonce()
    request = encode_request(CHANNEL, nonce)
    assert request.startswith(MAGIC + bytes([VERSION])) and len(request) == MIN_REQUEST_BYTES
    parsed = decode_request(request)
    assert parsed is not None and parsed.channel == CHANNEL and parsed.nonce == nonce
    answer = responder().datagram_received(request, LAN_IP, 0.0)
    assert answer is not None
    assert decode_answer(answer, nonce, LAN_IP) == (LAN_IP, 8470)  # the address is where it came from
    assert decode_answer(answer, new_nonce(), LAN_IP) is None  # someone else's answer


def test_a_rendezvous_on_one_address_names_it_and_on_loopback_answers_only_this_machine() -> None:
    nonce = new_nonce()
    request = encode_request(CHANNEL, nonce)
    answer = responder("10.0.0.5").datagram_received(request, LAN_IP, 0.0)
    assert answer is not None and decode_answer(answer, nonce, LAN_IP) == ("10.0.0.5", 8470)
    assert responder("0.0.0.0").host is None and responder("::").host is None
    local = responder("127.0.0.1")
    assert local.datagram_received(request, LAN_IP, 0.0) is None  # it could not reach us anyway
    answer = local.datagram_received(request, "127.0.0.1", 0.0)
    assert answer is not None and decode_answer(answer, nonce, "127.0.0.1") == ("127.0.0.1", 8470)


def test_another_channel_is_not_answered_and_only_a_channel_can_be_asked_for() -> None:
    assert responder().datagram_received(encode_request(OTHER, new_nonce()), LAN_IP, 0.0) is None
    for not_a_channel in (f"{CHANNEL}-lemon-tiger-orbit-cactus", "7-crimson", "", "7-purple-people"):
        with pytest.raises(ValueError, match="not a session channel"):
            encode_request(not_a_channel, new_nonce())  # a full code's secret half cannot leave by mistake


def test_garbage_truncated_oversized_and_wrong_version_datagrams_are_ignored() -> None:
    core = responder()
    request = encode_request(CHANNEL, new_nonce())
    body = request[len(MAGIC) + 1 :].rstrip()
    bad = [
        b"",
        MAGIC,
        MAGIC + bytes([VERSION]),
        b"\x00" * 200,
        os.urandom(300),
        MAGIC + bytes([VERSION + 1]) + body.ljust(200),  # a version we do not speak
        b"XYZ" + bytes([VERSION]) + body.ljust(200),  # not ours at all
        request.ljust(MAX_DATAGRAM_BYTES + 1),  # oversized, though valid inside
        request[: len(MAGIC) + 1 + len(body) // 2].ljust(200),  # truncated JSON
        MAGIC + bytes([VERSION]) + body,  # unpadded: its answer would outweigh it
        MAGIC + bytes([VERSION]) + body.replace(b'"find"', b'"here"').ljust(200),  # an answer sent to us
        MAGIC + bytes([VERSION]) + body[:-1] + b',"extra":1}' + b" " * 100,  # unknown field
        MAGIC + bytes([VERSION]) + json.dumps({"type": "find", "channel": CHANNEL, "nonce": 5}).encode().ljust(200),
        MAGIC + bytes([VERSION]) + b'{"type": "find", "channel": "\xff\xfe"}'.ljust(200),
        MAGIC + bytes([VERSION]) + b"[" * 150,
    ]
    bad += [request[:cut] for cut in range(len(request))]
    for datagram in bad:
        assert core.datagram_received(datagram, LAN_IP, 0.0) is None, datagram
        assert decode_answer(datagram, "0" * 32, LAN_IP) is None
    assert core.answered == 0 and core.ignored == len(bad)


def test_an_answer_is_never_larger_than_the_request_that_caused_it() -> None:
    largest = encode_answer("f" * 32, 65535, "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255")
    assert len(largest) < MIN_REQUEST_BYTES
    nonce = new_nonce()
    assert decode_answer(encode_answer(nonce, 1, "::1"), nonce, LAN_IP) == ("::1", 1)
    with pytest.raises(ValueError):
        encode_answer(nonce, 8470, "not-an-address")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=200))
def test_nothing_a_sender_sends_raises(noise: bytes, tail: bytes) -> None:
    core = responder()
    for datagram in (noise, MAGIC + bytes([VERSION]) + noise, encode_request(CHANNEL, "0" * 32)[:40] + tail):
        assert core.datagram_received(datagram, LAN_IP, 0.0) is None
        assert decode_answer(datagram, "0" * 32, LAN_IP) is None


def test_each_source_is_rate_limited_on_its_own() -> None:
    core = responder(limits=DiscoveryLimits(requests_per_s=2.0, burst=5.0, max_tracked_ips=2))
    request = encode_request(CHANNEL, new_nonce())
    answers = [core.datagram_received(request, LAN_IP, 10.0) for _ in range(8)]
    assert sum(a is not None for a in answers) == 5  # the burst, then nothing
    assert core.datagram_received(request, "192.168.1.21", 10.0) is not None  # another source is unaffected
    assert core.datagram_received(request, LAN_IP, 10.4) is None
    assert core.datagram_received(request, LAN_IP, 10.6) is not None  # one more after half a second
    # Wrong channels and garbage with our magic count too: guessing channels is no cheaper.
    for _ in range(5):
        core.datagram_received(encode_request(OTHER, new_nonce()), "192.168.1.22", 20.0)
    assert core.datagram_received(request, "192.168.1.22", 20.0) is None
    assert core._rates.tracked <= 2  # the oldest sources are forgotten


def test_the_rendezvous_says_which_channels_it_holds() -> None:
    core = Rendezvous()
    core.connect(1, "127.0.0.1", 0.0)
    message = {"type": "open", "model": "m", "expected_members": 2, "capability": capability("h"), "candidates": []}
    (opened,) = core.receive(1, json.dumps({**message, "fingerprint": FP}), 0.0)
    code = opened.message.code  # type: ignore[union-attr]
    assert core.holds(code) and core.holds(code.upper().replace("-", " ")) and not core.holds(OTHER)
    core.disconnect(1, 1.0)  # the host leaves: the session ends
    assert not core.holds(code)


def test_subnet_broadcasts_come_from_the_route_table() -> None:
    table = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"  # default route: not a subnet
        "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"  # 192.0.2.0/24
        "wlan0\t0010A8C0\t00000000\t0001\t0\t0\t0\t00F0FFFF\t0\t0\t0\n"  # 192.168.16.0/20
        "tun0\t0100000A\t00000000\t0001\t0\t0\t0\tFFFFFFFF\t0\t0\t0\n"  # a host route
        "down0\t000300C0\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"  # not up
        "garbage line\n"
    )
    assert parse_route_broadcasts(table) == ["192.0.2.255", "192.168.31.255"]
    destinations = default_destinations()
    assert destinations[0] == "255.255.255.255" and {"127.255.255.255", "127.0.0.1"} <= set(destinations)


# --- a real embedded rendezvous, over loopback --------------------------------------------------


def test_an_embedded_rendezvous_is_found_for_its_channel_and_not_for_another() -> None:
    async def scenario() -> None:
        port = free_udp_port()
        handle = await start_rendezvous("127.0.0.1", 0, 0, discovery_port=port)
        try:
            assert handle.discovery is not None and handle.discovery.port == port
            host = await open_session(handle.url)
            assert await discover(host.code, port, timeout=3) == handle.http_address
            started = time.monotonic()
            with pytest.raises(DiscoveryError, match=r"no host on this network has session .*--rendezvous"):
                await discover(OTHER if host.code != OTHER else CHANNEL, port, timeout=1)
            assert time.monotonic() - started < 2
            await host.close()
        finally:
            await handle.close()
        with pytest.raises(DiscoveryError):  # closed with the rendezvous
            await discover(host.code, port, timeout=0.5)

    run(scenario())


def test_a_rendezvous_on_all_addresses_is_found_and_joined_at_the_address_found() -> None:
    async def scenario() -> None:
        port = free_udp_port()
        handle = await start_rendezvous("0.0.0.0", 0, 0, discovery_port=port)
        try:
            host = await open_session(handle.url)
            ip, http_port = await discover(host.code, port, timeout=3)
            assert http_port == handle.http_address[1]
            member = await RendezvousClient.join(
                f"ws://{ip}:{http_port}/v1/session",
                f"{host.code}-lemon-tiger-orbit-cactus",
                capability=capability("m"),
                fingerprint=FP,
            )
            assert member.code == host.code
            await member.close()
            await host.close()
        finally:
            await handle.close()

    run(scenario())


def test_several_hosts_on_one_machine_share_the_port_and_each_is_found() -> None:
    async def scenario() -> None:
        port = free_udp_port()
        handles = [await start_rendezvous("0.0.0.0", 0, 0, discovery_port=port) for _ in range(3)]
        try:
            hosts = [await open_session(h.url) for h in handles]
            assert all(h.discovery is not None for h in handles)
            for handle, host in zip(handles, hosts, strict=True):
                assert (await discover(host.code, port, timeout=3))[1] == handle.http_address[1]
            for host in hosts:
                await host.close()
        finally:
            for handle in handles:
                await handle.close()

    run(scenario(), timeout=40)


def test_a_taken_port_costs_a_warning_not_the_rendezvous(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:  # no SO_REUSEADDR: exclusive
            squatter.bind(("0.0.0.0", 0))
            port = squatter.getsockname()[1]
            handle = await start_rendezvous("127.0.0.1", 0, 0, discovery_port=port)
            try:
                assert handle.discovery is None
                host = await open_session(handle.url)  # the rendezvous itself works
                await host.close()
            finally:
                await handle.close()

    with caplog.at_level("WARNING", logger="kafila.rendezvous.server"):
        run(scenario())
    assert "LAN discovery is off" in caplog.text


# --- broadcast across a real LAN of two network namespaces -----------------------------------

_RESPONDER = """
import asyncio, sys
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous

async def main() -> None:
    handle = await start_rendezvous("0.0.0.0", 0, 0, discovery_port=int(sys.argv[1]))
    host = await RendezvousClient.open(handle.url, model="m", expected_members=2,
                                       capability={"name": "h", "memory_gib": 8.0}, fingerprint="ab" * 32)
    print(host.code, handle.http_address[1], flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await host.close()
    await handle.close()

asyncio.run(main())
"""

_DISCOVERER = """
import asyncio, json, sys
from kafila.network.discovery import DiscoveryError, default_destinations, discover

async def main() -> None:
    channel, port = sys.argv[1], int(sys.argv[2])
    results = {"destinations": default_destinations()}
    for name, destinations in (("broadcast", ["255.255.255.255"]), ("default", None)):
        results[name] = list(await discover(channel, port, timeout=3, destinations=destinations))
    try:
        await discover("8-crimson-harbor" if channel != "8-crimson-harbor" else "9-crimson-harbor", port, timeout=1)
    except DiscoveryError as error:
        results["other"] = str(error)
    print(json.dumps(results), flush=True)

asyncio.run(main())
"""


@pytest.mark.usefixtures("natlab_required")
def test_a_joiner_finds_the_host_by_broadcast_on_a_real_lan() -> None:
    with NatLab(prefix="kd") as lab:
        home = lab.add_home("lan", "port-restricted")
        joiner_host = lab.add_host(home)
        port = 8470  # the real default: the namespaces are the lab's own
        host = lab.run_home(
            home,
            [sys.executable, "-c", _RESPONDER, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert host.stdout is not None and host.stdin is not None
        code, http_port = line_from(host.stdout, "the host's session code").split()
        done = subprocess.run(
            ["ip", "netns", "exec", joiner_host.namespace, sys.executable, "-c", _DISCOVERER, code, str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        host.stdin.close()
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout)
        subnet = ".".join(home.host_address.split(".")[:3])
        assert any(d.startswith(subnet) for d in results["destinations"])  # the LAN's own broadcast address
        assert results["broadcast"] == [home.host_address, int(http_port)]
        assert results["default"] == [home.host_address, int(http_port)]
        assert "no host on this network has session" in results["other"]


# --- the command line ----------------------------------------------------------------------------


def test_kafila_join_without_rendezvous_says_nobody_answered() -> None:
    env = {**os.environ, "KAFILA_DISCOVERY_PORT": str(free_udp_port())}
    env.pop("KAFILA_RENDEZVOUS", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "join", "7-crimson-harbor-lemon-tiger-orbit-cactus"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "COLUMNS": "200"},
        check=False,
    )
    assert done.returncode != 0
    assert "looking for the host of 7-crimson-harbor on this network" in done.stderr
    assert "no host on this network has session 7-crimson-harbor" in done.stderr
    assert "cactus" not in done.stderr.replace("7-crimson-harbor-lemon-tiger-orbit-cactus", "")
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 30


def test_kafila_join_finds_a_real_host_on_this_machine(tmp_path: Path) -> None:
    from host_process import running_host, seeded_cache, stop, wait_ready
    from tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    port = free_udp_port()
    common = ("--context", "256", "--concurrency", "2", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
    with running_host("--model", model, "--members", "2", *common, "--discovery-port", str(port), ready=False) as host:
        code, _ = host.join_line()
        env = {**os.environ, "KAFILA_CACHE": str(seeded_cache(tmp_path / "cache")), "COLUMNS": "200"}
        env.pop("KAFILA_RENDEZVOUS", None)
        member = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kafila",
                "join",
                code,
                "--discovery-port",
                str(port),
                "--name",
                "m",
                "--threads",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        try:
            wait_ready(host, timeout=60)
            assert f"kafila join {code} finds this host by itself" in host.output().replace("`", "")
        finally:
            output = stop(member)
    assert f"looking for the host of {'-'.join(code.split('-')[:3])} on this network" in output
    assert "found its rendezvous at" in output


def test_a_standalone_kafila_rendezvous_answers_discovery_when_asked_to() -> None:
    """`kafila rendezvous --discovery-port P`, a real process: found for a session opened on it."""
    port = free_udp_port()
    command = [sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--http-port", "0",
               "--stun-port", "0", "--discovery-port", str(port)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        assert line_from(process.stdout, "the rendezvous's READY line").startswith("READY ")
        http = line_from(process.stdout, "the rendezvous's HTTP line").split()[1]

        async def scenario() -> tuple[str, int]:
            host = await open_session(f"ws://{http}/v1/session")
            try:
                return await discover(host.code, port, timeout=3)
            finally:
                await host.close()

        found = run(scenario())
        assert f"{found[0]}:{found[1]}" == http
    finally:
        process.terminate()
        process.wait(timeout=20)
