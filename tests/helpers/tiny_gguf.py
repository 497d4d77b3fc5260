"""Write tiny GGUF models with the gguf package: random weights, a tiny vocabulary, few blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from kafila.runtime.gguf.gguf_file import FastGGUFReader, RawCopyWriter, raw_value


def write_tiny_llama(
    path: Path,
    n_blocks: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 32,
    tied_output: bool = False,
    wide_blocks: tuple[int, ...] = (),
    seed: int = 0,
) -> Path:
    """A llama-family model; blocks listed in `wide_blocks` store their FFN in F16, others Q8_0."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(n_blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_vocab - 3)])
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def weight(shape: tuple[int, int]) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def add(name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> None:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
            writer.add_tensor(name, values.astype(dtype))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    q8, f16, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16, GGMLQuantizationType.F32
    head_dim = n_embd // n_head
    add("token_embd.weight", weight((n_vocab, n_embd)), q8)
    add("output_norm.weight", np.ones(n_embd, dtype=np.float32), f32)
    if not tied_output:
        add("output.weight", weight((n_vocab, n_embd)), q8)
    for i in range(n_blocks):
        ffn_type = f16 if i in wide_blocks else q8
        add(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32), f32)
        add(f"blk.{i}.attn_q.weight", weight((n_embd, n_embd)), q8)
        add(f"blk.{i}.attn_k.weight", weight((n_head_kv * head_dim, n_embd)), q8)
        add(f"blk.{i}.attn_v.weight", weight((n_head_kv * head_dim, n_embd)), q8)
        add(f"blk.{i}.attn_output.weight", weight((n_embd, n_embd)), q8)
        add(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32), f32)
        add(f"blk.{i}.ffn_gate.weight", weight((n_ff, n_embd)), ffn_type)
        add(f"blk.{i}.ffn_up.weight", weight((n_ff, n_embd)), ffn_type)
        add(f"blk.{i}.ffn_down.weight", weight((n_embd, n_ff)), ffn_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_other_family(
    path: Path, arch: str, n_blocks: int = 2, settings: dict[str, int | list[bool]] | None = None
) -> Path:
    """A header-only stand-in for a model no llama.cpp can run: block tensors, the keys a manifest
    reads and `settings` (whole numbers, or per-block flags), for what is refused before anything loads."""
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(n_blocks)
    writer.add_embedding_length(16)
    writer.add_head_count(2)
    for key, value in (settings or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 16), dtype=np.float32))
    for i in range(n_blocks):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((16, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite(
    source: Path,
    target: Path,
    values: dict[str, tuple[GGUFValueType, Any]] | None = None,
    without_tensors: tuple[str, ...] = (),
) -> Path:
    """A copy of a model with metadata `values` (type, value) set over its own, and the tensors
    named in `without_tensors` left out."""
    values = values or {}
    reader = FastGGUFReader(source)
    writer = RawCopyWriter(target, arch=str(reader.scalar("general.architecture")))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or key in values:
            continue
        vtype, value = raw_value(reader, key)
        writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, (vtype, value) in values.items():
        items = None
        if vtype == GGUFValueType.ARRAY:
            items = GGUFValueType.BOOL if all(isinstance(v, bool) for v in value) else GGUFValueType.INT32
        writer.add_key_value(key, value, vtype, sub_type=items)
    for tensor in reader.tensors:
        if tensor.name not in without_tensors:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def write_split_parts(source: Path, out: Path, n_parts: int) -> list[Path]:
    """`source` split as llama-gguf-split splits a model: `stem-0000N-of-0000M.gguf`, the metadata
    in the first part, each part's tensors a contiguous run, every part saying which it is."""
    reader = FastGGUFReader(source)
    tensors = list(reader.tensors)
    share = -(-len(tensors) // n_parts)
    paths = []
    for index in range(n_parts):
        path = out / f"{source.stem}-{index + 1:05d}-of-{n_parts:05d}.gguf"
        writer = RawCopyWriter(path, arch=str(reader.scalar("general.architecture")))
        if index == 0:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
                    continue
                vtype, value = raw_value(reader, key)
                writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", n_parts)
        writer.add_int32("split.tensors.count", len(tensors))
        for tensor in tensors[index * share : (index + 1) * share]:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths
