"""Read a model's planning manifest from its GGUF header: no weight is loaded or even read."""

from __future__ import annotations

import re
from os import PathLike
from pathlib import Path
from typing import Any

from kafila.planner.types import MAX_BLOCKS, ContextNeeds, ModelManifest
from kafila.runtime.gguf.families import DEFAULT_GRAPH_NODES, FAMILIES, Family, attention_windowed, recurrent_blocks
from kafila.runtime.gguf.gguf_file import FastGGUFReader, GGUFFormatError
from kafila.runtime.gguf.slicer import prediction_blocks

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.")  # routed experts, stacked
HEAD_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
KV_CACHE_BYTES_PER_VALUE = 2  # f16 cache, llama.cpp's default
RECURRENT_STATE_BYTES_PER_VALUE = 4  # f32 recurrent state, llama.cpp's default
# Per batch row, the widest block's intermediate results llama.cpp's graph holds at once, in
# float32 values per unit of width: residual, norms and attention output (model width), query,
# key and value (head width), and the feed-forward's gate, up, activation and routing (its width).
# An upper bound fitted with room over every supported family (docs/runtime.md).
ACTIVATION_VALUES = {"embd": 4, "heads": 4, "ffn": 6}


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFFormatError(f"metadata {key} is {value!r}, not a count")
    return value


def _per_block(value: Any, n_blocks: int, key: str) -> list[int]:
    """A per-layer setting that GGUF stores as one number or as one number per block."""
    if isinstance(value, list):
        if len(value) != n_blocks:
            raise GGUFFormatError(f"{key} lists {len(value)} values for {n_blocks} blocks")
        return [_count(v, key) for v in value]
    return [_count(value, key)] * n_blocks


def read_manifest(path: str | PathLike[str]) -> ModelManifest:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    return manifest_of(FastGGUFReader(path), str(path), path.stem)


def manifest_of(reader: FastGGUFReader, label: str, stem: str) -> ModelManifest:
    """The manifest of an open model: a whole file, or a header alone (`HeaderReader`: a model on the
    hub planned before any weight is fetched). Only the header is read. `label` names the model in
    errors; `stem` is its name where the metadata gives none."""
    arch = reader.scalar("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError(f"{label} has no general.architecture")
    parts = reader.scalar("split.count", 0)
    if isinstance(parts, int) and parts > 1:  # llama-gguf-split's parts: the reader and the slicer read one file
        raise GGUFFormatError(
            f"{label} is one part of a model split in {parts} files; Kafila reads a model from one file: merge "
            f"the parts with `llama-gguf-split --merge FIRST-PART.gguf MERGED.gguf` and give MERGED.gguf"
        )
    stored = reader.scalar(f"{arch}.block_count")
    if not isinstance(stored, int) or stored < 1:
        raise GGUFFormatError(f"{label} has no positive {arch}.block_count")
    n_blocks = stored - prediction_blocks(reader, arch)  # what runs, and what a division covers
    if n_blocks < 1:
        raise GGUFFormatError(f"{label} has {stored} blocks, all of them for multi-token prediction")
    if n_blocks > MAX_BLOCKS:
        raise GGUFFormatError(f"{label} declares {n_blocks} blocks; Kafila plans models of up to {MAX_BLOCKS}")

    block_bytes = [0] * n_blocks
    expert_bytes = [0] * n_blocks
    block_tensors = [0] * n_blocks  # what sizes each stage's graph (`ContextNeeds`)
    head_bytes = 0
    for tensor in reader.tensors:
        match = _BLOCK_TENSOR.match(tensor.name)
        if match:
            index = int(match.group(1))
            if index >= stored:
                raise GGUFFormatError(f"tensor {tensor.name} is past block_count {stored}")
            if index >= n_blocks:
                continue  # a prediction block: never run, and no stage holds it
            block_bytes[index] += int(tensor.n_bytes)
            block_tensors[index] += 1
            if _EXPERT_TENSOR.match(tensor.name):
                expert_bytes[index] += int(tensor.n_bytes)
        elif tensor.name in HEAD_TENSORS:  # a tied output has no output.weight: counted once
            head_bytes += int(tensor.n_bytes)
    empty = [i for i, size in enumerate(block_bytes) if size == 0]
    if empty:
        raise GGUFFormatError(f"{label} has no tensors for blocks {empty}")

    n_embd = _count(reader.scalar(f"{arch}.embedding_length", 0), "embedding_length")
    n_head = _per_block(reader.scalar(f"{arch}.attention.head_count", 0), stored, "head_count")
    n_head_kv = _per_block(reader.scalar(f"{arch}.attention.head_count_kv", n_head), stored, "head_count_kv")
    n_head, n_head_kv = n_head[:n_blocks], n_head_kv[:n_blocks]
    default_head_dim = n_embd // max(n_head) if max(n_head) > 0 else 0
    key_length = _count(reader.scalar(f"{arch}.attention.key_length", default_head_dim), "key_length")
    value_length = _count(reader.scalar(f"{arch}.attention.value_length", key_length), "value_length")
    if reader.scalar(f"{arch}.attention.key_length_mla") and reader.scalar(f"{arch}.attention.value_length_mla"):
        value_length = 0  # latent attention: llama.cpp caches the latent as keys alone, and reads values from it
    kv = [KV_CACHE_BYTES_PER_VALUE * heads * (key_length + value_length) for heads in n_head_kv]
    state = None
    family = FAMILIES.get(arch)
    if family is not None and family.recurrent_state:
        recurrent = recurrent_blocks(arch, n_blocks, reader.scalar)
        per_sequence = _recurrent_state_bytes(reader, arch)
        kv = [0 if r else size for r, size in zip(recurrent, kv, strict=True)]
        state = tuple(per_sequence if r else 0 for r in recurrent)

    experts = _count(reader.scalar(f"{arch}.expert_count", 0), "expert_count")
    experts_used = _count(reader.scalar(f"{arch}.expert_used_count", 0), "expert_used_count")
    moe = any(expert_bytes)
    if moe and not 0 < experts_used <= experts:
        raise GGUFFormatError(f"{label} has expert tensors but routes {experts_used} of {experts} experts a token")

    name = reader.scalar("general.name") or stem
    context = _context_needs(
        reader, arch, family, block_tensors, len(reader.tensors) - sum(block_tensors), n_embd, max(n_head) * key_length
    )  # an unsupported family is planned as it is, and refused by the slicer
    stage_starts = None if family is None else family.cut_points(n_blocks, reader.scalar).starts
    if family is not None and n_blocks in family.unsplittable_block_counts:
        stage_starts = ()
    return ModelManifest(
        name=str(name),
        architecture=arch,
        block_bytes=tuple(block_bytes),
        head_bytes=head_bytes,
        kv_bytes_per_token=tuple(kv),
        state_bytes_per_sequence=state,
        expert_bytes=tuple(expert_bytes) if moe else None,
        experts=experts if moe else 0,
        experts_used=experts_used if moe else 0,
        stage_starts=stage_starts,
        context=context,
    )


def _recurrent_state_bytes(reader: FastGGUFReader, arch: str) -> int:
    """A linear-attention block's state for one sequence, as llama.cpp allocates it (f32): its
    convolution's last inputs and the recurrence's matrix (llama_hparams::n_embd_r, n_embd_s)."""

    def size(key: str) -> int:
        return _count(reader.scalar(f"{arch}.ssm.{key}", 0), f"ssm.{key}")

    inner, state, groups, kernel = size("inner_size"), size("state_size"), size("group_count"), size("conv_kernel")
    convolution = max(kernel - 1, 0) * (inner + 2 * groups * state)
    return RECURRENT_STATE_BYTES_PER_VALUE * (convolution + state * inner)


def _context_needs(
    reader: FastGGUFReader,
    arch: str,
    family: Family | None,
    block_tensors: list[int],
    other_tensors: int,
    n_embd: int,
    query_width: int,
) -> ContextNeeds:
    """What each stage's llama.cpp context will allocate besides weights and KV, from the header."""

    def widest(key: str) -> int:
        value = reader.scalar(f"{arch}.{key}", 0)
        values = value if isinstance(value, list) else [value]
        return max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)

    routed = widest("expert_used_count") * widest("expert_feed_forward_length")
    shared = max(1, widest("expert_shared_count")) * widest("expert_shared_feed_forward_length")
    ffn = max(widest("feed_forward_length"), routed + shared) + widest("expert_count")
    heads = max(query_width, 2 * widest("ssm.inner_size"))
    values = ACTIVATION_VALUES["embd"] * n_embd + ACTIVATION_VALUES["heads"] * heads + ACTIVATION_VALUES["ffn"] * ffn
    windowed = attention_windowed(arch, reader.scalar(f"{arch}.attention.sliding_window"))
    least, per_tensor, per_row = family.graph_nodes if family is not None else DEFAULT_GRAPH_NODES
    return ContextNeeds(
        block_tensors=tuple(block_tensors),
        other_tensors=other_tensors,
        min_graph_nodes=least,
        graph_nodes_per_tensor=per_tensor,
        graph_nodes_per_row=per_row,
        activation_bytes_per_row=4 * values,
        attention_masks=2 if windowed else 1,
        n_vocab=reader.array_length("tokenizer.ggml.tokens") or 0,
    )
