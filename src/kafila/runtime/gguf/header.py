"""A model known by its header alone: the planner's manifest and the slicer's stage file, with no
weight held. A model on the hub is planned from its header, and each machine fetches only the byte
ranges of the tensors its own stage reads (`kafila.hub.ranges`); this is the part that needs no
network: which bytes those are, and the tensors' data read back from where they were put.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import ReaderTensor

from kafila.runtime.gguf.gguf_file import SPLIT_KEYS, GGUFFormatError, HeaderReader
from kafila.runtime.gguf.gguf_merge import check_parts

JOIN_GAP = 1 << 16  # tensors closer than this are fetched as one range: a request costs more than the gap
PACKED_ALIGNMENT = 64  # each range starts here in the local file, so a tensor's view of it stays aligned


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes lie in the model: which part (0 unless it is split), from which byte."""

    name: str
    part: int
    start: int
    n_bytes: int

    @property
    def end(self) -> int:
        return self.start + self.n_bytes


@dataclass(frozen=True)
class ByteRun:
    """One range of a part to fetch, and where it goes in the local file that holds the fetched
    ranges back to back."""

    part: int
    start: int
    length: int
    packed: int

    @property
    def end(self) -> int:
        return self.start + self.length


class ModelHeader:
    """A model's headers read as one model: `reader` is what the manifest and the slicer take (a
    split model's parts joined as `merge_parts` joins them: the first part's metadata less
    `split.*`, every part's tensors in order), and `spans` where each tensor's bytes lie."""

    def __init__(self, readers: Sequence[HeaderReader], names: Sequence[str]) -> None:
        if len(readers) == 1:
            reader = readers[0]
        else:
            tensors = check_parts(readers, names)
            reader = copy.copy(readers[0])
            reader.fields = OrderedDict((k, v) for k, v in readers[0].fields.items() if k not in SPLIT_KEYS)
            reader.tensors = tensors
        self.reader: HeaderReader = reader
        self.header_bytes = tuple(r.header_bytes for r in readers)
        self.spans: dict[str, TensorSpan] = {}
        for part, each in enumerate(readers):
            for tensor in each.tensors:
                if tensor.name in self.spans:
                    raise GGUFFormatError(f"{names[part]}: tensor {tensor.name} is in two parts of the model")
                self.spans[tensor.name] = TensorSpan(tensor.name, part, int(tensor.data_offset), int(tensor.n_bytes))

    def spans_of(self, tensors: Iterable[ReaderTensor]) -> list[TensorSpan]:
        return [self.spans[tensor.name] for tensor in tensors]


def check_spans(spans: Iterable[TensorSpan], header_bytes: Sequence[int], sizes: Sequence[int]) -> None:
    """GGUFFormatError unless every tensor lies after its part's header, inside the part's `sizes`
    (as the hub serves it), and ends before the next tensor starts: the byte lengths the header
    gives are the bytes the file holds."""
    by_part: dict[int, list[TensorSpan]] = {}
    for span in spans:
        by_part.setdefault(span.part, []).append(span)
    for part, listed in by_part.items():
        listed.sort(key=lambda s: s.start)
        if listed[0].start < header_bytes[part]:
            raise GGUFFormatError(f"tensor {listed[0].name} starts inside the header, at byte {listed[0].start}")
        for this, following in itertools.pairwise(listed):
            if this.end > following.start:
                raise GGUFFormatError(
                    f"tensor {this.name} ({this.n_bytes} bytes from byte {this.start}) runs into {following.name}"
                )
        last = listed[-1]
        if last.end > sizes[part]:
            raise GGUFFormatError(
                f"tensor {last.name} ends at byte {last.end}, past the end of the file ({sizes[part]} bytes)"
            )


def packed_layout(spans: Iterable[TensorSpan], gap: int = JOIN_GAP) -> tuple[list[ByteRun], dict[str, int]]:
    """The ranges to fetch for these tensors (neighbours less than `gap` bytes apart joined into one
    range), each at its place in a local file that holds them back to back, and where each tensor's
    bytes then start in that file."""
    ordered = sorted(spans, key=lambda s: (s.part, s.start))
    groups: list[list[TensorSpan]] = []
    for span in ordered:
        if groups and groups[-1][-1].part == span.part and span.start - max(s.end for s in groups[-1]) < gap:
            groups[-1].append(span)
        else:
            groups.append([span])
    runs: list[ByteRun] = []
    where: dict[str, int] = {}
    packed = 0
    for group in groups:
        start, end = group[0].start, max(s.end for s in group)
        runs.append(ByteRun(group[0].part, start, end - start, packed))
        for span in group:
            where[span.name] = packed + span.start - start
        packed += -(-(end - start) // PACKED_ALIGNMENT) * PACKED_ALIGNMENT
    return runs, where


class PackedTensors:
    """The slicer's `TensorData` for tensors fetched into one local file (`packed_layout`): each
    tensor's bytes viewed in place, as the type and shape its header gives, with no copy."""

    def __init__(self, path: Path, where: Mapping[str, int]) -> None:
        self.where = dict(where)
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)

    def __call__(self, tensor: ReaderTensor) -> np.ndarray:
        at = self.where.get(tensor.name)
        if at is None:
            raise GGUFFormatError(f"tensor {tensor.name} was not fetched")
        raw = self.data[at : at + int(tensor.n_bytes)]
        if len(raw) != tensor.n_bytes:
            raise GGUFFormatError(f"tensor {tensor.name}: {len(raw)} bytes fetched, the header gives {tensor.n_bytes}")
        return raw.view(tensor.data.dtype).reshape(tensor.data.shape)
