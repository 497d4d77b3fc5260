"""Fleets and model manifests modelled on the paper's evaluation, from published figures.

Devices: memory bandwidth and memory from vendor data sheets (GB/s, GiB). Usable memory is
what a model may occupy: the laptop keeps about a quarter of its unified memory for the OS.
Per-token overheads are round figures of the order llama.cpp shows on such hardware; the
planner's comparison does not hinge on them.

Models: Qwen3-8B, 14B and 32B, and the mixture of experts Qwen3-30B-A3B, at Q4_K_M, sized
tensor by tensor from the published shapes (config.json) and llama.cpp's Q4_K_M type rules:
Q6_K for attn_v and ffn_down (ffn_down_exps too) in the first and last eighth of the blocks and
every third block between, Q4_K elsewhere, Q6_K output, Q4_K token embedding, f32 norms and
f32 expert routers (llama.cpp never quantizes ffn_gate_inp).

Run `python scripts/fleets.py` to rewrite the example fleets in examples/.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _bytes(qtype: Q, n_elements: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n_elements // block * size


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _attention_and_norms(wide: Q, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return (
        _bytes(Q.Q4_K, hidden * heads * head_dim)  # attn_q
        + _bytes(Q.Q4_K, hidden * kv_heads * head_dim)  # attn_k
        + _bytes(wide, hidden * kv_heads * head_dim)  # attn_v
        + _bytes(Q.Q4_K, heads * head_dim * hidden)  # attn_output
        + 4 * (2 * hidden + 2 * head_dim)  # attn_norm, ffn_norm, q_norm, k_norm (f32)
    )


def _ffn(wide: Q, hidden: int, ffn: int) -> int:
    return 2 * _bytes(Q.Q4_K, hidden * ffn) + _bytes(wide, ffn * hidden)  # gate, up, down


def _qwen3_entry(name: str, architecture: str, n_blocks: int, hidden: int, kv_heads: int, head_dim: int,
                 vocab: int, blocks: list[int]) -> dict:  # fmt: skip
    return {
        "name": name,
        "architecture": architecture,
        "n_blocks": n_blocks,
        "block_bytes": blocks,
        "head_bytes": _bytes(Q.Q4_K, vocab * hidden) + _bytes(Q.Q6_K, vocab * hidden) + 4 * hidden,
        "kv_bytes_per_token_per_block": 2 * kv_heads * 2 * head_dim,
    }


def qwen3_model(name: str) -> dict:
    n_blocks, hidden, heads, kv_heads, head_dim, ffn, vocab = QWEN3_SHAPES[name]
    blocks = []
    for i in range(n_blocks):
        wide = Q.Q6_K if _more_bits(i, n_blocks) else Q.Q4_K
        blocks.append(_attention_and_norms(wide, hidden, heads, kv_heads, head_dim) + _ffn(wide, hidden, ffn))
    return _qwen3_entry(name, "qwen3", n_blocks, hidden, kv_heads, head_dim, vocab, blocks)


def qwen3moe_model(name: str) -> dict:
    n_blocks, hidden, heads, kv_heads, head_dim, ffn, experts, used, vocab = QWEN3_MOE_SHAPES[name]
    blocks, expert_bytes = [], []
    for i in range(n_blocks):
        wide = Q.Q6_K if _more_bits(i, n_blocks) else Q.Q4_K
        router = 4 * experts * hidden  # ffn_gate_inp (f32)
        stacked = experts * _ffn(wide, hidden, ffn)  # ffn_gate_exps, ffn_up_exps, ffn_down_exps
        blocks.append(_attention_and_norms(wide, hidden, heads, kv_heads, head_dim) + router + stacked)
        expert_bytes.append(stacked)
    entry = _qwen3_entry(name, "qwen3moe", n_blocks, hidden, kv_heads, head_dim, vocab, blocks)
    return {**entry, "expert_bytes": expert_bytes, "experts": experts, "experts_used": used}


def model_entry(name: str) -> dict:
    return qwen3moe_model(name) if name in QWEN3_MOE_SHAPES else qwen3_model(name)


# name: (bandwidth GB/s, usable memory GiB, overhead us, dense fp16 TFLOPS)
DEVICES = {
    "gaming-pc-4090": (1008.0, 22.0, 40.0, 165.0),
    "desktop-3060": (360.0, 11.0, 45.0, 51.0),
    "lab-h100-3g-slice": (1676.0, 38.0, 35.0, 400.0),
    "institute-a40": (696.0, 46.0, 50.0, 150.0),
    "laptop-m3-pro": (150.0, 13.5, 60.0, 7.4),
}

# Each fleet: anchor, session, and per device (NAT, rtt to the rendezvous in ms).
FLEETS = {
    "lan": {
        "model": "Qwen3-8B-Q4_K_M",
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
        "anchor": "laptop-m3-pro",
        "members": {
            "gaming-pc-4090": ("ordinary", 95.0),
            "desktop-3060": ("restrictive", 230.0),
            "lab-h100-3g-slice": ("permissive", 79.0),
            "institute-a40": ("ordinary", 180.0),
            "laptop-m3-pro": ("restrictive", 115.0),
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
    examples = Path(__file__).resolve().parent.parent / "examples"
    examples.mkdir(exist_ok=True)
    for fleet_name in FLEETS:
        target = examples / f"fleet-{fleet_name}.json"
        target.write_text(json.dumps(fleet(fleet_name), indent=1) + "\n")
        print(f"wrote {target}")
