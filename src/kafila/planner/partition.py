"""Exact chain-on-chain partition: the minimum bottleneck over contiguous block ranges.

This is the paper's Algorithm 1 generalised to blocks of unequal size. The paper's one-pass
greedy feasibility test is optimal only when every block weighs the same: with unequal blocks,
a device that greedily takes one more block can leave a heavy block to a device that cannot
hold it. The test here instead tracks every chain position each prefix of devices can reach
within the bound, which is exact for any block sizes and still polynomial.

Each device's prices come as a matrix whose entry [a, b] is its cost for blocks [a, b), or
infinity where it may not hold that range. The bottleneck of any division is one of those
entries, so the search binary-searches their sorted values for the smallest feasible one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt

FloatMatrix = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Division:
    bottleneck: float
    bounds: tuple[int, ...]  # m + 1 chain positions: device j holds blocks [bounds[j], bounds[j+1])

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each device's blocks, in chain order."""
        return list(pairwise(self.bounds))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.spans)


def candidate_bottlenecks(cost_matrices: Sequence[FloatMatrix]) -> npt.NDArray[np.float64]:
    """Every value a bottleneck can take, sorted: one per (device, range) that is allowed.

    Repeated values are harmless to the binary search, so they are not removed.
    """
    finite = [matrix[np.isfinite(matrix)] for matrix in cost_matrices]
    if not finite:
        return np.empty(0)
    return np.sort(np.concatenate(finite))


def _reachable(cost_matrices: Sequence[FloatMatrix], bound: float) -> list[npt.NDArray[np.bool_]] | None:
    """Chain positions reachable after each device, or None if the whole chain is not."""
    n_positions = cost_matrices[0].shape[0]
    reach: npt.NDArray[np.bool_] = np.zeros(n_positions, dtype=bool)
    reach[0] = True
    history = [reach]
    for matrix in cost_matrices:
        reach = np.any(matrix[reach] <= bound, axis=0)
        if not reach.any():
            return None
        history.append(reach)
    return history if reach[-1] else None


def balanced_division(cost_matrices: Sequence[FloatMatrix], bound: float) -> tuple[int, ...]:
    """Among the divisions within `bound`, the one whose stage costs are most even.

    Many divisions share the smallest bottleneck: when one stage (often the head) sets it, the
    others may take any blocks that keep them under it, and a division that piles them on one
    device and leaves its neighbour one block is as good on paper as an even one. It is worse in
    fact: a prediction that is off (the cost model's are, by a few per cent with a model's own
    pricing, by more with the generic probe's) turns the piled-up stage into the bottleneck. So
    the ties are broken by the smallest sum of squared stage costs, a dynamic programme over the
    same prices.
    """
    scale = bound if 0 < bound < np.inf else 1.0  # costs in units of the bound: squares stay finite
    with np.errstate(invalid="ignore", over="ignore"):
        squared = [np.where(matrix <= bound, (matrix / scale) ** 2, np.inf) for matrix in cost_matrices]
    found = least_sum_division(squared)
    assert found is not None  # `bound` is feasible, so some division keeps every stage within it
    return found[1]


def least_sum_division(prices: Sequence[FloatMatrix]) -> tuple[float, tuple[int, ...]] | None:
    """The division whose stages' prices sum least, with that sum: `prices` one matrix a device in
    chain order, [a, b] its price for blocks [a, b), infinity where it may not hold them. A dynamic
    programme over chain positions; None where every division has an infinite price."""
    n_positions = prices[0].shape[0]
    best = np.full(n_positions, np.inf)
    best[0] = 0.0
    choices = []
    for matrix in prices:
        totals = best[:, None] + matrix
        choices.append(np.argmin(totals, axis=0))
        best = totals[choices[-1], np.arange(n_positions)]
    if not np.isfinite(best[-1]):
        return None
    end = n_positions - 1
    bounds = [end]
    for chosen in reversed(choices):
        end = int(chosen[end])
        bounds.append(end)
    return float(best[-1]), tuple(reversed(bounds))


def partition(
    cost_matrices: Sequence[FloatMatrix],
    candidates: npt.NDArray[np.float64] | None = None,
    below: float = np.inf,
) -> Division | None:
    """The division with the smallest bottleneck, or None when none exists (under `below`).

    `candidates` may be any sorted superset of the true candidate values (a planner comparing
    several device orders passes one shared set); `below` limits the search to bottlenecks
    strictly smaller than it, so a caller that only wants an improvement pays one test.
    """
    if not cost_matrices:
        raise ValueError("a partition needs at least one device")
    n_blocks = cost_matrices[0].shape[0] - 1
    if len(cost_matrices) > n_blocks:
        return None
    values = candidate_bottlenecks(cost_matrices) if candidates is None else candidates
    values = values[: int(np.searchsorted(values, below, side="left"))]
    if len(values) == 0 or _reachable(cost_matrices, float(values[-1])) is None:
        return None
    low, high = 0, len(values) - 1  # values[high] is feasible; find the first feasible index
    while low < high:
        middle = (low + high) // 2
        if _reachable(cost_matrices, float(values[middle])) is None:
            low = middle + 1
        else:
            high = middle
    bound = float(values[high])
    bounds = balanced_division(cost_matrices, bound)
    division = Division(bottleneck=bound, bounds=bounds)
    achieved = max(float(matrix[a, b]) for matrix, (a, b) in zip(cost_matrices, division.spans, strict=True))
    assert achieved == bound  # the bound is the smallest feasible candidate, so some stage meets it
    return division


def division_from_counts(counts: Sequence[int]) -> tuple[int, ...]:
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return tuple(bounds)
