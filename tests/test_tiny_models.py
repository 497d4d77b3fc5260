"""The tiny test models must really run in llama.cpp, or tests built on them prove nothing."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from gguf import GGUFReader
from plain_llama import plain_llama
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.gguf.manifest import read_manifest

# Longer than gemma3's 16-token sliding window, and with text that no word piece
# covers, so byte fallback and the windowed layers are both exercised.
PROMPT = "hello world, the model is in the block of kafila and it is a test: ünïcödé 123!"
N_GREEDY = 32
# gemma3 makes every 6th layer global: with 6 blocks, both kinds of layer are present.
# llama4 skips RoPE in every 4th block and has experts in every 2nd: 8 blocks hold both twice.
# qwen3next makes every 4th block full attention, the others gated delta nets.
N_BLOCKS = {
    "llama": 4, "qwen2": 4, "qwen3": 4, "gemma3": 6, "qwen3moe": 4, "gpt-oss": 4, "qwen3next": 8,
    "gemma2": 4, "phi3": 4, "mistral3": 4, "deepseek2": 5, "glm4moe": 4, "llama4": 8,
}  # fmt: skip
TIED = {
    "llama": False, "qwen2": False, "qwen3": True, "gemma3": True, "qwen3moe": False, "gpt-oss": False,
    "qwen3next": False, "gemma2": True, "phi3": True, "mistral3": False, "deepseek2": False, "glm4moe": False,
    "llama4": False,
}  # fmt: skip
MOE = ("qwen3moe", "gpt-oss", "qwen3next", "deepseek2", "glm4moe", "llama4")
PREDICTION_BLOCKS = {"glm4moe": 1}  # stored after the blocks llama.cpp runs


@pytest.fixture(scope="session", params=SUPPORTED_TINY_ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One model per architecture, written once per test process."""
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
    # byte fallback loses nothing; llama-cpp-python drops SentencePiece's leading space only after
    # a BOS, and gpt-oss's tokenizer adds none
    assert llm.detokenize(prompt).decode().removeprefix(" " if arch == "gpt-oss" else "") == PROMPT

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
    assert int(meta[f"{arch}.block_count"]) == N_BLOCKS[arch] + PREDICTION_BLOCKS.get(arch, 0)
    assert int(meta[f"{arch}.attention.head_count_kv"]) < int(meta[f"{arch}.attention.head_count"])
    assert 64 <= int(meta[f"{arch}.embedding_length"]) <= 128
    if arch in ("gemma3", "gemma2"):
        assert int(meta[f"{arch}.attention.sliding_window"]) == 16
    if arch == "gemma2":
        assert float(meta["gemma2.attn_logit_softcapping"]) == 50.0
    if arch == "phi3":  # rotary on 12 of each head's 16 dimensions
        assert int(meta["phi3.rope.dimension_count"]) == 12
    if arch == "mistral3":
        assert meta["mistral3.rope.scaling.type"] == "yarn"
        assert float(meta["mistral3.attention.temperature_scale"]) == 0.1
    if arch in MOE and arch != "llama4":
        assert (int(meta[f"{arch}.expert_count"]), int(meta[f"{arch}.expert_used_count"])) == (8, 2)
    if arch in ("deepseek2", "glm4moe"):
        assert int(meta[f"{arch}.expert_shared_count"]) == 1
        assert int(meta[f"{arch}.leading_dense_block_count"]) == (2 if arch == "deepseek2" else 1)
        assert int(meta[f"{arch}.expert_gating_func"]) == 2  # sigmoid
    if arch == "llama4":
        assert (int(meta["llama4.expert_count"]), int(meta["llama4.expert_used_count"])) == (4, 1)
        assert int(meta["llama4.interleave_moe_layer_step"]) == 2


def test_manifest_and_storage(tiny: tuple[str, Path]) -> None:
    arch, path = tiny
    manifest = read_manifest(path)
    assert manifest.architecture == arch
    assert len(manifest.block_bytes) == N_BLOCKS[arch]
    if arch != "gpt-oss":  # whose blocks are all alike, as the real model's: MXFP4 experts throughout
        assert len(set(manifest.block_bytes)) > 1
    assert manifest.head_bytes > 0

    names = {t.name for t in GGUFReader(path).tensors}
    assert ("output.weight" not in names) == TIED[arch]
    assert ("blk.0.attn_q.bias" in names) == (arch in ("qwen2", "gpt-oss", "glm4moe"))
    assert ("blk.0.attn_q_norm.weight" in names) == (arch in ("qwen3", "gemma3", "qwen3moe"))
    assert ("blk.0.post_ffw_norm.weight" in names) == (arch in ("gemma3", "gemma2"))
    moe = {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"}
    assert (moe <= names) == (arch in ("qwen3moe", "gpt-oss", "qwen3next"))  # the others lead with dense blocks
    dense_ffn = arch not in ("qwen3moe", "gpt-oss", "qwen3next", "phi3")  # phi3 fuses it into ffn_up
    assert ("blk.0.ffn_gate.weight" in names) == dense_ffn
    assert (manifest.expert_bytes is not None) == (arch in MOE)
    if arch != "qwen3next":  # whose delta-net blocks hold attn_qkv, and attention blocks attn_q
        has_q = "blk.0.attn_q.weight" in names or "blk.0.attn_q_a.weight" in names
        assert ("blk.0.attn_qkv.weight" in names) == (arch == "phi3") != has_q
    assert ({"rope_factors_long.weight", "rope_factors_short.weight"} <= names) == (arch == "phi3")
    harmony = {"attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias", "ffn_down_exps.bias"}
    assert ({f"blk.0.{name}" for name in harmony} <= names) == (arch == "gpt-oss")
    if arch == "qwen3next":  # blocks 0-2 and 4-6 are delta nets, 3 and 7 full attention with a gated query
        delta_net = {"attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a"}
        delta_net |= {"ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight"}
        attention = {"attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_output.weight"}
        shared = {"ffn_gate_inp_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
        for i in range(N_BLOCKS[arch]):
            kind, other = (attention, delta_net) if i % 4 == 3 else (delta_net, attention)
            assert {f"blk.{i}.{n}" for n in kind | shared} <= names
            assert not {f"blk.{i}.{n}" for n in other} & names
    last = N_BLOCKS[arch] - 1  # past the dense lead of deepseek2 and glm4moe: routed and shared experts
    shared = {f"blk.{last}.ffn_{name}_shexp.weight" for name in ("gate", "up", "down")} | {
        f"blk.{last}.exp_probs_b.bias"
    }
    assert (shared <= names) == (arch in ("deepseek2", "glm4moe"))
    assert ("blk.0.attn_kv_a_mqa.weight" in names) == (arch == "deepseek2")
    assert (f"blk.{N_BLOCKS[arch]}.nextn.eh_proj.weight" in names) == (arch == "glm4moe")
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
