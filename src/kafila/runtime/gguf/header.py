"""A model known by its header alone: the planner's manifest and the slicer's stage file, with no
weight held. A model on the hub is planned from its header, and each machine fetches only the byte
ranges of the tensors its own stage reads (`kafila.hub.ranges`); this is the part that needs no
network: which bytes those are.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gguf import ReaderTensor

from kafila.runtime.gguf.gguf_file import SPLIT_KEYS, GGUFFormatError, HeaderReader
from kafila.runtime.gguf.gguf_merge import check_parts

JOIN_GAP = 1 << 16  # tensors closer than this are fetched as one range: a request costs more than the gap


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
    """One range of a part to fetch."""

    part: int
    start: int
    length: int

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


def fetch_runs(spans: Iterable[TensorSpan], gap: int = JOIN_GAP) -> list[ByteRun]:
    """The ranges to fetch for these tensors: neighbours less than `gap` bytes apart joined into one
    range (the bytes between them fetched and dropped)."""
    ordered = sorted(spans, key=lambda s: (s.part, s.start))
    groups: list[list[TensorSpan]] = []
    for span in ordered:
        if groups and groups[-1][-1].part == span.part and span.start - max(s.end for s in groups[-1]) < gap:
            groups[-1].append(span)
        else:
            groups.append([span])
    return [ByteRun(group[0].part, group[0].start, max(s.end for s in group) - group[0].start) for group in groups]
