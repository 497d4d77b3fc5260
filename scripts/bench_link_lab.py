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
  exchange and time how long the survivor takes to report the broken link;
- **transfer** (not run by default): on the direct or relayed edge, a stage file at each uplink
  delay and loss, line capped or not, side by side in one run: reno with the kernel's socket
  receive buffer, 1 MiB and 4 MiB, cubic, and Kafila's (4 MiB, the "rate" controller of
  kafila.network.congestion); beside each rate the losses QUIC saw, its congestion window and
  where the kernel or the delay line dropped packets.

    python scripts/bench_link_lab.py [--frames 1000] [--round-trips 300] [--repeats 5] [--kills 5]
                                     [--transfer-mb 64] [--delays 0 20] [--losses 0 0.0025]
                                     [--rate-mb 20] [--variants reno kafila] [--edge direct]
                                     [--sections matrix rtt kill transfer]     (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from natlab import NAT_TYPES
from natlab_punch_agent import kill_one, lab_with_rendezvous, peer_home, predicted_edge, punch_pair, run_pair
from natlab_wan import WanLink

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


def _drops(lab: Any, homes: list[Any]) -> dict[str, int]:
    """Where packets can be lost outside QUIC: the kernel's queue into each line's TUN device
    (its TX drops), and each host's UDP receive buffer (RcvbufErrors)."""
    counts: dict[str, int] = {"tun": 0, "rcvbuf": 0}
    for home in homes:
        tun = json.loads(lab.exec(lab.public_ns, ["ip", "-s", "-j", "link", "show", f"wan{home.index}"]))
        counts["tun"] += tun[0]["stats64"]["tx"]["dropped"]
        snmp = [line.split() for line in lab.exec(home.host_ns, ["cat", "/proc/net/snmp"]).splitlines()]
        names, values = [row for row in snmp if row[0] == "Udp:"][:2]
        counts["rcvbuf"] += int(values[names.index("RcvbufErrors")])
    return counts


TRANSFER_VARIANTS = {  # --variants name: (what the table calls it, the agents' options)
    "kernel": ("kernel's SO_RCVBUF, reno", ["--receive-buffer", "0", "--congestion", "reno"]),
    "1mib": ("1 MiB SO_RCVBUF, reno", ["--receive-buffer", str(1 << 20), "--congestion", "reno"]),
    "reno": ("4 MiB SO_RCVBUF, reno", ["--congestion", "reno"]),
    "cubic": ("4 MiB, cubic", ["--congestion", "cubic"]),
    "kafila": ("4 MiB, rate (Kafila's)", []),
}


def transfer(
    lab: Any,
    stun: str,
    http: str,
    megabytes: int,
    delays: list[float],
    repeats: int,
    edge: str,
    losses: list[float],
    rate_mb: float,
    names: list[str] | None,
) -> None:
    """A stage file over the edge, at each one-way uplink delay and loss in turn (a round trip of
    4× the delay, a path loss of about 2× each line's: each packet crosses both homes' lines),
    `repeats` times, alternating; with `rate_mb`, the sender's uplink and the receiver's downlink
    capped at that many MB/s by the kernel's token bucket (`NatLab.shape`)."""
    a, b = EDGES[edge]
    b = peer_home(lab, a, b)
    # through the relay the members' buffers matter less than the relay's: Kafila's own only
    chosen = names or (list(TRANSFER_VARIANTS) if edge == "direct" else ["reno", "kafila"])
    variants = dict(TRANSFER_VARIANTS[name] for name in chosen)
    if rate_mb:
        lab.shape(lab.homes[a], rate_mb * 1e6, 0)
        lab.shape(lab.homes[b], 0, rate_mb * 1e6)
    limit = f", capped at {rate_mb:g} MB/s" if rate_mb else ""
    print(f"{megabytes} MB stage file, {a} → {b} ({edge}{limit}); delay and loss are each uplink's, one way\n")
    print(
        "| uplink delay | loss per line | link | RTT | MB/s | seconds | QUIC lost packets | cwnd median / max KB "
        "| delay line passed / dropped | TUN queue drops | UDP RcvbufErrors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for _ in range(repeats):
        for delay, loss, (variant, options) in itertools.product(delays, losses, variants.items()):
            for home in (a, b):
                lab.set_wan(lab.homes[home], WanLink(delay_ms=delay, loss=loss))
            before = [lab.wan_counts(lab.homes[h]) for h in (a, b)]
            kernel_before = _drops(lab, [lab.homes[h] for h in (a, b)])
            outcomes = run_pair(lab, stun, http, a, b, "--transfer", str(megabytes), *options)
            after = [lab.wan_counts(lab.homes[h]) for h in (a, b)]
            kernel = {k: v - kernel_before[k] for k, v in _drops(lab, [lab.homes[h] for h in (a, b)]).items()}
            result = outcomes[0]["transfer"]
            windows = [s[1] / 1e3 for s in result["samples"]]
            rtts = [s[3] for s in result["samples"] if s[3] > 0]
            passed = sum(x[0] - y[0] for x, y in zip(after, before, strict=True))
            dropped = sum(x[1] - y[1] for x, y in zip(after, before, strict=True))
            rate = result["bytes"] / result["seconds"] / 1e6
            print(
                f"| {delay:g} ms | {loss:.2%} | {variant} | {statistics.median(rtts):.0f} ms | {rate:.1f} "
                f"| {result['seconds']:.1f} | {result['lost_packets']} "
                f"| {statistics.median(windows):.0f} / {max(windows):.0f} | {passed} / {dropped} "
                f"| {kernel['tun']} | {kernel['rcvbuf']} |",
                flush=True,
            )
    for home in (a, b):
        lab.set_wan(lab.homes[home], WanLink())
        lab.shape(lab.homes[home], 0, 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=1000, help="frames each way per pair in the matrix")
    parser.add_argument("--round-trips", type=int, default=300, help="timed round trips per size and edge")
    parser.add_argument("--repeats", type=int, default=5, help="links per edge for the round trips, pooled")
    parser.add_argument("--kills", type=int, default=5, help="killed neighbours per edge")
    parser.add_argument("--transfer-mb", type=int, default=64, help="the stage file's size in the transfer section")
    parser.add_argument("--edge", choices=sorted(EDGES), default="direct", help="the transfer section's edge")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 20.0], help="one-way uplink delays, ms")
    parser.add_argument("--losses", type=float, nargs="+", default=[0.0], help="each uplink's loss, each way")
    parser.add_argument("--rate-mb", type=float, default=0.0, help="cap the transfer's path at this many MB/s")
    parser.add_argument("--variants", nargs="+", choices=sorted(TRANSFER_VARIANTS), help="the transfer's variants")
    parser.add_argument(
        "--sections", nargs="+", choices=["matrix", "rtt", "kill", "transfer"], default=["matrix", "rtt", "kill"]
    )
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
            print()
        if "transfer" in args.sections:
            transfer(
                lab,
                stun,
                http,
                args.transfer_mb,
                args.delays,
                args.repeats,
                args.edge,
                args.losses,
                args.rate_mb,
                args.variants,
            )


if __name__ == "__main__":
    main()
