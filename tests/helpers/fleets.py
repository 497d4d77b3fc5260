"""Fleets and model manifests modelled on the paper's evaluation, from published figures.

Devices: memory bandwidth and memory from vendor data sheets (GB/s, GiB). Usable memory is
what a model may occupy: a machine with unified memory (the laptop, the Mac Studios, the DGX
Spark, the Ryzen AI Max desktop) keeps about a quarter of it for the OS, the CPU-only
workstation 16 of its 256 GiB. Per-token overheads are round figures of the order llama.cpp
shows on such hardware; the planner's comparison does not hinge on them. The DGX Spark's fp16
figure is its data sheet's 1 PFLOP of sparse FP4, halved for density and quartered for fp16.

Models are sized tensor by tensor: each block's tensors as llama.cpp names them, with element
counts from the published shapes (config.json) and bytes from the ggml type's block size.

- Qwen3-8B, 14B and 32B, and the mixture of experts Qwen3-30B-A3B, at Q4_K_M by llama.cpp's
  type rules (llama-quant.cpp): Q6_K for attn_v and ffn_down (ffn_down_exps too) in the first
  and last eighth of the blocks and every third block between, Q4_K elsewhere, Q6_K output,
  Q4_K token embedding, f32 norms and f32 expert routers (llama.cpp never quantizes
  ffn_gate_inp).
- gpt-oss-120b as the published MXFP4 GGUF (ggml-org/gpt-oss-120b-GGUF; llama.cpp's MXFP4_MOE
  rules): routed experts MXFP4 (32 values in 17 bytes), every other matrix, token embedding and
  output included, Q8_0; norms, biases, attention sinks and the router f32. Its header reads 433
  f32, 146 q8_0 and 108 mxfp4 tensors, 59.02 GiB (llama.cpp issue #15253); this sizing lands on
  the same counts and size.
- DeepSeek-V3 (671B) at Q4_K_M by the same rules, on the tensor set today's converter writes:
  the multi-token-prediction block (layer 61) dropped, kv_b_proj split into attn_k_b and
  attn_v_b. No tensor is named attn_v, so only ffn_down (dense, routed and shared) gets the
  wider Q6_K; attn_k_b's rows of 128 values do not fit Q4_K's 256-value blocks and fall back to
  Q5_0. Its KV cache holds only the compressed latent and the rotary key (512 + 64 values a token
  a block): llama.cpp allocates no V cache for MLA.

Run `python tests/helpers/fleets.py` to rewrite the example fleets in examples/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

QWEN3_SHAPES = {
    # name: (blocks, hidden, heads, kv heads, head dim, ffn, vocab)
    "Qwen3-8B-Q4_K_M": (36, 4096, 32, 8, 128, 12288, 151936),
    "Qwen3-14B-Q4_K_M": (40, 5120, 40, 8, 128, 17408, 151936),
    "Qwen3-32B-Q4_K_M": (64, 5120, 64, 8, 128, 25600, 151936),
}


QWEN3_MOE_SHAPES = {
    # name: (blocks, hidden, heads, kv heads, head dim, expert ffn, experts, experts a token, vocab)
    "Qwen3-30B-A3B-Q4_K_M": (48, 2048, 32, 4, 128, 768, 128, 8, 151936),
}

# gpt-oss-120b (config.json): 36 blocks, hidden 2880, 64 query heads and 8 KV heads of 64,
# 128 experts of FFN 2880, 4 a token, vocabulary 201088.
GPT_OSS_120B = "gpt-oss-120b-MXFP4"
GPT_OSS_SHAPE = (36, 2880, 64, 8, 64, 2880, 128, 4, 201088)


class DeepSeekShape(NamedTuple):
    blocks: int
    dense_blocks: int  # first_k_dense_replace
    hidden: int
    ffn: int  # the dense blocks'
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    expert_ffn: int
    experts: int
    experts_used: int
    shared_experts: int
    vocab: int


# DeepSeek-V3 (config.json), its multi-token-prediction block left out as the converter does.
DEEPSEEK_V3 = "DeepSeek-V3-Q4_K_M"
DEEPSEEK_V3_SHAPE = DeepSeekShape(
    blocks=61,
    dense_blocks=3,
    hidden=7168,
    ffn=18432,
    heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    expert_ffn=2048,
    experts=256,
    experts_used=8,
    shared_experts=1,
    vocab=129280,
)


class Tensor(NamedTuple):
    """One tensor of the GGUF file, named as llama.cpp names it (without blk.N.)."""

    name: str
    elements: int
    qtype: Q
    routed: bool = False  # a stack of routed experts: a token reads k of its n

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        assert self.elements % block == 0, f"{self.name}: {self.elements} values in blocks of {block}"
        return self.elements // block * size


class ModelTensors(NamedTuple):
    """A model as its file holds it: each block's tensors and the head's."""

    name: str
    architecture: str
    blocks: list[list[Tensor]]
    head: list[Tensor]  # token_embd, output_norm, output
    kv_bytes_per_token_per_block: int  # f16 cache, as llama.cpp allocates it
    experts: int = 0
    experts_used: int = 0


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the blocks whose attn_v and ffn_down Q4_K_M widens to Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k_m_wide(i: int, n: int) -> Q:
    return Q.Q6_K if _more_bits(i, n) else Q.Q4_K


def _qwen3_attention(wide: Q, hidden: int, heads: int, kv_heads: int, head_dim: int) -> list[Tensor]:
    return [
        Tensor("attn_q", hidden * heads * head_dim, Q.Q4_K),
        Tensor("attn_k", hidden * kv_heads * head_dim, Q.Q4_K),
        Tensor("attn_v", hidden * kv_heads * head_dim, wide),
        Tensor("attn_output", heads * head_dim * hidden, Q.Q4_K),
        Tensor("attn_norm", hidden, Q.F32),
        Tensor("ffn_norm", hidden, Q.F32),
        Tensor("attn_q_norm", head_dim, Q.F32),
        Tensor("attn_k_norm", head_dim, Q.F32),
    ]


def _q4_k_m_head(hidden: int, vocab: int) -> list[Tensor]:
    return [
        Tensor("token_embd", vocab * hidden, Q.Q4_K),
        Tensor("output_norm", hidden, Q.F32),
        Tensor("output", vocab * hidden, Q.Q6_K),
    ]


def qwen3_tensors(name: str) -> ModelTensors:
    n_blocks, hidden, heads, kv_heads, head_dim, ffn, vocab = QWEN3_SHAPES[name]
    blocks = []
    for i in range(n_blocks):
        wide = _q4_k_m_wide(i, n_blocks)
        blocks.append(
            [
                *_qwen3_attention(wide, hidden, heads, kv_heads, head_dim),
                Tensor("ffn_gate", hidden * ffn, Q.Q4_K),
                Tensor("ffn_up", hidden * ffn, Q.Q4_K),
                Tensor("ffn_down", ffn * hidden, wide),
            ]
        )
    return ModelTensors(name, "qwen3", blocks, _q4_k_m_head(hidden, vocab), 2 * kv_heads * 2 * head_dim)


def qwen3moe_tensors(name: str) -> ModelTensors:
    n_blocks, hidden, heads, kv_heads, head_dim, ffn, experts, used, vocab = QWEN3_MOE_SHAPES[name]
    blocks = []
    for i in range(n_blocks):
        wide = _q4_k_m_wide(i, n_blocks)
        stack = experts * hidden * ffn
        blocks.append(
            [
                *_qwen3_attention(wide, hidden, heads, kv_heads, head_dim),
                Tensor("ffn_gate_inp", experts * hidden, Q.F32),
                Tensor("ffn_gate_exps", stack, Q.Q4_K, routed=True),
                Tensor("ffn_up_exps", stack, Q.Q4_K, routed=True),
                Tensor("ffn_down_exps", stack, wide, routed=True),
            ]
        )
    head = _q4_k_m_head(hidden, vocab)
    return ModelTensors(name, "qwen3moe", blocks, head, 2 * kv_heads * 2 * head_dim, experts, used)


def gpt_oss_tensors(name: str = GPT_OSS_120B) -> ModelTensors:
    n_blocks, hidden, heads, kv_heads, head_dim, ffn, experts, used, vocab = GPT_OSS_SHAPE
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    block = [
        Tensor("attn_norm", hidden, Q.F32),
        Tensor("post_attention_norm", hidden, Q.F32),
        Tensor("attn_q", hidden * q_width, Q.Q8_0),
        Tensor("attn_q.bias", q_width, Q.F32),
        Tensor("attn_k", hidden * kv_width, Q.Q8_0),
        Tensor("attn_k.bias", kv_width, Q.F32),
        Tensor("attn_v", hidden * kv_width, Q.Q8_0),
        Tensor("attn_v.bias", kv_width, Q.F32),
        Tensor("attn_output", q_width * hidden, Q.Q8_0),
        Tensor("attn_output.bias", hidden, Q.F32),
        Tensor("attn_sinks", heads, Q.F32),
        Tensor("ffn_gate_inp", hidden * experts, Q.F32),
        Tensor("ffn_gate_inp.bias", experts, Q.F32),
        Tensor("ffn_gate_exps", experts * hidden * ffn, Q.MXFP4, routed=True),
        Tensor("ffn_gate_exps.bias", experts * ffn, Q.F32, routed=True),
        Tensor("ffn_up_exps", experts * hidden * ffn, Q.MXFP4, routed=True),
        Tensor("ffn_up_exps.bias", experts * ffn, Q.F32, routed=True),
        Tensor("ffn_down_exps", experts * ffn * hidden, Q.MXFP4, routed=True),
        Tensor("ffn_down_exps.bias", experts * hidden, Q.F32, routed=True),
    ]
    head = [
        Tensor("token_embd", vocab * hidden, Q.Q8_0),
        Tensor("output_norm", hidden, Q.F32),
        Tensor("output", vocab * hidden, Q.Q8_0),
    ]
    kv = 2 * kv_heads * 2 * head_dim  # every block full size: llama.cpp's default swa_full
    return ModelTensors(name, "gpt-oss", [block] * n_blocks, head, kv, experts, used)


def deepseek3_tensors(name: str = DEEPSEEK_V3, s: DeepSeekShape = DEEPSEEK_V3_SHAPE) -> ModelTensors:
    qk_head = s.qk_nope + s.qk_rope
    blocks = []
    for i in range(s.blocks):
        wide = _q4_k_m_wide(i, s.blocks)  # for every ffn_down: llama.cpp reads i from the name
        block = [
            Tensor("attn_norm", s.hidden, Q.F32),
            Tensor("attn_q_a_norm", s.q_lora_rank, Q.F32),
            Tensor("attn_kv_a_norm", s.kv_lora_rank, Q.F32),
            Tensor("ffn_norm", s.hidden, Q.F32),
            Tensor("attn_q_a", s.hidden * s.q_lora_rank, Q.Q4_K),
            Tensor("attn_q_b", s.q_lora_rank * s.heads * qk_head, Q.Q4_K),
            Tensor("attn_kv_a_mqa", s.hidden * (s.kv_lora_rank + s.qk_rope), Q.Q4_K),
            Tensor("attn_k_b", s.qk_nope * s.kv_lora_rank * s.heads, Q.Q5_0),  # rows of 128: Q4_K falls back
            Tensor("attn_v_b", s.kv_lora_rank * s.v_head * s.heads, Q.Q4_K),
            Tensor("attn_output", s.heads * s.v_head * s.hidden, Q.Q4_K),
        ]
        if i < s.dense_blocks:
            block += [
                Tensor("ffn_gate", s.hidden * s.ffn, Q.Q4_K),
                Tensor("ffn_up", s.hidden * s.ffn, Q.Q4_K),
                Tensor("ffn_down", s.ffn * s.hidden, wide),
            ]
        else:
            stack, shared = s.experts * s.hidden * s.expert_ffn, s.shared_experts * s.hidden * s.expert_ffn
            block += [
                Tensor("ffn_gate_inp", s.hidden * s.experts, Q.F32),
                Tensor("exp_probs_b.bias", s.experts, Q.F32),
                Tensor("ffn_gate_exps", stack, Q.Q4_K, routed=True),
                Tensor("ffn_up_exps", stack, Q.Q4_K, routed=True),
                Tensor("ffn_down_exps", stack, wide, routed=True),
                Tensor("ffn_gate_shexp", shared, Q.Q4_K),
                Tensor("ffn_up_shexp", shared, Q.Q4_K),
                Tensor("ffn_down_shexp", shared, wide),
            ]
        blocks.append(block)
    kv = 2 * (s.kv_lora_rank + s.qk_rope)  # one K row a token (latent + rotary key); MLA keeps no V cache
    head = _q4_k_m_head(s.hidden, s.vocab)
    return ModelTensors(name, "deepseek2", blocks, head, kv, s.experts, s.experts_used)


MODELS = {
    **dict.fromkeys(QWEN3_SHAPES, qwen3_tensors),
    **dict.fromkeys(QWEN3_MOE_SHAPES, qwen3moe_tensors),
    GPT_OSS_120B: gpt_oss_tensors,
    DEEPSEEK_V3: deepseek3_tensors,
}


def model_tensors(name: str) -> ModelTensors:
    return MODELS[name](name)


def parameters(name: str) -> tuple[int, int]:
    """Total parameters, and those a token uses but the token embedding (a lookup of one row)."""
    model = model_tensors(name)
    total = sum(t.elements for block in model.blocks for t in block) + sum(t.elements for t in model.head)
    active = sum(
        t.elements * model.experts_used // model.experts if t.routed else t.elements
        for block in model.blocks
        for t in block
    ) + sum(t.elements for t in model.head if t.name != "token_embd")
    return total, active


def model_entry(name: str) -> dict:
    """The fleet file's model: per-block bytes (and of them the routed experts'), head and KV bytes."""
    model = model_tensors(name)
    entry = {
        "name": model.name,
        "architecture": model.architecture,
        "n_blocks": len(model.blocks),
        "block_bytes": [sum(t.n_bytes for t in block) for block in model.blocks],
        "head_bytes": sum(t.n_bytes for t in model.head),
        "kv_bytes_per_token_per_block": model.kv_bytes_per_token_per_block,
    }
    if model.experts:
        entry["expert_bytes"] = [sum(t.n_bytes for t in block if t.routed) for block in model.blocks]
        entry["experts"], entry["experts_used"] = model.experts, model.experts_used
    return entry


# name: (bandwidth GB/s, usable memory GiB, overhead us, dense fp16 TFLOPS)
DEVICES = {
    "gaming-pc-4090": (1008.0, 22.0, 40.0, 165.0),
    "desktop-3060": (360.0, 11.0, 45.0, 51.0),
    "lab-h100-3g-slice": (1676.0, 38.0, 35.0, 400.0),
    "institute-a40": (696.0, 46.0, 50.0, 150.0),
    "laptop-m3-pro": (150.0, 13.5, 60.0, 7.4),
    # Large unified or system memory, for a model no GPU of the above holds in a group of five.
    "mac-studio-m3-ultra-256": (819.0, 192.0, 60.0, 28.0),
    "mac-studio-m2-ultra-192": (800.0, 144.0, 60.0, 27.0),
    "dgx-spark-128": (273.0, 96.0, 45.0, 125.0),
    "ryzen-ai-max-395-128": (256.0, 96.0, 50.0, 59.0),
    "threadripper-pro-256": (332.0, 240.0, 80.0, 20.0),  # CPU only: 8 channels of DDR5-5200
}

SMALL_FLEET_MODELS = (*QWEN3_SHAPES, *QWEN3_MOE_SHAPES, GPT_OSS_120B)

# Each fleet: its example model, the models the planner benchmark divides on it, anchor, and per
# device (NAT, rtt to the rendezvous in ms).
FLEETS = {
    "lan": {
        "model": "Qwen3-8B-Q4_K_M",
        "benchmark": SMALL_FLEET_MODELS,
        "anchor": "gaming-pc-4090",
        "members": {
            "gaming-pc-4090": ("ordinary", 21.0),
            "desktop-3060": ("ordinary", 22.0),
            "lab-h100-3g-slice": ("ordinary", 20.5),
            "institute-a40": ("ordinary", 21.5),
            "laptop-m3-pro": ("ordinary", 23.0),
        },
    },
    "one-region": {
        "model": "Qwen3-14B-Q4_K_M",
        "benchmark": SMALL_FLEET_MODELS,
        "anchor": "gaming-pc-4090",
        "members": {
            "gaming-pc-4090": ("ordinary", 38.0),
            "desktop-3060": ("ordinary", 52.0),
            "lab-h100-3g-slice": ("permissive", 24.0),
            "institute-a40": ("permissive", 31.0),
            "laptop-m3-pro": ("restrictive", 61.0),
        },
    },
    "intercontinental": {
        "model": "Qwen3-32B-Q4_K_M",
        "benchmark": SMALL_FLEET_MODELS,
        "anchor": "laptop-m3-pro",
        "members": {
            "gaming-pc-4090": ("ordinary", 95.0),
            "desktop-3060": ("restrictive", 230.0),
            "lab-h100-3g-slice": ("permissive", 79.0),
            "institute-a40": ("ordinary", 180.0),
            "laptop-m3-pro": ("restrictive", 115.0),
        },
    },
    "big-memory": {
        "model": DEEPSEEK_V3,
        "benchmark": (DEEPSEEK_V3,),
        "anchor": "mac-studio-m3-ultra-256",
        "members": {
            "mac-studio-m3-ultra-256": ("ordinary", 22.0),
            "mac-studio-m2-ultra-192": ("ordinary", 23.0),
            "threadripper-pro-256": ("ordinary", 21.0),
            "dgx-spark-128": ("permissive", 29.0),
            "ryzen-ai-max-395-128": ("restrictive", 47.0),
        },
    },
}


def fleet(name: str, model: str | None = None, context: int = 4096, concurrency: int = 4) -> dict:
    spec = FLEETS[name]
    devices = []
    for device, (nat, rtt) in spec["members"].items():
        bandwidth, memory, overhead, tflops = DEVICES[device]
        devices.append(
            {
                "name": device,
                "bandwidth_gb_s": bandwidth,
                "overhead_us": overhead,
                "tflops": tflops,
                "memory_gib": memory,
                "nat": nat,
                "rtt_ms": rtt,
            }
        )
    return {
        "model": model_entry(model or spec["model"]),
        "session": {"context": context, "concurrency": concurrency},
        "anchor": spec["anchor"],
        "devices": devices,
    }


if __name__ == "__main__":
    examples = Path(__file__).resolve().parents[2] / "examples"
    examples.mkdir(exist_ok=True)
    for fleet_name in FLEETS:
        target = examples / f"fleet-{fleet_name}.json"
        target.write_text(json.dumps(fleet(fleet_name), indent=1) + "\n")
        print(f"wrote {target}")
