"""Tiny GGUF models of several architectures that real llama.cpp loads and runs.

Tests need models whose blocks differ in size, whose KV head counts differ from their
query head counts and whose tokenizer takes any text, yet cost nothing to download: these
are written on the spot with the gguf package, random weights and a few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

SUPPORTED_TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "llama4")

Q8_0 = GGMLQuantizationType.Q8_0
F16 = GGMLQuantizationType.F16
F32 = GGMLQuantizationType.F32
BF16 = GGMLQuantizationType.BF16
# Per-block FFN storage, cycled by block index, so that block byte sizes differ.
_FFN_TYPES: tuple[GGMLQuantizationType, ...] = (Q8_0, F16, F32)


@dataclass(frozen=True)
class ModelShape:
    """What one architecture needs: sizes, and which optional tensors llama.cpp expects.

    `_SHAPES` holds the tiny default of each architecture; a caller may pass its own (larger,
    all-Q8_0) shape to `write_tiny_model`, as scripts/bench_concurrency.py does.
    """

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    tied_output: bool  # no output.weight: llama.cpp reuses token_embd
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, gemma3
    post_norms: bool = False  # gemma3: post_attention_norm, post_ffw_norm
    sliding_window: int = 0  # gemma3: every 6th layer global, the rest windowed
    # Tuned so greedy decoding wanders instead of repeating one token: with a tied output
    # and a large embedding, the residual stream is mostly the current token's embedding,
    # whose logit then wins every step; a small embedding lets the blocks steer.
    init_gain: float = 2.0  # multiplies 1/sqrt(fan_in)
    embd_std: float = 0.1
    ffn_types: tuple[GGMLQuantizationType, ...] = _FFN_TYPES  # cycled by block index
    attn_v_type: GGMLQuantizationType = F16
    attn_qko_type: GGMLQuantizationType = Q8_0  # attention's q, k and output projections
    n_expert: int = 0  # mixture of experts: the FFN is n_expert experts, n_expert_used routed a token
    n_expert_used: int = 0
    n_ff_expert: int = 0
    moe_layer_step: int = 0  # llama4: experts in every n-th block only, a dense FFN in the others
    shared_expert: bool = False  # llama4: beside the routed experts, one of n_ff_expert every token uses
    rope_freqs: bool = False  # llama4 (llama3-style RoPE scaling): one rope_freqs.weight for every block


_SHAPES: dict[str, ModelShape] = {
    "llama": ModelShape(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied_output=False, embd_std=1.0),
    "qwen2": ModelShape(n_embd=96, n_head=6, n_head_kv=2, head_dim=16, n_ff=160, tied_output=False, qkv_bias=True),
    # head_dim * n_head != n_embd here, so key_length is what sizes the KV cache
    "qwen3": ModelShape(n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied_output=True, qk_norm=True),
    "gemma3": ModelShape(
        n_embd=128,
        n_head=4,
        n_head_kv=1,
        head_dim=32,
        n_ff=192,
        tied_output=True,
        qk_norm=True,
        post_norms=True,
        sliding_window=16,
        embd_std=0.005,  # gemma scales embeddings by sqrt(n_embd) and post-norms every block output
    ),
}

# Qwen3-30B-A3B's block scaled down: qwen3's attention, its FFN as 8 experts of which 2 route a
# token (128 and 8 there), and an output of its own
_SHAPES["qwen3moe"] = replace(
    _SHAPES["qwen3"], tied_output=False, n_expert=8, n_expert_used=2, n_ff_expert=64, embd_std=1.0
)

# Llama 4 Scout / Maverick scaled down: 4 experts of which 1 routes a token (16 or 128 there), a
# shared expert, experts in every 2nd block (Maverick's interleave_moe_layer_step; Scout's is 1),
# and llama3-style RoPE frequency factors. llama.cpp itself skips RoPE in every 4th block.
_SHAPES["llama4"] = replace(
    _SHAPES["llama"],
    n_expert=4,
    n_expert_used=1,
    n_ff_expert=64,
    moe_layer_step=2,
    shared_expert=True,
    rope_freqs=True,
)

TINY_SHAPES: Mapping[str, ModelShape] = MappingProxyType(_SHAPES)

_WORDS = ("the", "a", "and", "hello", "world", "of", "to", "is", "in", "it", "model", "block", "kafila")


def _vocab(arch: str) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """A SentencePiece ("llama") vocabulary: specials, all 256 byte fallbacks, some pieces.

    Byte fallback is what lets any text tokenize. Word pieces are listed with all their
    prefixes because SPM only merges adjacent symbols whose concatenation is a token.
    """
    specials = ["<unk>", "<s>", "</s>"]
    if arch == "gemma3":
        specials += ["<pad>", "<start_of_turn>", "<end_of_turn>"]
    tokens = list(specials)
    types = [TokenType.UNKNOWN] + [TokenType.CONTROL] * (len(specials) - 1)
    scores = [0.0] * len(specials)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    scores += [0.0] * 256
    pieces: list[str] = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    for word in _WORDS:
        spelled = "▁" + word
        pieces += [spelled[:n] for n in range(2, len(spelled) + 1)]
    pieces = list(dict.fromkeys(pieces))
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]
    ids = {name: tokens.index(name) for name in specials}
    return tokens, scores, [int(t) for t in types], ids


def write_tiny_model(
    path: Path,
    arch: str,
    n_blocks: int = 4,
    seed: int = 0,
    shape: ModelShape | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a tiny random `arch` model to `path`; the same arguments give the same bytes.

    FFN storage cycles Q8_0 / F16 / F32 by block so block sizes differ; llama and qwen2
    carry their own output.weight, qwen3 and gemma3 tie it to token_embd. `shape` replaces
    the architecture's tiny default (and its limit of 12 blocks); `chat_template` (Jinja) is
    stored as tokenizer.chat_template, without which servers use their built-in one. Tensors
    are written through a temporary file as they are made, so a model of a gigabyte needs
    little memory to write.
    """
    if arch not in _SHAPES:
        raise ValueError(f"no tiny model for architecture {arch!r}; choose from {SUPPORTED_TINY_ARCHS}")
    if shape is None:
        if not 1 <= n_blocks <= 12:
            raise ValueError(f"n_blocks is {n_blocks}; tiny models have 1 to 12")
        shape = _SHAPES[arch]
    elif n_blocks < 1:
        raise ValueError(f"n_blocks is {n_blocks}; a model needs at least 1")
    arch_index = SUPPORTED_TINY_ARCHS.index(arch)
    rng = np.random.default_rng([seed, arch_index])
    tokens, scores, types, special_ids = _vocab(arch)
    n_vocab = len(tokens)
    n_embd, n_ff, head_dim = shape.n_embd, shape.n_ff, shape.head_dim
    n_q, n_kv = shape.n_head * head_dim, shape.n_head_kv * head_dim

    path = Path(path)
    writer = GGUFWriter(str(path), arch=arch, use_temp_file=True)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(n_blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_expert)
    if shape.moe_layer_step:
        writer.add_interleave_moe_layer_step(shape.moe_layer_step)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(special_ids["<unk>"])
    writer.add_bos_token_id(special_ids["<s>"])
    writer.add_eos_token_id(special_ids["</s>"])
    if "<pad>" in special_ids:
        writer.add_pad_token_id(special_ids["<pad>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def matrix(rows: int, cols: int) -> np.ndarray:
        """A (rows, cols) weight; GGUF's ne is (cols, rows), cols being the input size."""
        return (rng.standard_normal((rows, cols)) * (shape.init_gain / np.sqrt(cols))).astype(np.float32)

    def add(name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> None:
        if qtype == F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    # Control tokens get small embeddings (and zero output rows): they still mark BOS,
    # but greedy decoding never picks them, so a completion never stops early on EOS.
    control = [i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)]
    embd = (rng.standard_normal((n_vocab, n_embd)) * shape.embd_std).astype(np.float32)
    embd[control] *= 0.05
    add("token_embd.weight", embd, Q8_0)
    add("output_norm.weight", ones(n_embd), F32)
    if not shape.tied_output:
        out = matrix(n_vocab, n_embd)
        out[control] = 0.0
        add("output.weight", out, Q8_0)
    if shape.rope_freqs:  # divisors of each rotary pair's frequency, as llama3's scaling stores them
        add("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32), F32)

    for i in range(n_blocks):
        ffn_type = shape.ffn_types[i % len(shape.ffn_types)]
        blk = f"blk.{i}"
        add(f"{blk}.attn_norm.weight", ones(n_embd), F32)
        add(f"{blk}.attn_q.weight", matrix(n_q, n_embd), shape.attn_qko_type)
        add(f"{blk}.attn_k.weight", matrix(n_kv, n_embd), shape.attn_qko_type)
        add(f"{blk}.attn_v.weight", matrix(n_kv, n_embd), shape.attn_v_type)
        if shape.qkv_bias:
            add(f"{blk}.attn_q.bias", (rng.standard_normal(n_q) * 0.1).astype(np.float32), F32)
            add(f"{blk}.attn_k.bias", (rng.standard_normal(n_kv) * 0.1).astype(np.float32), F32)
            add(f"{blk}.attn_v.bias", (rng.standard_normal(n_kv) * 0.1).astype(np.float32), F32)
        if shape.qk_norm:
            add(f"{blk}.attn_q_norm.weight", ones(head_dim), F32)
            add(f"{blk}.attn_k_norm.weight", ones(head_dim), F32)
        add(f"{blk}.attn_output.weight", matrix(n_embd, n_q), shape.attn_qko_type)
        if shape.post_norms:
            add(f"{blk}.post_attention_norm.weight", ones(n_embd), F32)
        add(f"{blk}.ffn_norm.weight", ones(n_embd), F32)
        if shape.n_expert and (shape.moe_layer_step == 0 or (i + 1) % shape.moe_layer_step == 0):
            experts, n_ff_e = shape.n_expert, shape.n_ff_expert
            add(f"{blk}.ffn_gate_inp.weight", matrix(experts, n_embd), F32)  # the router
            for name, rows, cols in (("gate", n_ff_e, n_embd), ("up", n_ff_e, n_embd), ("down", n_embd, n_ff_e)):
                stacked = np.stack([matrix(rows, cols) for _ in range(experts)])
                add(f"{blk}.ffn_{name}_exps.weight", stacked, ffn_type)
                if shape.shared_expert:
                    add(f"{blk}.ffn_{name}_shexp.weight", matrix(rows, cols), ffn_type)
        else:
            add(f"{blk}.ffn_gate.weight", matrix(n_ff, n_embd), ffn_type)
            add(f"{blk}.ffn_up.weight", matrix(n_ff, n_embd), ffn_type)
            add(f"{blk}.ffn_down.weight", matrix(n_embd, n_ff), ffn_type)
        if shape.post_norms:
            add(f"{blk}.post_ffw_norm.weight", ones(n_embd), F32)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_wide_model(path: Path, n_blocks: int) -> Path:
    """A llama whose blocks cost clearly more than a stage's fixed cost (about 4 MB of Q8_0 each),
    so that how the blocks are divided shows in the stages' times; its vocabulary stays tiny."""
    shape = ModelShape(
        n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=2048, tied_output=False, embd_std=1.0,
        ffn_types=(Q8_0,), attn_v_type=Q8_0,
    )  # fmt: skip
    return write_tiny_model(path, "llama", n_blocks=n_blocks, shape=shape)
