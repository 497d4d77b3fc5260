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

from kafila.network.nat import reflexive_address
from kafila.network.punch import punch
from kafila.network.rendezvous_client import RendezvousClient


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


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
    capability = {"name": args.name, "memory_gib": 1.0, "rtt_ms": rtt_ms}
    candidates = [f"{h}:{p}" for h, p in (host, srflx)]
    url = f"ws://{args.http}/v1/session"
    introduced = time.perf_counter()
    if args.code is None:
        client = await RendezvousClient.open(
            url, model="lab", expected_members=2, capability=capability, fingerprint="0" * 64, candidates=candidates
        )
        print(json.dumps({"code": client.code}), flush=True)
    else:
        client = await RendezvousClient.join(
            url, args.code, capability=capability, fingerprint="0" * 64, candidates=candidates
        )
    try:
        ready = await client.wait_ready(timeout=20)
        introduction_s = time.perf_counter() - introduced
        peer = next(m for m in ready.members if m.name != args.name)
        slowest = max(rtt_ms, peer.capability.rtt_ms or 0.0)
        await asyncio.sleep((slowest - rtt_ms) / 2e3)
        session = hashlib.sha256(ready.host.encode()).digest()[:8]
        result = await punch(sock, session, [address(c) for c in peer.candidates], timeout=args.timeout)
    finally:
        await client.close()
        sock.close()
    path = f"{result.path[0]}:{result.path[1]}" if result.path else None
    return {"path": path, "seconds": result.seconds, "introduction_s": introduction_s}


def _line(process: subprocess.Popen[str]) -> dict[str, Any]:
    text = process.stdout.readline() if process.stdout else ""
    if not text:
        process.kill()
        raise RuntimeError(f"punch agent failed: {process.stderr.read() if process.stderr else ''}")
    result: dict[str, Any] = json.loads(text)
    return result


def punch_pair(lab: Any, stun: str, http: str, home_a: str, home_b: str) -> dict[str, Any]:
    """Run one agent in each home of a NatLab: the first opens a session, the second joins it.

    Returns whether both ended on a direct path, the slower one's punch time, and the joiner's
    time from joining to the introduction.
    """
    base = [sys.executable, __file__, "--stun", stun, "--http", http, "--timeout", "4"]
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
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stun", required=True)
    parser.add_argument("--http", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--code")
    parser.add_argument("--timeout", type=float, default=4.0)
    print(json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
