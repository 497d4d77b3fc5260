"""Sweep the speculation cost rule over many sampled free-text answers on the simulated ring.

tests/test_draft_cost.py asks its 5% bound of a fixed set of tables; this asks it of many more
(tables `--first`..`--last`, at each ring of `--rings`), and names every table below `--bound`
with why: each drafted trip's token index, window (drafts sent), drafts kept, and the accept rate
the rule weighed. The simulated ring and the tables are the test's own (a wave takes the trip plus
a cost a drafted row; a table is a random model over a 12-token vocabulary, sampled with the
table's seed); a copy measures the ring first, as a host's first requests do.

    PYTHONPATH=src python3 scripts/sweep_draft_cost.py [--first 0] [--last 999] [--rings 45+31 105+31 20+25 300+30]

Pure simulation: no model, no network; about 25 s a thousand tables a ring.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the simulated ring of the tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from test_draft_cost import ANSWERS_ASKED, CYCLE, FREE_TEXT_JOBS, WARM_JOBS, long_free_text_answer, simulate

from kafila.runtime.engine.speculation import DraftWindow, Speculate
from kafila.serving.batcher import Batcher


@dataclass(frozen=True)
class Trip:
    """A drafted trip of the answer: at its `index`-th token, `drafted` drafts sent, `kept` kept,
    the rule having weighed an accept rate of `rate`."""

    index: int
    drafted: int
    kept: int
    rate: float


def answer_ratio(table_seed: int, trip_ms: float, row_ms: float) -> tuple[float, int, list[Trip]] | None:
    """Tokens/s with n-gram drafts against none for one table's sampled answer on one ring, the
    answer's length and its drafted trips; None where the answer is shorter than the test asks."""
    answer = long_free_text_answer(table_seed, trip_ms, row_ms)
    if answer is None:
        return None
    table, plain, plain_s = answer
    _, _, measured = simulate(CYCLE, WARM_JOBS, Speculate.NGRAM, table_seed, trip_ms, row_ms)
    trips: list[Trip] = []
    watch(measured, trips)
    drafted, drafted_s, _ = simulate(table, FREE_TEXT_JOBS, Speculate.NGRAM, table_seed, trip_ms, row_ms, measured)
    if drafted["chat"] != plain:
        raise AssertionError(f"table {table_seed}: drafts changed the text")
    return plain_s / drafted_s, round(plain_s * 1e3 / trip_ms), trips


def watch(batcher: Batcher, trips: list[Trip]) -> None:
    """Record every drafted trip the batcher lands from now on into `trips`, with the accept rate
    its window was chosen on."""
    record, paying = batcher.speculation.record, batcher._paying
    tokens = batcher.tokens_generated
    rates: list[float] = []

    def chosen(window: DraftWindow, sharing: int, guesses: bool = True) -> int:
        rates.append(window.accept.rate)
        return paying(window, sharing, guesses)

    def recorded(drafted: int, accepted: int) -> None:
        if drafted:
            trips.append(Trip(batcher.tokens_generated - tokens - accepted - 1, drafted, accepted, rates[-1]))
        record(drafted, accepted)

    batcher._paying = chosen  # type: ignore[method-assign]
    batcher.speculation.record = recorded  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--last", type=int, default=999)
    parser.add_argument("--rings", nargs="+", default=["45+31", "105+31", "20+25", "300+30"], help="trip+row ms")
    parser.add_argument("--bound", type=float, default=0.95)
    parser.add_argument("--worst", type=int, default=5, help="the worst tables to list a ring, below the bound or not")
    args = parser.parse_args()
    for ring in args.rings:
        trip_ms, row_ms = (float(part) for part in ring.split("+"))
        results = {}
        for table_seed in range(args.first, args.last + 1):
            result = answer_ratio(table_seed, trip_ms, row_ms)
            if result is not None:
                results[table_seed] = result
        ranked = sorted(results.items(), key=lambda item: item[1][0])
        ratios = sorted(ratio for ratio, _, _ in results.values())
        print(
            f"ring {trip_ms:g} + {row_ms:g} ms: {len(results)} answers of {ANSWERS_ASKED}+ tokens, "
            f"worst {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, "
            f"{sum(r < args.bound for r in ratios)} below {args.bound}"
        )
        for rank, (table_seed, (ratio, tokens, trips)) in enumerate(ranked):
            if ratio >= args.bound and rank >= args.worst:
                break
            kept, sent = sum(trip.kept for trip in trips), sum(trip.drafted for trip in trips)
            shown = ", ".join(f"@{t.index}: {t.kept}/{t.drafted} (p {t.rate:.2f})" for t in trips)
            print(
                f"  table {table_seed}: {ratio:.3f}, {tokens} tokens, {len(trips)} drafted trips keep {kept} of {sent}:"
            )
            print(f"    {shown}")


if __name__ == "__main__":
    main()
