"""Join the parts of a split GGUF (`name-00001-of-00003.gguf`, as llama-gguf-split writes them)
into one file: Kafila's reader, planner and slicer read a model from one file.

The metadata is the first part's, less the `split.*` keys; the tensors are every part's, in
order, their bytes copied as they are (what `llama-gguf-split --merge` does).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

from gguf import ReaderTensor

from kafila.runtime.gguf.gguf_file import SPLIT_KEYS, FastGGUFReader, GGUFFormatError, RawCopyWriter, raw_value
from kafila.runtime.gguf.slicer import _reporting_size, disk_full_said


def check_parts(readers: Sequence[FastGGUFReader], names: Sequence[str]) -> list[ReaderTensor]:
    """Every part's tensors, in order, once the parts are checked to be the whole split model, first
    part first (`names` name them in errors): what merging them, or reading their headers as one
    model, relies on."""
    first = readers[0]
    count = first.scalar("split.count", 0)
    if count != len(readers):
        raise GGUFFormatError(f"{names[0]} says the model is split in {count} parts; {len(readers)} were given")
    for index, (name, reader) in enumerate(zip(names, readers, strict=True)):
        if reader.scalar("split.no") != index or reader.scalar("split.count") != count:
            raise GGUFFormatError(f"{name} is not part {index + 1} of {count} of {Path(names[0]).name}'s model")
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    expected = first.scalar("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise GGUFFormatError(f"{Path(names[0]).name}'s model has {expected} tensors; its parts hold {len(tensors)}")
    return tensors


def merge_parts(parts: Sequence[Path], out: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the split model whose `parts` are given, first part first, to `out` (through a
    temporary file, so `out` exists only whole). `progress` hears (bytes written, bytes in all)."""
    readers = [FastGGUFReader(part) for part in parts]
    first = readers[0]
    tensors = check_parts(readers, [str(part) for part in parts])
    arch = first.scalar("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError(f"{parts[0]} has no general.architecture")
    total = sum(part.stat().st_size for part in parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    try:
        with disk_full_said(out, "the parts were merged", GGUFFormatError):
            with _reporting_size(partial, lambda n: progress(min(n, total), total)) if progress else nullcontext():
                writer = RawCopyWriter(partial, arch=arch)
                for key, field in first.fields.items():
                    if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment", *SPLIT_KEYS):
                        continue  # the writer adds the first ones itself
                    vtype, value = raw_value(first, key)
                    writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
                for tensor in tensors:
                    writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
                writer.close()
            os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    if progress is not None:
        progress(total, total)
    return out
