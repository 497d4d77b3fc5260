"""The tiny test models must really run in llama.cpp, or tests built on them prove nothing."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from gguf import GGUFReader
from plain_llama import plain_llama
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.manifest import read_manifest

# Longer than gemma3's 16-token sliding window, and with text that no word piece
# covers, so byte fallback and the windowed layers are both exercised.
PROMPT = "hello world, the model is in the block of kafila and it is a test: ünïcödé 123!"
N_GREEDY = 32
# gemma3 makes every 6th layer global: with 6 blocks, both kinds of layer are present.
# llama4 skips RoPE in every 4th block and has experts in every 2nd: 8 blocks hold both twice.
N_BLOCKS = {"llama": 4, "qwen2": 4, "qwen3": 4, "gemma3": 6, "qwen3moe": 4, "llama4": 8}
TIED = {"llama": False, "qwen2": False, "qwen3": True, "gemma3": True, "qwen3moe": False, "llama4": False}


@pytest.fixture(scope="module", params=SUPPORTED_TINY_ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One model per architecture, written once for the whole module."""
    arch: str = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    return arch, write_tiny_model(path, arch, n_blocks=N_BLOCKS[arch])


def _load(path: Path) -> llama_cpp.Llama:
    return plain_llama(str(path), n_ctx=256, n_threads=2, verbose=False, seed=0)


def _greedy(llm: llama_cpp.Llama, prompt: list[int]) -> list[int]:
    """N_GREEDY greedy tokens; generate() does not stop at EOS, so the count is exact."""
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == N_GREEDY:
            break
    return out


def test_generates_varied_deterministic_tokens(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    llm = _load(path)
    prompt = llm.tokenize(PROMPT.encode())
    assert len(prompt) > 16
    assert llm.detokenize(prompt).decode() == PROMPT  # byte fallback loses nothing

    first = _greedy(llm, prompt)
    second = _greedy(llm, prompt)
    assert first == second
    assert len(first) == N_GREEDY
    assert len(set(first)) >= 4, f"{arch} greedy output collapsed: {first}"

    # No end-of-generation token, so a completion with max_tokens=32 also runs the full length.
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert not any(llama_cpp.llama_vocab_is_eog(vocab, t) for t in first)

    fresh = _load(path)  # a separate context, as a separate process would have
    assert _greedy(fresh, fresh.tokenize(PROMPT.encode())) == first


def test_metadata_llama_cpp_sees(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    meta = _load(path).metadata
    assert meta["general.architecture"] == arch
    assert meta["tokenizer.ggml.model"] == "llama"
    assert int(meta[f"{arch}.block_count"]) == N_BLOCKS[arch]
    assert int(meta[f"{arch}.attention.head_count_kv"]) < int(meta[f"{arch}.attention.head_count"])
    assert 64 <= int(meta[f"{arch}.embedding_length"]) <= 128
    if arch == "gemma3":
        assert int(meta["gemma3.attention.sliding_window"]) == 16
    if arch == "qwen3moe":
        assert (int(meta["qwen3moe.expert_count"]), int(meta["qwen3moe.expert_used_count"])) == (8, 2)
    if arch == "llama4":
        assert (int(meta["llama4.expert_count"]), int(meta["llama4.expert_used_count"])) == (4, 1)
        assert int(meta["llama4.interleave_moe_layer_step"]) == 2


def test_manifest_and_storage(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    manifest = read_manifest(path)
    assert manifest.architecture == arch
    assert len(manifest.block_bytes) == N_BLOCKS[arch]
    assert len(set(manifest.block_bytes)) > 1
    assert manifest.head_bytes > 0

    names = {t.name for t in GGUFReader(path).tensors}
    assert ("output.weight" not in names) == TIED[arch]
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in names) == (arch in ("qwen3", "gemma3", "qwen3moe"))
    assert ("blk.0.post_ffw_norm.weight" in names) == (arch == "gemma3")
    moe = {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"}
    assert (moe <= names) == (arch == "qwen3moe") and ("blk.0.ffn_gate.weight" in names) == (arch != "qwen3moe")
    assert (manifest.expert_bytes is not None) == (arch in ("qwen3moe", "llama4"))
    if arch == "llama4":  # experts and a shared expert in every 2nd block, a dense FFN in the others
        ffn = ("gate", "up", "down")
        experts = {"blk.1.ffn_gate_inp.weight"} | {
            f"blk.1.ffn_{n}_{kind}.weight" for n in ffn for kind in ("exps", "shexp")
        }
        assert experts <= names and "blk.1.ffn_gate.weight" not in names and "rope_freqs.weight" in names


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_same_arguments_same_bytes(arch: str, tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", arch)
    b = write_tiny_model(tmp_path / "b.gguf", arch)
    c = write_tiny_model(tmp_path / "c.gguf", arch, seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tiny model"):
        write_tiny_model(tmp_path / "x.gguf", "mamba")
