"""Rule-of-thumb divisions (uniform, memory-proportional) and how any division performs."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from kafila.planner.cost import FloatMatrix
from kafila.planner.partition import division_from_counts
from kafila.planner.types import DivisionSummary


def proportional_division(weights: Sequence[float], positions: Sequence[int]) -> tuple[int, ...]:
    """Block counts proportional to the weights where stages may only begin and end at `positions`
    (ascending, from 0 to the block count): the groups between them are divided by largest
    remainder, at least one each, as blocks are when every boundary is allowed."""
    groups = [b - a for a, b in pairwise(positions)]
    shares = _proportional(weights, len(groups))
    bounds = [0, *np.cumsum(shares).tolist()]
    return tuple(sum(groups[a:b]) for a, b in pairwise(bounds))


def _proportional(weights: Sequence[float], n_parts: int) -> tuple[int, ...]:
    """Counts summing to n_parts, proportional to the weights, at least one each, by largest remainder."""
    m = len(weights)
    if m > n_parts:
        raise ValueError(f"{n_parts} parts cannot give each of {m} devices one")
    total = float(sum(weights))
    exact = [n_parts * w / total for w in weights]
    counts = [max(1, int(share)) for share in exact]
    while sum(counts) < n_parts:
        lagging = max(range(m), key=lambda i: (exact[i] - counts[i], -i))
        counts[lagging] += 1
    while sum(counts) > n_parts:
        over = max((i for i in range(m) if counts[i] > 1), key=lambda i: (counts[i] - exact[i], i))
        counts[over] -= 1
    return tuple(counts)


def summarise(
    counts: Sequence[int],
    cost_matrices: Sequence[FloatMatrix] | None,
    fits_matrices: Sequence[np.ndarray],
) -> DivisionSummary:
    """Bottleneck, utilisation (mean stage / bottleneck) and whether every share fits."""
    spans = list(pairwise(division_from_counts(counts)))
    fits = all(bool(mask[a, b]) for mask, (a, b) in zip(fits_matrices, spans, strict=True))
    if cost_matrices is None:
        return DivisionSummary(counts=tuple(counts), bottleneck_s=None, utilisation=None, fits=fits)
    stage_costs = [float(matrix[a, b]) for matrix, (a, b) in zip(cost_matrices, spans, strict=True)]
    bottleneck = max(stage_costs)
    utilisation = sum(stage_costs) / len(stage_costs) / bottleneck if bottleneck > 0 else 1.0
    return DivisionSummary(counts=tuple(counts), bottleneck_s=bottleneck, utilisation=utilisation, fits=fits)
