"""The host's decisions, driven through every path of its lifecycle with made-up events, looks
and times: no process, socket, model or clock (the core's shell is tested in test_host_runner and
end to end in test_session_network), as aioquic's tests drive a connection with made-up datagrams."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.network.rendezvous_client import RendezvousClosed, RendezvousError
from kafila.session.core import (
    ANSWERED,
    GUESS_BUDGET,
    LOAD_LOOKS,
    LOOK_AT_LEAST_EVERY_S,
    MEMORY_LOWERINGS,
    REBALANCE_CHECK_S,
    ServingPolicy,
    SessionCore,
)
from kafila.session.lifecycle import (
    AbandonRing,
    Admit,
    CodeRefused,
    Command,
    Deploy,
    Deployed,
    DeployFailed,
    Dismiss,
    Dismissed,
    Event,
    Fail,
    FailHeld,
    ForgetRing,
    Gathered,
    Interrupted,
    JoinerRefused,
    Judged,
    LoadJudged,
    Look,
    LowerMemory,
    LowerOwnMemory,
    MemberFailed,
    MemoryShortage,
    NewcomerChecked,
    Opened,
    OwnShortOfMemory,
    Phase,
    PriceLoad,
    PriceRebalance,
    RecordIncident,
    Refuse,
    RenewCode,
    Resume,
    Retire,
    Retired,
    Say,
    SendAway,
    ServeAlone,
    ServedAlone,
    StageBroken,
    StartFailed,
    Stopped,
    Unready,
    Warn,
)
from kafila.session.member_runner import (
    REJOIN_WINDOW_S,
    UNREACHABLE_WINDOW_S,
    Rejoins,
    retry_pause,
    worth_retrying,
)
from kafila.session.presence import RendezvousUnreachable

PATIENCE_S = 30.0
COOLDOWN_S = 60.0
WINDOW_S = 10.0  # the load's window
RESUME_S = 60.0
RING = frozenset({"laptop", "workstation"})
JOIN = "kafila join blue-fox-… --rendezvous 192.0.2.7:8470"
NAMES = {"laptop": "laptop", "workstation": "workstation", "phone": "phone"}
MEASURED = (((0, 4), 40), ((4, 8), 40))


def policy(rebalance: bool = True, follow_load: bool = False) -> ServingPolicy:
    return ServingPolicy(
        newcomer_patience_s=PATIENCE_S, rebalance_cooldown_s=COOLDOWN_S, rebalance=rebalance, resume_within_s=RESUME_S,
        follow_load=follow_load, load_window_s=WINDOW_S, load_cooldown_s=COOLDOWN_S,
    )  # fmt: skip


def session(networked: bool = True, follow_load: bool = False) -> SessionCore:
    if networked:
        return SessionCore(policy(follow_load=follow_load))
    return SessionCore.one_machine(policy(rebalance=False, follow_load=follow_load))


def seen(now: float, **changes: object) -> Look:
    """A look at a ring of two members serving, busy unless told otherwise; the rendezvous lists
    every member linked."""
    look = Look(now=now, alive=RING, idle=False, names=NAMES)
    look = dataclasses.replace(look, **changes)  # type: ignore[arg-type]
    return look if "listed" in changes else dataclasses.replace(look, listed=look.alive)


def said(commands: list[Command]) -> list[str]:
    return [c.text for c in commands if isinstance(c, Say)]


def serving_ring(members: tuple[str, ...] = ("laptop", "workstation")) -> SessionCore:
    host = session()
    host.handle(Opened(JOIN))
    assert host.handle(Gathered(members)) == [Deploy(members)]
    assert host.handle(Deployed(members)) == []  # the first plan: nothing "replanned"
    assert host.phase == Phase.SERVING
    return host


def admitted(host: SessionCore, member: str) -> list[Command]:
    return host.handle(NewcomerChecked(member, member=member))


# --- while a ring serves ----------------------------------------------------------------------


def test_a_busy_healthy_ring_is_left_alone() -> None:
    host = serving_ring()
    assert [host.handle(seen(t)) for t in (0.0, 1.0, 100.0)] == [[]] * 3


def test_arrivals_are_answered_before_anything_else() -> None:
    host = serving_ring()
    commands = host.handle(seen(0.0, arrivals=("phone", "tablet"), alive=frozenset({"laptop"})))  # the ring broke too
    assert commands[:2] == [Admit("phone"), Admit("tablet")]
    assert commands[2] == RecordIncident("the ring broke", "lost workstation")
    assert commands[-1] == Retire("lost workstation")


def test_a_stage_or_engine_failure_breaks_the_ring_with_no_member_lost() -> None:
    host = serving_ring()
    assert host.handle(StageBroken("laptop: its stage stopped", epoch=7)) == []  # a ring before this one
    assert host.handle(seen(0.0)) == []
    assert host.handle(StageBroken("laptop: its stage stopped", epoch=0)) == []
    assert host.handle(seen(0.5))[-1] == Retire("laptop: its stage stopped")
    other = serving_ring()
    assert other.handle(seen(0.0, engine_error="the link to laptop is down"))[-1] == Retire(
        "the link to laptop is down"
    )


def test_a_broken_stage_is_forgotten_once_a_new_ring_serves() -> None:
    host = serving_ring()
    host.handle(StageBroken("laptop: its stage stopped", epoch=0))
    host.handle(seen(0.0))
    host.handle(Retired(tuple(RING)))
    assert host.handle(Deployed(("laptop", "workstation"), epoch=1))[0].text.startswith("replanned")  # type: ignore[union-attr]
    assert host.broken is None and host.handle(seen(1.0)) == []


def test_a_newcomer_on_an_idle_ring_is_taken_in_at_once() -> None:
    host = serving_ring()
    admitted(host, "phone")
    commands = host.handle(seen(0.0, alive=RING | {"phone"}, idle=True))
    assert commands[-1] == Retire("the host is replanning, taking in phone")
    assert host.handle(Retired(("laptop", "workstation", "phone"))) == [Deploy(("laptop", "workstation", "phone"))]
    assert not host.newcomers


def test_a_newcomer_under_steady_load_gets_its_replan_after_the_hosts_patience() -> None:
    host = serving_ring()
    admitted(host, "phone")
    waiting = seen(0.0, alive=RING | {"phone"})
    assert host.handle(waiting) == []  # the patience starts
    assert host.next_deadline() == LOOK_AT_LEAST_EVERY_S
    assert host.handle(dataclasses.replace(waiting, now=PATIENCE_S - 1)) == []
    assert host.next_deadline() == PATIENCE_S  # when the patience ends, if nothing happens first
    assert host.handle(dataclasses.replace(waiting, now=PATIENCE_S))[-1] == Unready(
        ("the requests running to finish, then the host to replan taking in phone",), True
    )
    assert host.handle(dataclasses.replace(waiting, now=PATIENCE_S + 1)) == []  # said once; running requests finish
    drained = host.handle(dataclasses.replace(waiting, now=PATIENCE_S + 5, idle=True))
    assert drained[-1] == Retire("the host is replanning, taking in phone")


def test_newcomers_that_leave_before_anything_was_held_change_nothing() -> None:
    host = serving_ring()
    admitted(host, "phone")
    host.handle(seen(0.0, alive=RING | {"phone"}))
    assert host.handle(seen(1.0)) == []
    assert host.newcomers_waiting_since is None and not host.newcomers and host.phase == Phase.SERVING


def test_a_newcomer_the_rendezvous_no_longer_lists_is_forgotten_though_its_link_is_up() -> None:
    host = serving_ring()
    admitted(host, "phone")
    assert host.handle(seen(0.0, alive=RING | {"phone"}, listed=RING, idle=True)) == []
    assert not host.newcomers


def test_a_newcomer_already_in_the_ring_a_replan_made_waits_for_nothing() -> None:
    """Its admission ended while a replan after a break was under way, which took it in."""
    host = serving_ring()
    host.handle(seen(0.0, alive=frozenset({"laptop", "phone"})))  # workstation lost; phone linked meanwhile
    host.handle(Retired(("laptop", "phone")))
    host.handle(Deployed(("laptop", "phone"), epoch=1))
    admitted(host, "phone")
    assert host.handle(seen(1.0, alive=frozenset({"laptop", "phone"}), idle=True)) == []


def test_an_idle_ring_is_judged_for_a_rebalance_every_few_seconds_when_it_measured_something_new() -> None:
    host = serving_ring()
    assert host.handle(seen(10.0, idle=True, measurements=MEASURED)) == [PriceRebalance()]
    assert host.next_deadline() == 10.0 + LOOK_AT_LEAST_EVERY_S
    assert host.handle(seen(10.0 + REBALANCE_CHECK_S / 2, idle=True, measurements=(((0, 4), 41),))) == []
    assert host.next_deadline() == 10.0 + REBALANCE_CHECK_S
    assert host.handle(seen(10.0 + REBALANCE_CHECK_S, idle=True, measurements=(((0, 4), 41),))) == [PriceRebalance()]
    assert host.handle(seen(20.0, measurements=(((0, 4), 42),))) == []  # busy: never judged under load


def test_no_rebalance_when_turned_off() -> None:
    host = SessionCore(policy(rebalance=False))
    host.handle(Gathered(("laptop",)))
    host.handle(Deployed(("laptop",)))
    assert host.handle(seen(10.0, alive=frozenset({"laptop"}), idle=True, measurements=MEASURED)) == []


def test_a_rebalance_is_followed_by_a_cool_down_that_doubles() -> None:
    host = serving_ring()
    now = 0.0
    for cooldown in (COOLDOWN_S, 2 * COOLDOWN_S):
        assert host.handle(seen(now, idle=True, measurements=((((0, 4), int(now)),)))) == [PriceRebalance()]
        host.handle(Judged(now, worth_it=True, reason="laptop is 2× slower"))
        host.handle(Retired(tuple(RING)))
        host.handle(Deployed(tuple(RING)))
        soon = (((0, 4), int(now) + 1),)
        assert host.handle(seen(now + cooldown - 1, idle=True, measurements=soon)) == []  # cooling down
        now += cooldown


# --- the load served -------------------------------------------------------------------------

EVERYONE = frozenset({"laptop", "workstation", "phone"})
TAKEN_IN = (
    "phone taken in: at 4 users at once, its 2 blocks save more than its place costs "
    "(10.0 ms a token with it, 14.0 ms without)"
)
LEFT_OUT = (
    "phone left out: at 1 user at once, its edges add 40.0 ms to each pass of the ring, more than its 2 blocks save"
)


def standing_by() -> SessionCore:
    """A ring of two serving, the phone standing by, planned for one user: members may stand by, so
    the host follows the load."""
    host = session(follow_load=True)
    host.handle(Opened(JOIN))
    assert host.handle(Gathered(("laptop", "workstation", "phone"))) == [Deploy(("laptop", "workstation", "phone"), 1)]
    assert host.handle(Deployed(("laptop", "workstation"), standby=("phone",))) == []
    return host


def busy(host: SessionCore, start: float, end: float, running: int, step: float = 0.5) -> list[tuple[float, Command]]:
    """Looks every `step` s from `start` to `end` while `running` requests run at once: each
    command they gave, with the time of its look."""
    given, now = [], start
    while now <= end + 1e-9:
        given += [(now, command) for command in host.handle(seen(now, alive=EVERYONE, running=running))]
        now += step
    return given


def taken_in_at_four(host: SessionCore) -> None:
    assert busy(host, 0.0, 2.0, running=4) == [] and host.load.measured is None  # 2 s of 10: not read yet
    assert host.handle(seen(2.5, alive=EVERYONE, running=4)) == [PriceLoad(4)]  # busy a quarter of the window
    assert host.load.measured == 4
    assert busy(host, 3.0, 3.0, running=4) == []  # weighed once
    assert host.handle(LoadJudged(3.1, 4, True, TAKEN_IN)) == [
        Say(f"the load calls for a replan, once no request runs: {TAKEN_IN}")
    ]
    assert busy(host, 3.5, 4.5, running=4) == []  # the requests running go on: the change waits
    assert host.handle(seen(5.0, alive=EVERYONE, idle=True)) == [
        Unready((f"the host to replan, {TAKEN_IN}",), paused=True),
        Retire(f"the host is replanning, {TAKEN_IN}"),
    ]
    everyone = ("laptop", "workstation", "phone")
    assert host.handle(Retired(everyone)) == [Deploy(everyone, 4)]  # planned for the load it serves
    assert said(host.handle(Deployed(everyone, epoch=2))) == [f"replanned with 4 members, {TAKEN_IN}"]
    assert host.ring == EVERYONE and host.standby == frozenset() and host.load.planned == 4


def test_a_member_standing_by_is_taken_in_when_the_load_grows_and_it_pays_once_no_request_runs() -> None:
    taken_in_at_four(standing_by())


def test_when_the_load_falls_the_member_is_left_out_again_after_a_cool_down_that_doubles() -> None:
    host = standing_by()
    taken_in_at_four(host)
    asked = [(now, command) for now, command in busy(host, 6.0, 80.0, running=1) if isinstance(command, PriceLoad)]
    assert asked and asked[0][1] == PriceLoad(1) and len(asked) == 1
    assert asked[0][0] >= 3.1 + COOLDOWN_S  # the cool-down from the verdict that took the phone in
    now = asked[0][0]
    host.handle(LoadJudged(now, 1, True, LEFT_OUT))
    assert host.handle(seen(now + 1, alive=EVERYONE, idle=True))[-1] == Retire(f"the host is replanning, {LEFT_OUT}")
    everyone = ("laptop", "workstation", "phone")
    assert host.handle(Retired(everyone)) == [Deploy(everyone, 1)]
    host.handle(Deployed(("laptop", "workstation"), epoch=3, standby=("phone",)))
    assert host.load.planned == 1 and host.load.cooldown_s == 4 * COOLDOWN_S  # doubled after each change


def test_a_load_between_two_or_a_burst_weighs_nothing_and_a_level_not_worth_it_is_weighed_once() -> None:
    host = standing_by()
    for step in range(60):  # 2, 2, 1, 1, 1, ...: 1.4 at once, within half a request and the hysteresis of 1
        assert host.handle(seen(step * 0.5, alive=EVERYONE, running=2 if step % 5 < 2 else 1)) == []
    assert host.load.measured is not None and 1.3 < host.load.measured < 1.6

    host = standing_by()
    assert busy(host, 0.0, 1.5, running=4) == []  # a burst of 2 s, then nothing runs: never read
    assert [c for t in range(2, 40) for c in host.handle(seen(float(t), alive=EVERYONE, idle=True))] == []

    host = standing_by()
    assert busy(host, 0.0, 3.0, running=3)[0][1] == PriceLoad(3)
    host.handle(LoadJudged(3.0, 3, False, "phone taken in: …; less than 15% faster, so who serves stays"))
    assert busy(host, 3.5, 20.0, running=3) == []  # the same level: not weighed again
    assert host.handle(seen(20.5, alive=EVERYONE, running=3, idle=True)) == []  # no change waits for the idle ring
    grown = busy(host, 21.0, 40.0, running=4)
    assert [c for _, c in grown] == [PriceLoad(4)]  # another level is


def test_under_steady_load_the_change_holds_new_requests_after_the_hosts_patience() -> None:
    host = standing_by()
    busy(host, 0.0, 2.5, running=4)
    host.handle(LoadJudged(3.0, 4, True, TAKEN_IN))
    assert host.next_deadline() <= 3.0 + PATIENCE_S
    assert busy(host, 3.0, 3.0 + PATIENCE_S - 0.5, running=4) == []
    held = host.handle(seen(3.0 + PATIENCE_S, alive=EVERYONE, running=4))
    assert held == [
        Say("the requests running finish first; new ones wait for the replan for the load"),
        Unready(("the requests running to finish, then the host to replan for the load",), paused=True),
    ]
    assert host.phase == Phase.PAUSED
    assert host.handle(seen(40.0, alive=EVERYONE, running=1)) == []  # still held: not resumed
    assert host.handle(seen(41.0, alive=EVERYONE, idle=True))[-1] == Retire(f"the host is replanning, {TAKEN_IN}")


def test_a_ring_that_breaks_while_a_change_waits_is_planned_for_the_load_the_change_was_for() -> None:
    host = standing_by()
    busy(host, 0.0, 2.5, running=4)
    host.handle(LoadJudged(3.0, 4, True, TAKEN_IN))
    broke = host.handle(seen(3.5, alive=frozenset({"laptop", "phone"}), running=4))
    assert isinstance(broke[-1], Retire)
    assert host.handle(Retired(("laptop", "phone"))) == [Deploy(("laptop", "phone"), 4)]
    assert host.load.change is None


def test_the_load_is_sampled_by_looks_while_requests_run_and_ignored_where_every_member_serves() -> None:
    host = standing_by()
    host.handle(seen(1.0, alive=EVERYONE, running=2))
    assert host.next_deadline() == 1.0 + WINDOW_S / LOAD_LOOKS
    host.handle(seen(2.0, alive=EVERYONE, idle=True))
    assert host.next_deadline() == 2.0 + LOOK_AT_LEAST_EVERY_S

    every = serving_ring()  # every member serves (`--every-member-serves`): the room's load, always
    assert all(not isinstance(c, PriceLoad) for t in range(60) for c in every.handle(seen(float(t), running=4)))
    assert every.load.measured is None


def test_requests_a_broken_ring_left_end_when_no_ring_serves_in_time() -> None:
    host = serving_ring()
    host.handle(seen(0.0, alive=frozenset({"laptop"})))
    host.handle(Retired(("laptop",), held_since=0.0))
    host.handle(DeployFailed("the link to laptop went down"))  # nothing serves: waiting for members
    assert host.phase == Phase.WAITING and host.held_since is None  # the failure ended them
    again = serving_ring()
    again.handle(seen(0.0, alive=frozenset({"laptop"})))
    again.handle(Retired(("laptop",), held_since=0.0))
    again.handle(Deployed(("laptop",), epoch=1))
    assert again.held_since is None  # the new ring took them on


def test_requests_a_broken_ring_left_end_if_the_replan_takes_longer_than_resume_within_s() -> None:
    host = serving_ring()
    host.handle(seen(0.0, alive=frozenset({"laptop"})))
    host.handle(Retired(("laptop",), held_since=1.0))
    assert host.phase == Phase.DEPLOYING
    assert host.handle(seen(RESUME_S + 0.5, arrivals=("phone",))) == []  # no joiner is answered while deploying
    assert host.next_deadline() == 1.0 + RESUME_S  # sooner than the next look it would ask for anyway
    assert host.handle(seen(1.0 + RESUME_S)) == [
        FailHeld(f"the ring broke, and no new ring served within {RESUME_S:g} s")
    ]
    assert host.held_since is None and host.phase == Phase.DEPLOYING


# --- the whole lifecycle -------------------------------------------------------------------------


def test_a_session_forms_deploys_and_serves() -> None:
    host = session()
    assert host.handle(Opened(JOIN)) == [] and host.phase == Phase.GATHERING
    assert host.handle(Gathered(("laptop", "workstation"))) == [Deploy(("laptop", "workstation"))]
    assert host.phase == Phase.DEPLOYING
    assert host.handle(Deployed(("laptop", "workstation"))) == []
    assert host.phase == Phase.SERVING


def test_a_forming_that_fails_as_a_whole_gets_a_new_code() -> None:
    host = session()
    host.handle(Opened(JOIN))
    commands = host.handle(CodeRefused("the session did not fill within 600 s"))
    assert commands == [
        Warn("refused a member", "the session did not fill within 600 s"),
        Say("that code is void now; a new one follows"),
        RenewCode("the session was closed: the session did not fill within 600 s"),
    ]
    assert host.handle(Opened("kafila join red-owl-…")) == [] and host.join_line == "kafila join red-owl-…"
    assert host.handle(Gathered(("laptop",))) == [Deploy(("laptop",))]


def test_the_rendezvous_session_is_wanted_while_anyone_may_join() -> None:
    host = serving_ring()
    assert host.wants_rendezvous_session
    for _ in range(GUESS_BUDGET):  # nobody may join any more: relay traffic alone keeps it
        host.handle(NewcomerChecked("guesser", "it proved a different code", guess=True))
    assert not host.wants_rendezvous_session
    assert not SessionCore.one_machine(policy()).wants_rendezvous_session


def test_a_session_that_loses_a_member_mid_stream_replans_then_takes_it_back_when_it_rejoins() -> None:
    host = serving_ring()
    broke = host.handle(seen(5.0, alive=frozenset({"laptop"})))
    assert broke == [
        RecordIncident("the ring broke", "lost workstation"),
        Unready(("the host to replan with the members that are left",)),
        SendAway(("workstation",)),  # its seat at the rendezvous is free at once
        Retire("lost workstation"),
    ]
    assert host.phase == Phase.DEPLOYING
    assert host.handle(Retired(("laptop",))) == [Deploy(("laptop",))]
    replanned = host.handle(Deployed(("laptop",), epoch=1))
    assert said(replanned) == ["replanned with 2 members", f"a seat is free again; to fill it: {JOIN}"]
    assert [c.kind for c in replanned if isinstance(c, Say)] == ["replanned", "note"]  # as /events files them
    back = frozenset({"laptop"})
    assert host.handle(seen(6.0, alive=back, arrivals=("workstation",))) == [Admit("workstation")]
    assert said(admitted(host, "workstation")) == [
        "workstation verified and linked; it joins the ring once no request is running"
    ]
    taking_in = host.handle(seen(7.0, alive=RING, idle=True))
    assert taking_in == [
        Unready(("the host to replan, taking in workstation",), paused=True),
        Retire("the host is replanning, taking in workstation"),
    ]
    assert host.handle(Retired(("laptop", "workstation"))) == [Deploy(("laptop", "workstation"))]
    assert said(host.handle(Deployed(("laptop", "workstation"), epoch=2))) == [
        "replanned with 3 members, taking in workstation"
    ]
    assert host.phase == Phase.SERVING and not host.paused


def test_a_newcomer_takes_a_freed_seat_until_the_guess_budget_is_spent() -> None:
    host = serving_ring()
    host.handle(seen(1.0, alive=frozenset({"laptop"})))
    host.handle(Retired(("laptop",)))
    host.handle(Deployed(("laptop",), epoch=1))
    ring = frozenset({"laptop"})
    assert host.handle(seen(2.0, alive=ring, arrivals=("phone", "tablet"))) == [
        Admit("phone"),
        Admit("tablet"),
    ]
    for guess in range(1, GUESS_BUDGET):  # one wrong code, or two, close nothing
        failed = host.handle(NewcomerChecked(f"guesser-{guess}", "it proved a different code", guess=True))
        assert failed == [Warn(f"did not admit guesser-{guess}", "it proved a different code")]
        assert host.guesses.admitting
        assert host.handle(seen(3.0, alive=ring, arrivals=(f"g{guess}",))) == [Admit(f"g{guess}")]
    spent = host.handle(NewcomerChecked("tablet", "it proved a different code", guess=True))
    assert spent[0] == Warn("did not admit tablet", "it proved a different code")
    assert said(spent)[0].startswith(f"this session admits no more members: {GUESS_BUDGET} joiners failed")
    assert not host.guesses.admitting and host.guesses.failed_proofs == GUESS_BUDGET
    refused = host.handle(seen(3.0, alive=ring, arrivals=("guesser",)))
    assert refused == [
        Refuse("guesser", "this session admits no more members; the host must start over with a new code")
    ]
    # A joiner that proved the code but left, or was refused for its own reasons, is no guess.
    other = serving_ring()
    for _ in range(2 * GUESS_BUDGET):
        other.handle(NewcomerChecked("phone", "phone left after proving the code"))
    assert other.guesses.admitting and other.guesses.failed_proofs == 0


def test_joiners_refused_while_the_session_forms_keep_its_code_until_the_guess_budget_is_spent() -> None:
    host = session()
    host.handle(Opened(JOIN))
    for why in ("did not prove the session code within 30 s", "sent garbage", "aborted"):  # no guesses
        assert host.handle(JoinerRefused("laptop", why)) == [Warn("refused laptop", why)]
    assert host.phase == Phase.GATHERING and host.guesses.failed_proofs == 0 and host.join_line == JOIN
    for _ in range(GUESS_BUDGET - 1):
        assert host.handle(JoinerRefused("guesser", "a different code", guess=True)) == [
            Warn("refused guesser", "a different code")
        ]
    ended = host.handle(JoinerRefused("guesser", "a different code", guess=True))
    assert ended[0] == Warn("refused guesser", "a different code")
    assert isinstance(ended[-1], Fail) and ended[-1].exit and "admits no one" in ended[-1].message
    assert host.phase == Phase.FAILED and not host.guesses.admitting
    assert host.handle(Gathered(("laptop",))) == []  # too late: forming has ended


def test_guesses_count_over_the_hosts_whole_life() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(JoinerRefused("guesser", "a different code", guess=True))
    host.handle(Gathered(("laptop",)))
    host.handle(Deployed(("laptop",)))
    host.handle(NewcomerChecked("guesser", "a different code", guess=True))
    assert host.guesses.admitting
    spent = host.handle(NewcomerChecked("guesser", "a different code", guess=True))
    assert not host.guesses.admitting and said(spent)[0].startswith("this session admits no more members")


def test_a_session_whose_joiners_all_left_before_it_formed_serves_alone() -> None:
    host = session()
    host.handle(Opened(JOIN))
    assert host.handle(Gathered(())) == [ServeAlone("every member failed its part")]
    assert host.handle(ServedAlone()) == [] and host.phase == Phase.SERVING


def test_a_planned_replan_under_load_holds_new_requests_then_takes_the_newcomer_in() -> None:
    host = serving_ring()
    admitted(host, "phone")
    waiting = dict(alive=RING | {"phone"})
    assert host.handle(seen(0.0, **waiting)) == []
    held = host.handle(seen(PATIENCE_S, **waiting))
    assert held == [
        Say("the requests running finish first; new ones wait for the replan taking in phone"),
        Unready(("the requests running to finish, then the host to replan taking in phone",), paused=True),
    ]
    assert host.phase == Phase.PAUSED
    assert host.handle(seen(PATIENCE_S + 1, **waiting)) == []
    drained = host.handle(seen(PATIENCE_S + 2, idle=True, **waiting))
    assert drained[-1] == Retire("the host is replanning, taking in phone")
    assert host.handle(Retired(("laptop", "workstation", "phone"))) == [Deploy(("laptop", "workstation", "phone"))]
    assert said(host.handle(Deployed(("laptop", "workstation", "phone"), epoch=1))) == [
        "replanned with 4 members, taking in phone"
    ]


def test_newcomers_that_leave_while_requests_are_held_release_them() -> None:
    host = serving_ring()
    admitted(host, "phone")
    host.handle(seen(0.0, alive=RING | {"phone"}))
    host.handle(seen(PATIENCE_S, alive=RING | {"phone"}))
    assert host.phase == Phase.PAUSED
    assert host.handle(seen(PATIENCE_S + 1)) == [
        Resume(),
        Say("the newcomers left before the replan; serving on with the ring as it is"),
    ]
    assert host.phase == Phase.SERVING and not host.paused


def test_an_idle_ring_that_measured_something_new_is_priced_and_rebalanced_when_worth_it() -> None:
    host = serving_ring()
    measured = MEASURED
    assert host.handle(seen(10.0, idle=True, measurements=measured)) == [PriceRebalance()]
    assert host.handle(Judged(10.0, worth_it=False)) == []
    later = 10.0 + REBALANCE_CHECK_S
    assert host.handle(seen(later, idle=True, measurements=tuple(measured))) == []  # nothing new to judge
    more = (((0, 4), 41), ((4, 8), 41))
    assert host.handle(seen(later + REBALANCE_CHECK_S, idle=True, measurements=more)) == [PriceRebalance()]
    why = "rebalancing by what the stages measured serving"
    rebalance = host.handle(Judged(later + REBALANCE_CHECK_S, worth_it=True, reason="laptop is 2× slower"))
    assert rebalance == [
        Say(f"{why}: laptop is 2× slower"),
        Unready((f"the host to replan, {why}",), paused=True),
        Retire(f"the host is replanning, {why}"),
    ]
    host.handle(Retired(("laptop", "workstation")))
    assert said(host.handle(Deployed(tuple(RING), epoch=1))) == [f"replanned with 3 members, {why}"]
    soon = later + REBALANCE_CHECK_S + COOLDOWN_S / 2
    assert host.handle(seen(soon, idle=True, measurements=(((0, 3), 30),))) == []  # cooling down


def test_a_plan_refused_at_the_start_ends_the_host_naming_the_device() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop",)))
    refusal = "laptop cannot hold blocks 0-25: it has 2.0 GiB, they need 3.1 GiB"
    assert host.handle(DeployFailed(refusal, refused=True)) == [Fail(f"the model does not fit: {refusal}", exit=True)]
    assert host.phase == Phase.FAILED
    assert host.handle(seen(1.0)) == []


def test_a_plan_refused_after_a_break_waits_for_members_while_anyone_may_join() -> None:
    host = serving_ring()
    host.handle(seen(1.0, alive=frozenset({"laptop"})))
    host.handle(Retired(("laptop",)))
    refusal = "laptop cannot hold blocks 0-25: it has 2.0 GiB, they need 3.1 GiB"
    commands = host.handle(DeployFailed(refusal, refused=True))
    assert commands == [
        ForgetRing(),
        Fail(f"lost workstation; the members that are left cannot hold the model: {refusal}"),
        Say(f"waiting for members to join again: {JOIN}"),
        Say(f"a seat is free again; to fill it: {JOIN}"),
    ]
    assert host.phase == Phase.WAITING
    # A member that joins again is taken in as a newcomer would be.
    assert host.handle(seen(2.0, alive=frozenset({"laptop"}), arrivals=("workstation",))) == [Admit("workstation")]
    admitted(host, "workstation")
    back = host.handle(seen(3.0, alive=RING, idle=True))
    assert back[-1] == Retire("the host is replanning, taking in workstation")
    host.handle(Retired(("laptop", "workstation")))
    host.handle(Deployed(("laptop", "workstation"), epoch=1))
    assert host.phase == Phase.SERVING


def test_with_nobody_able_to_join_a_failed_replan_is_the_end() -> None:
    host = serving_ring()
    for _ in range(GUESS_BUDGET):
        host.handle(NewcomerChecked("guesser", "it proved a different code", guess=True))
    host.handle(seen(1.0, alive=frozenset({"laptop"})))
    host.handle(Retired(("laptop",)))
    commands = host.handle(DeployFailed("the link to laptop went down"))
    assert commands == [ForgetRing(), Fail("lost workstation; replanning failed: the link to laptop went down")]
    assert host.phase == Phase.FAILED


def test_a_member_that_fails_its_part_is_sent_home_and_the_rest_planned_again_down_to_none() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop", "workstation")))
    stalled = "workstation did not load its stage in 900 s"
    assert host.handle(MemberFailed("workstation", stalled)) == [
        Warn("leaving a member out", stalled),
        Dismiss("workstation", f"the host left this member out: {stalled}"),
    ]
    assert host.handle(Dismissed("workstation", ("laptop", "workstation"))) == [Deploy(("laptop",))]
    host.handle(MemberFailed("laptop", "laptop left before it could load its stage"))
    assert host.handle(Dismissed("laptop", ())) == [ServeAlone("every member failed its part")]
    assert host.handle(ServedAlone()) == [] and host.phase == Phase.SERVING


GIB = 2**30
OUT_OF_MEMORY = "workstation could not load its stage: ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate"


def ran_out(needed: int, can_hold: int | None = None, smallest: int = GIB // 4) -> MemberFailed:
    """The workstation could not load blocks 2-5 for lack of memory."""
    shortage = MemoryShortage((2, 6), needed, can_hold)
    return MemberFailed("workstation", OUT_OF_MEMORY, shortage, smallest, "workstation")


def test_a_member_that_runs_out_of_memory_is_planned_again_with_less_of_it_not_sent_home() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop", "workstation")))
    assert host.handle(ran_out(4 * GIB)) == [
        Warn(
            "workstation ran out of memory loading blocks 2-5 (needed 4.00 GiB); replanning with 3.00 GiB for it",
            OUT_OF_MEMORY,
        ),
        LowerMemory("workstation", 3 * GIB),
        Deploy(("laptop", "workstation")),  # the same members again
    ]
    assert host.phase == Phase.DEPLOYING
    assert host.handle(Deployed(("laptop", "workstation"))) == [] and host.phase == Phase.SERVING


def test_what_a_member_says_it_can_hold_lowers_its_memory_further() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop", "workstation")))
    commands = host.handle(ran_out(4 * GIB, can_hold=GIB))
    assert LowerMemory("workstation", GIB) in commands and commands[-1] == Deploy(("laptop", "workstation"))
    commands = host.handle(ran_out(4 * GIB, can_hold=8 * GIB))  # more free than 3/4 of the need: 3/4 it is
    assert LowerMemory("workstation", 3 * GIB) in commands


def test_a_member_short_of_memory_again_and_again_is_left_out_at_last() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop", "workstation")))
    needed = 8 * GIB
    for _ in range(MEMORY_LOWERINGS):
        commands = host.handle(ran_out(needed))
        lowered = next(c.memory_bytes for c in commands if isinstance(c, LowerMemory))
        assert lowered == needed * 3 // 4 and commands[-1] == Deploy(("laptop", "workstation"))
        needed = lowered
    assert host.handle(ran_out(needed)) == [
        Warn(
            "leaving a member out", f"{OUT_OF_MEMORY} (still short of memory after {MEMORY_LOWERINGS} smaller shares)"
        ),
        Dismiss(
            "workstation",
            f"the host left this member out: {OUT_OF_MEMORY} (still short of memory after {MEMORY_LOWERINGS} "
            "smaller shares)",
        ),
    ]
    assert host.handle(Dismissed("workstation", ("laptop", "workstation"))) == [Deploy(("laptop",))]


def test_a_member_that_could_not_hold_even_the_smallest_stage_is_left_out() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop", "workstation")))
    commands = host.handle(ran_out(GIB, smallest=GIB))  # 3/4 of a block: no stage fits it
    assert commands == [
        Warn("leaving a member out", f"{OUT_OF_MEMORY} (it cannot hold even the smallest stage)"),
        Dismiss(
            "workstation", f"the host left this member out: {OUT_OF_MEMORY} (it cannot hold even the smallest stage)"
        ),
    ]


OWN_OUT_OF_MEMORY = "this machine could not load its blocks 0-3: failed to allocate buffer for kv cache"


def test_a_host_short_of_memory_for_its_own_share_plans_again_with_less_of_it_and_ends_when_that_is_spent() -> None:
    """The host's own share is lowered as a member's is; a host cannot be left out, so when it is
    still short after MEMORY_LOWERINGS smaller shares, nothing serves."""
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop",)))
    needed = 8 * GIB
    commands = host.handle(OwnShortOfMemory(OWN_OUT_OF_MEMORY, MemoryShortage((0, 4), needed), GIB // 4))
    assert commands == [
        Warn(
            "this machine ran out of memory loading blocks 0-3 (needed 8.00 GiB); replanning with 6.00 GiB of it",
            OWN_OUT_OF_MEMORY,
        ),
        LowerOwnMemory(6 * GIB),
        Deploy(("laptop",)),  # the same members again
    ]
    for _ in range(MEMORY_LOWERINGS - 1):
        needed = needed * 3 // 4
        assert host.handle(OwnShortOfMemory(OWN_OUT_OF_MEMORY, MemoryShortage((0, 4), needed)))[-1] == Deploy(
            ("laptop",)
        )
    assert host.handle(OwnShortOfMemory(OWN_OUT_OF_MEMORY, MemoryShortage((0, 4), needed))) == [
        Fail(
            f"the session could not start: {OWN_OUT_OF_MEMORY} (still short of memory after {MEMORY_LOWERINGS} smaller "
            "shares)",
            exit=True,
        )
    ]
    assert host.phase == Phase.FAILED


def test_a_host_that_cannot_hold_even_the_smallest_stage_of_its_own_ends_at_once() -> None:
    host = session()
    host.handle(Opened(JOIN))
    host.handle(Gathered(("laptop",)))
    said_free = MemoryShortage((0, 4), 4 * GIB, can_hold_bytes=GIB // 8)
    assert host.handle(OwnShortOfMemory(OWN_OUT_OF_MEMORY, said_free, GIB // 4)) == [
        Fail(f"the session could not start: {OWN_OUT_OF_MEMORY} (it cannot hold even the smallest stage)", exit=True)
    ]


def test_a_member_short_of_memory_in_a_replan_is_planned_again_with_the_members_of_that_replan() -> None:
    host = serving_ring(("laptop", "workstation", "phone"))
    host.handle(seen(1.0, alive=RING))  # phone lost
    assert host.handle(Retired(("laptop", "workstation"))) == [Deploy(("laptop", "workstation"))]
    assert host.handle(ran_out(2 * GIB))[-1] == Deploy(("laptop", "workstation"))
    assert said(host.handle(Deployed(("laptop", "workstation"), epoch=1))) == [
        "replanned with 3 members",
        f"a seat is free again; to fill it: {JOIN}",
    ]


def test_a_replan_with_no_member_left_serves_alone() -> None:
    host = serving_ring(("laptop",))
    host.handle(seen(1.0, alive=frozenset()))
    assert host.handle(Retired(())) == [ForgetRing(), ServeAlone("replanned: no member is left")]
    assert said(host.handle(ServedAlone())) == [f"a seat is free again; to fill it: {JOIN}"]
    assert host.handle(seen(2.0, alive=frozenset(), engine_error="out of memory")) == [
        Fail("serving alone failed: out of memory")
    ]
    assert host.phase == Phase.FAILED


def test_ctrl_c_ends_the_session_and_losses_after_it_are_no_failure() -> None:
    host = serving_ring()
    assert host.handle(Interrupted("the host is shutting down")) == [AbandonRing("the host is shutting down")]
    assert host.phase == Phase.STOPPING
    assert host.handle(seen(1.0, alive=frozenset())) == []
    assert host.handle(Deployed(tuple(RING))) == []


def test_ctrl_c_while_requests_wait_for_a_replan_tells_them_there_will_be_none() -> None:
    host = serving_ring()
    admitted(host, "phone")
    host.handle(seen(0.0, alive=RING | {"phone"}, idle=True))  # the replan by choice begins
    assert host.paused
    assert host.handle(Interrupted("the host is shutting down")) == [
        Unready((), failure="the host is shutting down"),
        AbandonRing("the host is shutting down"),
    ]


def test_one_machines_failed_stages_are_loaded_again_as_one() -> None:
    host = session(networked=False)
    assert host.phase == Phase.DEPLOYING  # `kafila host` with no members loads its own stages
    assert host.handle(ServedAlone()) == [] and host.phase == Phase.SERVING
    failed = host.handle(Look(now=1.0, engine_error="stage 1 stopped"))
    assert failed == [
        RecordIncident("a stage failed", "stage 1 stopped"),
        Unready(("the host to replan without the failed stage",)),
        Retire("stage 1 stopped", learn=False),
    ]
    assert host.handle(Retired(())) == [ServeAlone("replanned")]
    assert host.handle(DeployFailed("needs 3.1 GiB, has 2.0 GiB", refused=True)) == [
        Fail("stage 1 stopped; the host cannot serve alone: needs 3.1 GiB, has 2.0 GiB")
    ]
    assert host.handle(Look(now=10.0, idle=True, measurements=MEASURED)) == []  # no rebalance on one machine


MEMBERS = ("laptop", "workstation", "phone")


def looked(now: float, alive: set[str], listed: set[str], arrivals: list[str], running: int, error: str | None) -> Look:
    measurements = (((0, 2), int(now)),)
    return seen(now, alive=frozenset(alive), listed=frozenset(listed), arrivals=tuple(arrivals), idle=running == 0,
                running=running, engine_error=error, measurements=measurements)  # fmt: skip


some = st.lists(st.sampled_from(MEMBERS), max_size=2)
events = st.one_of(
    st.builds(looked, st.floats(0, 1000), st.sets(st.sampled_from(MEMBERS)), st.sets(st.sampled_from(MEMBERS)), some,
              st.integers(0, 4), st.none() | st.just("the engine failed")),
    st.builds(StageBroken, st.just("a stage stopped"), st.integers(0, 3)),
    st.builds(StartFailed, st.just("no rendezvous"), st.booleans()),
    st.builds(Gathered, st.tuples(st.sampled_from(MEMBERS))),
    st.builds(CodeRefused, st.just("did not fill")),
    st.builds(JoinerRefused, st.sampled_from(MEMBERS), st.just("wrong code"), st.booleans()),
    st.builds(NewcomerChecked, st.sampled_from(MEMBERS), st.none() | st.just("no"), st.booleans(),
              st.sampled_from(MEMBERS)),
    st.builds(Retired, st.lists(st.sampled_from(MEMBERS), max_size=3).map(tuple), st.none() | st.floats(0, 1000)),
    st.builds(Deployed, st.lists(st.sampled_from(MEMBERS), max_size=3).map(tuple), st.integers(0, 3)),
    st.builds(MemberFailed, st.sampled_from(MEMBERS), st.just("stalled")),
    st.builds(MemberFailed, st.sampled_from(MEMBERS), st.just("ran out of memory"),
              st.builds(MemoryShortage, st.just((0, 2)), st.integers(0, 2**40), st.none() | st.integers(0, 2**40)),
              st.integers(0, 2**40)),
    st.builds(Dismissed, st.sampled_from(MEMBERS), st.lists(st.sampled_from(MEMBERS), max_size=3).map(tuple)),
    st.builds(DeployFailed, st.just("does not fit"), st.booleans()),
    st.just(ServedAlone()),
    st.builds(Judged, st.floats(0, 1000), st.booleans(), st.just("faster")),
    st.builds(LoadJudged, st.floats(0, 1000), st.integers(1, 4), st.booleans(), st.just("phone taken in")),
    st.builds(Opened, st.just(JOIN)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(events, max_size=40), st.booleans(), st.booleans())
def test_whatever_happens_at_most_one_command_answers_and_it_comes_last(
    history: list[Event], networked: bool, follow_load: bool
) -> None:
    """The shell feeds the answer of a command back as the next event: an answered command that
    was not last would be answered after commands that came later, and two would race."""
    host = session(networked=networked, follow_load=follow_load)
    for event in history:
        commands = host.handle(event)
        answered = [i for i, c in enumerate(commands) if isinstance(c, ANSWERED)]
        assert len(answered) <= 1 and answered in ([], [len(commands) - 1]), (event, commands)
        assert (host.deployment is not None) == (host.phase == Phase.DEPLOYING), (event, host)
        assert host.next_deadline() > host.last_look, (event, host)  # the shell never spins
        if host.phase != Phase.DEPLOYING:  # the newcomers left for a plan are none of the ring's
            assert not host.newcomers & host.ring, (event, host)
    assert host.handle(Interrupted("stop"))[-1] == AbandonRing("stop")
    assert host.handle(Stopped("stop")) == [] and host.phase == Phase.STOPPING


def test_a_join_keeps_trying_for_a_seat_another_holds_and_a_join_again_for_a_network_coming_back() -> None:
    full = RendezvousError("session_full", "session 7-red-fox is full")
    for rejoining in (False, True):  # a squatter's seat is freed once it fails the code; a dead one's in 120 s
        assert worth_retrying(full, rejoining=rejoining, since_s=100.0)
        assert not worth_retrying(full, rejoining=rejoining, since_s=REJOIN_WINDOW_S)  # not for ever
    unreachable = RendezvousUnreachable("no kafila rendezvous answers at 203.0.113.1:8470: timed out")
    for error in (unreachable, RendezvousClosed(), OSError("network is unreachable"), TimeoutError()):
        assert worth_retrying(error, rejoining=True, since_s=5.0), error
        assert not worth_retrying(error, rejoining=True, since_s=UNREACHABLE_WINDOW_S)  # the host is gone
        assert not worth_retrying(error, rejoining=False, since_s=0.0)  # a first join says why at once
    for error in (RendezvousError("unknown_code", "no session has this code"), ValueError("bad")):
        assert not worth_retrying(error, rejoining=True, since_s=5.0), error
    assert [retry_pause(full, tries) for tries in range(1, 7)] == [3.0, 6.0, 12.0, 24.0, 30.0, 30.0]
    assert retry_pause(RendezvousError("rate_limited", "slow down", retry_after_s=20), 1) == 20.0


def test_a_member_joins_again_while_its_joins_last_and_a_few_times_in_a_row() -> None:
    rejoins = Rejoins(limit=3, steady_s=60.0)
    assert [rejoins.after_loss(5.0) for _ in range(4)] == [True, True, True, False]  # quick losses run out
    steady = Rejoins(limit=3, steady_s=60.0)
    assert all(steady.after_loss(lasted) for lasted in (5.0, 5.0, 120.0, 5.0, 5.0, 61.0))  # a lasting join resets
