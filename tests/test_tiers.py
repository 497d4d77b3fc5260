"""The planner degrades through three tiers as measurements go missing, and says which ran."""

from __future__ import annotations

import itertools

import pytest

from kafila.planner import PlanRefused, Tier, plan_session
from kafila.planner.types import Device, ModelManifest, ServingSpec

MANIFEST = ModelManifest(
    name="m", block_bytes=(100, 300, 100, 200, 100, 100), head_bytes=250, kv_bytes_per_token=(1,) * 6
)
SESSION = ServingSpec(context=10, concurrency=1)


def test_cost_model_when_every_member_measured_bandwidth_and_overhead() -> None:
    fleet = [Device(name=f"d{i}", memory_bytes=5000, bandwidth_bytes_per_s=100.0, overhead_s=0.0) for i in range(3)]
    assert plan_session(MANIFEST, fleet, SESSION).tier is Tier.COST_MODEL


def test_throughput_tier_divides_by_flops_and_keeps_the_head_at_the_anchor() -> None:
    fleet = [
        Device(name="anchor", memory_bytes=5000, flops=1.0),  # slow: would not be head on cost
        Device(name="fast", memory_bytes=5000, flops=4.0, bandwidth_bytes_per_s=1e3, overhead_s=0.0),
        Device(name="mid", memory_bytes=5000, flops=2.0),
    ]
    plan = plan_session(MANIFEST, fleet, SESSION, anchor="anchor")
    assert plan.tier is Tier.THROUGHPUT
    assert plan.head == "anchor"
    # Brute force over the fixed chain fast -> mid -> anchor, pricing bytes / flops, no head term.
    flops = [4.0, 2.0, 1.0]
    best = min(
        max(sum(MANIFEST.block_bytes[a:b]) / f for f, (a, b) in zip(flops, [(0, i), (i, j), (j, 6)], strict=True))
        for i, j in itertools.combinations(range(1, 6), 2)
    )
    assert plan.bottleneck_s == best
    assert plan.baselines["uniform"].bottleneck_s is not None
    assert plan.baselines["uniform"].bottleneck_s >= best


def test_memory_tier_balances_memory_and_reports_no_times() -> None:
    fleet = [
        Device(name="big", memory_bytes=4000, bandwidth_bytes_per_s=1e3),  # no overhead: not tier (a)
        Device(name="small", memory_bytes=1000),
    ]
    plan = plan_session(MANIFEST, fleet, SESSION, anchor="big")
    assert plan.tier is Tier.MEMORY
    assert plan.bottleneck_s is None and plan.utilisation is None
    assert all(stage.cost_s is None for stage in plan.stages)
    fills = {s.device: s.resident_bytes / s.memory_bytes for s in plan.stages}
    assert max(fills.values()) <= 1
    # The small member gets the share closest to its quarter of the memory.
    assert plan.stages[0].device == "small" and plan.stages[0].end - plan.stages[0].start in (1, 2)
    assert plan.baselines["memory"].bottleneck_s is None


def test_memory_tier_refuses_when_nothing_fits() -> None:
    fleet = [Device(name="a", memory_bytes=600), Device(name="b", memory_bytes=600)]
    with pytest.raises(PlanRefused) as refused:
        plan_session(MANIFEST, fleet, SESSION)
    assert refused.value.device in {"a", "b"}
    assert refused.value.shortfall_bytes is not None and refused.value.shortfall_bytes > 0
