"""A GGUF reader that opens a file with a large vocabulary in well under a second.

`gguf.GGUFReader` builds several numpy views for every item of every metadata array, which
takes about 11 s for gemma-3-270m's 262,144-token vocabulary. This subclass keeps the rest of
the reader (header checks, alignment, tensor table, memory-mapped tensor data) and overrides
only how an array field is parsed: a numeric array becomes one view of its values, and a string
array one view of its raw bytes, with the item offsets found by a plain scan of the lengths.
The override touches a private method, which is why pyproject.toml pins the gguf range.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, GGUFWriter

_LENGTH = np.dtype("<u8")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")  # what llama-gguf-split adds to each part


class GGUFFormatError(ValueError):
    """The file is not a GGUF model this program can read."""


class HeaderIncomplete(GGUFFormatError):
    """The bytes given end inside the GGUF header: a caller reading it in pieces reads more."""


class FastGGUFReader(GGUFReader):
    def __init__(self, path: os.PathLike[str] | str) -> None:
        self._string_array_offsets: dict[int, npt.NDArray[np.int64]] = {}
        try:
            super().__init__(path, "r")
        except (FileNotFoundError, HeaderIncomplete):
            raise
        except (ValueError, IndexError, KeyError, OverflowError) as error:
            raise GGUFFormatError(f"{path} is not a readable GGUF file: {error}") from error
        short = [t.name for t in self.tensors if t.data.nbytes != t.n_bytes]
        if short:
            raise GGUFFormatError(f"{path} is truncated: tensor data ends early (first: {short[0]})")

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs
        item_type_raw = self._get(offs, np.uint32)
        offs += 4
        count_raw = self._get(offs, np.uint64)
        offs += 8
        count = int(count_raw[0])
        item_type = GGUFValueType(int(item_type_raw[0]))
        parts: list[npt.NDArray[Any]] = [item_type_raw, count_raw]
        if item_type == GGUFValueType.STRING:
            starts = self._scan_strings(offs, count)
            payload = self._get(offs, np.uint8, int(starts[-1]))
            self._string_array_offsets[orig_offs] = starts
            parts.append(payload)
            return 12 + int(payload.nbytes), parts, [], [GGUFValueType.ARRAY, item_type]
        if item_type == GGUFValueType.ARRAY:
            raise GGUFFormatError("nested arrays in GGUF metadata are not supported")
        values = self._get(offs, self.gguf_scalar_to_np[item_type], count)
        if len(values) != count:
            raise GGUFFormatError("metadata array runs past the end of the file")
        parts.append(values)
        return 12 + int(values.nbytes), parts, [2], [GGUFValueType.ARRAY, item_type]

    def _scan_strings(self, offs: int, count: int) -> npt.NDArray[np.int64]:
        """Byte offsets (relative to `offs`) of each string's length prefix, plus the end."""
        raw = self.data.data
        limit = len(self.data)
        if count > (limit - offs) // 8:
            raise self._past_end("string array is longer than the file")
        starts = np.empty(count + 1, dtype=np.int64)
        position = offs
        from_bytes = int.from_bytes
        for i in range(count):
            starts[i] = position - offs
            if position + 8 > limit:
                raise self._past_end("string array runs past the end of the file")
            position += 8 + from_bytes(raw[position : position + 8], "little")
        if position > limit:
            raise self._past_end("string array runs past the end of the file")
        starts[count] = position - offs
        return starts

    def _past_end(self, why: str) -> GGUFFormatError:
        return GGUFFormatError(why)

    def scalar(self, key: str, default: Any = None) -> Any:
        """A scalar or string value, or the whole list for a numeric array."""
        field = self.fields.get(key)
        if field is None:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return self.strings(key)
            return field.parts[-1].tolist()
        try:
            return field.contents()
        except UnicodeDecodeError as error:
            raise GGUFFormatError(f"metadata {key} is not valid UTF-8") from error

    def array_length(self, key: str) -> int | None:
        """How many items an array holds (a vocabulary's tokens), without decoding them; None if
        the key is missing or not an array."""
        field = self.fields.get(key)
        if field is None or field.types[0] != GGUFValueType.ARRAY:
            return None
        return int(field.parts[-2][0])

    def strings(self, key: str) -> list[str]:
        """Decode a string array on demand; most callers never need to."""
        field = self.fields[key]
        starts = self._string_array_offsets[field.offset + self._key_header_size(field)]
        payload = field.parts[-1].tobytes()
        return [payload[int(a) + 8 : int(b)].decode("utf-8", errors="replace") for a, b in itertools.pairwise(starts)]

    @staticmethod
    def _key_header_size(field: Any) -> int:
        return 8 + int(field.parts[1].nbytes) + 4


class HeaderReader(FastGGUFReader):
    """A GGUF model read from its header alone (the file's first bytes, up to where tensor data
    begins, or more): metadata and the tensor table, as from the whole file. Each tensor's `data`
    is a stand-in of its type and shape that holds no memory (zeros, stride 0); its bytes come from
    elsewhere (a stage fetched by ranges: `kafila.runtime.gguf.slicer.StageLayout`). Bytes that end
    inside the header raise `HeaderIncomplete`, so a caller fetching it over the network knows to
    fetch more."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self._tensors_start: int | None = None
        super().__init__(path)
        if len(self.data) < self.data_offset:  # the padding before tensor data is the header's too
            raise HeaderIncomplete(f"the header is {self.data_offset} bytes; {len(self.data)} were read")

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Literal["I", "S", "<"] | None = None
    ) -> npt.NDArray[Any]:
        kind = np.dtype(dtype)
        if self._tensors_start is not None and offset >= self._tensors_start:  # a tensor's data: a stand-in
            kind = kind.newbyteorder(self.byte_order if override_order is None else override_order)
            return np.broadcast_to(np.zeros((), dtype=kind), (int(count),))
        if offset + kind.itemsize * int(count) > len(self.data):
            raise HeaderIncomplete(f"the header runs past the {len(self.data)} bytes read")
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self._tensors_start = start_offs
        super()._build_tensors(start_offs, fields)

    def _past_end(self, why: str) -> GGUFFormatError:
        return HeaderIncomplete(f"the header runs past the {len(self.data)} bytes read ({why})")

    @property
    def header_bytes(self) -> int:
        """How long the header is: tensor data starts here (after the alignment's padding)."""
        return int(self.data_offset)


class RawValue(NamedTuple):
    """A metadata value kept as the bytes the source file stored, so copying it decodes nothing."""

    encoded: bytes


def raw_value(reader: FastGGUFReader, key: str) -> tuple[GGUFValueType, RawValue]:
    """The stored type and encoded bytes of a metadata value (after its key and type tag)."""
    field = reader.fields[key]
    start = field.offset + FastGGUFReader._key_header_size(field)
    size = sum(int(part.nbytes) for part in field.parts[3:])
    return field.types[0], RawValue(bytes(reader.data[start : start + size]))


class RawCopyWriter(GGUFWriter):
    """A GGUFWriter that can also write values given as `RawValue`, byte for byte.

    The tokenizer of a large model holds hundreds of thousands of strings; re-encoding them one
    by one is what makes slicing slow, and copying their bytes is exact.
    """

    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if isinstance(val, RawValue):
            return (self._pack("I", vtype) if add_vtype else b"") + val.encoded
        return super()._pack_val(val, vtype, add_vtype, sub_type)
