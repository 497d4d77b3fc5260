"""The rendezvous's HTTP side against what the open internet sends: slow headers, a flood of
sockets from one address. Real sockets against a real rendezvous; the caps are set small so the
attacks stay small, and a legitimate `open` from another address must still be served."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass

import pytest
import websockets

from kafila.contracts import FleetDevice
from kafila.network.http_guard import ConnectionGate
from kafila.network.limits import address_group
from kafila.network.rendezvous import Limits, OpenSession
from kafila.network.rendezvous_server import RendezvousHandle, start_rendezvous

FP = "ab" * 32
HEADER_TIMEOUT_S = 0.5


@pytest.mark.parametrize(
    ("ip", "group"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("[2001:db8:1:3::9]", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("unknown", "unknown"),
    ],
)
def test_every_limit_counts_an_ipv4_address_or_an_ipv6_slash_64(ip: str, group: str) -> None:
    assert address_group(ip) == group


@dataclass(eq=False)
class Socket:
    closing: bool = False

    def is_closing(self) -> bool:
        return self.closing


def test_the_gate_caps_connections_per_address_group_and_in_all() -> None:
    gate = ConnectionGate(per_address=2, total=3)
    one, two, three = Socket(), Socket(), Socket()
    assert gate.admit(one, "2001:db8::1") and gate.admit(two, "2001:db8::2")
    assert not gate.admit(Socket(), "2001:db8::ffff")  # the same /64
    assert gate.admit(three, "192.0.2.1")
    assert not gate.admit(Socket(), "192.0.2.2")  # 3 in all
    gate.release(one)
    assert gate.admit(Socket(), "2001:db8::3")
    two.closing = True  # an upgraded connection that closed: found when a cap is reached
    assert gate.admit(Socket(), "2001:db8::4")
    assert gate.open == 3 and gate.refused == 2


def test_the_gate_leaves_room_beyond_one_network() -> None:
    """One IPv6 /56 (or IPv4 /24) holds an eighth of the connections, however many /64s it has."""
    gate = ConnectionGate(per_address=4, total=64, per_network=8)
    admitted = sum(gate.admit(Socket(), f"2001:db8:0:{i:x}::1") for i in range(64))  # 64 /64s of one /58
    assert admitted == 8 and gate.refused == 56
    assert gate.admit(Socket(), "2001:db8:1::1") and gate.admit(Socket(), "192.0.2.1")  # other networks


async def legitimate_open(handle: RendezvousHandle, source: str) -> str:
    """An `open` from `source` (a loopback address other than the attackers'); the answer's type."""
    request = OpenSession(
        type="open", model="m", expected_members=2, capability=FleetDevice(name="h", memory_gib=8), candidates=[],
        fingerprint=FP,
    )  # fmt: skip
    async with websockets.connect(handle.url, local_addr=(source, 0), open_timeout=5) as websocket:
        await websocket.send(request.model_dump_json())
        answer = await asyncio.wait_for(websocket.recv(), 5)
    return str(answer).split('"type":"', 1)[1].split('"', 1)[0]


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def test_slow_headers_are_cut_off_and_a_legitimate_open_is_served() -> None:
    """Slowloris: each connection sends a header line now and then and never finishes."""

    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0, header_timeout_s=HEADER_TIMEOUT_S)
        slow: list[socket.socket] = []
        try:
            for _ in range(30):
                sock = socket.create_connection(handle.http_address)
                sock.sendall(b"GET /v1/session HTTP/1.1\r\nHost: rendezvous\r\n")
                sock.setblocking(False)
                slow.append(sock)
            deadline, still_open = time.monotonic() + 10 * HEADER_TIMEOUT_S, list(slow)
            while still_open:
                assert time.monotonic() < deadline, f"{len(still_open)} slow connections still open"
                for sock in list(still_open):
                    if closed_by_server(sock):
                        still_open.remove(sock)
                    else:
                        with contextlib.suppress(OSError):
                            sock.send(b"X-Slow: 1\r\n")
                await asyncio.sleep(HEADER_TIMEOUT_S / 5)
            assert await legitimate_open(handle, "127.0.0.2") == "opened"
        finally:
            for sock in slow:
                sock.close()
            await handle.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_flood_of_sockets_from_one_address_leaves_the_rendezvous_serving_others() -> None:
    """1,000 sockets from one address: all but the per-address cap are refused at once, so
    descriptors stay free and an `open` from elsewhere is served."""

    async def scenario() -> None:
        limits = Limits(max_connections_per_ip=16)
        handle = await start_rendezvous("127.0.0.1", 0, 0, limits=limits, header_timeout_s=60)
        flood: list[socket.socket] = []
        try:
            for _ in range(1000):
                try:
                    flood.append(socket.create_connection(handle.http_address, timeout=5))
                except OSError:
                    break  # this client's own limits: the rendezvous still holds only its cap
                if len(flood) % 50 == 0:
                    await asyncio.sleep(0.01)  # let the server accept them
            deadline = time.monotonic() + 10
            while handle.gate.refused < len(flood) - limits.max_connections_per_ip:
                assert time.monotonic() < deadline, (handle.gate.open, handle.gate.refused)
                await asyncio.sleep(0.05)
            assert handle.gate.open <= limits.max_connections_per_ip
            assert await legitimate_open(handle, "127.0.0.2") == "opened"
        finally:
            for sock in flood:
                sock.close()
            await handle.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
