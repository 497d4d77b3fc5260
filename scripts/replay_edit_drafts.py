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

    PYTHONPATH=$PWD/src python scripts/replay_edit_drafts.py ANSWER.json [ANSWER.json ...]
        [--rings 101+15.3 110+32 32+20] [--tokens 64 160] [--min-ngram 2] [--max-ngram 4]

Pure simulation: a second or two an answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' greedy sampler
from test_speculation import Sample

from kafila.runtime.engine.draft_model import _common_prefix
from kafila.runtime.engine.engines import EngineStep, EveryRowLogits, PrefixCut, StepResult
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import MAX_DRAFT, MAX_NGRAM, MIN_NGRAM, NgramDrafter, Speculate
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("answers", nargs="+", type=Path, help="files trace_edit_drafts.py --save wrote")
    parser.add_argument("--rings", nargs="+", default=["101+15.3", "110+32", "32+20"], help="trip+row ms")
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 160])
    parser.add_argument("--min-ngram", type=int, default=MIN_NGRAM)
    parser.add_argument("--max-ngram", type=int, default=MAX_NGRAM)
    args = parser.parse_args()
    print(f"n-gram lookup {args.min_ngram}..{args.max_ngram}: tokens/s against no drafts, the rule (the oracle)")
    for path in args.answers:
        saved = json.loads(path.read_text())
        prompt, answer, vocabulary = renumbered(saved["prompt"], saved["answer"])
        for ring in args.rings:
            trip_ms, row_ms = (float(part) for part in ring.split("+"))
            figures = []
            for tokens in args.tokens:
                if tokens > len(answer):
                    raise SystemExit(f"{path}: {len(answer)} tokens saved, fewer than {tokens}")
                rule = replay(prompt, answer, vocabulary, tokens, trip_ms, row_ms, args.min_ngram, args.max_ngram)
                best = oracle(prompt, answer, tokens, trip_ms, row_ms, args.min_ngram, args.max_ngram)
                figures.append(f"{tokens} tokens {rule:.3f}x ({best:.3f}x)")
            print(f"{path.name} at {trip_ms:g} + {row_ms:g} ms: " + ", ".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
