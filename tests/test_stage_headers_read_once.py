"""A stage's file header is read once as the stage loads (issue 36).

The host's head engine loads after its own stage's last byte, on the way to serving, and a
262k-token vocabulary's header (gemma-3) takes about 0.07 s to parse each time: the head's
engine read its file's header four times (the family's input transform, the token embedding,
the block range, whether drafts may be checked), 0.2 s more between the last byte and serving.
Real stage files of a tiny model, real llama.cpp, a real local ring; the reads are counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import local_ring_engine
from kafila.runtime.engine.stage import BlockStage
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings

SETTINGS = ContextSettings(n_ctx=128, n_batch=32, n_seq_max=1, n_threads=1)


@pytest.fixture
def header_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The files whose GGUF header this process reads from now on, one entry a read."""
    reads: list[Path] = []
    read = FastGGUFReader.__init__

    def counted(self: FastGGUFReader, path: str | Path) -> None:
        reads.append(Path(path))
        read(self, path)

    monkeypatch.setattr(FastGGUFReader, "__init__", counted)
    yield reads


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("headers") / "tiny.gguf", "llama", n_blocks=2)


def test_the_heads_engine_reads_its_stage_files_header_once(
    model: Path, tmp_path: Path, header_reads: list[Path]
) -> None:
    stages = cached_slices(model, [1, 1], tmp_path)
    header_reads.clear()  # the cut's own reads
    engine = local_ring_engine(stages, SETTINGS)
    try:
        assert engine.head is not None and engine.speculation_refused is None
        assert header_reads.count(stages[-1].path) == 1, header_reads
    finally:
        engine.close()


def test_a_hosts_vocabulary_is_read_once_where_the_head_is_on_a_member(
    model: Path, tmp_path: Path, header_reads: list[Path]
) -> None:
    stages = cached_slices(model, [1, 1], tmp_path)
    header_reads.clear()
    engine = local_ring_engine(stages, SETTINGS, model=model)
    try:
        assert engine.head is None and engine.speculation_refused is None
        assert header_reads.count(model) == 1, header_reads
    finally:
        engine.close()


def test_a_block_stage_reads_its_files_header_once(model: Path, tmp_path: Path, header_reads: list[Path]) -> None:
    first = cached_slices(model, [1, 1], tmp_path)[0]
    header_reads.clear()
    stage = BlockStage(first.path, SETTINGS)
    try:
        assert (stage.first_block, stage.n_layers) == (0, 1)
        assert header_reads.count(first.path) == 1, header_reads
    finally:
        stage.close()
