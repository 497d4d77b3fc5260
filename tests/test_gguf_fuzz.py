"""A corrupted model file gets a clear error, never a crash or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from tiny_gguf import rewrite
from tiny_models import write_tiny_llama

from kafila.runtime.gguf.gguf_file import GGUFFormatError
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings, LlamaModel


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("fuzz") / "tiny.gguf").read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_headers_fail_cleanly(tiny_bytes: bytes, tmp_path: Path, data: st.DataObject) -> None:
    corrupted = bytearray(tiny_bytes)
    header_end = 2048  # metadata and tensor table of the tiny model
    for _ in range(data.draw(st.integers(1, 6))):
        corrupted[data.draw(st.integers(0, header_end))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.just(len(corrupted)), st.integers(0, len(corrupted))))
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(corrupted[:cut]))
    try:
        manifest = read_manifest(path)
    except (GGUFFormatError, ValidationError):
        return
    assert manifest.n_blocks >= 1


def test_a_model_missing_a_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    """llama.cpp's own reason reaches the person: the tensor it looked for, not a warning it
    happened to print before."""
    source = write_tiny_llama(tmp_path / "whole.gguf", n_blocks=2)
    rewrite(source, tmp_path / "broken.gguf", without_tensors=("blk.1.attn_q.weight",))
    with pytest.raises(RuntimeError, match=r"could not load .*tensor 'blk\.1\.attn_q\.weight' not found"):
        LlamaModel(tmp_path / "broken.gguf", ContextSettings(n_ctx=64, n_batch=8, n_seq_max=1, n_threads=1))
