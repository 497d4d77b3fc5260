"""The host's token embedding: Q8_0 rows dequantized without gguf's generic wrapper (issue 38).

The host embeds each token on the ring's critical path; gguf's `dequantize` splits and groups
its input in Python around three lines of arithmetic. The short path must give the same floats
bit for bit, on gguf's own quantized rows and on a real model file's embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tiny_models import write_tiny_model

from kafila.runtime.engine.stage import TokenEmbedding, q8_0_rows
from kafila.runtime.gguf.families import family_of
from kafila.runtime.gguf.gguf_file import FastGGUFReader

Q8_0 = GGMLQuantizationType.Q8_0


def test_q8_0_rows_are_ggufs_dequantized_rows_bit_for_bit() -> None:
    values = np.random.default_rng(0).standard_normal((7, 640)).astype(np.float32) * 3.0
    values[2] = 0.0  # a zero block's scale is zero
    raw = quantize(values, Q8_0)
    assert np.array_equal(q8_0_rows(raw).reshape(7, 640), dequantize(raw, Q8_0))
    assert np.array_equal(q8_0_rows(raw[3:4]).reshape(1, 640), dequantize(raw[3:4], Q8_0))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_models_q8_0_embedding_is_ggufs_dequantized_rows_with_the_familys_scale(arch: str, tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch)
    reader = FastGGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert GGMLQuantizationType(tensor.tensor_type) is Q8_0
    n_embd = int(tensor.shape[0])
    tokens = [5, 0, 5, 17]
    expected = dequantize(np.asarray(tensor.data)[tokens], Q8_0).reshape(len(tokens), n_embd)
    scale = family_of(arch).token_input_scale(n_embd)
    if scale is not None:
        expected = expected * scale
    assert np.array_equal(TokenEmbedding(path)(tokens), expected)
