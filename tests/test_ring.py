"""Ring order: exact over subsets, equal to brute force, file order kept on ties."""

from __future__ import annotations

import numpy as np
from brute import best_ring_key
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.contracts import NatBehaviour, NatClass
from kafila.planner import plan_session
from kafila.planner.ring import best_ring, ring_key
from kafila.planner.types import Device, EdgePrediction, ModelManifest, ServingSpec


@st.composite
def symmetric_weights(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    m = draw(st.integers(2, 8))
    weights = np.zeros((m, m), dtype=np.int64)
    for i in range(m):
        for j in range(i + 1, m):
            weights[i, j] = weights[j, i] = draw(st.integers(0, 50))
    return weights, draw(st.integers(0, m - 1))


@settings(max_examples=200, deadline=None)
@given(instance=symmetric_weights())
def test_ring_search_equals_brute_force(instance: tuple[np.ndarray, int]) -> None:
    weights, anchor = instance
    found = best_ring(weights, anchor)
    assert found.order[0] == anchor
    assert sorted(found.order) == list(range(len(weights)))
    assert found.key == ring_key(found.order, weights) == best_ring_key(weights.tolist(), anchor)
    assert found.search.value == "exact"


@settings(max_examples=40, deadline=None)
@given(instance=symmetric_weights())
def test_heuristic_returns_a_valid_ring_no_worse_than_the_listed_order(instance: tuple[np.ndarray, int]) -> None:
    weights, anchor = instance
    found = best_ring(weights, anchor, exact_limit=1)
    given_order = (anchor, *[i for i in range(len(weights)) if i != anchor])
    assert found.order[0] == anchor and sorted(found.order) == list(range(len(weights)))
    assert found.key == ring_key(found.order, weights) <= ring_key(given_order, weights)
    assert found.search.value == "heuristic" or len(weights) <= 3


def test_exact_search_at_sixteen_members_matches_known_optimum() -> None:
    """Points on a line: the cheapest ring visits them in order out and back, cost 2 * span."""
    rng = np.random.default_rng(7)
    positions = rng.permutation(16) * 10
    weights = np.abs(positions[:, None] - positions[None, :]).astype(np.int64)
    found = best_ring(weights, anchor=3)
    assert found.search.value == "exact"
    assert found.key == 2 * (positions.max() - positions.min())


def _manifest(n_blocks: int = 12) -> ModelManifest:
    return ModelManifest(name="m", block_bytes=(10,) * n_blocks, head_bytes=10, kv_bytes_per_token=(0,) * n_blocks)


def _member(name: str, nat: NatClass | None = None, rtt_ms: float | None = None) -> Device:
    return Device(
        name=name,
        memory_bytes=10**9,
        bandwidth_bytes_per_s=1e9,
        overhead_s=1e-5,
        nat=NatBehaviour.from_class(nat) if nat else None,
        rtt_s=rtt_ms / 1e3 if rtt_ms is not None else None,
    )


def test_without_nat_or_rtt_the_file_order_is_kept() -> None:
    fleet = [_member(f"m{i}") for i in range(6)]
    plan = plan_session(_manifest(), fleet, ServingSpec(), anchor="m0")
    assert plan.ring == tuple(f"m{i}" for i in range(6))
    assert all(edge.cost_s is None for edge in plan.edges)


def test_restrictive_members_are_separated_by_permissive_ones() -> None:
    names = ["anchor", "r1", "r2", "p1", "p2"]
    classes = [
        NatClass.PERMISSIVE,
        NatClass.RESTRICTIVE,
        NatClass.RESTRICTIVE,
        NatClass.PERMISSIVE,
        NatClass.PERMISSIVE,
    ]
    fleet = [_member(n, c) for n, c in zip(names, classes, strict=True)]
    plan = plan_session(_manifest(), fleet, ServingSpec(), anchor="anchor")
    relayed = [e for e in plan.edges if e.predicted is EdgePrediction.RELAYED]
    assert relayed == []  # an all-direct ring exists: permissive members are at least as many
    order = list(plan.ring)
    for i, name in enumerate(order):
        if name.startswith("r"):
            neighbours = {order[i - 1], order[(i + 1) % len(order)]}
            assert neighbours <= {"anchor", "p1", "p2"}


def test_the_fewest_relays_when_a_direct_ring_is_impossible() -> None:
    names = ["anchor", "r1", "r2", "p1", "p2"]
    classes = [NatClass.ORDINARY, NatClass.RESTRICTIVE, NatClass.RESTRICTIVE, NatClass.PERMISSIVE, NatClass.PERMISSIVE]
    plan = plan_session(
        _manifest(), [_member(n, c) for n, c in zip(names, classes, strict=True)], ServingSpec(), anchor="anchor"
    )
    assert sum(e.predicted is EdgePrediction.RELAYED for e in plan.edges) == 1


def test_rtt_priced_ring_prefers_direct_edges_and_breaks_all_relayed_ties_by_separation() -> None:
    # Every member restrictive: every edge relays and every order costs 2 * sum(rtt). The
    # tie-break puts members of similar distance to the rendezvous next to each other.
    rtts = {"anchor": 80.0, "far1": 230.0, "near1": 82.0, "far2": 228.0, "near2": 85.0}
    fleet = [_member(n, NatClass.RESTRICTIVE, r) for n, r in rtts.items()]
    plan = plan_session(_manifest(), fleet, ServingSpec(), anchor="anchor")
    assert all(e.predicted is EdgePrediction.RELAYED for e in plan.edges)
    total = sum(e.cost_s for e in plan.edges if e.cost_s is not None)
    assert abs(total - 2 * sum(rtts.values()) / 1e3) < 1e-9
    order = list(plan.ring)
    start = order.index("anchor")
    order = order[start:] + order[:start]
    positions = {name: i for i, name in enumerate(order)}
    assert abs(positions["far1"] - positions["far2"]) == 1
    separation = sum(abs(rtts[order[i]] - rtts[order[(i + 1) % 5]]) for i in range(5))
    assert separation == 2 * (230.0 - 80.0)
