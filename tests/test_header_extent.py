"""Where a GGUF header ends, found from its bytes as they arrive (`HeaderExtent`): what a header read
from the hub stops at (issue 36). Against the gguf package's own reading of real files, fed in pieces
of every size, and of a file with every kind of metadata and an alignment of its own."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tiny_models import TINY_SHAPES, write_tiny_model

from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.header_extent import HeaderExtent


def fed(data: bytes, sizes: list[int]) -> tuple[HeaderExtent, int]:
    """`data` fed in pieces of `sizes` (the last repeated) until the header is complete: the extent,
    and how many bytes it had been given by then."""
    extent, at = HeaderExtent(), 0
    while at < len(data):
        size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
        if extent.feed(data[at : at + size]):
            return extent, min(at + size, len(data))
        at += size
    return extent, at


@pytest.mark.parametrize("arch", sorted(TINY_SHAPES))
def test_every_tiny_familys_header_ends_where_the_gguf_reader_says_whatever_the_pieces(
    arch: str, tmp_path: Path
) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=2)
    data, length = path.read_bytes(), FastGGUFReader(path).data_offset
    rng = random.Random(arch)
    for sizes in ([1], [7], [4096], [len(data)], [rng.randint(1, 5000) for _ in range(400)]):
        extent, given = fed(data, sizes)
        assert extent.length == length and extent.complete and not extent.unknown
        assert given - max(sizes) < length <= given  # complete with the piece that held its last byte


def test_every_kind_of_metadata_and_an_alignment_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(256)
    writer.add_uint8("k.u8", 1)
    writer.add_int16("k.i16", -2)
    writer.add_float32("k.f32", 0.5)
    writer.add_bool("k.bool", True)
    writer.add_uint64("k.u64", 1 << 40)
    writer.add_float64("k.f64", 0.25)
    writer.add_string("k.string", "héllo")
    writer.add_array("k.strings", ["a", "", "ccc" * 100])
    writer.add_array("k.ints", list(range(1000)))
    writer.add_array("k.empty", [])
    writer.add_tensor("a", np.zeros((3, 5), dtype=np.float32))
    writer.add_tensor("a.much.longer.name", np.ones(7, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data, length = path.read_bytes(), FastGGUFReader(path).data_offset
    assert length % 256 == 0
    for size in (1, 3, 64, len(data)):
        extent, given = fed(data, [size])
        assert extent.length == length and given - size < length <= given


def test_bytes_that_are_no_little_endian_gguf_header_are_unknown_not_guessed() -> None:
    assert HeaderExtent().feed(b"GGUF") is False  # too few bytes to say anything yet
    for start in (b"not a gguf file at all, just text", b"GGUF\x00\x00\x00\x03" + bytes(16)):  # big-endian v3
        extent = HeaderExtent()
        assert extent.feed(start) is False
        assert extent.unknown and extent.length is None
