"""One member of a multi-member session inside a lab namespace, bringing up all its edges at once.

Used by tests/test_nat_lab_edges.py. Like `natlab_punch_agent` (whose helpers it imports), the
agent learns its reflexive address from the lab rendezvous's STUN port on the one socket it will
use, and its NAT's behaviour (RFC 5780's tests, as a session's member does), then opens a
session (printing `{"code": ...}`) or joins one with `--code`. Once the
session is full (`--members`), each member waits out half the difference between its round
trip to the rendezvous and the slowest member's, so that everyone starts together, and calls
`kafila.network.edges.connect_edges` for every other member: the punches share the socket, an
edge that does not punch is relayed. Then `--frames` activation frames go each way on every
edge at once, each checked. The outcome is one JSON line:

    {"name": ..., "member_id": ..., "seconds": <connect_edges time>,
     "edges": {peer name: {"path": "direct"|"relayed", "frames_received": n, "frames_ok": bool}}}

or `{"name": ..., "error": ..., "peer": <peer name>}` with exit status 1 if an edge failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from natlab_punch_agent import AGENT_LINE_S, address, exchange, member_socket, stop
from waiting import line_from

from kafila.contracts import NatBehaviour
from kafila.network.edges import EdgeError, connect_edges
from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux
from kafila.network.nat import probe_nat
from kafila.network.rendezvous_client import RendezvousClient

AGENT = str(Path(__file__).resolve())


async def run(args: argparse.Namespace) -> int:
    sock, host, srflx, rtt_ms = member_socket(args.stun)
    identity = create_identity(name=args.name)
    report = await probe_nat(address(args.stun))  # as `presence.present` does: both ends of an edge read both
    nat = None
    if report.mapping is not None and report.filtering is not None:
        nat = NatBehaviour(mapping=report.mapping, filtering=report.filtering).model_dump(mode="json")
    options: dict[str, Any] = {
        "capability": {"name": args.name, "memory_gib": 1.0, "rtt_ms": rtt_ms, "nat": nat},
        "fingerprint": identity.fingerprint,
        "candidates": [f"{h}:{p}" for h, p in (host, srflx)],
    }
    url = f"ws://{args.http}/v1/session"
    if args.code is None:
        client = await RendezvousClient.open(url, model="lab", expected_members=args.members, **options)
        print(json.dumps({"code": client.code}), flush=True)
    else:
        client = await RendezvousClient.join(url, args.code, **options)
    demux: DatagramDemux | None = None
    try:
        ready = await client.wait_ready(timeout=30)
        peers = [m for m in ready.members if m.member_id != client.member_id]
        names = {m.member_id: m.name for m in peers}
        slowest = max([rtt_ms, *(m.capability.rtt_ms or 0.0 for m in peers)])
        await asyncio.sleep((slowest - rtt_ms) / 2e3)
        demux = await DatagramDemux.over(sock)
        began = time.perf_counter()
        try:
            edges = await connect_edges(client, demux, identity, client.code, peers, timeout_s=args.timeout)
        except EdgeError as error:
            print(json.dumps({"name": args.name, "error": str(error), "peer": names.get(error.peer_id)}), flush=True)
            return 1
        seconds = time.perf_counter() - began
        mine = int(client.member_id[1:])
        results = await asyncio.gather(
            *(exchange(edge.link, mine, int(peer_id[1:]), args.frames) for peer_id, edge in edges.items())
        )
        outcome = {
            "name": args.name,
            "member_id": client.member_id,
            "seconds": seconds,
            "edges": {
                names[peer_id]: {"path": edge.path, "frames_received": got, "frames_ok": ok}
                for (peer_id, edge), (got, ok) in zip(edges.items(), results, strict=True)
            },
        }
        await asyncio.sleep(1.0)  # the peers may still be receiving our last frames
        for edge in edges.values():
            await edge.close()
        print(json.dumps(outcome), flush=True)
        return 0
    finally:
        await client.close()
        if demux is not None:
            demux.close()
        else:
            sock.close()


def _line(process: subprocess.Popen[str]) -> dict[str, Any]:
    text = line_from(process.stdout, "the edges agent's report", timeout=AGENT_LINE_S)
    if not text:
        process.kill()
        raise RuntimeError(f"edges agent failed: {process.stderr.read() if process.stderr else ''}")
    result: dict[str, Any] = json.loads(text)
    return result


def connect_members(lab: Any, stun: str, http: str, homes: list[str], frames: int = 100) -> dict[str, dict[str, Any]]:
    """One agent in each home (the first opens the session), all edges between them at once.

    Returns each home's outcome line, keyed by home name; every agent's name is its home's.
    """
    base = [sys.executable, AGENT, "--stun", stun, "--http", http, "--members", str(len(homes))]
    base += ["--frames", str(frames)]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    agents = [lab.run_home(lab.homes[homes[0]], [*base, "--name", homes[0]], **pipes)]
    try:
        code = _line(agents[0])["code"]
        for home in homes[1:]:
            agents.append(lab.run_home(lab.homes[home], [*base, "--name", home, "--code", code], **pipes))
        outcomes = {home: _line(agent) for home, agent in zip(homes, agents, strict=True)}
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)
    finally:
        stop(agents)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stun", required=True)
    parser.add_argument("--http", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--code")
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="connect_edges' timeout")
    parser.add_argument("--frames", type=int, default=100, help="frames each way on every edge")
    raise SystemExit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
