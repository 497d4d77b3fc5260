"""NAT lab benchmark: classification time, join-to-introduction time, and hole punching per pair.

Builds a lab with a home of every NAT type (two of each, for same-type pairs), starts a real
`kafila rendezvous` in its public namespace, then measures, all inside the lab:

- the time `kafila nat` takes to classify each home, and whether it is right;
- for every ordered pair of NAT types, `--attempts` punches signalled through the rendezvous:
  the success rate, the median time to a direct path, and the median time from joining to the
  introduction (`ready`);
- the planner's prediction for each pair next to the outcome (the paper's Table III).

    python scripts/bench_nat_lab.py [--attempts 20]     (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from natlab import NAT_BEHAVIOUR, NAT_TYPES
from natlab_punch_agent import lab_with_rendezvous, peer_home, predicted_edge, punch_pair

KAFILA = [sys.executable, "-m", "kafila"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attempts", type=int, default=20)
    args = parser.parse_args()
    with lab_with_rendezvous("kb") as (lab, stun, http):
        print("| NAT | classified as (mapping / filtering / class) | right | seconds |")
        print("|---|---|---|---|")
        for nat in NAT_TYPES:
            started = time.monotonic()
            out = lab.run_home(
                lab.homes[nat], [*KAFILA, "nat", "--rendezvous", stun, "--json"], stdout=subprocess.PIPE, text=True
            )
            report = json.loads(out.communicate(timeout=60)[0])
            seconds = time.monotonic() - started
            got = (report["mapping"], report["filtering"], report["class"])
            right = "yes" if got == NAT_BEHAVIOUR[nat] else "NO"
            print(f"| {nat} | {' / '.join(map(str, got))} | {right} | {seconds:.2f} |")

        rows = []
        for a, b in itertools.product(NAT_TYPES, repeat=2):
            results = [punch_pair(lab, stun, http, a, peer_home(lab, a, b)) for _ in range(args.attempts)]
            predicted = predicted_edge(a, b).value
            successes = [r for r in results if r["direct"]]
            rows.append((a, b, predicted, len(successes), results, successes))

    print(f"\n| from \\\\ to | {' | '.join(NAT_TYPES)} |")
    print("|---|" + "---|" * len(NAT_TYPES))
    for a in NAT_TYPES:
        cells = []
        for b in NAT_TYPES:
            _, _, predicted, ok, results, _ = next(r for r in rows if r[0] == a and r[1] == b)
            observed = "direct" if ok == len(results) else ("relayed" if ok == 0 else f"{ok}/{len(results)} direct")
            mark = "✓" if (observed == predicted) else "✗"
            cells.append(f"{mark} predicted {predicted}, {observed}")
        print(f"| **{a}** | {' | '.join(cells)} |")

    print("\n| pair | punched | median time to direct (s) | median join to introduction (s) |")
    print("|---|---|---|---|")
    for a, b, _, ok, results, successes in rows:
        punch_time = f"{statistics.median(r['seconds'] for r in successes):.2f}" if successes else "—"
        intro = statistics.median(r["introduction_s"] for r in results)
        print(f"| {a} → {b} | {ok}/{len(results)} | {punch_time} | {intro:.3f} |")


if __name__ == "__main__":
    main()
