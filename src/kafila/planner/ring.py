"""Exact ring ordering by dynamic programming over subsets (Held-Karp), with the anchor fixed.

Edge weights are integers so that ties are real ties: a ring's key is its total cost first and
a tie-breaking term second, packed into one int64 as cost * scale + tie. Enumerating the
(m-1)! orders is hopeless past ten members; the subset table has 2^(m-1) * (m-1) cells, and
each layer of it is filled with a few array operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kafila.planner.types import RingSearch

EXACT_LIMIT = 16  # members; 2^15 x 15 cells, well under a second even on a slow machine
IntMatrix = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RingOrder:
    order: tuple[int, ...]  # indices into the member list, anchor first
    key: int
    search: RingSearch


def ring_key(order: Sequence[int], weights: IntMatrix) -> int:
    return sum(int(weights[order[i], order[(i + 1) % len(order)]]) for i in range(len(order)))


def combine(primary: IntMatrix, tie_break: IntMatrix | None) -> IntMatrix:
    """Pack two integer objectives into one whose order is lexicographic."""
    if tie_break is None:
        return primary
    scale = int(tie_break.max()) * len(tie_break) + 1
    return primary * scale + tie_break


def _held_karp(weights: IntMatrix, anchor: int) -> tuple[tuple[int, ...], int]:
    others = [i for i in range(len(weights)) if i != anchor]
    n = len(others)
    w = weights[np.ix_(others, others)]
    from_anchor = weights[anchor, others]
    to_anchor = weights[others, anchor]
    size = 1 << n
    unreachable = np.iinfo(np.int64).max // 4
    best = np.full((size, n), unreachable, dtype=np.int64)
    parent = np.full((size, n), -1, dtype=np.int16)
    for j in range(n):
        best[1 << j, j] = from_anchor[j]
    subsets = np.arange(size)
    popcount = np.zeros(size, dtype=np.int64)
    for j in range(n):
        popcount += (subsets >> j) & 1
    for layer in range(2, n + 1):
        layer_sets = subsets[popcount == layer]
        for j in range(n):
            with_j = layer_sets[(layer_sets >> j) & 1 == 1]
            previous = best[with_j ^ (1 << j)] + w[:, j][None, :]
            choice = np.argmin(previous, axis=1)
            best[with_j, j] = previous[np.arange(len(with_j)), choice]
            parent[with_j, j] = choice
    full = size - 1
    closing = best[full] + to_anchor
    last = int(np.argmin(closing))
    key = int(closing[last])
    path = []
    subset = full
    while last != -1:
        path.append(others[last])
        previous_last = int(parent[subset, last])
        subset ^= 1 << last
        last = previous_last
    return (anchor, *reversed(path)), key


def _local_search(weights: IntMatrix, anchor: int, start: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """2-opt from the given order until no reversal of a stretch lowers the key."""
    order = list(start)
    key = ring_key(order, weights)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(order) - 1):
            for j in range(i + 1, len(order)):
                candidate = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                candidate_key = ring_key(candidate, weights)
                if candidate_key < key:
                    order, key, improved = candidate, candidate_key, True
    return tuple(order), key


def _nearest_neighbour(weights: IntMatrix, anchor: int) -> list[int]:
    order = [anchor]
    left = set(range(len(weights))) - {anchor}
    while left:
        nearest = min(sorted(left), key=lambda j: weights[order[-1], j])
        order.append(nearest)
        left.remove(nearest)
    return order


def best_ring(weights: IntMatrix, anchor: int, exact_limit: int = EXACT_LIMIT) -> RingOrder:
    """The cheapest ring starting at the anchor; the listed order wins every tie.

    Keeping the given order when nothing beats it means a fleet without NAT or RTT data is
    served in the order its owner wrote down.
    """
    m = len(weights)
    given = (anchor, *[i for i in range(m) if i != anchor])
    given_key = ring_key(given, weights)
    if m <= 3:  # every ring of three or fewer members is the same cycle
        return RingOrder(order=given, key=given_key, search=RingSearch.EXACT)
    if m <= exact_limit:
        order, key = _held_karp(weights, anchor)
        search = RingSearch.EXACT
    else:
        order, key = min(
            _local_search(weights, anchor, list(given)),
            _local_search(weights, anchor, _nearest_neighbour(weights, anchor)),
            key=lambda found: found[1],
        )
        search = RingSearch.HEURISTIC
    if given_key <= key:
        return RingOrder(order=given, key=given_key, search=search)
    return RingOrder(order=order, key=key, search=search)
