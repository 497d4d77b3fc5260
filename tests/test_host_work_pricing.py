"""The serving host's own work a token, priced: the planner adds it to the host's stage and may
then put the head on a ring neighbour of the host, which holds block 0 (docs/planner.md, "As a
session's host"); the session measures it from its process's CPU time less its stages' timers
and keeps it with the host's pricing. Pure: no process, socket or model file."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, event, given, settings
from test_who_serves import achieved, modelled_fleets, oracle, planner_inputs

from kafila.contracts import FleetDevice, ModelPricing, StageReport
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import Device, ModelManifest, ServingSpec
from kafila.planner.who_serves import plan_serving_host_choice, plan_who_serves
from kafila.session.pricing import MIN_TOKENS_FOR_HOST_WORK, HostWork, Machine, PlannedRing, RingPricing

MS = 1e-3
# gemma-3-270m's shape on two alike one-core machines (docs/benchmarks.md, issue 38): 18 blocks,
# the head's output about 1.7 blocks' read at the head's bandwidth. A stage of the 17 first
# blocks costs about 7 ms a token, the head's one block and output about 12.4.
DEMO = ModelManifest(name="demo", block_bytes=(3_600_000,) * 18, head_bytes=170_000_000, kv_bytes_per_token=(0,) * 18)


def one_core(name: str, host_work_s: float | None = None) -> Device:
    return Device(
        name=name,
        memory_bytes=2**30,
        bandwidth_bytes_per_s=3_600_000 / 0.35e-3,  # a block in 0.35 ms
        head_bandwidth_bytes_per_s=170_000_000 / 11.7e-3,  # the output in 11.7 ms
        overhead_s=1.0 * MS,
        host_work_s=host_work_s,
    )


def demo_choice(host_work_s: float | None, users: int, members: int = 1):
    devices = [one_core("host", host_work_s), *(one_core(f"member-{i}") for i in range(1, members + 1))]
    session = ServingSpec(context=2048, concurrency=max(4, users), load=users)
    return plan_serving_host_choice(DEMO, devices, session, every_member=True)


def test_unmeasured_host_work_keeps_the_head_on_the_host() -> None:
    choice = demo_choice(None, users=4)
    assert choice.plan.head == "host"
    assert [(s.device, s.end - s.start) for s in choice.plan.stages] == [("member-1", 17), ("host", 1)]


def test_under_load_the_host_s_own_work_moves_the_head_to_the_member_and_the_host_holds_block_0() -> None:
    choice = demo_choice(3 * MS, users=4)
    assert choice.plan.head == "member-1"
    first, head = choice.plan.stages
    assert (first.device, first.start, head.device, head.end) == ("host", 0, "member-1", 18)
    assert head.end - head.start == 1  # the head's output already sets the pace: it takes no block more
    # The plan's stages keep their own prices (what their timers will measure); the host's work
    # is in the time per token: the member's head sets it, the host's blocks and work beside it.
    assert first.cost_s == pytest.approx(1 * MS + 17 * 0.35 * MS)
    assert choice.time_per_token_s == pytest.approx(head.cost_s)
    assert any("head moved off the anchor" in note for note in choice.plan.notes)


def test_for_one_user_the_host_s_work_is_on_every_pass_wherever_the_head_is_so_the_head_stays() -> None:
    choice = demo_choice(3 * MS, users=1)
    assert choice.plan.head == "host"
    stages_s = sum(s.cost_s or 0.0 for s in choice.plan.stages)
    assert choice.time_per_token_s == pytest.approx(stages_s + 3 * MS)


def test_a_small_host_work_that_gains_less_than_the_head_margin_keeps_the_head() -> None:
    assert demo_choice(0.2 * MS, users=4).plan.head == "host"


def test_a_head_off_the_host_is_a_ring_neighbour_of_it_so_the_host_holds_block_0() -> None:
    """Four alike machines at a load: without the host's neighbour rule any member could take the
    head; with it, the chain starts at the host, so the ring's trip is the one priced."""
    for users in (4, 16):
        choice = demo_choice(6 * MS, users=users, members=3)
        assert choice.plan.head != "host"
        assert choice.plan.stages[0].device == "host" and choice.plan.stages[0].start == 0
        ring = choice.plan.ring  # head first
        assert ring[1] == "host"  # the host follows the head round the ring


@settings(max_examples=60, deadline=None)
@given(instance=modelled_fleets(max_members=3))
def test_with_the_host_s_work_the_choice_equals_brute_force_with_it_on_the_host_s_stage(instance) -> None:
    """In rings of up to three every member is a neighbour of the anchor, so the brute force of
    test_who_serves, with the host's work added to the anchor's every stage (as overhead), and
    every head allowed (by the 5% margin), is the objective."""
    f, anchor = instance
    host_work_s = 2.5 * MS
    overhead = tuple(o + host_work_s if i == anchor else o for i, o in enumerate(f.overhead))
    expected = oracle(replace(f, overhead=overhead), anchor, pin_head=False)
    assume(not expected.close_call and expected.times)
    manifest, devices, session, round_trips = planner_inputs(f, 64)
    devices[anchor] = devices[anchor].model_copy(update={"host_work_s": host_work_s})
    names = [d.name for d in devices]
    choice = plan_who_serves(manifest, devices, session, names[anchor], round_trips, hosting=True)
    index = {name: i for i, name in enumerate(names)}
    assert choice.time_per_token_s == pytest.approx(expected.times[expected.chosen], rel=1e-7)
    achieved(f, index, choice.plan)  # the stages' own prices: without the host's work
    event(f"head on the anchor: {choice.plan.head == names[anchor]}")


def test_round_trips_do_not_change_that_a_moved_head_leaves_the_trip_as_priced() -> None:
    devices = [one_core("host", 3 * MS), one_core("member")]
    trips = RoundTrips(members=("host", "member"), seconds=((0.0, 0.004), (0.004, 0.0)))
    choice = plan_serving_host_choice(DEMO, devices, ServingSpec(context=2048, concurrency=4), trips, True)
    assert choice.plan.head == "member" and choice.ring_trip_s == pytest.approx(0.004)


# --- measured serving, kept --------------------------------------------------------------------


def test_host_work_is_the_process_s_cpu_less_its_stages_over_the_tokens_served_by_where_the_head_is() -> None:
    meter = HostWork()
    assert meter.sample(ring=1, cpu_s=10.0, own_stage_s=4.0, tokens=100, head_here=True) is None  # starts it
    assert meter.sample(1, 10.1, 4.05, 100 + MIN_TOKENS_FOR_HOST_WORK - 1, True) is None  # too few tokens yet
    assert meter.measured_us == {}
    served = MIN_TOKENS_FOR_HOST_WORK * 2
    reading = meter.sample(1, 10.0 + 1.0, 4.0 + 0.6, 100 + served, True)
    assert reading == pytest.approx(1e6 * 0.4 / served) and meter.measured_us == {True: reading}
    # a new ring's stages start their timers afresh: it starts over, keeping the last reading
    assert meter.sample(2, 12.0, 0.1, 400, False) is None and meter.measured_us == {True: reading}
    assert meter.sample(2, 12.0 + 0.2, 0.1 + 0.3, 400 + served, False) is None  # timers ahead of the CPU: none
    assert meter.sample(2, 12.2 + 0.5, 0.4 + 0.3, 400 + 2 * served, False) == pytest.approx(1e6 * 0.2 / served)
    assert meter.measured_us == {True: reading, False: pytest.approx(1e6 * 0.2 / served)}
    assert meter.kept(kept(5.0, 7.0)) == {"host_work_us": meter.measured_us[False], "host_work_with_head_us": reading}


SHA = "a" * 64


def machine(name: str, pricings: tuple[ModelPricing, ...] = ()) -> Machine:
    capability = FleetDevice(name=name, memory_gib=1.0, bandwidth_gb_s=10.0, overhead_us=1000.0)
    return Machine(name, capability, pricings)


def kept(host_work_us: float | None, with_head_us: float | None = None) -> ModelPricing:
    return ModelPricing(
        model_sha256=SHA,
        bandwidth_gb_s=10.0,
        head_bandwidth_gb_s=14.5,
        overhead_us=1000.0,
        host_work_us=host_work_us,
        host_work_with_head_us=with_head_us,
    )


def ring_pricing() -> RingPricing:
    return RingPricing(DEMO, ServingSpec(context=2048, concurrency=4), model_sha256=SHA, host="h")


def test_the_host_is_planned_with_its_kept_work_and_then_with_what_it_measures_now() -> None:
    machines = {"h": machine("host", (kept(None, 3000.0),)), "m": machine("member")}
    prices = ring_pricing()
    host, member = prices.devices(machines, ["h", "m"])
    assert host.host_work() == pytest.approx((3 * MS, 3 * MS)) and member.host_work() is None  # one for both
    assert prices.choose(machines, ["h", "m"], every_member=True).plan.head == "member"
    # Serving with the head on the member, its work beside its blocks is less (a row's sampling,
    # the logits' copy went with the head): both measured, the head stays on the member.
    prices.host_work.measured_us[False] = 900.0
    (host, _) = prices.devices(machines, ["h", "m"])
    assert host.host_work() == pytest.approx((0.9 * MS, 3 * MS))
    assert prices.choose(machines, ["h", "m"], every_member=True).plan.head == "member"
    prices.host_work.measured_us[True] = 100.0  # measured serving the head: it costs little here
    assert prices.choose(machines, ["h", "m"], every_member=True).plan.head == "host"
    # what its stage measured serving prices its blocks; its work stays the host's own
    prices.served["h"] = kept(None)
    (host, _) = prices.devices(machines, ["h", "m"])
    assert host.host_work() == pytest.approx((0.9 * MS, 0.1 * MS))


def test_a_host_that_never_measured_its_work_plans_as_before() -> None:
    machines = {"h": machine("host", (kept(None),)), "m": machine("member")}
    (host, _) = ring_pricing().devices(machines, ["h", "m"])
    assert host.host_work() is None


def test_the_host_keeps_its_work_with_its_pricing_from_serving() -> None:
    machines = {"h": machine("host", (kept(None),)), "m": machine("member")}
    prices = ring_pricing()
    plan = prices.plan(machines, ["h", "m"])
    ring = PlannedRing(tuple("m" if s.device == "member" else "h" for s in plan.stages), plan)
    report = [
        StageReport(range=(s.start, s.end), ms_per_token_alone=8.0, steps_alone=64, seconds=1.0, rows=100)
        for s in plan.stages
    ]
    assert prices.own_by_serving(machines, ring, report) is not None
    assert prices.own_by_serving(machines, ring, report).host_work_us is None  # type: ignore[union-attr]
    prices.host_work.measured_us[True] = 2500.0
    own = prices.own_by_serving(machines, ring, report)
    assert own is not None and (own.host_work_us, own.host_work_with_head_us) == (None, 2500.0)
    # what an earlier session kept stays where this one measured nothing
    machines["h"] = machine("host", (kept(900.0, 4000.0),))
    own = prices.own_by_serving(machines, ring, report)
    assert own is not None and (own.host_work_us, own.host_work_with_head_us) == (900.0, 2500.0)


def test_a_fleet_file_s_host_work_reaches_the_planner() -> None:
    from kafila.planner.fleet import device_of

    fleet = FleetDevice(name="home", memory_gib=1.0, bandwidth_gb_s=10.0, host_work_us=2500.0)
    assert device_of(fleet).host_work() == pytest.approx((2.5 * MS, 2.5 * MS))
    both = device_of(fleet.model_copy(update={"host_work_with_head_us": 4000.0}))
    assert both.host_work() == pytest.approx((2.5 * MS, 4 * MS))
    priced = FleetDevice(name="home", memory_gib=1.0).priced(kept(2500.0, 4000.0))
    assert (priced.host_work_us, priced.host_work_with_head_us) == (2500.0, 4000.0)
    assert FleetDevice(name="home", memory_gib=1.0, host_work_us=7.0).priced(kept(None)).host_work_us == 7.0


def test_the_host_s_work_beside_the_head_and_beside_blocks_are_priced_in_their_roles() -> None:
    """Beside the head the host also samples each whole row: 3 ms there and 0.5 beside blocks
    moves the head (12.4 + 3 against 12.4 for the member's head, the host's blocks 7 + 0.5)."""
    devices = [one_core("host").model_copy(update={"host_work_s": 0.5 * MS, "host_work_with_head_s": 3 * MS})]
    devices.append(one_core("member"))
    choice = plan_serving_host_choice(DEMO, devices, ServingSpec(context=2048, concurrency=4), every_member=True)
    assert choice.plan.head == "member"
    host = devices[0].model_copy(update={"host_work_s": 3 * MS, "host_work_with_head_s": 0.5 * MS})
    choice = plan_serving_host_choice(DEMO, [host, devices[1]], ServingSpec(context=2048, concurrency=4), None, True)
    assert choice.plan.head == "host"
