"""GGUF files for what is refused or rewritten rather than run: header-only stand-ins for families
no llama.cpp runs, copies with metadata changed or tensors left out, and a model split into parts
as llama-gguf-split writes it. Runnable tiny models: `tiny_models`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from kafila.runtime.gguf.gguf_file import FastGGUFReader, RawCopyWriter, raw_value


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
