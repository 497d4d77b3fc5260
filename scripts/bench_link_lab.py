"""QUIC links in the NAT lab: the link matrix, round trips direct against relayed, killed neighbours.

Builds a lab with a home of every NAT type (a second of a type for same-type pairs) and a real
`kafila rendezvous`, then runs `tests/helpers/natlab_punch_agent.py` pairs, each side a process in its
home, introduced by the rendezvous:

- **matrix**: for every ordered pair of NAT types, punch, link (direct, or through the relay the
  rendezvous grants) and send `--frames` activation frames each way; the path against the
  planner's prediction, and whether every frame arrived, in order and intact;
- **rtt**: on one direct edge and one relayed edge, the round trip of one activation frame for
  hidden sizes 640, 2048 and 4096 at f32 and f16 (the session's host sends, the joiner
  echoes), and a raw UDP datagram of the same size over the same path and sockets as the
  floor; `--repeats` links per edge, alternating, pooled;
- **kill**: on the same two edges, `--kills` times each, SIGKILL one agent right after an
  exchange and time how long the survivor takes to report the broken link.

    python scripts/bench_link_lab.py [--frames 1000] [--round-trips 300] [--repeats 5] [--kills 5]
                                     [--sections matrix rtt kill]     (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from natlab import NAT_TYPES
from natlab_punch_agent import kill_one, lab_with_rendezvous, peer_home, predicted_edge, punch_pair

EDGES = {"direct": ("port-restricted", "port-restricted"), "relayed": ("symmetric", "symmetric")}


def matrix(lab: Any, stun: str, http: str, frames: int) -> None:
    print("| opens \\\\ joins | predicted | path taken | as predicted | frames each way (a→b, b→a) |")
    print("|---|---|---|---|---|")
    matched = 0
    for a, b in itertools.product(NAT_TYPES, repeat=2):
        outcome = punch_pair(lab, stun, http, a, peer_home(lab, a, b), frames=frames)
        predicted = predicted_edge(a, b).value
        links = set(outcome["links"])
        taken = links.pop() if len(links) == 1 else " / ".join(map(str, outcome["links"]))
        ok = taken == predicted
        matched += ok
        to_b, to_a = reversed(outcome["frames_received"])  # each side reports what it received
        intact = "all in order, intact" if outcome["frames_ok"] else "LOSS, REORDERING OR DAMAGE"
        counts = f"{to_b} / {frames}, {to_a} / {frames}: {intact}"
        print(f"| {a} → {b} | {predicted} | {taken} | {'✓' if ok else '✗'} | {counts} |")
    print(f"\n{matched} of {len(NAT_TYPES) ** 2} ordered pairs took the predicted path.")


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), float(np.quantile(values, 0.99))


def rtt(lab: Any, stun: str, http: str, count: int, repeats: int) -> None:
    """`repeats` links per edge, alternating direct and relayed so drift on a shared machine hits both alike."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for _ in range(repeats):
        for via, (a, b) in EDGES.items():
            outcome = punch_pair(lab, stun, http, a, peer_home(lab, a, b), rtt=count)
            if outcome["links"] != [via, via]:
                raise SystemExit(f"{a} → {b} linked {outcome['links']}, not {via}")
            pooled = runs.setdefault(via, {})
            for name, result in outcome["rtt"].items():
                into = pooled.setdefault(name, {"bytes": result["bytes"], "quic_ms": [], "udp_ms": [], "udp_lost": 0})
                into["quic_ms"] += result["quic_ms"]
                into["udp_ms"] += result["udp_ms"]
                into["udp_lost"] += result["udp_lost"]
    names = ", ".join(f"{via}: {a} → {b}" for via, (a, b) in EDGES.items())
    print(f"{repeats} × {count} round trips per size and edge ({names}); times in ms\n")
    print(
        "| frame | frame bytes | direct median | direct p99 | relayed median | relayed p99 | relayed / direct "
        "| UDP direct median | UDP relayed median |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, direct in runs["direct"].items():
        relayed = runs["relayed"][name]
        (d50, d99), (r50, r99) = _stats(direct["quic_ms"]), _stats(relayed["quic_ms"])
        u_d, u_r = statistics.median(direct["udp_ms"]), statistics.median(relayed["udp_ms"])
        hidden, dtype = name.split()
        lost = direct["udp_lost"] + relayed["udp_lost"]
        note = f" ({lost} lost)" if lost else ""
        print(
            f"| {hidden} × {dtype} | {direct['bytes']} | {d50:.2f} | {d99:.2f} | {r50:.2f} | {r99:.2f} "
            f"| {r50 / d50:.2f}× | {u_d:.3f} | {u_r:.3f}{note} |"
        )


def kills(lab: Any, stun: str, http: str, count: int) -> None:
    print("| edge | kills | survivor reported | report after kill: median s | max s |")
    print("|---|---|---|---|---|")
    for via, (a, b) in EDGES.items():
        outcomes = [kill_one(lab, stun, http, a, peer_home(lab, a, b), victim=i % 2) for i in range(count)]
        reported = [o for o in outcomes if o["report"] is not None and o["report"]["down"] == "LinkDead"]
        times = [o["reported_s"] for o in reported]
        median, worst = (f"{statistics.median(times):.2f}", f"{max(times):.2f}") if times else ("—", "—")
        print(f"| {via} ({a} → {b}) | {count} | {len(reported)} / {count} | {median} | {worst} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=1000, help="frames each way per pair in the matrix")
    parser.add_argument("--round-trips", type=int, default=300, help="timed round trips per size and edge")
    parser.add_argument("--repeats", type=int, default=5, help="links per edge for the round trips, pooled")
    parser.add_argument("--kills", type=int, default=5, help="killed neighbours per edge")
    parser.add_argument("--sections", nargs="+", choices=["matrix", "rtt", "kill"], default=["matrix", "rtt", "kill"])
    args = parser.parse_args()
    with lab_with_rendezvous("kk") as (lab, stun, http):
        if "matrix" in args.sections:
            matrix(lab, stun, http, args.frames)
            print()
        if "rtt" in args.sections:
            rtt(lab, stun, http, args.round_trips, args.repeats)
            print()
        if "kill" in args.sections:
            kills(lab, stun, http, args.kills)


if __name__ == "__main__":
    main()
