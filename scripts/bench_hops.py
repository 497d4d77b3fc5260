"""The transport's toll alone: a host's engine thread and a member's stage over a real QUIC link on
loopback, the compute replaced by sleeps, so every CPU millisecond counted is the hops' (issue 38).

    python scripts/bench_hops.py [--tokens 300] [--host-ms 12] [--stage-ms 8]

The host's engine thread drives `QuicRing` (a token's rows out, the member's rows back, as the
head's engine does) and sleeps `--host-ms` a token for the head's compute; the member, a child
process, serves `serve_stage` with a stage whose forward sleeps `--stage-ms` and returns its
rows. Host on CPU 0, member on CPU 1 (as the demo holds them). Printed, a token: each thread's
on-CPU microseconds (its schedstat: sleeps cost none), the datagrams each side sent, the wall
time beyond the two sleeps (the hops' latency, and the sleeps' own overshoot), and the host
link's smoothed RTT. Run it with PYTHONPATH set to the source tree to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from linked_routers import loopback_socket

from kafila.network.identity import Identity, create_identity
from kafila.network.link import DatagramDemux, open_link
from kafila.runtime.engine.stage import StepInput
from kafila.session.member import serve_stage
from kafila.session.quic_ring import QuicRing
from kafila.session.router import LinkRouter
from kafila.wire.frames import Frame, Kind

HIDDEN = 640  # gemma-3-270m's: a token's rows are three datagrams each way
WARM_TOKENS = 20


class SleepingStage:
    """A block stage whose compute is a sleep: the rows come back as they went."""

    name, hidden, first_block, n_layers = "sleeping stage", HIDDEN, 0, 17

    def __init__(self, stage_ms: float) -> None:
        self.stage_ms = stage_ms

    def forward(
        self, steps: Sequence[StepInput], decode: bool = True, row_by_row: Sequence[bool] | None = None
    ) -> list[Any]:
        time.sleep(self.stage_ms / 1e3)
        return [step.states for step in steps]


def cpu_ns_by_thread() -> dict[int, int]:
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            found[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass
    return found


async def counted_demux(sent: list[int]) -> tuple[DatagramDemux, socket.socket]:
    sock = loopback_socket()
    demux = await DatagramDemux.over(sock)

    def tap(direction: str, _data: bytes, _address: tuple[str, int]) -> None:
        if direction == "out":
            sent[0] += 1

    demux.tap = tap
    return demux, sock


def member(identities: tuple[Identity, Identity], pipe: Connection, stage_ms: float) -> None:
    os.sched_setaffinity(0, {1})

    async def main() -> None:
        sent = [0]
        demux, sock = await counted_demux(sent)
        pipe.send(sock.getsockname())
        link = await open_link(demux, pipe.recv(), identities[1], identities[0].fingerprint, dial=False)
        router = LinkRouter(link, "host")
        executor = ThreadPoolExecutor(1, thread_name_prefix="stage")
        serving = asyncio.create_task(
            serve_stage(SleepingStage(stage_ms), router.activation, router.activation, executor)  # type: ignore[arg-type]
        )
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, pipe.recv) == "mark":
            pipe.send((cpu_ns_by_thread(), sent[0], os.getpid()))
        serving.cancel()

    asyncio.run(main())


def per_token(before: dict[int, int], after: dict[int, int], main: int, tokens: int) -> dict[str, float]:
    """µs a token: the main thread (the event loop), the busiest other, the rest."""
    spent = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    loop = spent.pop(main, 0)
    busiest = max(spent, key=lambda tid: spent[tid])
    work = spent.pop(busiest)
    return {"loop": loop / tokens / 1e3, "work": work / tokens / 1e3, "other": sum(spent.values()) / tokens / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--host-ms", type=float, default=12.0)
    parser.add_argument("--stage-ms", type=float, default=8.0)
    args = parser.parse_args()
    identities = (create_identity(), create_identity())
    here, there = mp.Pipe()
    child = mp.get_context("fork").Process(target=member, args=(identities, there, args.stage_ms))
    child.start()
    os.sched_setaffinity(0, {0})
    result: dict[str, float] = {}

    async def host() -> None:
        sent = [0]
        demux, sock = await counted_demux(sent)
        member_at = here.recv()
        here.send(sock.getsockname())
        link = await open_link(demux, member_at, identities[0], identities[1].fingerprint, dial=True)
        router = LinkRouter(link, "member")
        ring = QuicRing(asyncio.get_running_loop(), router.activation, "member", router.activation, "member")
        row = np.random.default_rng(0).standard_normal((1, HIDDEN)).astype(np.float32)

        def engine() -> None:
            def token(position: int) -> None:
                ring.send([Frame.of_hidden(Kind.DECODE, 1, position, row)])
                (frame,) = ring.receive(1)
                frame.hidden_states()

            for position in range(WARM_TOKENS):
                token(position)
            here.send("mark")
            member_before, host_before, sent_before = here.recv(), cpu_ns_by_thread(), sent[0]
            started = time.perf_counter()
            for position in range(WARM_TOKENS, WARM_TOKENS + args.tokens):
                time.sleep(args.host_ms / 1e3)
                token(position)
            elapsed = time.perf_counter() - started
            here.send("mark")
            member_after, host_after = here.recv(), cpu_ns_by_thread()
            mine = per_token(host_before, host_after, os.getpid(), args.tokens)
            theirs = per_token(member_before[0], member_after[0], member_after[2], args.tokens)
            result.update({f"host {k} µs": v for k, v in mine.items()})
            result.update({f"member {k} µs": v for k, v in theirs.items()})
            result["host datagrams"] = (sent[0] - sent_before) / args.tokens
            result["member datagrams"] = (member_after[1] - member_before[1]) / args.tokens
            result["host rtt ms"] = link.core.rtt_ms or float("nan")
            result["wall ms beyond the sleeps"] = 1e3 * elapsed / args.tokens - args.host_ms - args.stage_ms

        await asyncio.to_thread(engine)
        here.send("stop")
        ring.close()
        demux.close()

    asyncio.run(host())
    child.join()
    result["all µs"] = sum(v for k, v in result.items() if k.endswith("µs"))
    print(json.dumps({k: round(v, 2) for k, v in result.items()}))


if __name__ == "__main__":
    main()
