"""A stage-sized stream over modelled home paths: reno (one stream, as before) against "rate"
(kafila.network.congestion, Kafila's), side by side, the line's rate beside each figure.

Two real aioquic connections (tests/helpers/quic_path_sim.py) on a simulated clock, so the
figures are the protocol's, free of the CPU bound that the NAT lab on a shared machine sets
(`scripts/bench_link_lab.py --sections transfer` measures the same over real sockets, slower):
a 20 MB/s line with a 100 ms queue at 40 and 100 ms round trips, with and without 0.5% loss each
way, and the relay's 8 MB/s policer (a 2 MB bucket) at 80 ms. Then a home router's deep buffer (a
second of its line) at 40 ms, with and without the loss, and a 10 MB/s line that halves a second
in (another machine of the home sends): there the table gives the queueing delay too, the wait in
the bottleneck's queue over the transfer's second half (mean, and the most), what the transfer adds
to a ring's tokens and everything else the home sends over that line.

    python scripts/bench_congestion.py [--mb 64] [--controls reno rate] [--sections lossy deep]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from quic_path_sim import PathModel, simulate_transfer

import kafila.network.congestion as congestion

PATHS = [  # (what the table calls it, the path, the line's rate: the limit)
    ("20 MB/s, 40 ms", PathModel(rate=20e6, delay_s=0.02), 20e6),
    ("20 MB/s, 40 ms, 0.5% loss", PathModel(rate=20e6, delay_s=0.02, loss=0.005), 20e6),
    ("20 MB/s, 100 ms", PathModel(rate=20e6, delay_s=0.05), 20e6),
    ("20 MB/s, 100 ms, 0.5% loss", PathModel(rate=20e6, delay_s=0.05, loss=0.005), 20e6),
    ("relay's 8 MB/s policer, 80 ms", PathModel(rate=8e6, burst=2e6, delay_s=0.04), 8e6),
    ("relay's 8 MB/s policer, 80 ms, 0.5% loss", PathModel(rate=8e6, burst=2e6, delay_s=0.04, loss=0.005), 8e6),
]
DEEP = [  # a home router's buffer of a second: the queue a transfer keeps there
    ("20 MB/s, 40 ms, 1 s buffer", PathModel(rate=20e6, delay_s=0.02, queue_s=1.0), 20e6),
    ("20 MB/s, 40 ms, 1 s buffer, 0.5% loss", PathModel(rate=20e6, delay_s=0.02, queue_s=1.0, loss=0.005), 20e6),
    (
        "10 MB/s halving at 1 s, 40 ms, 1 s buffer",
        PathModel(rate=10e6, delay_s=0.02, queue_s=1.0, slower_at_s=1.0, slower_rate=5e6),
        10e6,
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="the stream's size, MiB")
    parser.add_argument("--controls", nargs="+", default=["reno", congestion.NAME], help="aioquic controllers")
    parser.add_argument("--sections", nargs="+", choices=["lossy", "deep"], default=["lossy", "deep"])
    args = parser.parse_args()
    size = args.mb << 20
    print(f"{args.mb} MiB on one stream, simulated clock; MB/s and the fraction of the line's rate\n")
    if "lossy" in args.sections:
        print("| path | limit MB/s | " + " | ".join(f"{c} MB/s (of limit)" for c in args.controls) + " |")
        print("|---|---|" + "---|" * len(args.controls))
        for name, path, limit in PATHS:
            cells = []
            for control in args.controls:
                started = time.perf_counter()
                run = simulate_transfer(size, path, congestion_control=control, time_limit_s=3600)
                cpu = time.perf_counter() - started
                cells.append(
                    f"{run.rate / 1e6:.2f} ({run.rate / limit:.2f}; {run.dropped + run.lost} lost, {cpu:.0f} s CPU)"
                )
            print(f"| {name} | {limit / 1e6:g} | " + " | ".join(cells) + " |", flush=True)
        print()
    if "deep" in args.sections:
        titles = (f"{c} MB/s (of limit); queue ms, mean (most)" for c in args.controls)
        print("| path | limit MB/s | " + " | ".join(titles) + " |")
        print("|---|---|" + "---|" * len(args.controls))
        for name, path, limit in DEEP:
            cells = []
            for control in args.controls:
                run = simulate_transfer(size, path, congestion_control=control, time_limit_s=3600)
                steady = [wait for when, wait in run.waits if when >= run.seconds / 2]
                cells.append(
                    f"{run.rate / 1e6:.2f} ({run.rate / limit:.2f}); {run.queueing() * 1e3:.0f} "
                    f"({max(steady, default=0.0) * 1e3:.0f}), {run.dropped} dropped"
                )
            print(f"| {name} | {limit / 1e6:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
