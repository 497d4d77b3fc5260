"""The host's pricing of its machines, pure: which price each machine plans with, what a served
ring teaches, when an idle ring is divided again. No link, process or model file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.contracts import FleetDevice, ModelPricing, StageReport
from kafila.planner import ModelManifest, ServingSpec
from kafila.planner.cost import ChainPrefix, cost_model_matrix
from kafila.planner.fleet import device_of, generic_model_seconds, pricing_by_ratio
from kafila.session.pricing import (
    GENERIC,
    MIN_STEPS_TO_REBALANCE,
    MIN_STEPS_TO_REPRICE,
    SCALED,
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


# --- the first plan: members priced by the host's measure of the model, scaled --------------------


def test_a_machine_is_priced_by_the_hosts_measure_scaled_by_their_generic_probes() -> None:
    """r = the whole model at the member's generic numbers over the host's: o goes by r, b and
    b_head by 1 / r, so every stage of the member costs r times the host's for the same blocks."""
    host = FleetDevice(name="host", memory_gib=64, bandwidth_gb_s=40.0, overhead_us=100.0)
    member = FleetDevice(name="m", memory_gib=64, bandwidth_gb_s=20.0, head_bandwidth_gb_s=30.0, overhead_us=300.0)
    measured = ModelPricing(model_sha256=DIGEST, bandwidth_gb_s=12.0, head_bandwidth_gb_s=24.0, overhead_us=400.0)
    mine = 100e-6 + 1.2e9 / 40e9 + 0.05e9 / 40e9
    theirs = 300e-6 + 1.2e9 / 20e9 + 0.05e9 / 30e9
    assert generic_model_seconds(MANIFEST, host) == pytest.approx(mine)
    assert generic_model_seconds(MANIFEST, member) == pytest.approx(theirs)
    ratio = theirs / mine
    scaled = pricing_by_ratio(MANIFEST, host, measured, member)
    assert scaled == ModelPricing(
        model_sha256=DIGEST, bandwidth_gb_s=12.0 / ratio, head_bandwidth_gb_s=24.0 / ratio, overhead_us=400.0 * ratio
    )
    prefix = ChainPrefix.of(MANIFEST, SESSION)
    for is_head in (False, True):
        at_host = cost_model_matrix(device_of(host.priced(measured)), prefix, is_head)
        at_member = cost_model_matrix(device_of(member.priced(scaled)), prefix, is_head)
        finite = at_host < float("inf")
        assert at_member[finite] == pytest.approx(at_host[finite] * ratio)
    # The same generic probe: the host's measure as it is. None where a machine has no numbers.
    assert pricing_by_ratio(MANIFEST, host, measured, host.model_copy(update={"name": "twin"})) == measured
    bare = FleetDevice(name="bare", memory_gib=8)
    assert pricing_by_ratio(MANIFEST, host, measured, bare) is None
    assert pricing_by_ratio(MANIFEST, bare, measured, host) is None


HOSTED = {
    "h": Machine("host", device("host", 20.0), (own(25.0),)),  # measured this model before the first plan
    "a": Machine("pc", device("pc", 40.0)),  # generic probe twice the host's bandwidth
    "b": Machine("laptop", device("laptop", 20.0), (own(6.0),)),  # priced this model itself
}


def hosted() -> RingPricing:
    return RingPricing(MANIFEST, SESSION, model_sha256=DIGEST, host="h")


def test_the_first_plan_prices_members_without_their_own_by_the_hosts_measure() -> None:
    pricing = hosted()
    expected = pricing_by_ratio(MANIFEST, HOSTED["h"].capability, own(25.0), HOSTED["a"].capability)
    assert expected is not None and expected.bandwidth_gb_s > 25.0  # the faster probe, the faster price
    assert pricing.pricing(HOSTED, "a") == expected
    assert pricing.pricing(HOSTED, "b") == own(6.0)  # its own measure comes before the host's
    assert [pricing.priced_on(HOSTED, m) for m in ("h", "a", "b")] == [THE_MODEL, SCALED, THE_MODEL]
    # What the host's stage measured serving carries to the members priced by its measure.
    pricing.served["h"] = own(10.0)
    assert pricing.pricing(HOSTED, "a") == pricing_by_ratio(
        MANIFEST, HOSTED["h"].capability, own(10.0), HOSTED["a"].capability
    )
    # A host that has not priced the model: the generic probe, as before.
    unpriced = {**HOSTED, "h": Machine("host", device("host", 20.0))}
    assert hosted().pricing(unpriced, "a") is None and hosted().priced_on(unpriced, "a") == GENERIC
    note = pricing.note(HOSTED, ["h", "a"], Path("m.gguf"))
    assert "as the host measured them, scaled by generic probe for pc" in note, note


def test_the_hosts_own_stage_is_kept_once_it_has_served_enough_tokens() -> None:
    pricing = hosted()
    plan = pricing.plan(HOSTED, ["h", "a", "b"])
    chain = tuple({"host": "h", "pc": "a", "laptop": "b"}[stage.device] for stage in plan.stages)
    ring = PlannedRing(chain, plan)
    assert pricing.own_by_serving(HOSTED, ring, reports(ring, {"h": 2.0}, MIN_STEPS_TO_REBALANCE - 1)) is None
    kept = pricing.own_by_serving(HOSTED, ring, reports(ring, {"h": 2.0}, MIN_STEPS_TO_REBALANCE))
    assert kept is not None and kept.bandwidth_gb_s == pytest.approx(25.0 / 2)
    assert kept.overhead_us == pytest.approx(100.0)
    assert pricing.served == {}  # keeping it for the next session teaches this one nothing
