"""The planner's memory for a stage is at least what llama.cpp then allocates for it.

A stage needs its weights, its KV cache and a llama.cpp context: compute buffers for a full prompt
batch, the scheduler's graph metadata, attention masks, and at the head the logits rows and the
tokenizer's tables. The planner prices the context from the model's header (`ContextNeeds`); here
every supported family, the real gemma-3-270m and a wider model are loaded stage by stage on real
llama.cpp, and what the process allocated while building each stage (glibc's own count of its heap
and mapped chunks) plus the stage's mapped weights is held to the planner's figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_allocation import LIBC, settings_of, stage_allocation
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model, write_wide_model

from kafila.planner.cost import ChainPrefix
from kafila.planner.types import DRAFT_ROWS, ContextNeeds, ModelManifest, ServingSpec
from kafila.runtime.engine.stage import WholeModel
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import slice_model

MiB = 2**20
# The runner's settings: one context of context * concurrency cells, batches of 512 rows.
SESSIONS = (ServingSpec(context=4096, concurrency=4), ServingSpec(context=512, concurrency=1))
N_BLOCKS = {"qwen3next": 8, "llama4": 8}  # cut where their families allow (after a full-attention block; at 4)


pytestmark = pytest.mark.skipif(LIBC is None, reason="needs glibc's mallinfo2 to count what llama.cpp allocates")


def models(folder: Path, gemma: Path) -> list[tuple[str, Path]]:
    found = [
        (arch, write_tiny_model(folder / f"{arch}.gguf", arch, n_blocks=N_BLOCKS.get(arch, 4)))
        for arch in SUPPORTED_TINY_ARCHS
    ]
    return [*found, ("wide", write_wide_model(folder / "wide.gguf", 4)), ("gemma-3-270m", gemma)]


def test_planned_need_covers_what_llama_cpp_allocates(tmp_path: Path, gemma_path: Path) -> None:
    llama_first = write_tiny_model(tmp_path / "first.gguf", "llama")
    WholeModel(llama_first, settings_of(SESSIONS[1])).close()  # llama.cpp's one-time set-up: no stage's cost
    short: list[str] = []
    for name, path in models(tmp_path, gemma_path):
        manifest = read_manifest(path)
        cut = (manifest.stage_starts or (manifest.n_blocks // 2,))[0]
        stages = slice_model(path, [cut, manifest.n_blocks - cut], tmp_path / f"stages-{name}")
        for session in SESSIONS:
            prefix = ChainPrefix.of(manifest, session)
            pieces = [(s.path, s.first_block, s.end_block, s.is_head, False) for s in stages]
            for stage_path, first, end, is_head, whole in [*pieces, (path, 0, manifest.n_blocks, True, True)]:
                planned = int(prefix.resident_matrix(is_head)[first, end])
                used = stage_allocation(stage_path, is_head, whole, session)
                kind = "whole" if whole else "head" if is_head else "blocks"
                line = f"{name} {kind} {first}-{end - 1} at {session.context}x{session.concurrency}: "
                line += f"planned {planned / MiB:.1f} MiB, llama.cpp {used / MiB:.1f} MiB"
                print(line)
                if used > planned:
                    short.append(line)
    assert not short, "the planner gave less than llama.cpp took:\n" + "\n".join(short)


def test_context_needs_follow_llama_cpp_rules() -> None:
    """The graph grows with tensors (or with the batch, for delta nets), masks with cells and rows,
    and only the head pays for logits and the vocabulary."""
    needs = ContextNeeds(
        block_tensors=(10, 10), other_tensors=3, activation_bytes_per_row=1000, attention_masks=2, n_vocab=1000
    )
    small, large = needs.stage_bytes(np.asarray([23, 200]), cells=1024, sequences=2, is_head=False)
    assert large - small == (200 * 8 - 1024) * 24 * 2**10  # past the 1024-node floor, 8 nodes a tensor
    masks = needs.stage_bytes(np.asarray(23), cells=2048, sequences=2, is_head=False) - small
    assert masks == 2 * 1024 * 512 * 4
    head = needs.stage_bytes(np.asarray(23), cells=1024, sequences=2, is_head=True) - small
    assert head == 1000 * ((2 + DRAFT_ROWS) * 8 + 256)  # a row per sequence and the drafted rows of a wave
    delta_net = needs.model_copy(update={"min_graph_nodes": 0, "graph_nodes_per_tensor": 32, "graph_nodes_per_row": 40})
    assert int(delta_net.stage_bytes(np.asarray(23), 1024, 2, False, rows=512)) > int(small) + 19_000 * 24 * 2**10


def test_the_planner_charges_each_stage_its_context() -> None:
    manifest = ModelManifest(
        name="m",
        block_bytes=(100 * MiB,) * 4,
        head_bytes=50 * MiB,
        kv_bytes_per_token=(0,) * 4,
        context=ContextNeeds(
            block_tensors=(9,) * 4, other_tensors=3, activation_bytes_per_row=0, attention_masks=1, n_vocab=0
        ),
    )
    session = ServingSpec(context=1, concurrency=1)
    prefix = ChainPrefix.of(manifest, session)
    bare = ChainPrefix.of(manifest.model_copy(update={"context": None}), session)
    extra = prefix.resident_matrix(False)[0, 2] - bare.resident_matrix(False)[0, 2]
    assert extra == manifest.context_bytes(0, 2, False, session) == 1024 * 24 * 2**10 + 512 * 4 + 16 * MiB
