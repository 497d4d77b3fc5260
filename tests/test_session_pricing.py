"""The host's pricing of its machines, pure: which price each machine plans with, what a served
ring teaches, when an idle ring is divided again. No link, process or model file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.contracts import FleetDevice, ModelPricing, StageReport
from kafila.planner import ModelManifest, ServingSpec
from kafila.session.pricing import (
    GENERIC,
    MIN_STEPS_TO_REBALANCE,
    MIN_STEPS_TO_REPRICE,
    SERVING,
    THE_MODEL,
    Machine,
    PlannedRing,
    RingPricing,
)

DIGEST = "ab" * 32
MANIFEST = ModelManifest(name="m", block_bytes=(100_000_000,) * 12, head_bytes=50_000_000, kv_bytes_per_token=(0,) * 12)
SESSION = ServingSpec(context=1024, concurrency=4)  # where the slowest stage sets the time per token


def device(name: str, bandwidth: float) -> FleetDevice:
    return FleetDevice(name=name, memory_gib=64, bandwidth_gb_s=bandwidth, overhead_us=100.0)


def own(bandwidth: float, sha: str = DIGEST) -> ModelPricing:
    return ModelPricing(model_sha256=sha, bandwidth_gb_s=bandwidth, head_bandwidth_gb_s=bandwidth, overhead_us=50.0)


MACHINES = {
    "h": Machine("host", device("host", 20.0), (own(25.0),)),  # priced this model itself
    "a": Machine("pc", device("pc", 20.0), (own(30.0, sha="cd" * 32),)),  # priced another model only
    "b": Machine("laptop", device("laptop", 20.0)),
}


def prices() -> RingPricing:
    return RingPricing(MANIFEST, SESSION, model_sha256=DIGEST)


def served_ring(pricing: RingPricing) -> PlannedRing:
    plan = pricing.plan(MACHINES, ["h", "a", "b"])
    chain = tuple({"host": "h", "pc": "a", "laptop": "b"}[stage.device] for stage in plan.stages)
    return PlannedRing(chain, plan)


def reports(ring: PlannedRing, scale: dict[str, float], steps: int) -> list[StageReport]:
    """Each stage measured at `scale` times its predicted cost, after `steps` decodes alone."""
    return [
        StageReport(
            range=(stage.start, stage.end),
            ms_per_token_alone=(stage.cost_s or 0) * 1e3 * scale.get(member, 1.0),
            steps_alone=steps,
        )
        for member, stage in zip(ring.chain, ring.plan.stages, strict=True)
    ]


def test_each_machine_is_priced_by_the_best_it_has() -> None:
    pricing = prices()
    assert pricing.pricing(MACHINES, "h") == own(25.0)  # its own pricing of this model
    assert pricing.pricing(MACHINES, "a") is None  # another model's pricing says nothing of this one
    assert [pricing.priced_on(MACHINES, m) for m in ("h", "a", "b")] == [THE_MODEL, GENERIC, GENERIC]
    served = own(5.0)
    pricing.served["a"] = served
    assert pricing.pricing(MACHINES, "a") == served and pricing.priced_on(MACHINES, "a") == SERVING
    pricing.forget("a")  # its seat may be taken by another machine
    assert pricing.priced_on(MACHINES, "a") == GENERIC
    assert RingPricing(MANIFEST, SESSION).pricing(MACHINES, "h") is None  # the model not hashed yet
    devices = pricing.devices(MACHINES, ["h", "b"])
    assert [d.name for d in devices] == ["host", "laptop"] and devices[0].bandwidth_bytes_per_s == 25e9


def test_a_served_ring_prices_each_machine_by_what_its_stage_measured() -> None:
    pricing = prices()
    ring = served_ring(pricing)
    too_few = reports(ring, {"b": 3.0}, MIN_STEPS_TO_REPRICE - 1)
    assert pricing.learn_from_serving(MACHINES, ring, too_few) == []  # not enough decodes to trust
    learned = pricing.learn_from_serving(MACHINES, ring, reports(ring, {"b": 3.0}, MIN_STEPS_TO_REPRICE))
    assert set(learned) == set(ring.chain)
    assert pricing.priced_on(MACHINES, "b") == SERVING
    slow, fast = pricing.served["b"], pricing.served["a"]
    assert slow.bandwidth_gb_s == pytest.approx(20.0 / 3.0) and fast.bandwidth_gb_s == pytest.approx(20.0)
    replanned = pricing.plan(MACHINES, ["h", "a", "b"])
    blocks = {stage.device: stage.end - stage.start for stage in replanned.stages}
    assert blocks["laptop"] < blocks["pc"]  # the machine that measured slow gets fewer blocks


def test_an_idle_ring_is_divided_again_only_when_its_measurements_call_for_it() -> None:
    pricing = prices()
    ring = served_ring(pricing)
    assert pricing.rebalance_verdict(MACHINES, ring, ["h", "a", "b"], reports(ring, {}, 8)) is None  # too early
    steady = pricing.rebalance_verdict(MACHINES, ring, ["h", "a", "b"], reports(ring, {}, MIN_STEPS_TO_REBALANCE))
    assert steady is not None and not steady.worth_it and pricing.last_verdict == steady
    lopsided = reports(ring, {"b": 4.0}, MIN_STEPS_TO_REBALANCE)
    verdict = pricing.rebalance_verdict(MACHINES, ring, ["h", "a", "b"], lopsided)
    assert verdict is not None and verdict.worth_it and verdict.planned_bottleneck_s < verdict.measured_bottleneck_s
    assert pricing.served == {}  # a verdict learns nothing: only a replan does


def test_the_plans_reader_is_told_where_each_machines_prices_come_from() -> None:
    pricing = prices()
    model = Path("m.gguf")
    assert pricing.note(MACHINES, ["b"], model).startswith("stage times: from the generic probe")
    assert pricing.note(MACHINES, ["h"], model) == "stage times: every machine priced on this model's own stages"
    mixed = pricing.note(MACHINES, ["h", "a"], model)
    assert "priced on this model's own stages for host" in mixed and "from the generic probe for pc" in mixed
    assert "kafila probe --model m.gguf" in mixed
