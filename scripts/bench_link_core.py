"""The links' own CPU a token, without sockets or an event loop: two `LinkCore`s (real aioquic
connections) hand a token's rows each way, with the time injected, for each datagram ceiling
given, interleaved over rounds (issue 38).

    python scripts/bench_link_core.py [--ceilings 1200 1452] [--tokens 2000] [--rounds 3]

A token: the dialler sends a hidden state of 640 f32 (gemma-3-270m's), the listener answers
with its own 8 ms later, as a ring of two machines does; each side's timers run when due. A
ceiling of 1,200 never probes; a larger one is probed and used once the probe is acknowledged
(`kafila.network.datagram_size`). Printed for each: the CPU microseconds a token of both sides
together (`time.process_time`: what the load around hardly moves), the datagrams a token, and
the size the link then used. Run it with PYTHONPATH set to the source tree to measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kafila.network.link import LinkConfig
from kafila.wire.frames import Frame, Kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # what the tests import
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the link-core tests' simulated pair
from test_link_core import Pair, frames

HIDDEN = 640
WARM_UP = 200  # tokens before the count: the handshake's ACKs, the probe, the window settled


def run(ceiling: int, tokens: int) -> tuple[float, float, int]:
    """µs of CPU a token (both sides), datagrams a token, and the datagram size in use."""
    config = LinkConfig(idle_timeout_s=4.0, handshake_timeout_s=10.0, max_datagram_size=ceiling)
    pair = Pair(config=config).up()
    pair.advance(0.1)
    row = np.ones((1, HIDDEN), dtype=np.float32)
    moved = [0]

    def token(position: int) -> None:
        for sender, receiver in ((pair.dialler, pair.listener), (pair.listener, pair.dialler)):
            sender.send_frame(Frame.of_hidden(Kind.DECODE, 1, position, row))
            moved[0] += pair.transfer()
            pair.advance(0.008)
            assert [frame.position for frame in frames(receiver)] == [position]

    for position in range(WARM_UP):
        token(position)
    moved[0] = 0
    started = time.process_time()
    for position in range(tokens):
        token(position)
    cpu_us = (time.process_time() - started) / tokens * 1e6
    return cpu_us, moved[0] / tokens, pair.dialler.datagram_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ceilings", type=int, nargs="+", default=[1200, 1452])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpu: dict[int, list[float]] = {ceiling: [] for ceiling in args.ceilings}
    for _ in range(args.rounds):
        for ceiling in args.ceilings:
            cpu_us, datagrams, size = run(ceiling, args.tokens)
            cpu[ceiling].append(cpu_us)
            print(f"ceiling {ceiling}: size {size}, {cpu_us:.1f} µs a token, {datagrams:.2f} datagrams", flush=True)
    for ceiling, values in cpu.items():
        spread = f"{min(values):.1f}–{max(values):.1f}"
        print(f"ceiling {ceiling}: median {statistics.median(values):.1f} µs a token ({spread})")


if __name__ == "__main__":
    main()
