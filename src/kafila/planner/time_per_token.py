"""Time per token at a load, and the division of a fixed chain that minimises it.

A ring of stages with prices c_i (cost.py prices a row) and a round trip L around it (each edge
crossed once, one way: half its round trip) serves c sequences at once. A pass of the ring gives
each of them one token, and no stage takes rows faster than its price allows, so

    t_c = max(max_i c_i, (sum_i c_i + L) / c)

One user pays the whole pass; many users pay the slowest stage. The bottleneck search of
partition.py minimises the first term alone; here both count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from kafila.planner.cost import FloatMatrix
from kafila.planner.partition import Division, balanced_division, candidate_bottlenecks, least_sum_division

TIE_TOLERANCE = 1e-9  # relative: divisions this close in time per token differ by rounding alone


def time_per_token_s(stage_costs: Sequence[float], ring_round_trip_s: float, concurrency: int) -> float:
    """t_c for stages of these prices on a ring of this round trip (one way round)."""
    return max(*stage_costs, (sum(stage_costs) + ring_round_trip_s) / concurrency)


@dataclass(frozen=True)
class TimedDivision:
    division: Division
    time_per_token_s: float


def _least_sum(matrices: Sequence[FloatMatrix], bound: float) -> tuple[float, tuple[int, ...]] | None:
    """The division with the least total price among those whose every stage is within `bound`."""
    return least_sum_division([np.where(matrix <= bound, matrix, np.inf) for matrix in matrices])


def _timed(matrices: Sequence[FloatMatrix], bounds: tuple[int, ...], round_trip_s: float, c: int) -> TimedDivision:
    costs = [float(matrix[a, b]) for matrix, (a, b) in zip(matrices, pairwise(bounds), strict=True)]
    return TimedDivision(Division(bottleneck=max(costs), bounds=bounds), time_per_token_s(costs, round_trip_s, c))


def fastest_division(
    matrices: Sequence[FloatMatrix],
    ring_round_trip_s: float,
    concurrency: int,
    below: float = np.inf,
    candidates: npt.NDArray[np.float64] | None = None,
) -> TimedDivision | None:
    """The division of least t_c on this chain (None if none fits, or none is faster than `below`);
    among near-equals (TIE_TOLERANCE) the one of least bottleneck, and then the most even, as
    partition.py breaks its ties. `candidates`, sorted, may be any superset of the values a
    bottleneck can take (one set shared by every chain of a fleet saves sorting each).

    For a bound B on every stage, S(B) is the least total price: t_c is at best max(B, (S(B)+L)/c).
    B grows while S(B) falls, so the best B is where they cross, found by binary search over the
    values a bottleneck can take, a least-sum dynamic programme per step.
    """
    n_blocks = matrices[0].shape[0] - 1
    c, trip = concurrency, ring_round_trip_s
    if len(matrices) > n_blocks:
        return None
    if below < np.inf:  # one test: a division faster than `below` has its stages and its pass within it
        under = _least_sum(matrices, below)
        if under is None or (under[0] + trip) / c >= below:
            return None
    values = np.unique(candidate_bottlenecks(matrices)) if candidates is None else candidates
    if len(values) == 0:
        return None
    sums: dict[int, tuple[float, tuple[int, ...]] | None] = {}

    def least(i: int) -> tuple[float, tuple[int, ...]] | None:
        if i not in sums:
            sums[i] = _least_sum(matrices, float(values[i]))
        return sums[i]

    def first(predicate: Callable[[int], bool]) -> int:
        low, high = 0, len(values)
        while low < high:
            middle = (low + high) // 2
            if predicate(middle):
                high = middle
            else:
                low = middle + 1
        return low

    def crossed(i: int) -> bool:
        found = least(i)
        return found is not None and values[i] >= (found[0] + trip) / c

    crossing = first(crossed)
    found = [least(i) for i in (crossing - 1, crossing) if 0 <= i < len(values)]
    timed = [_timed(matrices, bounds, trip, c) for _, bounds in filter(None, found)]
    if not timed:
        return None
    best = min(t.time_per_token_s for t in timed)
    budget = c * best * (1 + TIE_TOLERANCE) - trip

    def within(i: int) -> bool:
        found = least(i)
        return found is not None and found[0] <= budget

    tightest = first(within)
    least_found = least(tightest)
    assert least_found is not None  # the best division's own bottleneck is one such bound
    even = balanced_division(matrices, float(values[tightest]))
    even_timed = _timed(matrices, even, trip, c)
    if even_timed.time_per_token_s <= best * (1 + TIE_TOLERANCE):
        return even_timed
    return _timed(matrices, least_found[1], trip, c)
