"""The serving host's decisions, driven through every path with made-up views and times: no
process, socket, model or clock (the core's shell is tested end to end in test_session_network)."""

from __future__ import annotations

import dataclasses

from kafila.session.core import (
    REBALANCE_CHECK_S,
    WAIT,
    Admit,
    HoldRequests,
    JudgeRebalance,
    ReplanAfterBreak,
    ReplanWithNewcomers,
    ServingCore,
    SessionView,
    StopHolding,
)
from kafila.session.member_runner import Rejoins

PATIENCE_S = 30.0
COOLDOWN_S = 60.0
RING = frozenset({"laptop", "workstation"})


def core(rebalance: bool = True) -> ServingCore:
    return ServingCore(newcomer_patience_s=PATIENCE_S, rebalance_cooldown_s=COOLDOWN_S, rebalance=rebalance)


def serving(now: float, **changes: object) -> SessionView:
    """A ring of two members serving, busy unless told otherwise."""
    view = SessionView(now=now, deployed=RING, alive=RING, idle=False)
    return dataclasses.replace(view, **changes)  # type: ignore[arg-type]


def test_a_busy_healthy_ring_is_left_alone() -> None:
    host = core()
    assert [host.next_action(serving(t)) for t in (0.0, 1.0, 100.0)] == [WAIT] * 3


def test_arrivals_are_checked_one_at_a_time_before_anything_else() -> None:
    host = core()
    view = serving(0.0, arrivals=("phone", "tablet"), alive=frozenset({"laptop"}))  # the ring broke too
    assert host.next_action(view) == Admit("phone")
    assert host.next_action(dataclasses.replace(view, arrivals=("tablet",))) == Admit("tablet")
    assert host.next_action(dataclasses.replace(view, arrivals=())) == ReplanAfterBreak(("workstation",))


def test_a_member_lost_mid_stream_is_replanned_without_then_taken_back_when_it_rejoins() -> None:
    host = core()
    assert host.next_action(serving(5.0, alive=frozenset({"laptop"}))) == ReplanAfterBreak(("workstation",))
    replanned = frozenset({"laptop"})  # the ring the replan made, while requests run on it
    assert host.next_action(serving(6.0, deployed=replanned, alive=replanned)) == WAIT
    back = serving(7.0, deployed=replanned, alive=RING, arrivals=("workstation",))
    assert host.next_action(back) == Admit("workstation")
    admitted = serving(8.0, deployed=replanned, alive=RING, newcomers=("workstation",), idle=True)
    assert host.next_action(admitted) == ReplanWithNewcomers(("workstation",))


def test_a_stage_or_engine_failure_breaks_the_ring_with_no_member_lost() -> None:
    host = core()
    assert host.next_action(serving(0.0, broken="laptop: its stage stopped")) == ReplanAfterBreak(())
    assert host.next_action(serving(0.0, engine_error="the link to laptop is down")) == ReplanAfterBreak(())


def test_a_newcomer_on_an_idle_ring_is_taken_in_at_once() -> None:
    host = core()
    assert host.next_action(serving(0.0, newcomers=("phone",), idle=True)) == ReplanWithNewcomers(("phone",))
    assert host.newcomers_waiting_since is None and not host.holding


def test_a_newcomer_under_steady_load_gets_its_replan_after_the_hosts_patience() -> None:
    host = core()
    waiting = serving(0.0, newcomers=("phone",))
    assert host.next_action(waiting) == WAIT  # the patience starts
    assert host.next_action(dataclasses.replace(waiting, now=PATIENCE_S - 1)) == WAIT
    assert host.next_action(dataclasses.replace(waiting, now=PATIENCE_S)) == HoldRequests(("phone",))
    held = dataclasses.replace(waiting, now=PATIENCE_S + 1, ready=False)  # /v1 holds new requests now
    assert host.next_action(held) == WAIT  # said once; the running requests finish
    drained = dataclasses.replace(held, now=PATIENCE_S + 5, idle=True)
    assert host.next_action(drained) == ReplanWithNewcomers(("phone",))
    assert host.newcomers_waiting_since is None and not host.holding


def test_newcomers_that_leave_before_their_replan_release_the_held_requests() -> None:
    host = core()
    host.next_action(serving(0.0, newcomers=("phone",)))
    assert host.next_action(serving(PATIENCE_S, newcomers=("phone",))) == HoldRequests(("phone",))
    assert host.next_action(serving(PATIENCE_S + 1, ready=False)) == StopHolding()
    assert host.next_action(serving(PATIENCE_S + 2)) == WAIT


def test_newcomers_that_leave_before_anything_was_held_change_nothing() -> None:
    host = core()
    host.next_action(serving(0.0, newcomers=("phone",)))
    assert host.next_action(serving(1.0)) == WAIT
    assert host.newcomers_waiting_since is None and not host.holding


def test_an_idle_ring_is_judged_for_a_rebalance_every_few_seconds() -> None:
    host = core()
    idle = serving(10.0, idle=True)
    assert host.next_action(idle) == JudgeRebalance()
    assert host.next_action(dataclasses.replace(idle, now=10.0 + REBALANCE_CHECK_S / 2)) == WAIT
    assert host.next_action(dataclasses.replace(idle, now=10.0 + REBALANCE_CHECK_S)) == JudgeRebalance()
    assert host.next_action(serving(20.0)) == WAIT  # busy: never judged under load


def test_a_rebalance_is_followed_by_a_cool_down_that_doubles() -> None:
    host = core()
    assert host.next_action(serving(0.0, idle=True)) == JudgeRebalance()
    host.rebalanced(0.0)
    assert host.next_action(serving(COOLDOWN_S - 1, idle=True)) == WAIT
    assert host.next_action(serving(COOLDOWN_S, idle=True)) == JudgeRebalance()
    host.rebalanced(COOLDOWN_S)
    assert host.next_action(serving(COOLDOWN_S + 2 * COOLDOWN_S - 1, idle=True)) == WAIT
    assert host.next_action(serving(3 * COOLDOWN_S, idle=True)) == JudgeRebalance()


def test_no_rebalance_when_turned_off_or_with_no_engine() -> None:
    assert core(rebalance=False).next_action(serving(0.0, idle=True)) == WAIT
    assert core().next_action(serving(0.0, idle=True, engine=False)) == WAIT


def test_a_ring_is_judged_again_only_when_its_stages_measured_something_new() -> None:
    host = core()
    steps = [((0, 4), 40), ((4, 8), 40)]
    assert host.worth_judging(steps)
    assert not host.worth_judging(list(steps))
    assert host.worth_judging([((0, 4), 41), ((4, 8), 41)])


def test_a_member_joins_again_while_its_joins_last_and_a_few_times_in_a_row() -> None:
    rejoins = Rejoins(limit=3, steady_s=60.0)
    assert [rejoins.after_loss(5.0) for _ in range(4)] == [True, True, True, False]  # quick losses run out
    steady = Rejoins(limit=3, steady_s=60.0)
    assert all(steady.after_loss(lasted) for lasted in (5.0, 5.0, 120.0, 5.0, 5.0, 61.0))  # a lasting join resets
