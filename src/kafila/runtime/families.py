"""What Kafila must know about each model family to cut it into stages and embed tokens.

llama.cpp does the maths; these are the few facts it applies only when it owns the whole model:
the transform it applies to token embeddings (and not to embeddings given as input), and the
per-layer settings it derives from a block's absolute index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Family:
    name: str
    scales_token_embeddings: bool = False  # gemma multiplies token embeddings by sqrt(n_embd)
    sliding_window_period: int | None = None  # every n-th block global, unless the file lists them
    unsplittable_block_counts: frozenset[int] = frozenset()  # where llama.cpp keys settings on the count

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


FAMILIES = {
    family.name: family
    for family in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),
        Family("qwen3moe"),  # its experts are tensors of their block: a slice carries them whole
        # gemma3 27B (62 blocks) takes its attention scale from its block count, which a slice changes.
        Family(
            "gemma3", scales_token_embeddings=True, sliding_window_period=6, unsplittable_block_counts=frozenset({62})
        ),
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
