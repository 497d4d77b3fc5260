"""Where the edit's trips go with n-gram drafts: gemma-3-270m in one process, greedy, on
bench_wan.py's edit prompt (the 210-line file asked back with one identifier renamed), the batcher
drafting as the engine loop does, each decode wave timed as a ring whose trip takes `--trip-ms`
and each drafted row `--row-ms` more (the lab's measures, /status `trip_ms` and `row_ms`). For
each wave: drafts sent, or why none (no n-gram match, the window resting, the cost rule), and
the answer's tokens/s against decoding without drafts on that ring.

    PYTHONPATH=$PWD/src python scripts/trace_edit_drafts.py [--trip-ms 110] [--row-ms 32] [--tokens 160]
        [--min-ngram 2] [--save ANSWER.json]

`--save` writes the prompt's and the answer's token ids, which scripts/replay_edit_drafts.py
replays through other drafting rules without the model.

Rows computed together round otherwise than one at a time (docs/architecture.md, "Exactness"),
so the answer is this process's, not the lab's, and a different --min-ngram may change it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from bench_wan import edit_prompt
from lab_session import benchmark_gemma

from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import MAX_DRAFT, NgramDrafter, Speculate
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Batcher, Job, TextDelta

CONTEXT = 4096
MARKS = {"none found": "n", "rest": "w", "rule": "x"}  # a wave without drafts, and why


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trip-ms", type=float, default=110.0)
    parser.add_argument("--row-ms", type=float, default=32.0)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--min-ngram", type=int, default=None, help="the drafter's shortest suffix (default its own)")
    parser.add_argument("--save", type=Path, default=None, help="write the prompt's and answer's token ids here")
    args = parser.parse_args()
    model = benchmark_gemma()
    if model is None:
        return 2
    settings = ContextSettings(n_ctx=CONTEXT, n_batch=512, n_seq_max=1, n_threads=1)
    engine = open_engine(model, [read_manifest(model).n_blocks], settings)
    batcher = Batcher(
        1, 512, CONTEXT, engine.sampler, engine.piece, engine.is_end, engine.prefix_cut, Speculate.NGRAM,
        engine.speculation_refused, engine.every_row_whole,
    )  # fmt: skip
    prompt = engine.tokenize(edit_prompt(None))
    batcher.submit(Job("edit", prompt, args.tokens, SamplingSettings()))
    reasons: Counter[str] = Counter()
    waves: list[str] = []
    ring_ms, text = 0.0, ""
    answer: list[int] = []
    while not batcher.idle or batcher.trimming:
        for trim in batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        why = ""
        for sequence in batcher._active.values():
            if sequence.generated and sequence.drafter is not None:
                found = len(sequence.drafter.draft(MAX_DRAFT))
                paying = batcher._paying(sequence.window, 1)
                allowed = sequence.window.allowed
                why = "rest" if allowed == 0 else "none found" if found == 0 else "rule" if paying == 0 else "drafted"
        admitted = not batcher._active
        steps = batcher.plan()
        for sequence in batcher._active.values() if admitted else ():
            answer = sequence.generated  # the list the answer's tokens go to
            if args.min_ngram is not None:
                sequence.drafter = NgramDrafter(prompt, min_ngram=args.min_ngram)
        if not steps:
            continue
        results = engine.step_many(steps)
        for event in batcher.advance(results):
            if isinstance(event, TextDelta):
                text += event.text
        if all(step.decode for step in steps):
            drafted = sum(len(step.tokens) - 1 for step in steps)
            wave_ms = args.trip_ms + args.row_ms * drafted
            ring_ms += wave_ms
            batcher.trip_clock.record(drafted, wave_ms / 1e3)
            reasons[why] += 1
            waves.append(str(drafted) if why == "drafted" else MARKS.get(why, "?"))
    engine.close()
    plain_ms = (args.tokens - 1) * args.trip_ms  # one token a trip after the prompt's
    stats = batcher.speculation
    print(f"ring: a trip of {args.trip_ms:g} ms, {args.row_ms:g} ms a drafted row; {args.tokens} tokens")
    print(f"decode waves {sum(reasons.values())}: " + ", ".join(f"{why} {n}" for why, n in reasons.most_common()))
    print(f"drafted {stats.drafted}, kept {stats.accepted}, in {stats.trips} trips; tokens/s against no drafts "
          f"{plain_ms / ring_ms:.2f}x")  # fmt: skip
    print("each wave (drafts sent; n: none found, w: the window resting, x: the rule):", " ".join(waves))
    print(repr(text))
    if args.save is not None:
        args.save.write_text(json.dumps({"prompt": prompt, "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
