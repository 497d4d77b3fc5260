"""The manifest read from GGUF headers: tiny generated models and the real gemma-3-270m."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_llama, write_tiny_model

from kafila.runtime.gguf.gguf_file import FastGGUFReader, GGUFFormatError
from kafila.runtime.gguf.manifest import read_manifest

# Byte sizes by hand: Q8_0 stores 32 values in 34 bytes, F16 2 bytes and F32 4 bytes a value.
N_EMBD, N_FF, N_VOCAB, N_HEAD_KV, HEAD_DIM = 64, 128, 512, 2, 16  # write_tiny_llama's defaults
Q8 = 34 / 32
ATTENTION = int((2 * N_EMBD * N_EMBD + 2 * N_HEAD_KV * HEAD_DIM * N_EMBD) * Q8)
NORMS = 2 * N_EMBD * 4
FFN_Q8 = int(3 * N_FF * N_EMBD * Q8)
FFN_F16 = 3 * N_FF * N_EMBD * 2
EMBEDDING = int(N_VOCAB * N_EMBD * Q8)


def test_tiny_model_manifest(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_blocks=5, wide_blocks=(1, 3))
    manifest = read_manifest(path)
    assert manifest.architecture == "llama"
    assert manifest.n_blocks == 5
    narrow, wide = ATTENTION + NORMS + FFN_Q8, ATTENTION + NORMS + FFN_F16
    assert manifest.block_bytes == (narrow, wide, narrow, wide, narrow)
    assert manifest.head_bytes == 2 * EMBEDDING + N_EMBD * 4
    assert manifest.kv_bytes_per_token == (2 * N_HEAD_KV * (HEAD_DIM + HEAD_DIM),) * 5


def test_a_mixture_of_experts_records_its_experts_and_reads_k_of_n_a_token(tmp_path: Path) -> None:
    """From the header alone: each block's expert bytes (the stacked *_exps tensors, by hand here),
    the expert count and how many route a token; decoding reads the dense part and k/n of the
    experts, and a batch of B rows n·(1 − (1 − k/n)^B) of them."""
    manifest = read_manifest(write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", n_blocks=3))
    n, k, n_embd, n_ff = 8, 2, 64, 64  # tiny_models' qwen3moe shape
    per_type = {0: 34 / 32, 1: 2, 2: 4}  # the FFN storage cycles Q8_0, F16, F32 by block
    assert manifest.experts == n and manifest.experts_used == k
    assert manifest.expert_bytes == tuple(int(3 * n * n_ff * n_embd * per_type[i]) for i in range(3))
    dense = [b - e for b, e in zip(manifest.block_bytes, manifest.expert_bytes, strict=True)]
    assert all(d > 0 for d in dense)
    for rows in (1, 2, 4, 64):
        expected = [d + e * (1 - (1 - k / n) ** rows) for d, e in zip(dense, manifest.expert_bytes, strict=True)]
        assert manifest.read_bytes(rows) == pytest.approx(expected, abs=1.0)
    assert manifest.read_bytes(10_000) == manifest.block_bytes  # a big batch reads every expert
    dense_model = read_manifest(write_tiny_model(tmp_path / "dense.gguf", "qwen3", n_blocks=3))
    assert dense_model.expert_bytes is None and dense_model.read_bytes(4) == dense_model.block_bytes


def test_gpt_oss_expert_bytes_hold_the_expert_biases_and_a_token_reads_k_of_n(tmp_path: Path) -> None:
    """gpt-oss's experts carry biases (ffn_*_exps.bias), read with their expert; its router (with
    its bias), attention sinks and biases are dense. MXFP4 stores 32 values in 17 bytes."""
    manifest = read_manifest(write_tiny_model(tmp_path / "gpt-oss.gguf", "gpt-oss", n_blocks=3))
    n, k, n_embd, n_ff = 8, 2, 64, 64  # tiny_models' gpt-oss shape
    weights = 3 * n * n_ff * n_embd * 17 // 32
    biases = 4 * n * (n_ff + n_ff + n_embd)  # float32 gate, up and down biases of every expert
    assert (manifest.experts, manifest.experts_used) == (n, k)
    assert manifest.expert_bytes == (weights + biases,) * 3
    dense = [b - e for b, e in zip(manifest.block_bytes, manifest.expert_bytes, strict=True)]
    router = 4 * (n * n_embd + n)
    assert all(d > router for d in dense)
    expected = [d + (weights + biases) * k / n for d in dense]
    assert manifest.read_bytes(1) == pytest.approx(expected, abs=1.0)
    assert manifest.kv_bytes_per_token == (2 * 2 * (32 + 32),) * 3  # 2 KV heads of 32, f16 keys and values


def test_tied_embedding_is_counted_once(tmp_path: Path) -> None:
    manifest = read_manifest(write_tiny_llama(tmp_path / "tied.gguf", tied_output=True))
    assert manifest.head_bytes == EMBEDDING + N_EMBD * 4


def test_fast_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    ours, theirs = FastGGUFReader(path), GGUFReader(path)
    for key, field in theirs.fields.items():
        assert ours.scalar(key) == field.contents(), key
    assert [(t.name, t.n_bytes, t.data_offset) for t in ours.tensors] == [
        (t.name, t.n_bytes, t.data_offset) for t in theirs.tensors
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "not a readable GGUF"), (b"GGML" + b"\0" * 60, "not a readable GGUF"), (b"not a model at all", "GGUF")],
)
def test_files_that_are_not_gguf_are_refused_clearly(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=message):
        read_manifest(path)


def test_truncated_file_is_refused_clearly(tmp_path: Path) -> None:
    whole = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    for cut in (8, 24, 200, 900, len(whole) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(GGUFFormatError):
            read_manifest(path)


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        read_manifest("/nonexistent/model.gguf")


def test_gemma3_270m_manifest(gemma_path: Path) -> None:
    manifest = read_manifest(gemma_path)
    assert manifest.architecture == "gemma3"
    assert manifest.n_blocks == 18
    assert set(manifest.block_bytes) == {3_596_288, 3_995_648}  # 3.60 MB and 4.00 MB
    assert manifest.head_bytes == 178_257_920 + 2_560  # tied Q8_0 embedding + output norm
    assert manifest.kv_bytes_per_token == (2 * 1 * (256 + 256),) * 18


@pytest.mark.parametrize(
    ("arch", "lead", "ffn_bytes"), [("deepseek2", 2, (34 / 32, 2)), ("glm4moe", 1, (34 / 32, 2, 4))]
)
def test_shared_experts_are_dense_and_the_dense_lead_reads_whole(
    arch: str, lead: int, ffn_bytes: tuple[float, ...], tmp_path: Path
) -> None:
    """Blocks before the dense lead have no experts; after it, the routed experts (*_exps) are
    read k of n a token while the shared expert (*_shexp) and the router are read whole."""
    manifest = read_manifest(write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=4))
    n, k, n_embd, n_ff_expert = 8, 2, 64, 32  # tiny_models' shapes, one shared expert
    per_type = [ffn_bytes[i % len(ffn_bytes)] for i in range(4)]  # the FFN storage cycles by block
    routed = [0 if i < lead else int(3 * n * n_ff_expert * n_embd * per_type[i]) for i in range(4)]
    assert manifest.expert_bytes == tuple(routed)
    assert (manifest.experts, manifest.experts_used) == (n, k)
    dense = [b - e for b, e in zip(manifest.block_bytes, manifest.expert_bytes, strict=True)]
    shared = [int(3 * n_ff_expert * n_embd * per_type[i]) for i in range(4)]
    assert all(dense[i] > shared[i] for i in range(lead, 4))  # the shared expert is in the dense part
    expected = [d + e * k / n for d, e in zip(dense, routed, strict=True)]
    assert manifest.read_bytes(1) == pytest.approx(expected, abs=1.0)
    assert manifest.read_bytes(1)[:lead] == manifest.block_bytes[:lead]  # dense blocks: all read


def test_prediction_blocks_are_neither_blocks_nor_priced(tmp_path: Path) -> None:
    """glm4moe stores a multi-token prediction block after its last (counted in block_count);
    llama.cpp's graph never runs it and no slice holds it: the manifest leaves it out."""
    path = write_tiny_model(tmp_path / "glm.gguf", "glm4moe", n_blocks=4)
    manifest = read_manifest(path)
    assert manifest.n_blocks == 4 and len(manifest.kv_bytes_per_token) == 4
    reader = FastGGUFReader(path)
    assert reader.scalar("glm4moe.block_count") == 5
    prediction = sum(t.n_bytes for t in reader.tensors if t.name.startswith("blk.4."))
    assert prediction > 0
    assert sum(manifest.block_bytes) + manifest.head_bytes + prediction == sum(t.n_bytes for t in reader.tensors)
    assert manifest.kv_bytes_per_token == (2 * 2 * (32 + 32),) * 4


def test_latent_attention_caches_keys_alone(tmp_path: Path) -> None:
    """deepseek2's MLA caches one latent a token (kv_lora_rank + rotary dims, as an MQA key) and
    reads the values from it: no separate value cache."""
    manifest = read_manifest(write_tiny_model(tmp_path / "ds.gguf", "deepseek2", n_blocks=3))
    assert manifest.kv_bytes_per_token == (2 * 1 * (32 + 16),) * 3


def test_llama4_interleaves_expert_blocks_with_dense_ones(tmp_path: Path) -> None:
    """Experts in every 2nd block only (interleave_moe_layer_step), beside a shared expert that every
    token reads, so a dense part; the others a dense FFN. Stages start at multiples of 4 blocks."""
    manifest = read_manifest(write_tiny_model(tmp_path / "llama4.gguf", "llama4", n_blocks=8))
    n, k, n_embd, n_ff_expert = 4, 1, 64, 64  # tiny_models' llama4 shape
    per_type = (34 / 32, 2, 4)  # the FFN storage cycles Q8_0, F16, F32 by block
    routed = [int(3 * n * n_ff_expert * n_embd * per_type[i % 3]) if i % 2 else 0 for i in range(8)]
    assert (manifest.experts, manifest.experts_used) == (n, k)
    assert manifest.expert_bytes == tuple(routed)
    shared = [int(3 * n_ff_expert * n_embd * per_type[i % 3]) for i in range(8)]
    dense = [b - e for b, e in zip(manifest.block_bytes, routed, strict=True)]
    assert all(dense[i] > shared[i] for i in range(1, 8, 2))  # the shared expert is read whole
    assert manifest.read_bytes() == tuple(d + e // n for d, e in zip(dense, routed, strict=True))
    assert manifest.stage_starts == (4,) and manifest.max_stages == 2


# What llama.cpp saves of a sequence besides its cells' K and V: a cell's position and sequence id
# (12 bytes a cell, in each of the two caches of a windowed model), and headers.
CELL_METADATA_BYTES = 24
SEQUENCE_HEADER_BYTES = 256


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_the_cache_the_planner_counts_is_what_llama_cpp_keeps_for_a_sequence(tmp_path: Path, arch: str) -> None:
    """llama.cpp's own size of one sequence's saved state, after one token and after two: the step
    is a token's KV (the manifest's `kv_bytes_per_token`, blocks with a KV cache only), what is
    left is the recurrent state of a hybrid's linear-attention blocks (`state_bytes_per_sequence`)."""
    path = write_tiny_model(tmp_path / "m.gguf", arch, n_blocks=8 if arch in ("qwen3next", "llama4") else 4)
    manifest = read_manifest(path)
    llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False)
    try:
        sizes = []
        for _ in range(2):
            llm.eval([5])
            sizes.append(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))
    finally:
        llm.close()
    per_token = sizes[1] - sizes[0]
    assert 0 <= per_token - sum(manifest.kv_bytes_per_token) <= CELL_METADATA_BYTES
    state = sum(manifest.state_bytes_per_sequence or ())
    assert 0 <= sizes[0] - per_token - state <= SEQUENCE_HEADER_BYTES
    assert (state > 0) == (arch == "qwen3next")
