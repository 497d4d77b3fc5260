"""Tiny GGUF models of several architectures that real llama.cpp loads and runs.

Tests need models whose blocks differ in size, whose KV head counts differ from their
query head counts and whose tokenizer takes any text, yet cost nothing to download: these
are written on the spot with the gguf package, random weights and a few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize

SUPPORTED_TINY_ARCHS: tuple[str, ...] = (
    "llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss", "qwen3next", "gemma2", "phi3", "mistral3",
    "deepseek2", "glm4moe", "llama4",
)  # fmt: skip

Q8_0 = GGMLQuantizationType.Q8_0
F16 = GGMLQuantizationType.F16
F32 = GGMLQuantizationType.F32
BF16 = GGMLQuantizationType.BF16
MXFP4 = GGMLQuantizationType.MXFP4
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
    post_norms: bool = False  # gemma3, gemma2: post_attention_norm, post_ffw_norm
    sliding_window: int = 0  # gemma3: every 6th layer global, the rest windowed; gemma2: every 2nd
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
    # gpt-oss: biases on the attention output, the router and the experts, and a learned sink
    # logit per query head; its FFN's input norm is named post_attention_norm
    out_bias: bool = False
    attn_sinks: bool = False
    expert_biases: bool = False
    ffn_norm_name: str = "ffn_norm"
    add_bos: bool = True  # gpt-oss's tokenizer adds none: its chat template opens every prompt
    rope_scaling: tuple[str, float, int] | None = None  # (type, factor, original context length)
    # qwen3next: gated delta-net blocks (linear attention, with a recurrent state) between full
    # attention blocks every `full_attention_interval`-th; a shared expert beside the routed ones
    full_attention_interval: int = 0
    list_recurrent_layers: bool = False  # write attention.recurrent_layers, as newer converters do
    ssm_head_dim: int = 0  # the delta net's key and value head size (ssm.state_size)
    ssm_k_heads: int = 0  # ssm.group_count
    ssm_v_heads: int = 0  # ssm.time_step_rank
    ssm_conv: int = 4
    n_ff_shared: int = 0
    attn_softcap: float = 0.0  # gemma2: attention logits soft-capped at this, and the output's at final_softcap
    final_softcap: float = 0.0
    fused_qkv: bool = False  # phi3: one attn_qkv holds q, k and v
    fused_gate_up: bool = False  # phi3: ffn_up holds the gate and the up halves (2 * n_ff rows), no ffn_gate
    rope_dims: int = 0  # rotary dimensions per head, written when set (phi3's Phi-4-mini: part of a head)
    rope_factors: bool = False  # phi3: global long/short rope factor tensors, picked by the context's size
    yarn: bool = False  # mistral3: yarn rope scaling, and query temperature by position (llama 4 scaling)
    # deepseek2 and glm4moe: a lead of dense blocks, then routed experts beside shared ones
    n_expert_shared: int = 0
    dense_lead: int = 0
    expert_gating: int = 0  # llama.cpp's expert_gating_func (1 softmax, 2 sigmoid); 0: not written
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    nextn: int = 0  # glm4moe: multi-token prediction blocks after the last, which llama.cpp's graph never runs
    # deepseek2's multi-head latent attention; q_lora_rank 0 is a Lite model's single attn_q
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    v_head_dim: int = 0
    stated_vocab_size: int = 0  # deepseek2's vocab_size key, where a test needs another than the token count
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

# gpt-oss-20b's block scaled down: 4 query heads over 2 KV heads of 32 (64 over 8 of 64 there,
# n_head * head_dim != n_embd in both), every even block windowed (8 tokens; 128 there), 8 experts
# of which 2 route a token (32 and 4 there) stored as MXFP4 as the released files store them, and
# its yarn rope scaling
_SHAPES["gpt-oss"] = ModelShape(
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=32,
    n_ff=64,
    tied_output=False,
    qkv_bias=True,
    sliding_window=8,
    embd_std=1.0,
    ffn_types=(MXFP4,),
    n_expert=8,
    n_expert_used=2,
    n_ff_expert=64,
    out_bias=True,
    attn_sinks=True,
    expert_biases=True,
    ffn_norm_name="post_attention_norm",
    add_bos=False,
    rope_scaling=("yarn", 32.0, 4096),
)

# Qwen3-Next-80B-A3B's blocks scaled down: 3 of 4 are a gated delta net (there 16 key heads,
# 32 value heads of 128), every 4th is full attention with a gated query (16 heads, 2 KV, of 256,
# a quarter of each rotated); all have 512 experts of which 10 route a token, and a shared expert.
_SHAPES["qwen3next"] = ModelShape(
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_ff=0,
    tied_output=False,
    qk_norm=True,
    n_expert=8,
    n_expert_used=2,
    n_ff_expert=32,
    n_ff_shared=32,
    full_attention_interval=4,
    ssm_head_dim=8,
    ssm_k_heads=2,
    ssm_v_heads=4,
    rope_dims=4,
    embd_std=1.0,
)
# Gemma 2: every other layer windowed, post norms, soft-capped attention and output (50 and 30
# there), queries wider than the embedding (head_dim * n_head > n_embd, as in the 9B) and
# n_embd // n_head != head_dim, whose sqrt(n_embd) scale is no power of two
_SHAPES["gemma2"] = ModelShape(
    n_embd=96,
    n_head=4,
    n_head_kv=2,
    head_dim=32,
    n_ff=192,
    tied_output=True,
    post_norms=True,
    sliding_window=16,
    attn_softcap=50.0,
    final_softcap=30.0,
    embd_std=0.005,
)
# Phi-4-mini's layout: fused qkv and gate+up, rotary on 3/4 of each head with long-context rope
# factors, a tied output; Phi-3's converter also writes a window llama.cpp turns off
_SHAPES["phi3"] = ModelShape(
    n_embd=96,
    n_head=6,
    n_head_kv=2,
    head_dim=16,
    n_ff=128,
    tied_output=True,
    sliding_window=16,
    fused_qkv=True,
    fused_gate_up=True,
    rope_dims=12,
    rope_factors=True,
    embd_std=0.3,
)
# Mistral Small 3 / Ministral 3: llama's block, heads wider than n_embd / n_head, yarn rope scaling
# and the query temperature that grows with the position
_SHAPES["mistral3"] = ModelShape(
    n_embd=96, n_head=4, n_head_kv=2, head_dim=32, n_ff=160, tied_output=False, rope_dims=32, yarn=True, embd_std=1.0
)
# Positions at which the long-context settings change: phi3 takes its long rope factors in a
# context longer than this, mistral3 raises its query temperature every this many positions.
ORIGINAL_CONTEXT = 16
# DeepSeek-V3's block scaled down: latent attention (query and key-value ranks 32, heads of 16 + 16
# rotary dims, values of 16), 2 leading dense blocks (3 there), then 8 routed experts (256), 2 a
# token (8), one shared, sigmoid gating with a selection bias
_SHAPES["deepseek2"] = ModelShape(
    n_embd=64, n_head=4, n_head_kv=1, head_dim=32, n_ff=128, tied_output=False, embd_std=1.0,
    n_expert=8, n_expert_used=2, n_ff_expert=32, n_expert_shared=1, dense_lead=2, expert_gating=2,
    expert_weights_scale=2.5, expert_weights_norm=True, rope_dims=16, q_lora_rank=32, kv_lora_rank=32, v_head_dim=16,
    ffn_types=(Q8_0, F16),  # with F32 too, llama.cpp's own batched decodes part from single ones on this seed
)  # fmt: skip
# GLM-4.5-Air's block scaled down: biased attention with half its head rotary, a post-attention
# norm before the FFN, 1 leading dense block, 8 routed experts (128), 2 a token (8), one shared,
# sigmoid gating with a selection bias, and one multi-token prediction block at the end
_SHAPES["glm4moe"] = ModelShape(
    n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, tied_output=False, embd_std=1.0, qkv_bias=True,
    n_expert=8, n_expert_used=2, n_ff_expert=32, n_expert_shared=1, dense_lead=1, expert_gating=2,
    expert_weights_scale=2.5, expert_weights_norm=True, rope_dims=16, nextn=1,
)  # fmt: skip

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


def _vocab(arch: str, extra_specials: Sequence[str] = ()) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """A SentencePiece ("llama") vocabulary: specials, all 256 byte fallbacks, some pieces.

    Byte fallback is what lets any text tokenize. Word pieces are listed with all their
    prefixes because SPM only merges adjacent symbols whose concatenation is a token.
    """
    specials = ["<unk>", "<s>", "</s>"]
    if arch in ("gemma3", "gemma2"):
        specials += ["<pad>", "<start_of_turn>", "<end_of_turn>"]
    if arch == "gpt-oss":  # the harmony format's markers, which its chat template writes
        specials += ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"]
    if arch == "phi3":  # llama.cpp looks these up in any model named phi3
        specials += ["<|endoftext|>", "<|end|>"]
    specials += [s for s in extra_specials if s not in specials]
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
    extra_specials: Sequence[str] = (),
    n_vocab: int | None = None,
) -> Path:
    """Write a tiny random `arch` model to `path`; the same arguments give the same bytes.

    FFN storage cycles Q8_0 / F16 / F32 by block so block sizes differ; llama, qwen2, qwen3moe,
    mistral3 and gpt-oss carry their own output.weight, the others tie it to token_embd. `shape`
    replaces the architecture's tiny default (and its limit of 12 blocks); `chat_template` (Jinja) is
    stored as tokenizer.chat_template, without which servers use their built-in one;
    `extra_specials` are control tokens its syntax needs (`[TOOL_CALLS]`, `<|python_tag|>`);
    `n_vocab` pads the vocabulary with plain pieces to that many tokens (a larger head). Tensors
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
    tokens, scores, types, special_ids = _vocab(arch, extra_specials)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab is {n_vocab}; the {arch} vocabulary has {len(tokens)} tokens at least")
        padding = n_vocab - len(tokens)
        tokens += [f"▁pad{i}" for i in range(padding)]
        scores += [-float(len(scores) + i) for i in range(padding)]
        types += [int(TokenType.NORMAL)] * padding
    n_vocab = len(tokens)
    n_embd, n_ff, head_dim = shape.n_embd, shape.n_ff, shape.head_dim
    n_q, n_kv = shape.n_head * head_dim, shape.n_head_kv * head_dim

    path = Path(path)
    writer = GGUFWriter(str(path), arch=arch, use_temp_file=True)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(n_blocks + shape.nextn)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    if shape.kv_lora_rank:
        _add_latent_attention(writer, shape, n_vocab)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.rope_scaling is not None:
        scaling, factor, original_context = shape.rope_scaling
        writer.add_rope_scaling_type(RopeScalingType(scaling))
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original_context)
    if shape.attn_softcap:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.rope_dims:
        writer.add_rope_dimension_count(shape.rope_dims)
    if shape.rope_factors:
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        scale = 256 / ORIGINAL_CONTEXT
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(ORIGINAL_CONTEXT))))
    if shape.yarn:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(256 / ORIGINAL_CONTEXT)
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
        writer.add_rope_scaling_yarn_log_mul(1.0)
        writer.add_attn_temperature_scale(0.1)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_expert)
    if shape.full_attention_interval:
        _add_delta_net_metadata(writer, arch, shape, n_blocks)
    if shape.n_expert_shared:
        _add_shared_experts(writer, shape)
    if shape.nextn:
        writer.add_nextn_predict_layers(shape.nextn)
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
    writer.add_add_bos_token(shape.add_bos)
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
    if shape.rope_factors:  # one pair for the whole model, which every block reads
        n_factors = shape.rope_dims // 2
        add("rope_factors_long.weight", np.linspace(1.0, 8.0, n_factors, dtype=np.float32), F32)
        add("rope_factors_short.weight", np.linspace(1.0, 1.5, n_factors, dtype=np.float32), F32)
    if shape.rope_freqs:  # divisors of each rotary pair's frequency, as llama3's scaling stores them
        add("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32), F32)

    def latent_attention(blk: str) -> None:
        """deepseek2's: queries through a low rank (or one attn_q in a Lite model), keys and values
        from one shared latent, split per head into k_b and v_b as the converter stores them."""
        rope, q_rank, kv_rank, v_dim = shape.rope_dims, shape.q_lora_rank, shape.kv_lora_rank, shape.v_head_dim
        if q_rank:
            add(f"{blk}.attn_q_a.weight", matrix(q_rank, n_embd), shape.attn_qko_type)
            add(f"{blk}.attn_q_a_norm.weight", ones(q_rank), F32)
            add(f"{blk}.attn_q_b.weight", matrix(n_q, q_rank), shape.attn_qko_type)
        else:
            add(f"{blk}.attn_q.weight", matrix(n_q, n_embd), shape.attn_qko_type)
        add(f"{blk}.attn_kv_a_mqa.weight", matrix(kv_rank + rope, n_embd), shape.attn_qko_type)
        add(f"{blk}.attn_kv_a_norm.weight", ones(kv_rank), F32)
        add(f"{blk}.attn_k_b.weight", np.stack([matrix(kv_rank, head_dim - rope) for _ in range(shape.n_head)]), F16)
        add(f"{blk}.attn_v_b.weight", np.stack([matrix(v_dim, kv_rank) for _ in range(shape.n_head)]), F16)
        add(f"{blk}.attn_output.weight", matrix(n_embd, shape.n_head * v_dim), shape.attn_qko_type)

    def lead_then_experts_block(i: int, blk: str, ffn_type: GGMLQuantizationType) -> None:
        """A deepseek2 or glm4moe block: dense before `dense_lead`, else routed and shared experts;
        past the computed blocks, a glm4moe multi-token prediction block."""
        add(f"{blk}.attn_norm.weight", ones(n_embd), F32)
        if shape.kv_lora_rank:
            latent_attention(blk)
            add(f"{blk}.ffn_norm.weight", ones(n_embd), F32)
        else:
            for name, rows in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                add(f"{blk}.attn_{name}.weight", matrix(rows, n_embd), shape.attn_qko_type)
                add(f"{blk}.attn_{name}.bias", (rng.standard_normal(rows) * 0.1).astype(np.float32), F32)
            add(f"{blk}.attn_output.weight", matrix(n_embd, n_q), shape.attn_qko_type)
            add(f"{blk}.post_attention_norm.weight", ones(n_embd), F32)  # glm4moe's norm before the FFN
        if i < shape.dense_lead:
            add(f"{blk}.ffn_gate.weight", matrix(n_ff, n_embd), ffn_type)
            add(f"{blk}.ffn_up.weight", matrix(n_ff, n_embd), ffn_type)
            add(f"{blk}.ffn_down.weight", matrix(n_embd, n_ff), ffn_type)
        else:
            experts, n_ff_e, n_ff_s = shape.n_expert, shape.n_ff_expert, shape.n_ff_expert * shape.n_expert_shared
            add(f"{blk}.ffn_gate_inp.weight", matrix(experts, n_embd), F32)
            add(f"{blk}.exp_probs_b.bias", (rng.standard_normal(experts) * 0.1).astype(np.float32), F32)
            for name, rows, cols in (("gate", n_ff_e, n_embd), ("up", n_ff_e, n_embd), ("down", n_embd, n_ff_e)):
                add(f"{blk}.ffn_{name}_exps.weight", np.stack([matrix(rows, cols) for _ in range(experts)]), ffn_type)
            add(f"{blk}.ffn_gate_shexp.weight", matrix(n_ff_s, n_embd), ffn_type)
            add(f"{blk}.ffn_up_shexp.weight", matrix(n_ff_s, n_embd), ffn_type)
            add(f"{blk}.ffn_down_shexp.weight", matrix(n_embd, n_ff_s), ffn_type)
        if i >= n_blocks:
            add(f"{blk}.nextn.eh_proj.weight", matrix(n_embd, 2 * n_embd), Q8_0)
            for name in ("enorm", "hnorm", "shared_head_norm"):
                add(f"{blk}.nextn.{name}.weight", ones(n_embd), F32)

    for i in range(n_blocks + shape.nextn):
        ffn_type = shape.ffn_types[i % len(shape.ffn_types)]
        blk = f"blk.{i}"
        if shape.full_attention_interval:
            add(f"{blk}.attn_norm.weight", ones(n_embd), F32)
            add(f"{blk}.post_attention_norm.weight", ones(n_embd), F32)
            if (i + 1) % shape.full_attention_interval:
                _add_delta_net(add, matrix, rng, shape, blk)
            else:  # full attention; its query projection also yields a gate per query value
                add(f"{blk}.attn_q.weight", matrix(2 * n_q, n_embd), shape.attn_qko_type)
                add(f"{blk}.attn_k.weight", matrix(n_kv, n_embd), shape.attn_qko_type)
                add(f"{blk}.attn_v.weight", matrix(n_kv, n_embd), shape.attn_v_type)
                add(f"{blk}.attn_output.weight", matrix(n_embd, n_q), shape.attn_qko_type)
                add(f"{blk}.attn_q_norm.weight", ones(head_dim), F32)
                add(f"{blk}.attn_k_norm.weight", ones(head_dim), F32)
            experts, n_ff_e, n_ff_s = shape.n_expert, shape.n_ff_expert, shape.n_ff_shared
            add(f"{blk}.ffn_gate_inp.weight", matrix(experts, n_embd), F32)
            for name, rows, cols in (("gate", n_ff_e, n_embd), ("up", n_ff_e, n_embd), ("down", n_embd, n_ff_e)):
                add(f"{blk}.ffn_{name}_exps.weight", np.stack([matrix(rows, cols) for _ in range(experts)]), ffn_type)
            add(f"{blk}.ffn_gate_inp_shexp.weight", matrix(1, n_embd)[0], F32)  # the shared expert's gate
            add(f"{blk}.ffn_gate_shexp.weight", matrix(n_ff_s, n_embd), ffn_type)
            add(f"{blk}.ffn_up_shexp.weight", matrix(n_ff_s, n_embd), ffn_type)
            add(f"{blk}.ffn_down_shexp.weight", matrix(n_embd, n_ff_s), ffn_type)
            continue
        if shape.n_expert_shared:
            lead_then_experts_block(i, blk, ffn_type)
            continue
        add(f"{blk}.attn_norm.weight", ones(n_embd), F32)
        if shape.fused_qkv:
            add(f"{blk}.attn_qkv.weight", matrix(n_q + 2 * n_kv, n_embd), shape.attn_qko_type)
        else:
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
        if shape.out_bias:
            add(f"{blk}.attn_output.bias", (rng.standard_normal(n_embd) * 0.1).astype(np.float32), F32)
        if shape.attn_sinks:
            add(f"{blk}.attn_sinks.weight", rng.standard_normal(shape.n_head).astype(np.float32), F32)
        if shape.post_norms:
            add(f"{blk}.post_attention_norm.weight", ones(n_embd), F32)
        add(f"{blk}.{shape.ffn_norm_name}.weight", ones(n_embd), F32)
        if shape.n_expert and (shape.moe_layer_step == 0 or (i + 1) % shape.moe_layer_step == 0):
            experts, n_ff_e = shape.n_expert, shape.n_ff_expert
            add(f"{blk}.ffn_gate_inp.weight", matrix(experts, n_embd), F32)  # the router
            if shape.expert_biases:
                add(f"{blk}.ffn_gate_inp.bias", (rng.standard_normal(experts) * 0.1).astype(np.float32), F32)
            for name, rows, cols in (("gate", n_ff_e, n_embd), ("up", n_ff_e, n_embd), ("down", n_embd, n_ff_e)):
                stacked = np.stack([matrix(rows, cols) for _ in range(experts)])
                add(f"{blk}.ffn_{name}_exps.weight", stacked, ffn_type)
                if shape.expert_biases:
                    bias = (rng.standard_normal((experts, rows)) * 0.1).astype(np.float32)
                    add(f"{blk}.ffn_{name}_exps.bias", bias, F32)
                if shape.shared_expert:
                    add(f"{blk}.ffn_{name}_shexp.weight", matrix(rows, cols), ffn_type)
        elif shape.fused_gate_up:
            add(f"{blk}.ffn_up.weight", matrix(2 * n_ff, n_embd), ffn_type)
            add(f"{blk}.ffn_down.weight", matrix(n_embd, n_ff), ffn_type)
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


def _add_delta_net_metadata(writer: GGUFWriter, arch: str, shape: ModelShape, n_blocks: int) -> None:
    """A hybrid model's linear-attention sizes and where its full-attention blocks are: by period
    (`full_attention_interval`), and where the shape says so also block by block."""
    writer.add_ssm_conv_kernel(shape.ssm_conv)
    writer.add_ssm_state_size(shape.ssm_head_dim)
    writer.add_ssm_group_count(shape.ssm_k_heads)
    writer.add_ssm_time_step_rank(shape.ssm_v_heads)
    writer.add_ssm_inner_size(shape.ssm_head_dim * shape.ssm_v_heads)
    writer.add_full_attention_interval(shape.full_attention_interval)
    if shape.list_recurrent_layers:
        recurrent = [(i + 1) % shape.full_attention_interval != 0 for i in range(n_blocks)]
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_expert_shared_feed_forward_length(shape.n_ff_shared)


def _add_delta_net(
    add: Callable[[str, np.ndarray, GGMLQuantizationType], None],
    matrix: Callable[[int, int], np.ndarray],
    rng: np.random.Generator,
    shape: ModelShape,
    blk: str,
) -> None:
    """A gated delta-net block's linear attention, as llama.cpp's qwen3next loader sizes it."""
    n_embd, head, conv = shape.n_embd, shape.ssm_head_dim, shape.ssm_conv
    key_dim, value_dim = head * shape.ssm_k_heads, head * shape.ssm_v_heads
    conv_dim = 2 * key_dim + value_dim
    add(f"{blk}.attn_qkv.weight", matrix(conv_dim, n_embd), shape.attn_qko_type)
    add(f"{blk}.attn_gate.weight", matrix(value_dim, n_embd), shape.attn_qko_type)
    add(f"{blk}.ssm_conv1d.weight", (rng.standard_normal((conv_dim, conv)) * 0.5).astype(np.float32), F32)
    add(f"{blk}.ssm_dt.bias", (rng.standard_normal(shape.ssm_v_heads) * 0.5).astype(np.float32), F32)
    add(f"{blk}.ssm_a", -np.exp(rng.uniform(-1.0, 1.0, shape.ssm_v_heads)).astype(np.float32), F32)  # -exp(A_log)
    add(f"{blk}.ssm_ba.weight", matrix(2 * shape.ssm_v_heads, n_embd), F32)
    add(f"{blk}.ssm_norm.weight", np.ones(head, dtype=np.float32), F32)
    add(f"{blk}.ssm_out.weight", matrix(n_embd, value_dim), shape.attn_qko_type)


def _add_latent_attention(writer: GGUFWriter, shape: ModelShape, n_vocab: int) -> None:
    """deepseek2's attention keys as its converter writes them: the cache holds one latent of
    kv_lora_rank + the rotary dims a token (as an MQA key), the heads' own sizes are the _mla ones."""
    writer.add_vocab_size(shape.stated_vocab_size or n_vocab)
    if shape.q_lora_rank:
        writer.add_q_lora_rank(shape.q_lora_rank)
    writer.add_kv_lora_rank(shape.kv_lora_rank)
    writer.add_key_length(shape.kv_lora_rank + shape.rope_dims)
    writer.add_value_length(shape.kv_lora_rank)
    writer.add_key_length_mla(shape.head_dim)
    writer.add_value_length_mla(shape.v_head_dim)


def _add_shared_experts(writer: GGUFWriter, shape: ModelShape) -> None:
    writer.add_expert_shared_count(shape.n_expert_shared)
    writer.add_leading_dense_block_count(shape.dense_lead)
    if shape.expert_gating:
        writer.add_expert_gating_func(ExpertGatingFuncType(shape.expert_gating))
    if shape.expert_weights_scale:
        writer.add_expert_weights_scale(shape.expert_weights_scale)
    if shape.expert_weights_norm:
        writer.add_expert_weights_norm(True)


def write_wide_model(path: Path, n_blocks: int) -> Path:
    """A llama whose blocks cost clearly more than a stage's fixed cost (about 4 MB of Q8_0 each),
    so that how the blocks are divided shows in the stages' times; its vocabulary stays tiny."""
    shape = ModelShape(
        n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=2048, tied_output=False, embd_std=1.0,
        ffn_types=(Q8_0,), attn_v_type=Q8_0,
    )  # fmt: skip
    return write_tiny_model(path, "llama", n_blocks=n_blocks, shape=shape)


def write_tiny_llama(
    path: Path,
    n_blocks: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 512,
    tied_output: bool = False,
    wide_blocks: tuple[int, ...] = (),
    seed: int = 0,
) -> Path:
    """A llama of any size whose bytes are easy to count: every matrix Q8_0 but the FFN of the
    blocks in `wide_blocks`, F16; norms F32."""
    shape = ModelShape(
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=n_embd // n_head, n_ff=n_ff,
        tied_output=tied_output, embd_std=1.0, attn_v_type=Q8_0,
        ffn_types=tuple(F16 if i in wide_blocks else Q8_0 for i in range(n_blocks)),
    )  # fmt: skip
    return write_tiny_model(path, "llama", n_blocks=n_blocks, seed=seed, shape=shape, n_vocab=n_vocab)
