"""Replay fixed edit answers through the batcher's drafting rules on the simulated ring, without
the model: what a change to the n-gram lookup or the window would give on answers the model
actually wrote, and the most any window could give with the same lookup.

An answer is saved once with the model (`scripts/trace_edit_drafts.py --save ANSWER.json`; the
answer depends on the drafts the recording sent, rows computed together rounding otherwise). Here
a stand-in engine's greedy rows give that answer whatever was drafted, so every rule replays the
same text; each decode wave takes `trip` ms and each drafted row `row` ms more, as in the trace.
For each answer, ring and length: tokens/s against no drafts with the batcher's rule, and with an
oracle that knows how many of each trip's drafts would be kept and picks every window (0 to
MAX_DRAFT) to take the least time.

Where a ring names its stages' ms too (trip+row+stages), also drafts in flight (`in_flight`): up
to 1, 2, 3 (`--in-flight`) waves of one sequence's drafts out at once, each sent as the one before
it leaves on the guess that those out are kept whole, on a ring of three stages that take the
waves in turn (`Ring`, `RingTimes`: the head last with `--head-share` of the stages' ms and every
drafted row, at most `--cores` computing at once), by a rule and knowing which guesses are kept.

    PYTHONPATH=$PWD/src python scripts/replay_edit_drafts.py ANSWER.json [ANSWER.json ...]
        [--rings 101+15.3 110+32 32+20 88.4+14.3+27.4] [--tokens 64 160] [--min-ngram 2] [--max-ngram 4]
        [--in-flight 1 2 3] [--head-share 0.5] [--cores 2]

Pure simulation: a second or two an answer.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' greedy sampler
from test_speculation import Sample

from kafila.runtime.engine.draft_cost import best_window, expected_tokens
from kafila.runtime.engine.draft_model import _common_prefix
from kafila.runtime.engine.engines import EngineStep, EveryRowLogits, PrefixCut, StepResult
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import MAX_DRAFT, MAX_NGRAM, MIN_NGRAM, DraftWindow, NgramDrafter, Speculate
from kafila.serving.batcher import Batcher, Job

END = 0  # the stand-in's end token: answers are renumbered from 1


class AnswerModel:
    """A stand-in engine whose row after position p of the prompt and answer picks the answer's
    next token, with a cache per slot that refuses rows out of position order as a stage does."""

    def __init__(self, prompt: Sequence[int], answer: Sequence[int], vocabulary: int) -> None:
        self.prompt, self.answer, self.vocabulary = list(prompt), list(answer), vocabulary
        self.cache: dict[int, int] = {}  # slot → positions held

    def forget(self, slot: int, keep: int) -> None:
        self.cache[slot] = min(self.cache.get(slot, 0), keep)

    def row(self, held: int) -> np.ndarray:
        row = np.zeros(self.vocabulary, np.float32)
        index = held - len(self.prompt)
        row[self.answer[index] if 0 <= index < len(self.answer) else END] = 1.0
        return row

    def run(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        results: list[StepResult] = []
        for step in steps:
            held = self.cache.get(step.sequence_id, 0)
            if step.position != held:
                raise ValueError(f"rows at {step.position}; the cache holds {held}")
            rows = [self.row(held + i + 1) for i in range(len(step.tokens))]
            self.cache[step.sequence_id] = held + len(step.tokens)
            if step.every_row:
                results.append(EveryRowLogits(np.stack(rows)))
            else:
                results.append(rows[-1] if step.logits else None)
        return results


def renumbered(prompt: Sequence[int], answer: Sequence[int]) -> tuple[list[int], list[int], int]:
    """The prompt and answer over a vocabulary of just their tokens (from 1; END is 0): the rows
    stay small, and drafts compare as before."""
    numbers = {token: i + 1 for i, token in enumerate(sorted(set(prompt) | set(answer)))}
    return [numbers[t] for t in prompt], [numbers[t] for t in answer], len(numbers) + 1


def replay(
    prompt: list[int], answer: list[int], vocabulary: int, tokens: int, trip_ms: float, row_ms: float,
    min_ngram: int, max_ngram: int,
) -> float:  # fmt: skip
    """Tokens/s with the batcher's n-gram drafts against none, over the answer's first `tokens`."""
    model = AnswerModel(prompt, answer, vocabulary)
    batcher = Batcher(
        1, 512, len(prompt) + tokens + MAX_DRAFT + 1, lambda _s: Sample(None), lambda t: f"<{t}>".encode(),
        lambda t: t == END, PrefixCut.ANYWHERE, Speculate.NGRAM,
    )  # fmt: skip
    batcher.submit(Job("edit", prompt, tokens, SamplingSettings()))
    ring_ms = 0.0
    while not batcher.idle or batcher.trimming:
        for trim in batcher.take_trims():
            model.forget(trim.slot, trim.keep)
        admitted = not batcher._active
        steps = batcher.plan()
        for sequence in batcher._active.values() if admitted else ():
            sequence.drafter = NgramDrafter(prompt, min_ngram, max_ngram)
        if not steps:
            continue
        batcher.advance(model.run(steps))
        if all(step.decode for step in steps):
            drafted = sum(len(step.tokens) - 1 for step in steps)
            wave_ms = trip_ms + row_ms * drafted
            ring_ms += wave_ms
            batcher.trip_clock.record(drafted, wave_ms / 1e3)
    return (tokens - 1) * trip_ms / ring_ms  # without drafts, one token a trip after the prompt's


def oracle(prompt: list[int], answer: list[int], tokens: int, trip_ms: float, row_ms: float, min_ngram: int,
           max_ngram: int) -> float:  # fmt: skip
    """Tokens/s against no drafts where each trip's window is chosen knowing how many of its
    drafts (the same lookup's) would be kept: the least time to the answer's `tokens`th token."""
    drafter = NgramDrafter(prompt, min_ngram, max_ngram)
    kept: list[int] = []
    for index in range(tokens):
        kept.append(_common_prefix(drafter.draft(MAX_DRAFT), answer[index : index + MAX_DRAFT]))  # those kept
        drafter.extend(answer[index : index + 1])
    least = [float("inf")] * (tokens + 1)
    least[1] = 0.0  # the first token comes with the prompt's trip
    for index in range(1, tokens):
        for window in range(MAX_DRAFT + 1):
            reached = min(tokens, index + 1 + min(window, kept[index]))
            least[reached] = min(least[reached], least[index] + trip_ms + row_ms * window)
    return (tokens - 1) * trip_ms / least[tokens]


@dataclass(frozen=True)
class Ring:
    """A ring of `stages` stages, the head last, each with its own core where `cores` allow: a
    wave of n rows takes `stage_ms` (one row, all stages together; the head's share `head_share`,
    the rest split evenly) and `row_ms` a row more at the head (its rows of logits); the rest of
    `trip_ms` is the hops, split evenly over the ring's edges (the host's own work with them)."""

    trip_ms: float
    row_ms: float
    stage_ms: float
    stages: int = 3
    head_share: float = 0.5
    cores: int = 2

    @property
    def hop_ms(self) -> float:
        return (self.trip_ms - self.stage_ms) / self.stages

    def compute_ms(self, stage: int, rows: int) -> float:
        if stage == self.stages - 1:
            return self.head_share * self.stage_ms + self.row_ms * (rows - 1)
        return (1 - self.head_share) * self.stage_ms / (self.stages - 1)


class RingTimes:
    """When each wave sent round a `Ring` comes back: every stage takes the waves in the order they
    reach it, one at a time, and computes only while one of the ring's cores is free (the
    lab's stages share this box's two). Events in time order; `send` only at or after the last
    wave returned (`land`)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, wave, stage)
        self.order = 0
        self.rows: dict[int, int] = {}
        self.waiting: list[deque[tuple[float, int]]] = [deque() for _ in range(ring.stages)]
        self.busy = [False] * ring.stages
        self.cores_free = ring.cores

    def _push(self, time: float, kind: str, wave: int, stage: int) -> None:
        self.order += 1
        heapq.heappush(self.events, (time, self.order, kind, wave, stage))

    def send(self, now: float, wave: int, rows: int) -> None:
        self.rows[wave] = rows
        self._push(now + self.ring.hop_ms, "arrive", wave, 0)

    def _start(self, now: float) -> None:
        """Start the waves that have reached an idle stage, the earliest first, while cores are free."""
        while self.cores_free > 0:
            ready = [(queue[0][0], stage) for stage, queue in enumerate(self.waiting) if queue and not self.busy[stage]]
            if not ready:
                return
            _, stage = min(ready)
            _, wave = self.waiting[stage].popleft()
            self.busy[stage], self.cores_free = True, self.cores_free - 1
            self._push(now + self.ring.compute_ms(stage, self.rows[wave]), "done", wave, stage)

    def land(self) -> tuple[float, int]:
        """The next wave to come back, and when."""
        while self.events:
            now, _, kind, wave, stage = heapq.heappop(self.events)
            if kind == "arrive":
                self.waiting[stage].append((now, wave))
            else:
                self.busy[stage], self.cores_free = False, self.cores_free + 1
                if stage == self.ring.stages - 1:
                    self._start(now)
                    return now, wave
                self._push(now + self.ring.hop_ms, "arrive", wave, stage + 1)
            self._start(now)
        raise RuntimeError("no wave out")


@dataclass
class Wave:
    """One sequence's rows out round the ring in one wave."""

    start: int  # the answer's index of the token its first row feeds
    fed: list[int]  # the tokens its rows feed: the last known one, or guesses, then drafts
    drafts: int  # of them, those drafted (all but a known first)
    stale: bool = False  # sent on guesses a wave before it proved wrong
    shadow: int | None = None  # with no drafts, the lookup's free guess (`DraftWindow.shadowed`)


def in_flight(
    prompt: list[int], answer: list[int], tokens: int, ring: Ring, most: int, knows: bool,
    min_ngram: int, max_ngram: int,
) -> tuple[float, Counter[str]]:  # fmt: skip
    """Tokens/s against no drafts with up to `most` waves of one sequence's drafts out at once on
    `ring`: a wave goes as the one before it leaves, drafted on the guess that every wave out is
    kept whole (the n-gram continuation past them, its first row the guess for the token the wave
    before it brings). A wave that comes back with a reject, or whose token is not the guess the
    wave behind it fed, makes those behind stale: they still take their stages' time, and the next
    wave (with the cut) goes at once. The first wave out is windowed by the batcher's rule
    (`DraftWindow`, `best_window` at the ring's trip and row); a wave behind it goes where its
    expected tokens (each row's weighed by the chance that every guess up to it is kept) exceed
    what its time at the head (the ring's slowest stage) brings at the rate one wave a trip gives.
    `knows`: both send only the guesses that will be kept."""
    drafter = NgramDrafter(prompt + answer[:1], min_ngram, max_ngram)
    window = DraftWindow()
    times = RingTimes(ring)
    known, now, sent = 1, 0.0, 0
    out: dict[int, Wave] = {}
    counts: Counter[str] = Counter()

    def kept_run(start: int, guesses: Sequence[int]) -> int:
        return _common_prefix(list(guesses), answer[start : start + len(guesses)])

    def expected(start: int, rows: int, rate: float) -> float:
        """Tokens a wave feeding the answer's `start`.. brings: a row's, where every guess up to it is kept."""
        return sum(rate ** max(0, start + row - known + 1) for row in range(rows))

    def send(wave: Wave) -> None:
        nonlocal sent
        sent += 1
        out[sent] = wave
        times.send(now, sent, len(wave.fed))
        counts["waves"] += 1
        counts["rows"] += len(wave.fed)

    while known < tokens:
        live = [wave for wave in out.values() if not wave.stale]
        rate = window.accept.rate
        single = best_window(rate, ring.trip_ms, ring.row_ms, MAX_DRAFT)
        one_wave_rate = expected_tokens(rate, single) / (ring.trip_ms + ring.row_ms * single)
        if not live:
            room = min(MAX_DRAFT, tokens - known - 1)
            if knows:
                drafts = drafter.draft(room)
                drafts = drafts[: kept_run(known, drafts)]
            else:
                limit = window.allowed if window.trips else 1
                afford = window.ledger.affordable * ring.trip_ms
                drafts = drafter.draft(min(room, best_window(rate, ring.trip_ms, ring.row_ms, limit, afford_ms=afford)))
            guess = None
            if not drafts:
                window.skip()
                guess = next(iter(drafter.draft(1)), None)
            send(Wave(known - 1, [answer[known - 1], *drafts], len(drafts), shadow=guess))
            live = [out[sent]]
        while len(live) < most:
            start = live[-1].start + len(live[-1].fed)
            if start >= tokens - 1:
                break
            continuation = drafter.draft(start - known + MAX_DRAFT + 1)
            assumed = [t for wave in live for i, t in enumerate(wave.fed) if wave.start + i >= known]
            if continuation[: start - known] != assumed:
                break  # the lookup now continues otherwise than the guesses out
            guesses = continuation[start - known : start - known + min(MAX_DRAFT + 1, tokens - 1 - start)]
            if knows:
                rows = kept_run(start, guesses) if kept_run(known, assumed) == len(assumed) else 0
            else:
                rows, best = 0, 0.0
                for count in range(1, len(guesses) + 1):
                    head_ms = ring.compute_ms(ring.stages - 1, count)
                    gain = expected(start, count, rate) - one_wave_rate * head_ms
                    if gain > best:
                        rows, best = count, gain
            if rows == 0:
                break
            send(Wave(start, guesses[:rows], rows))
            counts["behind"] += 1
            live.append(out[sent])
        now, landed = times.land()
        wave = out.pop(landed)
        if wave.stale:
            counts["stale"] += 1
            counts["stale rows"] += len(wave.fed)
            continue
        assert wave.start == known - 1, "a wave that is not stale feeds the last token known first"
        right = kept_run(wave.start, wave.fed)  # its rows fed as the answer has them (all but the stale)
        drafter.extend(answer[known : wave.start + right + 1])
        known = wave.start + right + 1
        if wave.shadow is not None:
            window.shadowed(wave.shadow == answer[known - 1])
        if wave.drafts:
            window.landed(wave.drafts, right - (len(wave.fed) - wave.drafts), 0.0)
        wrong = right < len(wave.fed)
        for other in sorted(out):  # the waves behind it, in the order they go round
            behind = out[other]
            checked = min(len(behind.fed), known - behind.start)  # its rows whose tokens are known now
            wrong = wrong or kept_run(behind.start, behind.fed[:checked]) < checked
            behind.stale = behind.stale or wrong
    return (tokens - 1) * ring.trip_ms / now, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("answers", nargs="+", type=Path, help="files trace_edit_drafts.py --save wrote")
    parser.add_argument(
        "--rings", nargs="+", default=["101+15.3", "110+32", "32+20"],
        help="trip+row ms, or trip+row+stages ms (the stages' sum for one row) to replay waves in flight too",
    )  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 160])
    parser.add_argument("--min-ngram", type=int, default=MIN_NGRAM)
    parser.add_argument("--max-ngram", type=int, default=MAX_NGRAM)
    parser.add_argument("--in-flight", nargs="+", type=int, default=[1, 2, 3], help="waves of drafts out at most")
    parser.add_argument("--head-share", type=float, default=0.5, help="the head's share of the stages' ms")
    parser.add_argument("--cores", type=int, default=2, help="stages computing at once at most")
    args = parser.parse_args()
    print(f"n-gram lookup {args.min_ngram}..{args.max_ngram}: tokens/s against no drafts, the rule (the oracle)")
    for path in args.answers:
        saved = json.loads(path.read_text())
        prompt, answer, vocabulary = renumbered(saved["prompt"], saved["answer"])
        for spec in args.rings:
            parts = [float(part) for part in spec.split("+")]
            trip_ms, row_ms = parts[:2]
            figures = []
            for tokens in args.tokens:
                if tokens > len(answer):
                    raise SystemExit(f"{path}: {len(answer)} tokens saved, fewer than {tokens}")
                rule = replay(prompt, answer, vocabulary, tokens, trip_ms, row_ms, args.min_ngram, args.max_ngram)
                best = oracle(prompt, answer, tokens, trip_ms, row_ms, args.min_ngram, args.max_ngram)
                figures.append(f"{tokens} tokens {rule:.3f}x ({best:.3f}x)")
            print(f"{path.name} at {trip_ms:g} + {row_ms:g} ms: " + ", ".join(figures))
            if len(parts) < 3:
                continue
            ring = Ring(trip_ms, row_ms, parts[2], head_share=args.head_share, cores=args.cores)
            for tokens in args.tokens:
                shown = []
                for most in args.in_flight:
                    ratio, counts = in_flight(prompt, answer, tokens, ring, most, False, args.min_ngram, args.max_ngram)
                    known, _ = in_flight(prompt, answer, tokens, ring, most, True, args.min_ngram, args.max_ngram)
                    shown.append(
                        f"{most} out {ratio:.3f}x ({known:.3f}x; {counts['waves']} waves, {counts['behind']} behind, "
                        f"{counts['stale']} stale of {counts['stale rows']} rows)"
                    )
                print(f"  in flight, stages {parts[2]:g} ms, {tokens} tokens: " + "; ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
