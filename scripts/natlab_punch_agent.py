"""One side of a hole punch, run inside a lab namespace (tests/test_nat_lab_punch.py, scripts/bench_nat_lab.py).

All signalling goes through a real rendezvous. The agent learns its server-reflexive address
from the rendezvous's STUN port on the socket it will punch from; the host opens a session and
prints its code, the other joins with it; both exchange candidates and round-trip times in the
introductions. On `ready`, which the rendezvous sends to both at once, each waits out half the
difference between their round trips so that both start together, then punches with low-TTL
priming. The outcome is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kafila.network.frames import Frame, Kind
from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, Link, bind_relay, open_link, should_dial
from kafila.network.nat import reflexive_address
from kafila.network.punch import punch
from kafila.network.rendezvous_client import RendezvousClient
from kafila.planner.reachability import predict_edge
from kafila.planner.types import EdgePrediction, Mapping, NatBehaviour


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def activations(seed: int, count: int) -> list[Frame]:
    """Deterministic frames both sides can regenerate, so the receiver can check every byte."""
    rng = np.random.default_rng(seed)
    return [
        Frame.of_hidden(Kind.DECODE, seed * 100 + i % 10, i // 10, rng.standard_normal((1, 640)).astype(np.float32))
        for i in range(count)
    ]


async def exchange(link: Link, mine: int, theirs: int, count: int) -> bool:
    """Send our frames and receive theirs at once; True if theirs all arrived, in order, intact."""

    async def send() -> None:
        for frame in activations(mine, count):
            await link.send(frame)

    async def receive() -> list[Frame]:
        return [await asyncio.wait_for(link.receive(), 20) for _ in range(count)]

    _, got = await asyncio.gather(send(), receive())
    return _by_sequence(got) == _by_sequence(activations(theirs, count))


def _by_sequence(frames: list[Frame]) -> dict[int, list[Frame]]:
    """Frames grouped by sequence, each group in arrival order: order only holds within one."""
    groups: dict[int, list[Frame]] = {}
    for frame in frames:
        groups.setdefault(frame.sequence_id, []).append(frame)
    return groups


async def run(args: argparse.Namespace) -> dict[str, object]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    server = address(args.stun)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(server)
        host = (probe.getsockname()[0], sock.getsockname()[1])
    started = time.perf_counter()
    srflx = reflexive_address(sock, server)
    rtt_ms = (time.perf_counter() - started) * 1e3
    identity = create_identity(name=args.name)
    capability = {"name": args.name, "memory_gib": 1.0, "rtt_ms": rtt_ms}
    candidates = [f"{h}:{p}" for h, p in (host, srflx)]
    url = f"ws://{args.http}/v1/session"
    introduced = time.perf_counter()
    if args.code is None:
        client = await RendezvousClient.open(
            url,
            model="lab",
            expected_members=2,
            capability=capability,
            fingerprint=identity.fingerprint,
            candidates=candidates,
        )
        print(json.dumps({"code": client.code}), flush=True)
    else:
        client = await RendezvousClient.join(
            url, args.code, capability=capability, fingerprint=identity.fingerprint, candidates=candidates
        )
    outcome: dict[str, object] = {}
    try:
        ready = await client.wait_ready(timeout=20)
        outcome["introduction_s"] = time.perf_counter() - introduced
        peer = next(m for m in ready.members if m.name != args.name)
        slowest = max(rtt_ms, peer.capability.rtt_ms or 0.0)
        await asyncio.sleep((slowest - rtt_ms) / 2e3)
        session = hashlib.sha256(ready.host.encode()).digest()[:8]
        result = await punch(sock, session, [address(c) for c in peer.candidates], timeout=args.timeout)
        outcome["path"] = f"{result.path[0]}:{result.path[1]}" if result.path else None
        outcome["seconds"] = result.seconds
        if args.frames:
            demux = await DatagramDemux.over(sock)
            try:
                if result.path is not None:
                    target, via = result.path, "direct"
                else:
                    grant = await client.request_relay(peer.member_id, timeout=20)
                    target, via = client.relay_address(grant), "relayed"
                    await bind_relay(demux, target, bytes.fromhex(grant.relay_token), timeout=10)
                dial = should_dial(identity.fingerprint, peer.fingerprint)
                link = await open_link(demux, target, identity, peer.fingerprint, dial)
                mine, theirs = (1, 2) if args.code is None else (2, 1)
                outcome["link"] = via
                outcome["frames_ok"] = await exchange(link, mine, theirs, args.frames)
                await asyncio.sleep(0.5)  # the peer may still be receiving
                await link.close()
            finally:
                demux.close()
    finally:
        await client.close()
        sock.close()
    return outcome


def start_rendezvous(lab: Any) -> tuple[subprocess.Popen[str], str, str]:
    """A real `kafila rendezvous` in the lab's public namespace on both its addresses.

    Returns the process, its STUN address and its HTTP address; the caller terminates it.
    """
    from natlab import PUBLIC_ADDRESSES

    primary, alternate = PUBLIC_ADDRESSES
    process = lab.run_public(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", primary, "--alt-address", alternate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready = process.stdout.readline().split() if process.stdout else []
    http = process.stdout.readline().split() if process.stdout else []
    if len(ready) != 2 or ready[0] != "READY" or len(http) != 2 or http[0] != "HTTP":
        process.kill()
        raise RuntimeError("the lab's rendezvous did not start")
    return process, ready[1], http[1]


def peer_home(lab: Any, a: str, b: str) -> str:
    """The home of type `b` to pair with home `a`: a second one of that type when both match."""
    if a != b:
        return b
    second = f"{b}-2"
    if second not in lab.homes:
        lab.add_home(second, b)
    return second


def predicted_edge(a: str, b: str) -> EdgePrediction:
    """The planner's prediction for an edge between homes of two lab NAT types."""
    from natlab import NAT_BEHAVIOUR

    a_nat, b_nat = (
        NatBehaviour(mapping=Mapping(NAT_BEHAVIOUR[n][0]), filtering=Mapping(NAT_BEHAVIOUR[n][1])) for n in (a, b)
    )
    return predict_edge(a_nat, b_nat)


def _line(process: subprocess.Popen[str]) -> dict[str, Any]:
    text = process.stdout.readline() if process.stdout else ""
    if not text:
        process.kill()
        raise RuntimeError(f"punch agent failed: {process.stderr.read() if process.stderr else ''}")
    result: dict[str, Any] = json.loads(text)
    return result


def punch_pair(lab: Any, stun: str, http: str, home_a: str, home_b: str, frames: int = 0) -> dict[str, Any]:
    """Run one agent in each home of a NatLab: the first opens a session, the second joins it.

    Returns whether both ended on a direct path, the slower one's punch time, and the joiner's
    time from joining to the introduction.
    """
    base = [sys.executable, __file__, "--stun", stun, "--http", http, "--timeout", "4", "--frames", str(frames)]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    host = lab.run_home(lab.homes[home_a], [*base, "--name", "a"], **pipes)
    agents = [host]
    try:
        code = _line(host)["code"]
        agents.append(lab.run_home(lab.homes[home_b], [*base, "--name", "b", "--code", code], **pipes))
        outcomes = [_line(agent) for agent in agents]
        for agent in agents:
            agent.wait(timeout=30)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return {
        "direct": all(o["path"] is not None for o in outcomes),
        "seconds": max(o["seconds"] for o in outcomes),
        "introduction_s": outcomes[1]["introduction_s"],
        "links": [o.get("link") for o in outcomes],
        "frames_ok": all(o.get("frames_ok", False) for o in outcomes) if frames else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stun", required=True)
    parser.add_argument("--http", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--code")
    parser.add_argument("--timeout", type=float, default=4.0)
    parser.add_argument("--frames", type=int, default=0, help="then link over QUIC and exchange this many frames")
    print(json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
