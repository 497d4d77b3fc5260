"""What a machine brings to a session before it joins: an identity, a socket, candidates, a profile.

Both `kafila host` and `kafila join` do the same first steps: find the rendezvous's STUN port,
bind the one UDP socket every link will use, learn its server-reflexive address from that very
socket, classify the NAT, and describe the device (the cached probe) for the planner.

The NAT tests use sockets of their own, so they need not wait for the rest: a host begins them
(`NatTests`) as its command starts, and they run while llama.cpp loads and the model's header
comes from the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

from kafila.background import in_background
from kafila.contracts import FleetDevice, NatBehaviour
from kafila.network.identity import Identity, create_identity
from kafila.network.nat import NatReport, outgoing_address, probe_nat, reflexive_address
from kafila.portability import ignore_udp_connection_resets, run

Address = tuple[str, int]
INFO_TIMEOUT_S = 5.0  # for the whole answer, not each read: a rendezvous that drips it is refused too
MAX_INFO_BYTES = 64 << 10  # a rendezvous's /v1/info is a few hundred bytes


class RendezvousUnreachable(RuntimeError):
    pass


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def rendezvous_endpoints(address: Address) -> tuple[str, Address]:
    """The signalling URL and the STUN address of the rendezvous at `address` (its HTTP port)."""
    host, port = address
    try:
        deadline = time.monotonic() + INFO_TIMEOUT_S
        with urlopen(f"http://{_url_host(host)}:{port}/v1/info", timeout=INFO_TIMEOUT_S) as response:
            body = bytearray()
            while chunk := response.read1(MAX_INFO_BYTES + 1 - len(body)):
                body += chunk
                if len(body) > MAX_INFO_BYTES:
                    raise ValueError(f"its /v1/info is longer than {MAX_INFO_BYTES >> 10} KiB")
                if time.monotonic() > deadline:
                    raise ValueError(f"its /v1/info took more than {INFO_TIMEOUT_S:g} s to arrive")
        info = json.loads(body)
        path, stun_port = info["session_path"], int(info["stun_port"])
        if not isinstance(path, str) or not path.startswith("/") or len(path) > 256 or not 0 < stun_port < 65536:
            raise ValueError("its /v1/info names no session path and STUN port")
    except (URLError, OSError, ValueError, KeyError, TypeError) as error:
        raise RendezvousUnreachable(f"no kafila rendezvous answers at {host}:{port}: {error}") from None
    return f"ws://{_url_host(host)}:{port}{path}", (host, stun_port)


@dataclass
class Presence:
    identity: Identity
    sock: socket.socket
    candidates: list[str]
    capability: FleetDevice
    url: str
    stun: Address


@dataclass(frozen=True)
class Reach:
    """What this machine's UDP socket learns of its path to the rendezvous's STUN port."""

    mapped: Address  # the socket's address as the rendezvous sees it
    rtt_ms: float
    nat: NatReport | None  # None: the NAT tests could not finish (it is planned as unknown)


async def _reflexive(sock: socket.socket, stun: Address) -> tuple[Address, float]:
    """`sock`'s address as the rendezvous's STUN port sees it, and the round trip in ms;
    RendezvousUnreachable if STUN does not answer."""
    started = time.perf_counter()
    try:
        mapped = await asyncio.to_thread(reflexive_address, sock, stun)
    except (OSError, TimeoutError, ValueError) as error:
        raise RendezvousUnreachable(f"the rendezvous's STUN port {stun[0]}:{stun[1]} did not answer: {error}") from None
    return mapped, (time.perf_counter() - started) * 1e3


async def _nat_report(stun: Address) -> NatReport | None:
    try:
        return await probe_nat(stun)
    except Exception:  # a NAT we cannot classify is planned as unknown, not refused
        return None


async def reach(sock: socket.socket, stun: Address) -> Reach:
    """Ask the rendezvous's STUN port from `sock`, timing it, then run the NAT tests;
    RendezvousUnreachable if STUN does not answer."""
    mapped, rtt_ms = await _reflexive(sock, stun)
    return Reach(mapped, rtt_ms, await _nat_report(stun))


class NatTests:
    """The rendezvous's endpoints and this machine's NAT tests, begun at once in a thread of their
    own (with an event loop of its own: the caller's may not run yet), for `present` to take
    later. A filtering NAT makes the tests wait out a silence; begun as `kafila host` starts, that
    wait passes while llama.cpp loads and the model's header comes from the hub."""

    def __init__(self, rendezvous: Address) -> None:
        self.rendezvous = rendezvous
        self._endpoints = in_background("nat-endpoints", functools.partial(rendezvous_endpoints, rendezvous))
        self._report = in_background("nat-tests", self._tests)

    def _tests(self) -> NatReport | None:
        _url, stun = self._endpoints.result()  # RendezvousUnreachable, said where `present` awaits the endpoints
        return run(_nat_report(stun))

    async def endpoints(self) -> tuple[str, Address]:
        """The rendezvous's signalling URL and STUN address (`rendezvous_endpoints`)."""
        return await asyncio.wrap_future(self._endpoints)

    async def report(self) -> NatReport | None:
        """The NAT's report; None: the tests could not finish (it is planned as unknown)."""
        return await asyncio.wrap_future(self._report)


async def present(
    name: str, rendezvous: Address, device: FleetDevice, bind_ip: str = "0.0.0.0", begun: NatTests | None = None
) -> Presence:
    """Bind, learn our addresses and NAT, and describe ourselves; raises RendezvousUnreachable.
    `begun`: the NAT tests already under way against this rendezvous, taken rather than run again."""
    begun = begun if begun is not None and begun.rendezvous == rendezvous else None
    if begun is not None:
        url, stun = await begun.endpoints()
    else:
        url, stun = await asyncio.to_thread(rendezvous_endpoints, rendezvous)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((bind_ip, 0))
        ignore_udp_connection_resets(sock)
        port = sock.getsockname()[1]
        host_candidate = (outgoing_address(stun) if bind_ip == "0.0.0.0" else bind_ip, port)
        if begun is not None:
            mapped, rtt_ms = await _reflexive(sock, stun)
            reached = Reach(mapped, rtt_ms, await begun.report())
        else:
            reached = await reach(sock, stun)
        report, nat = reached.nat, None
        if report is not None and report.mapping is not None and report.filtering is not None:
            nat = NatBehaviour(mapping=report.mapping, filtering=report.filtering)
        candidates = [f"{h}:{p}" for h, p in dict.fromkeys([host_candidate, reached.mapped])]
        capability = device.model_copy(update={"name": name[:64], "rtt_ms": round(reached.rtt_ms, 3), "nat": nat})
        return Presence(create_identity(name=name), sock, candidates, capability, url, stun)
    except BaseException:
        sock.close()
        raise


def machine_tag(session: str) -> str:
    """This machine, as 16 hex digits that differ between sessions.

    The host counts distinct machines in its ring (stages on one machine share its cores, and
    overlapping them only makes them contend). The tag is a hash of the OS's machine id (or the
    host name and MAC address) salted with the session, so it cannot follow a machine from one
    session to the next. A process held to part of the machine's CPUs (the demo's shares,
    `taskset`, a container's cpuset) counts those too: processes held to cores of their own
    share none, and are as many machines.
    """
    identity = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            identity = Path(path).read_text().strip()
        if identity:
            break
    identity = identity or f"{socket.gethostname()}/{uuid.getnode():012x}"
    getter = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere a process has the whole machine
    held = sorted(getter(0)) if getter is not None else []
    if held and len(held) < (os.cpu_count() or len(held)):
        identity += "\0" + ",".join(map(str, held))
    return hashlib.sha256(f"kafila-machine/1\0{session}\0{identity}".encode()).hexdigest()[:16]
