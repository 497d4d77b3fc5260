"""What Kafila must know about each model family to cut it into stages and embed tokens.

llama.cpp does the maths. The slicer carries every per-layer metadata array over to a slice by
itself (`slicer._Slice`); this table holds only what cannot be read from the file: the transform
llama.cpp applies to token embeddings (and not to embeddings given as input), its default layout
of sliding-window blocks where the file lists none, the settings its code derives from the
block count or a block's absolute index, which a slice changes (`SliceRules`), and where a
setting keyed on the index cannot be carried by a slice, the blocks a stage may start at
(`CutPoints`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGUFValueType


@dataclass(frozen=True)
class SliceView:
    """What a family's rules see of the stage being cut: its place in the source, and the
    source's metadata (`value(key)`: a scalar, a string, a numeric list, or None if absent)."""

    arch: str
    n_blocks: int  # the source's
    first: int
    end: int
    is_head: bool
    value: Callable[[str], Any]

    @property
    def count(self) -> int:
        return self.end - self.first


@dataclass(frozen=True)
class SliceRules:
    """What a slice must carry beyond the source's metadata with per-layer arrays sliced:
    `values`, keys written as given (type and value), over the source's; `tensor_scales`, factors
    applied to the slice's float32 block tensors named by what follows `blk.N.`."""

    values: Mapping[str, tuple[GGUFValueType, Any]] = field(default_factory=dict)
    tensor_scales: Mapping[str, float] = field(default_factory=dict)


def _no_rules(_view: SliceView) -> SliceRules:
    return SliceRules()


@dataclass(frozen=True)
class CutPoints:
    """Where a model may be cut: the blocks a stage other than the first may start at (None: any;
    empty: none, the model runs whole), and why llama.cpp needs that, for the refusal."""

    starts: tuple[int, ...] | None = None
    reason: str = ""


def _anywhere(_n_blocks: int, _value: Callable[[str], Any]) -> CutPoints:
    return CutPoints()


@dataclass(frozen=True)
class Family:
    name: str
    scales_token_embeddings: bool = False  # gemma multiplies token embeddings by sqrt(n_embd)
    sliding_window_period: int | None = None  # llama.cpp's default pattern, unless the file lists the blocks
    unsplittable_block_counts: frozenset[int] = frozenset()  # where no rule can restore what the count keys
    rules: Callable[[SliceView], SliceRules] = _no_rules
    # (the source's block count, its metadata) -> where it may be cut
    cut_points: Callable[[int, Callable[[str], Any]], CutPoints] = _anywhere

    def token_input_scale(self, n_embd: int) -> np.float32 | None:
        """The factor llama.cpp applies to token embeddings only, as the float32 sqrtf it computes."""
        if not self.scales_token_embeddings:
            return None
        return np.sqrt(np.float32(n_embd))

    def sliding_blocks(self, first: int, count: int, period: int) -> list[bool]:
        """Which blocks of a slice use sliding-window attention, by their original index."""
        if period == 0:
            return [True] * count
        return [(first + i) % period < period - 1 for i in range(count)]


def _first(value: Any) -> int:
    """A setting stored as a scalar, or as a per-layer array of which llama.cpp reads entry 0."""
    return int(value[0]) if isinstance(value, list) else int(value)


def gemma_attention_scale(view: SliceView, n_blocks: int, wide_count: int) -> float:
    """The query scale llama.cpp gives a gemma2 or gemma3 model of `n_blocks` blocks: its 27B
    (`wide_count` blocks) scales by 1/sqrt(n_embd / n_head), every other size by 1/sqrt(head_dim)."""
    arch = view.arch
    n_embd, n_head = int(view.value(f"{arch}.embedding_length")), _first(view.value(f"{arch}.attention.head_count"))
    key_length = view.value(f"{arch}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else n_embd // n_head
    return 1.0 / math.sqrt(n_embd // n_head if n_blocks == wide_count else head_dim)


def _gemma3_rules(view: SliceView) -> SliceRules:
    """gemma3 scales its queries after their RMS norm by a factor keyed on the block count (the
    27B's 62); the slice's own count gives another, so its query norm weights absorb the ratio."""
    whole = gemma_attention_scale(view, view.n_blocks, 62)
    sliced = gemma_attention_scale(view, view.count, 62)
    if whole == sliced:
        return SliceRules()
    return SliceRules(tensor_scales={"attn_q_norm.weight": whole / sliced})


LLAMA4_NO_ROPE_STEP = 4  # llama.cpp's default n_no_rope_layer_step, which no llama4 file can set
LLAMA4_CHUNKED_PERIOD = 4  # load_swa_pattern(ml, 4): three chunked blocks, then one of full attention


def _llama4_cut_points(n_blocks: int, value: Callable[[str], Any]) -> CutPoints:
    """llama.cpp decides by a block's index in the file whether it skips RoPE (every 4th) and
    whether its FFN is experts (every interleave_moe_layer_step-th), and no key can list either
    per block: a slice renumbers its blocks from 0, so it must start where both patterns restart.
    A file whose blocks are all chunked makes llama.cpp abort, so the last stage keeps a block of
    full attention. With attention.sliding_window = 0, llama.cpp skips RoPE in the last block of
    the file (n_no_rope_layer_step = n_layer): every slice would skip it in its own last block."""
    if value("llama4.attention.sliding_window") == 0:
        return CutPoints((), "with attention.sliding_window = 0 llama.cpp skips RoPE in the last block of each file")
    moe_step = int(value("llama4.interleave_moe_layer_step") or 0)
    step = math.lcm(LLAMA4_NO_ROPE_STEP, LLAMA4_CHUNKED_PERIOD, max(1, moe_step))
    starts = tuple(range(step, n_blocks - LLAMA4_CHUNKED_PERIOD + 1, step))
    experts = f", and its experts where (i + 1) % {moe_step} == 0" if moe_step > 1 else ""
    reason = (
        f"llama.cpp skips RoPE in block i where (i + 1) % {LLAMA4_NO_ROPE_STEP} == 0{experts}, i counted in the "
        f"file, so stages start at multiples of {step}; and the last stage needs a block of full attention, "
        f"which only every {LLAMA4_CHUNKED_PERIOD}th block is"
    )
    return CutPoints(starts, reason)


FAMILIES = {
    family.name: family
    for family in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),
        Family("qwen3moe"),  # its experts are tensors of their block: a slice carries them whole
        Family("gemma3", scales_token_embeddings=True, sliding_window_period=6, rules=_gemma3_rules),
        Family("llama4", cut_points=_llama4_cut_points),
    )
}


class UnsupportedFamily(ValueError):
    def __init__(self, architecture: str) -> None:
        super().__init__(
            f"model family '{architecture}' is not supported for splitting; supported: {', '.join(sorted(FAMILIES))}"
        )


def family_of(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise UnsupportedFamily(architecture) from None
