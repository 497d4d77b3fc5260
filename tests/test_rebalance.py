"""Rebalancing a serving ring: replanned with prices that pass through what the stages measured,
and divided again only for a clear gain."""

from __future__ import annotations

import itertools
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.contracts import FleetDevice
from kafila.planner import ModelManifest, ServingSpec, plan_serving_host
from kafila.planner.cost import ChainPrefix, cost_model_matrix
from kafila.planner.fleet import device_of, pricing_from_serving
from kafila.planner.rebalance import REBALANCE_GAIN, judge_rebalance
from kafila.planner.types import Plan

DIGEST = "ab" * 32


@st.composite
def fleets(draw: st.DrawFn) -> tuple[ModelManifest, list[FleetDevice]]:
    n_blocks = draw(st.integers(2, 10))
    manifest = ModelManifest(
        name="m",
        block_bytes=tuple(draw(st.lists(st.integers(10**7, 10**9), min_size=n_blocks, max_size=n_blocks))),
        head_bytes=draw(st.integers(0, 2 * 10**9)),
        kv_bytes_per_token=(0,) * n_blocks,
    )
    count = draw(st.integers(2, min(4, n_blocks)))
    devices = [
        FleetDevice(
            name=f"d{i}",
            memory_gib=64,
            bandwidth_gb_s=draw(st.floats(1.0, 100.0)),
            overhead_us=draw(st.floats(0.0, 5000.0)),
        )
        for i in range(count)
    ]
    return manifest, devices


def measured_and_learned(
    plan: Plan, devices: list[FleetDevice], scales: dict[str, float]
) -> tuple[list[float | None], list[FleetDevice]]:
    """Each stage "measures" its prediction times its machine's scale; each machine is then priced
    by what it measured, as the host does before a replan."""
    by_name = {d.name: d for d in devices}
    measured: list[float | None] = []
    learned = dict(by_name)
    for stage in plan.stages:
        assert stage.cost_s is not None
        seconds = stage.cost_s * scales[stage.device]
        measured.append(seconds)
        pricing = pricing_from_serving(by_name[stage.device], DIGEST, stage.cost_s, seconds)
        assert pricing is not None
        learned[stage.device] = by_name[stage.device].priced(pricing)
    return measured, [learned[d.name] for d in devices]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), fleet=fleets())
def test_a_ring_whose_machines_all_run_slower_or_faster_alike_is_never_divided_again(
    data: st.DataObject, fleet: tuple[ModelManifest, list[FleetDevice]]
) -> None:
    """A load that slows every machine alike (the shared machine busy with something else) scales
    every price alike, which moves no block: noise of that kind cannot make the ring flap."""
    manifest, devices = fleet
    session = ServingSpec(context=1)
    plan = plan_serving_host(manifest, [device_of(d) for d in devices], session)
    scale = data.draw(st.floats(0.1, 10.0))
    measured, learned = measured_and_learned(plan, devices, {d.name: scale for d in devices})
    proposed = plan_serving_host(manifest, [device_of(d) for d in learned], session)
    verdict = judge_rebalance(plan, measured, proposed)
    assert verdict is not None and not verdict.worth_it, verdict


@settings(max_examples=200, deadline=None)
@given(data=st.data(), fleet=fleets())
def test_a_ring_whose_machines_run_off_their_prices_by_less_than_the_gain_apart_is_never_divided_again(
    data: st.DataObject, fleet: tuple[ModelManifest, list[FleetDevice]]
) -> None:
    """Where each machine's stage measured its prediction times its own scale, and the largest
    scale is less than 1 / (1 - REBALANCE_GAIN) times the smallest, no division beats the slowest
    measured by the gain: every division's slowest is at least the smallest scale times the plan's
    (which was the least), and the slowest measured at most the largest scale times it. So a load
    that slows the machines unevenly calls for a rebalance only past that spread (the end-to-end
    test in test_session_network.py reads it off /status)."""
    manifest, devices = fleet
    session = ServingSpec(context=1)
    plan = plan_serving_host(manifest, [device_of(d) for d in devices], session)
    smallest = data.draw(st.floats(0.1, 10.0))
    spread = data.draw(st.floats(1.0, 1 / (1 - REBALANCE_GAIN), exclude_max=True))
    scales = {d.name: smallest * data.draw(st.floats(1.0, spread)) for d in devices}
    measured, learned = measured_and_learned(plan, devices, scales)
    proposed = plan_serving_host(manifest, [device_of(d) for d in learned], session)
    verdict = judge_rebalance(plan, measured, proposed)
    assert verdict is not None and not verdict.worth_it, (scales, verdict)
    by_stage = [scales[stage.device] for stage in plan.stages]
    assert verdict.spread == pytest.approx(max(by_stage) / min(by_stage))  # what the host says of it


@settings(max_examples=200, deadline=None)
@given(data=st.data(), fleet=fleets())
def test_a_rebalance_is_called_for_only_where_the_measured_prices_make_it_clearly_faster(
    data: st.DataObject, fleet: tuple[ModelManifest, list[FleetDevice]]
) -> None:
    """Whatever each machine measured against its price, the verdict reads the same prices on both
    sides: the current division, priced by the learned numbers, costs exactly what was measured;
    a rebalance is called for only when the new plan's slowest stage is at least 25% faster."""
    manifest, devices = fleet
    session = ServingSpec(context=1)
    plan = plan_serving_host(manifest, [device_of(d) for d in devices], session)
    scales = {d.name: data.draw(st.floats(0.1, 10.0)) for d in devices}
    measured, learned = measured_and_learned(plan, devices, scales)
    prefix = ChainPrefix.of(manifest, session)
    by_name = {d.name: device_of(d) for d in learned}
    for stage, seconds in zip(plan.stages, measured, strict=True):
        priced = cost_model_matrix(by_name[stage.device], prefix, stage.is_head)[stage.start, stage.end]
        assert priced == pytest.approx(seconds, rel=1e-9)
    proposed = plan_serving_host(manifest, list(by_name.values()), session)
    verdict = judge_rebalance(plan, measured, proposed)
    assert verdict is not None and proposed.bottleneck_s is not None
    assert verdict.measured_bottleneck_s == pytest.approx(max(s for s in measured if s is not None))
    assert proposed.bottleneck_s <= verdict.measured_bottleneck_s * (1 + 1e-9)  # the planner's optimum
    assert verdict.worth_it == (
        [(s.device, s.start, s.end) for s in proposed.stages] != [(s.device, s.start, s.end) for s in plan.stages]
        and proposed.bottleneck_s <= verdict.measured_bottleneck_s * (1 - REBALANCE_GAIN)
    )


def test_a_member_four_times_slower_than_its_price_gives_blocks_back() -> None:
    """The member's probe claimed four times its real speed, so it was given most of the blocks;
    measured, it is the bottleneck, and priced by what it measured the division evens out."""
    manifest = ModelManifest(name="m", block_bytes=(10**8,) * 8, head_bytes=10**8, kv_bytes_per_token=(0,) * 8)
    host = FleetDevice(name="host", memory_gib=64, bandwidth_gb_s=20.0, overhead_us=200.0)
    boasting = FleetDevice(name="member", memory_gib=64, bandwidth_gb_s=80.0, overhead_us=50.0)
    session = ServingSpec(context=1)
    plan = plan_serving_host(manifest, [device_of(host), device_of(boasting)], session)
    assert [s.end - s.start for s in plan.stages if s.device == "member"] == [7]
    measured, learned = measured_and_learned(plan, [host, boasting], {"host": 1.0, "member": 4.0})
    proposed = plan_serving_host(manifest, [device_of(d) for d in learned], session)
    verdict = judge_rebalance(plan, measured, proposed)
    assert verdict is not None and verdict.worth_it, verdict
    assert {s.device: s.end - s.start for s in proposed.stages} == {"member": 4, "host": 4}
    assert "worth it" in verdict.reason and verdict.spread == pytest.approx(4.0)
    assert "(each stage 1 to 4 times its planned time)" in verdict.reason, verdict.reason
    # Judged again on the plan it made, with its stages measuring what they now cost, it stands.
    again, relearned = measured_and_learned(proposed, learned, {"host": 1.0, "member": 1.0})
    stands = judge_rebalance(proposed, again, plan_serving_host(manifest, [device_of(d) for d in relearned], session))
    assert stands is not None and not stands.worth_it and stands.reason == "the plan stands"


def test_nothing_is_judged_before_every_stage_has_a_measurement() -> None:
    manifest = ModelManifest(name="m", block_bytes=(10**8,) * 4, head_bytes=0, kv_bytes_per_token=(0,) * 4)
    devices = [device_of(FleetDevice(name=n, memory_gib=64, bandwidth_gb_s=10.0, overhead_us=100.0)) for n in "ab"]
    plan = plan_serving_host(manifest, devices, ServingSpec(context=1))
    assert judge_rebalance(plan, [0.01, None], plan) is None
    assert judge_rebalance(plan, [0.01], plan) is None  # one time for two stages
    assert judge_rebalance(plan, [0.01, 0.0], plan) is None
    with pytest.raises(ValueError, match="fraction"):
        judge_rebalance(plan, [0.01, 0.01], plan, gain=1.5)


def test_the_interquartile_mean_is_the_middle_half_and_moves_smoothly_where_decodes_fall_in_two_groups() -> None:
    """On a busy machine a short stage's decodes run through (1 ms) or wait for a core (5 ms);
    as the share of each crosses a half, the median jumps from one group to the other, the
    interquartile mean by a 32nd of the gap per decode."""
    from kafila.runtime.engine.stage import interquartile_mean

    assert interquartile_mean([4.0, 1.0, 3.0, 2.0]) == pytest.approx(2.5)
    assert interquartile_mean([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((0.75 * 2 + 3 + 0.75 * 4) / 2.5)
    assert interquartile_mean([7.0, 1.0]) == pytest.approx(4.0)
    assert interquartile_mean([1.0] * 60 + [500.0] * 4) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        interquartile_mean([])
    medians, means = [], []
    for fast in range(24, 41):
        decodes = [1.0] * fast + [5.0] * (64 - fast)
        medians.append(statistics.median(decodes))
        means.append(interquartile_mean(decodes))
    assert max(abs(b - a) for a, b in itertools.pairwise(medians)) >= 2.0
    assert max(abs(b - a) for a, b in itertools.pairwise(means)) <= 4.0 / 32 + 1e-9


def test_a_stages_time_alone_follows_its_recent_decodes_so_a_machine_that_slows_shows_it() -> None:
    """A machine that gets busy after a long session (a game started on the gaming PC) shows it in
    the time per token alone within RECENT_ALONE_STEPS decodes, where a few decodes held up by the
    operating system do not move it; batched decodes and prefill are not counted there, and the
    count of decodes alone keeps growing."""
    from kafila.runtime.engine.stage import RECENT_ALONE_STEPS, StageTimer

    timer = StageTimer()
    assert timer.ms_per_token_alone is None
    for _ in range(10 * RECENT_ALONE_STEPS):  # a long quiet session: 2 ms a token
        timer.add(0.002, 1, decode=True)
    timer.add(0.5, 4, decode=True)  # a batch of four rows
    timer.add(0.9, 30, decode=False)  # a prefill
    assert timer.ms_per_token_alone == pytest.approx(2.0)
    for _ in range(RECENT_ALONE_STEPS // 8):  # decodes the operating system held up: no slower machine
        timer.add(0.05, 1, decode=True)
    assert timer.ms_per_token_alone == pytest.approx(2.0)
    for _ in range(RECENT_ALONE_STEPS):  # then the machine runs at half speed
        timer.add(0.004, 1, decode=True)
    assert timer.ms_per_token_alone == pytest.approx(4.0)
    report = timer.report((0, 4))
    assert report.steps_alone == 11 * RECENT_ALONE_STEPS + RECENT_ALONE_STEPS // 8
    assert report.ms_per_token != report.ms_per_token_alone  # all decodes, the batch's too
