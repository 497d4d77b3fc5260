"""The serving host's decisions, pure: what to do next, given what its session looks like now.

The host's shell (`runner.HostRunner.watch_network`) reads a `SessionView` of its session several
times a second and asks `ServingCore.next_action` what to do; it carries the action out and asks
again. The core reads no clock and does no I/O: the view brings the time. Its own state, the
patience with newcomers and the rebalance schedule, changes only in `next_action`, so a test
drives every path with made-up views and times (tests/test_session_core.py).

The rules, in the order they are tried (the first that applies decides):
1. members arrived: check their code, one at a time;
2. the ring broke (a member lost, a stage's report of failure, the engine's error): replan with
   those left;
3. admitted newcomers wait: replan with them once no request runs; under steady load, after
   `newcomer_patience_s`, hold new requests so the running ones can finish;
4. the newcomers left before their replan: stop holding requests;
5. an idle ring, every `rebalance_check_s` after any cool-down: judge whether to divide again.
"""

from __future__ import annotations

from dataclasses import dataclass

REBALANCE_CHECK_S = 2.0  # how often an idle ring's measurements are read (the stage report's refresh)


@dataclass(frozen=True)
class SessionView:
    """What the host sees of its serving session at one moment."""

    now: float  # monotonic seconds
    deployed: frozenset[str]  # the members the ring was planned with
    alive: frozenset[str]  # members still linked
    engine: bool = True  # an engine loop serves (or turns requests away while paused)
    arrivals: tuple[str, ...] = ()  # joined, their code not yet checked
    newcomers: tuple[str, ...] = ()  # admitted, waiting for a plan that takes them in
    broken: str | None = None  # a stage's report that it stopped
    engine_error: str | None = None  # the engine loop's failure
    idle: bool = True  # no request running or queued
    ready: bool = True  # /v1 serves (not paused, not replanning)


@dataclass(frozen=True)
class Admit:
    member: str


@dataclass(frozen=True)
class ReplanAfterBreak:
    lost: tuple[str, ...]  # members of the ring no longer linked (none: a stage or the engine failed)


@dataclass(frozen=True)
class ReplanWithNewcomers:
    newcomers: tuple[str, ...]


@dataclass(frozen=True)
class HoldRequests:
    """New requests wait while those running finish, so the newcomers get their replan."""

    newcomers: tuple[str, ...]


@dataclass(frozen=True)
class StopHolding:
    """The newcomers left before their replan: serve on with the ring as it is."""


@dataclass(frozen=True)
class JudgeRebalance:
    """Read the idle ring's measurements and replan if a division clearly faster fits."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the session changes."""


Action = Admit | ReplanAfterBreak | ReplanWithNewcomers | HoldRequests | StopHolding | JudgeRebalance | Wait
WAIT = Wait()


@dataclass
class ServingCore:
    """The host's patience with newcomers and its rebalance schedule, and the rules that use them."""

    newcomer_patience_s: float
    rebalance_cooldown_s: float
    rebalance: bool = True  # divide again when the stages' measured times clearly call for it
    newcomers_waiting_since: float | None = None
    holding: bool = False  # new requests are held for the newcomers' replan
    next_rebalance_check: float = 0.0
    judged: object = None  # the stages' measurements when last judged for a rebalance

    def next_action(self, view: SessionView) -> Action:
        return (
            self._admit_arrivals(view)
            or self._replan_after_break(view)
            or self._take_in_newcomers(view)
            or self._newcomers_left(view)
            or self._judge_rebalance(view)
            or WAIT
        )

    def rebalanced(self, now: float) -> None:
        """A rebalance was judged worth it and begins: no other for a cool-down, doubled each time,
        so a ring on a machine whose load comes and goes cannot flap between divisions."""
        self.next_rebalance_check = now + self.rebalance_cooldown_s
        self.rebalance_cooldown_s *= 2

    def worth_judging(self, measurements: object) -> bool:
        """Whether the stages measured anything since the last judgement (an idle ring's report
        refreshes without news)."""
        if measurements == self.judged:
            return False
        self.judged = measurements
        return True

    def replanned(self) -> None:
        """A replan took the newcomers in (or the ring broke first): nothing is held for them now."""
        self.newcomers_waiting_since = None
        self.holding = False

    # --- the rules ---
    @staticmethod
    def _admit_arrivals(view: SessionView) -> Action | None:
        return Admit(view.arrivals[0]) if view.arrivals else None

    @staticmethod
    def _replan_after_break(view: SessionView) -> Action | None:
        lost = tuple(sorted(view.deployed - view.alive))
        if lost or view.broken is not None or view.engine_error is not None:
            return ReplanAfterBreak(lost)
        return None

    def _take_in_newcomers(self, view: SessionView) -> Action | None:
        if not view.newcomers:
            return None
        if view.idle:
            self.replanned()
            return ReplanWithNewcomers(view.newcomers)
        if self.newcomers_waiting_since is None:
            self.newcomers_waiting_since = view.now
        elif view.now - self.newcomers_waiting_since >= self.newcomer_patience_s and view.ready and not self.holding:
            self.holding = True
            return HoldRequests(view.newcomers)
        return WAIT

    def _newcomers_left(self, view: SessionView) -> Action | None:
        if self.newcomers_waiting_since is None:
            return None
        was_holding = self.holding
        self.replanned()
        return StopHolding() if was_holding else WAIT

    def _judge_rebalance(self, view: SessionView) -> Action | None:
        if not self.rebalance or not view.engine or not view.idle or view.now < self.next_rebalance_check:
            return None
        self.next_rebalance_check = view.now + REBALANCE_CHECK_S
        return JudgeRebalance()
