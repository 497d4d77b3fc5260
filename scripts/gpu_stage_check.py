"""What the planner admits on a GPU against what llama.cpp allocates there, and a split's speed.

    python scripts/gpu_stage_check.py admission [--model PATH] [--context 4096] [--concurrency 4]
    python scripts/gpu_stage_check.py rate [--model PATH] [--tokens 128] [--rounds 3]

admission: the planner (`plan_session`, `ChainPrefix.resident_matrix`) says what one stage holding
the whole model needs for the session, and what the first stage of a 2-stage halves split needs;
a device offered exactly that is admitted and one byte less refused. Each is then loaded with
every layer on the GPU and a context as the session runner makes it (context x concurrency cells,
concurrency sequences), and what llama.cpp allocated is printed next to the planner's figure: its
model, KV, output and compute buffers by device (from its log), `llama_model_size`, and the
GPU memory nvidia-smi sees taken by the load.

rate: greedy decode tokens/s of the model alone and cut in two halves (local stage processes,
as `kafila generate --stages 2` runs them), every layer on the GPU (on a build without one, the
CPU), rounds interleaved, medians. On this project's shared 2-vCPU machines the figures mean
nothing (two stage processes there have beaten the model alone by 2x under others' load).

The model: --model, else one written on the spot (tests/helpers/tiny_models.py's writer): a llama of 8
blocks, n_embd 1024, n_ff 2816, every matrix Q8_0 (about 100 MB), big enough that its buffers
are not lost in rounding and small enough to write in seconds. Its vocabulary is the tiny
models' few hundred tokens, so the head is small and the blocks are nearly all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from tiny_models import Q8_0, ModelShape, write_tiny_model

from kafila.planner import Device, PlanRefused, ServingSpec, plan_session
from kafila.planner.cost import ChainPrefix
from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.loading import llama
from kafila.runtime.llama.model import ContextSettings, LlamaModel

MEDIUM = ModelShape(
    n_embd=1024, n_head=16, n_head_kv=4, head_dim=64, n_ff=2816, tied_output=False,
    embd_std=1.0, ffn_types=(Q8_0,), attn_v_type=Q8_0,
)  # fmt: skip
MEDIUM_BLOCKS = 8
BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|output|compute|RS) buffer size =\s*([\d.]+) MiB")
PROMPT = "hello world, the model is in the block of kafila"
MiB = 2**20


def model_path(given: Path | None, work: Path) -> Path:
    if given is not None:
        if not given.is_file():
            raise SystemExit(f"gpu_stage_check: no model file at {given}")
        return given
    return write_tiny_model(work / "medium-llama.gguf", "llama", n_blocks=MEDIUM_BLOCKS, shape=MEDIUM)


def gpu_used_mib() -> float | None:
    """Memory in use on the first GPU, by nvidia-smi; None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
    return float(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def loaded_buffers(path: Path, settings: ContextSettings) -> tuple[dict[str, float], int, float | None]:
    """Load with llama.cpp's log captured: its buffers (device and kind -> MiB), llama_model_size,
    and the GPU memory the load took (MiB, nvidia-smi; None without one)."""
    before = gpu_used_mib()
    log = io.StringIO()
    os.environ["KAFILA_LLAMA_LOG"] = "1"  # llama.errors' log callback then prints to sys.stderr
    try:
        with contextlib.redirect_stderr(log):
            model = LlamaModel(path, settings)
    finally:
        del os.environ["KAFILA_LLAMA_LOG"]
    try:
        after = gpu_used_mib()
        weights = int(model._llama.llama_model_size(model.model))
    finally:
        model.close()
    buffers: dict[str, float] = {}
    for device, kind, mib in BUFFER_LINE.findall(log.getvalue()):
        buffers[f"{device} {kind}"] = buffers.get(f"{device} {kind}", 0.0) + float(mib)
    taken = after - before if after is not None and before is not None else None
    return buffers, weights, taken


def admission(args: argparse.Namespace, work: Path) -> int:
    path = model_path(args.model, work)
    manifest = read_manifest(path)
    session = ServingSpec(context=args.context, concurrency=args.concurrency)
    prefix = ChainPrefix.of(manifest, session)
    n, half = manifest.n_blocks, manifest.n_blocks // 2
    whole_need = int(prefix.resident_matrix(is_head=True)[0, n])
    first_need = int(prefix.resident_matrix(is_head=False)[0, half])
    print(
        f"model {path.name}: {n} blocks, {manifest.total_bytes / MiB:.1f} MiB of weights by the manifest; "
        f"session context {args.context} x {args.concurrency}"
    )
    try:
        plan = plan_session(manifest, [Device(name="gpu", memory_bytes=whole_need)], session)
        print(
            f"planner: one stage needs {whole_need / MiB:.1f} MiB; offered exactly that: admitted "
            f"(blocks {plan.stages[0].start}-{plan.stages[0].end - 1}, head {plan.head})"
        )
    except PlanRefused as refused:
        print(f"planner: one stage needs {whole_need / MiB:.1f} MiB, yet refused it: {refused}")
        return 1
    try:
        plan_session(manifest, [Device(name="gpu", memory_bytes=whole_need - 1)], session)
        print("planner: one byte less was admitted too: the figure is not the limit")
        return 1
    except PlanRefused as refused:
        print(f"planner: one byte less: refused ({refused})")

    settings = ContextSettings(
        n_ctx=args.context * args.concurrency, n_batch=512, n_seq_max=args.concurrency, gpu_layers=999
    )
    offloads = bool(llama().llama_supports_gpu_offload())
    first = slice_model(path, [half, n - half], work / "stages")[0].path
    # As HeadStage and WholeModel load it: a row of logits per sequence; a block stage asks none.
    as_head = replace(settings, max_outputs=settings.n_seq_max)
    loads = [
        ("whole model", path, whole_need, as_head),
        (f"first stage, blocks 0-{half - 1}", first, first_need, settings),
    ]
    for label, file, need, load_settings in loads:
        buffers, weights, taken = loaded_buffers(file, load_settings)
        on_gpu = sum(mib for name, mib in buffers.items() if not name.startswith("CPU"))
        total = sum(buffers.values())
        listed = ", ".join(f"{k} {v:.1f}" for k, v in sorted(buffers.items())) or "none logged"
        seen = "n/a" if taken is None else f"{taken:.0f} MiB"
        print(
            f"{label}: planner {need / MiB:.1f} MiB; llama.cpp allocated {total:.1f} MiB "
            f"({total - need / MiB:+.1f} MiB against the planner), {on_gpu:.1f} MiB of it off the CPU; "
            f"llama_model_size {weights / MiB:.1f} MiB; buffers (MiB): {listed}; nvidia-smi: {seen} taken "
            f"(offloads: {offloads})"
        )
    return 0


def greedy_rate(engine: Engine, tokens: int) -> float:
    """Decoded tokens/s of `tokens` greedy steps after the prompt, on past an end-of-text token (a
    random model may pick one early, and every round should time the same number of steps)."""
    prompt = engine.tokenize(PROMPT)
    logits = engine.step(0, 0, prompt, decode=False)
    started = time.perf_counter()
    for index in range(tokens):
        logits = engine.step(0, len(prompt) + index, [int(np.argmax(logits))], decode=True)
    seconds = time.perf_counter() - started
    engine.forget(0)
    return tokens / seconds


def rate(args: argparse.Namespace, work: Path) -> int:
    path = model_path(args.model, work)
    n = read_manifest(path).n_blocks
    settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1, gpu_layers=999)
    configs = {"alone": [n], "2 stages": [n // 2, n - n // 2]}
    rates: dict[str, list[float]] = {label: [] for label in configs}
    engines = {label: open_engine(path, counts, settings, work / "cache") for label, counts in configs.items()}
    try:
        for _ in range(args.rounds):
            for label, engine in engines.items():
                rates[label].append(greedy_rate(engine, args.tokens))
    finally:
        for engine in engines.values():
            engine.close()
    offloads = bool(llama().llama_supports_gpu_offload())
    alone = statistics.median(rates["alone"]) if rates["alone"] else float("nan")
    for label, values in rates.items():
        median = statistics.median(values) if values else float("nan")
        print(
            f"{label}: {median:.1f} tokens/s (median of {len(values)}; {median / alone:.0%} of alone; "
            f"{'GPU' if offloads else 'CPU'})"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("admission")
    one.add_argument("--model", type=Path)
    one.add_argument("--context", type=int, default=4096)
    one.add_argument("--concurrency", type=int, default=4)
    two = sub.add_parser("rate")
    two.add_argument("--model", type=Path)
    two.add_argument("--tokens", type=int, default=128)
    two.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        return admission(args, Path(scratch)) if args.what == "admission" else rate(args, Path(scratch))


if __name__ == "__main__":
    sys.exit(main())
