"""Who serves in a session, pure: the host's choice over its machines' prices and its edges'
measured round trips (`RingPricing.choose`, `measured_round_trips`), and the session core keeping
members that stand by linked, out of the ring, and weighed again at every replan. No process,
socket or model file (the end-to-end test is test_session_standby.py)."""

from __future__ import annotations

import pytest

from kafila.contracts import FleetDevice
from kafila.planner import ModelManifest, PlanRefused, ServingSpec
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import Device
from kafila.planner.who_serves import Role, ServingChoice, Why, plan_serving_host_choice, plan_who_serves
from kafila.session.core import SessionCore
from kafila.session.lifecycle import (
    Deploy,
    Deployed,
    Gathered,
    Look,
    NewcomerChecked,
    Opened,
    Phase,
    Retire,
    Retired,
    Say,
    SendAway,
)
from kafila.session.pricing import Machine, PlannedRing, RingPricing, measured_round_trips

GIB = 2**30
# 2.6 GB: more than the host's 1.5 GiB, so it needs at least one member.
MANIFEST = ModelManifest(
    name="m", block_bytes=(100_000_000,) * 24, head_bytes=200_000_000, kv_bytes_per_token=(1000,) * 24
)
SESSION = ServingSpec(context=512, concurrency=4)
NAMES = {"h": "home", "a": "near-desktop", "b": "far-laptop"}
TO_HOST_MS = {"a": 2.0, "b": 150.0}  # the far laptop behind a 150 ms edge


def machine(name: str, memory_gib: float) -> Machine:
    return Machine(name, FleetDevice(name=name, memory_gib=memory_gib, bandwidth_gb_s=50.0, overhead_us=100.0))


MACHINES = {"h": machine("home", 1.5), "a": machine("near-desktop", 2.0), "b": machine("far-laptop", 2.0)}


def pricing() -> RingPricing:
    return RingPricing(MANIFEST, SESSION)


def trips(members: list[str]) -> RoundTrips | None:
    return measured_round_trips({m: NAMES[m] for m in members}, "h", TO_HOST_MS, {})


# --- the edges' round trips -------------------------------------------------------------------


def test_round_trips_are_the_links_measurements_and_unlinked_members_are_guessed_through_the_host() -> None:
    names = {"h": "home", "a": "near", "b": "far"}
    guessed = measured_round_trips(names, "h", TO_HOST_MS, {})
    assert guessed is not None and guessed.members == ("home", "near", "far")
    assert guessed.between("home", "near") == pytest.approx(0.002)
    assert guessed.between("far", "home") == pytest.approx(0.150)
    # never linked: the larger of their round trips to the host, within the triangle inequality
    assert guessed.between("near", "far") == guessed.between("far", "near") == pytest.approx(0.150)
    linked = measured_round_trips(names, "h", TO_HOST_MS, {frozenset({"a", "b"}): 149.0})
    assert linked is not None and linked.between("near", "far") == pytest.approx(0.149)
    # a member whose link has measured nothing yet: the planner bounds edges as it did before
    assert measured_round_trips(names, "h", {"a": 2.0, "b": None}, {}) is None
    assert measured_round_trips({"h": "home"}, "h", {}, {}) == RoundTrips(members=("home",), seconds=((0.0,),))


# --- the host's choice ------------------------------------------------------------------------


def test_a_member_behind_a_slow_edge_stands_by_and_serves_when_another_member_is_lost() -> None:
    every = ["h", "a", "b"]
    choice = pricing().choose(MACHINES, every, round_trips=trips(every))
    assert choice.standby == ("far-laptop",) and set(choice.plan.ring) == {"home", "near-desktop"}
    assert choice.plan.head == "home"  # the host keeps the head
    far = next(m for m in choice.members if m.device == "far-laptop")
    assert far.role is Role.STANDS_BY and far.why is Why.COSTS_MORE
    assert far.words.startswith("far-laptop stands by: its edges add")
    assert far.time_with_s is not None and far.time_without_s is not None and far.time_with_s > far.time_without_s

    # The near desktop is lost: the home cannot hold the model alone, so the far laptop serves.
    left = ["h", "b"]
    after = pricing().choose(MACHINES, left, round_trips=trips(left))
    assert after.standby == () and set(after.plan.ring) == {"home", "far-laptop"}
    assert {m.device: m.why for m in after.members} == {"home": Why.ANCHOR, "far-laptop": Why.NEEDED}


def test_a_slow_machine_stands_by_for_its_own_stage_and_says_so() -> None:
    a_hundredth = FleetDevice(name="slow-laptop", memory_gib=2.0, bandwidth_gb_s=0.5, overhead_us=100.0)
    slow = {**MACHINES, "b": Machine("slow-laptop", a_hundredth)}
    lan = measured_round_trips({m: slow[m].name for m in ("h", "a", "b")}, "h", {"a": 0.5, "b": 0.5}, {})
    choice = pricing().choose(slow, ["h", "a", "b"], round_trips=lan)
    laptop = next(m for m in choice.members if m.device == "slow-laptop")
    assert choice.standby == ("slow-laptop",) and laptop.why is Why.COSTS_MORE
    assert laptop.words.startswith("slow-laptop stands by: its stage would take "), laptop.words
    assert laptop.time_with_s is not None and f"{laptop.time_with_s * 1e3:.1f} ms a token, more than" in laptop.words


def test_for_one_user_a_member_whose_stage_adds_more_to_a_pass_than_its_edges_says_so() -> None:
    """One user pays every stage of a pass: a machine with 20 ms of its own work a step stands by
    for it, though its stage is not the slowest, and the reason names its stage, not its edges."""
    busy = FleetDevice(name="busy-laptop", memory_gib=2.0, bandwidth_gb_s=50.0, overhead_us=20_000.0)
    machines = {**MACHINES, "b": Machine("busy-laptop", busy)}
    lan = measured_round_trips({m: machines[m].name for m in ("h", "a", "b")}, "h", {"a": 0.5, "b": 0.5}, {})
    choice = pricing().choose(machines, ["h", "a", "b"], round_trips=lan, load=1)
    laptop = next(m for m in choice.members if m.device == "busy-laptop")
    assert choice.standby == ("busy-laptop",) and laptop.why is Why.COSTS_MORE
    assert laptop.words.startswith("busy-laptop stands by: its stage would take "), laptop.words


def test_under_more_load_the_far_member_pays_and_serves() -> None:
    every = ["h", "a", "b"]
    loaded = RingPricing(MANIFEST, ServingSpec(context=512, concurrency=64))
    choice = loaded.choose(MACHINES, every, round_trips=trips(every))
    assert choice.standby == () and len(choice.plan.stages) == 3
    assert next(m for m in choice.members if m.device == "far-laptop").why is Why.PAYS


def test_the_host_weighs_who_serves_at_the_load_it_measures_with_memory_for_its_whole_room() -> None:
    """Room for 16 requests, planned for one user: the far laptop stands by; at 16 users at once
    the ring with it is clearly faster, and at one user again, clearly slower."""
    every = ["h", "a", "b"]
    prices = RingPricing(MANIFEST, ServingSpec(context=512, concurrency=16))
    alone = prices.choose(MACHINES, every, round_trips=trips(every), load=1)
    assert alone.standby == ("far-laptop",) and alone.concurrency == 1
    ids = {name: member for member, name in NAMES.items()}

    def ring_of(choice: ServingChoice) -> PlannedRing:
        chain = [s.device for s in sorted(choice.plan.stages, key=lambda s: s.start)]
        return PlannedRing(tuple(ids[name] for name in chain), choice.plan)

    grown = prices.load_verdict(MACHINES, ring_of(alone), ["h", "a"], every, [], 16, trips(every))
    assert grown is not None and grown.worth_it and grown.taken_in == ("far-laptop",), grown
    assert grown.reason.startswith("far-laptop taken in: at 16 users at once, its ")
    loaded = prices.choose(MACHINES, every, round_trips=trips(every), load=16)
    assert loaded.standby == () and prices.load is None  # weighing plans for nothing
    fallen = prices.load_verdict(MACHINES, ring_of(loaded), every, every, [], 1, trips(every))
    assert fallen is not None and fallen.worth_it and fallen.left_out == ("far-laptop",), fallen
    same = prices.load_verdict(MACHINES, ring_of(alone), ["h", "a"], every, [], 2, trips(every))
    assert same is not None and not same.worth_it and same.taken_in == ()


def test_asked_to_every_member_serves_and_the_plan_says_so() -> None:
    every = ["h", "a", "b"]
    choice = pricing().choose(MACHINES, every, round_trips=trips(every), every_member=True)
    assert choice.standby == () and len(choice.plan.stages) == 3
    assert {m.device: m.why for m in choice.members} == {
        "home": Why.ANCHOR,
        "near-desktop": Why.ASKED,
        "far-laptop": Why.ASKED,
    }
    assert pricing().plan(MACHINES, every, round_trips=trips(every)).stages == choice.plan.stages


def device(name: str, memory_gib: float, bandwidth_gb_s: float = 50.0) -> Device:
    return Device(
        name=name, memory_bytes=int(memory_gib * GIB), bandwidth_bytes_per_s=bandwidth_gb_s * 1e9, overhead_s=1e-4
    )


def test_the_session_chooses_as_kafila_plan_does_for_a_fleet_anchored_on_the_host() -> None:
    """`kafila plan` and the host both call `plan_serving_host_choice`; it is `plan_who_serves`
    with the head kept on the host, at every concurrency, one user included."""
    devices = [device("home", 4), device("near", 4, 30.0), device("far", 4, 80.0)]
    names = tuple(d.name for d in devices)
    rtt = RoundTrips(members=names, seconds=((0, 0.002, 0.04), (0.002, 0, 0.04), (0.04, 0.04, 0)))
    for concurrency in (1, 2, 4, 16, 64):
        session = ServingSpec(context=512, concurrency=concurrency)
        hosted = plan_serving_host_choice(MANIFEST, devices, session, rtt)
        assert hosted == plan_who_serves(MANIFEST, devices, session, "home", rtt, pin_head=True)


def test_a_host_too_small_for_the_head_leaves_it_to_a_member_and_one_too_small_for_a_block_holds_none() -> None:
    rtt = None
    tiny_host = [device("home", 0.15), device("near", 4), device("far", 4)]
    choice = plan_serving_host_choice(MANIFEST, tiny_host, SESSION, rtt)
    assert choice.plan.head != "home" and "home" in choice.plan.ring  # a block, not the head
    bare = [device("home", 0.01), device("near", 4), device("far", 4)]
    without = plan_serving_host_choice(MANIFEST, bare, SESSION, rtt)
    assert "home" not in without.plan.ring and any("holds no stage" in note for note in without.plan.notes)
    assert without.members[0].words.endswith("the ring is planned from this member")
    with pytest.raises(PlanRefused):
        plan_serving_host_choice(MANIFEST, [device("home", 0.01), device("near", 1)], SESSION, rtt)


# --- the session core -------------------------------------------------------------------------


def look(now: float, alive: set[str], idle: bool = True, arrivals: tuple[str, ...] = ()) -> Look:
    linked = frozenset(alive)
    return Look(now=now, alive=linked, listed=linked, idle=idle, arrivals=arrivals, names=NAMES)


def serving_without_the_far_laptop() -> SessionCore:
    host = SessionCore()
    host.handle(Opened("kafila join …"))
    assert host.handle(Gathered(("a", "b"))) == [Deploy(("a", "b"))]  # planned over every member
    assert host.handle(Deployed(("a",), standby=("b",))) == []
    assert host.phase == Phase.SERVING and host.ring == {"a"} and host.standby == {"b"}
    return host


def test_a_member_standing_by_stays_linked_out_of_the_ring_and_changes_nothing() -> None:
    host = serving_without_the_far_laptop()
    for now in (1.0, 2.0, 40.0):  # idle or busy, long after: not a newcomer, no replan
        assert host.handle(look(now, {"a", "b"}, idle=now != 2.0)) == []
    assert host.newcomers == frozenset() and host.phase == Phase.SERVING


def test_a_member_lost_from_the_ring_replans_over_those_standing_by_too() -> None:
    host = serving_without_the_far_laptop()
    broke = host.handle(look(5.0, {"b"}))
    assert SendAway(("a",)) in broke and isinstance(broke[-1], Retire)
    assert host.handle(Retired(("b",))) == [Deploy(("b",))]  # the far laptop is weighed again
    replanned = host.handle(Deployed(("b",), epoch=2))
    assert next(c.text for c in replanned if isinstance(c, Say)) == "replanned with 2 members"
    assert host.ring == {"b"} and host.standby == frozenset()


def test_a_member_standing_by_that_leaves_frees_its_seat_without_a_replan() -> None:
    host = serving_without_the_far_laptop()
    left = host.handle(look(5.0, {"a"}))
    assert left == [Say("far-laptop, who was standing by, left"), SendAway(("b",))]
    assert host.standby == frozenset() and host.phase == Phase.SERVING
    assert host.handle(look(6.0, {"a"})) == []


def test_a_newcomer_that_stands_by_after_its_replan_waits_for_no_other() -> None:
    host = serving_without_the_far_laptop()
    host.handle(NewcomerChecked("phone", member="phone"))
    names = {**NAMES, "phone": "phone"}
    taking_in = host.handle(
        Look(now=3.0, alive=frozenset({"a", "b", "phone"}), listed=frozenset({"a", "b", "phone"}), names=names)
    )
    assert isinstance(taking_in[-1], Retire)
    assert host.handle(Retired(("a", "b", "phone"))) == [Deploy(("a", "b", "phone"))]
    replanned = host.handle(Deployed(("a",), epoch=2, standby=("b", "phone")))
    assert [c.text for c in replanned if isinstance(c, Say)] == [
        "replanned with 2 members, taking in phone; 2 standing by"
    ]
    assert host.standby == {"b", "phone"} and host.newcomers == frozenset()
    assert (
        host.handle(
            Look(now=4.0, alive=frozenset({"a", "b", "phone"}), listed=frozenset({"a", "b", "phone"}), names=names)
        )
        == []
    )
