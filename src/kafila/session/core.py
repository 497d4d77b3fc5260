"""The host's decisions, pure: what to do next, given what happened and what its session looks like.

`SessionCore` is the whole lifecycle as a state machine (gathering, deploying, serving, paused,
waiting, failed, stopping). The shell (`runner.HostRunner`) hands it typed events (the vocabulary
is `session.lifecycle`), carries out the commands `handle` returns, in order, and hands back the
answer of the last one. After each batch of events, and at `next_deadline()` if nothing happens
first, the shell hands it a `Look` at the facts that are states rather than happenings (links
up, the engine idle). The core reads no clock and does no I/O: events bring the time. So a test
drives every path with made-up events (tests/test_session_core.py), as aioquic's tests drive a
connection with made-up datagrams.

Every decision's state lives here: the ring that serves, its epoch and whether a stage broke,
the members standing by, the newcomers waiting for a plan and since when, requests a broken ring
left and since when, the rebalance schedule, the load served and the load the ring was planned
for, the guess budget and the memory each machine is planned with.

Who serves is the planner's choice (`planner.who_serves`): every deployment is planned over every
member still linked, for the load served, so a member standing by is weighed again at each replan
(a member lost, a newcomer, a rebalance) and whenever the load moves, and taken in when it pays.
One standing by that leaves frees its seat.

While a ring serves, each look first answers joiners (admit, or refuse once the guess budget is
spent) and ends requests a broken ring left that waited too long; then one chain of rules, the
first that applies deciding:
1. the ring broke (a member's link down, a stage's report, the engine's error): replan with
   those left;
2. admitted newcomers wait: replan with them once no request runs; under steady load, after
   `newcomer_patience_s`, hold new requests so the running ones can finish;
3. a change of who serves that the load called for (6) waits the same way;
4. the newcomers left while requests were held for them: serve on;
5. an idle ring whose stages measured something new, every `REBALANCE_CHECK_S` after any
   cool-down: price whether dividing again is clearly faster;
6. where members may stand by, the load the ring serves (`LoadWatch`: requests at once over the
   busy part of a window) moved clearly off the load it was planned for, after any cool-down:
   weigh who serves at that load, and change it when another ring is clearly faster.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
    Measurements,
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

GUESS_BUDGET = 3  # failed proofs of the code a host takes in its whole life, over every code it issues
MEMORY_LOWERINGS = 3  # smaller shares a machine that runs out of memory gets before it is left out
MEMORY_LOWERED_TO = 0.75  # of what the stage it could not load needed
REBALANCE_CHECK_S = 2.0  # how often an idle ring's measurements are read (the stage report's refresh)
# The longest the shell goes without a look: the sources push what happens (a link down, a stage's
# report, an admission, the engine breaking), and this is how soon a fact none pushes is seen
# (the ring idle, a request starting).
LOOK_AT_LEAST_EVERY_S = 1.0
LOOK_GAP_S = 0.05  # the least time between two looks the core asks for
ANSWERED = (Retire, Deploy, Dismiss, ServeAlone, PriceRebalance, PriceLoad, RenewCode)  # commands answered by an event
FIRST_PLAN_LOAD = 1  # requests at once a session's first ring is planned for, before any load is seen
LOAD_BUSY_SHARE = 0.25  # the load is read once the ring was busy this share of the window at least
LOAD_HYSTERESIS = 0.25  # requests at once past the half that rounds, before the load counts as moved
LOAD_LOOKS = 10  # looks per window while the ring is busy: what the load is sampled by


@dataclass(frozen=True)
class ServingPolicy:
    """The host's patience, from its command line and environment."""

    newcomer_patience_s: float = 30.0  # admitted newcomers wait this long under load before requests are held
    rebalance_cooldown_s: float = 60.0  # the least time between two rebalances, doubled after each
    rebalance: bool = True  # divide again when the stages' measured times clearly call for it
    resume_within_s: float = 60.0  # how long requests a broken ring left wait for the next ring
    follow_load: bool = False  # weigh who serves again when the load moves (where members may stand by)
    load_window_s: float = 30.0  # the load is the mean requests at once over the busy part of this window
    load_cooldown_s: float = 60.0  # the least time between two replans for load, doubled after each


@dataclass(frozen=True)
class _Start:
    """The first deployment of a session."""


@dataclass(frozen=True)
class _Replan:
    """A deployment again over the members left: after a break, or by choice (`why` says which)."""

    error: str  # what broke, or why the host chose to
    why: str = ""  # ", taking in …" for a replan by choice
    after_break: bool = False


@dataclass(frozen=True)
class _Recover:
    """One machine's stages failed: load them again as one."""

    error: str


_Deployment = _Start | _Replan | _Recover


@dataclass
class Lowerings:
    """The smaller shares each machine that ran out of memory loading its own was given: each time
    MEMORY_LOWERED_TO of what the share needed (or what it said it can hold, if less), at most
    MEMORY_LOWERINGS times, and never below the smallest stage."""

    members: dict[str, int] = field(default_factory=dict)  # member → smaller shares it was given
    own: int = 0  # smaller shares this host gave itself

    def replan(
        self,
        member: str | None,
        name: str,
        failed: str,
        shortage: MemoryShortage,
        smallest: int,
        members: tuple[str, ...],
        load: int | None = None,
    ) -> list[Command] | str:
        """Plan `members` again, for `load`, with less of the memory of the machine that ran out
        (`member` named `name`, or None: this host); or why it cannot be lowered."""
        times = self.own if member is None else self.members.get(member, 0)
        if times >= MEMORY_LOWERINGS:
            return f"still short of memory after {times} smaller shares"
        lowered = int(shortage.needed_bytes * MEMORY_LOWERED_TO)
        if shortage.can_hold_bytes is not None:
            lowered = min(lowered, shortage.can_hold_bytes)
        if lowered < smallest:
            return "it cannot hold even the smallest stage"
        if member is None:
            self.own += 1
        else:
            self.members[member] = times + 1
        (first, end), needed = shortage.blocks, shortage.needed_bytes / 2**30
        whose = "of it" if member is None else "for it"
        return [
            Warn(
                f"{name} ran out of memory loading blocks {first}-{end - 1} (needed {needed:.2f} GiB); "
                f"replanning with {lowered / 2**30:.2f} GiB {whose}",
                failed,
            ),
            LowerOwnMemory(lowered) if member is None else LowerMemory(member, lowered),
            Deploy(members, load),
        ]


@dataclass
class GuessBudget:
    """Failed proofs of the code over the host's whole life, every code it issued included: each
    may be someone guessing the secret, so after GUESS_BUDGET no one is admitted any more."""

    failed_proofs: int = 0

    @property
    def admitting(self) -> bool:
        return self.failed_proofs < GUESS_BUDGET

    def spent_by_one_more(self) -> bool:
        """Count a failed proof; True when that spends the budget."""
        self.failed_proofs += 1
        return not self.admitting

    def answer(self, member: str) -> Command:
        """Who may take a freed seat: anyone who proves the code, until someone fails to."""
        if self.admitting:
            return Admit(member)
        return Refuse(member, "this session admits no more members; the host must start over with a new code")


@dataclass
class RebalanceSchedule:
    """When an idle ring's measurements are read next, and the cool-down after each rebalance,
    doubled each time, so a ring on a machine whose load comes and goes cannot flap between
    divisions. An idle ring's report refreshes without news: it is judged only on news."""

    cooldown_s: float
    next_check: float = 0.0
    judged: Measurements | None = None  # the stages' measurements when last judged
    due: bool = False  # the last look brought news to judge

    def looked(self, look: Look, rebalancing: bool) -> None:
        self.due = False
        if rebalancing and look.idle and look.now >= self.next_check:
            self.next_check = look.now + REBALANCE_CHECK_S
            self.due, self.judged = look.measurements != self.judged, look.measurements

    def judge(self, _look: Look) -> list[Command] | None:
        """The rule: news to judge, and nothing before it decided."""
        return [PriceRebalance()] if self.due else None

    def begun(self, now: float) -> None:
        """A rebalance was judged worth it and begins."""
        self.next_check = now + self.cooldown_s
        self.cooldown_s *= 2


@dataclass(frozen=True)
class LoadChange:
    """A change of who serves that the load called for, judged worth a replan, waiting for a
    moment without requests (since `waiting_since`)."""

    users: int
    why: str
    waiting_since: float


@dataclass
class LoadWatch:
    """The load the ring serves, and when it calls for weighing who serves again.

    The load is the mean of requests served at once over the part of the last `window_s` when any
    ran, each look's count held until the next look: what matters to a ring's time per token is
    how many share it while it serves, not how long it idles. It is read once the ring was busy
    LOAD_BUSY_SHARE of the window, so a burst does not move it; it has moved once it is half a
    request past the load planned for, and LOAD_HYSTERESIS more, so a load between two does not
    weigh both in turn; a level found not worth a replan is not weighed again until the load moves
    to another; after a replan for load, `cooldown_s` passes, doubled each time, before the next."""

    window_s: float
    cooldown_s: float
    planned: int = FIRST_PLAN_LOAD  # requests at once the serving ring was planned for
    spans: deque[tuple[float, float, int]] = field(default_factory=deque)  # (from, to, requests) while busy
    last: tuple[float, int] | None = None  # the previous look's time and requests at once
    measured: float | None = None  # the load read at the last look, if the window was busy enough
    not_before: float = 0.0  # the cool-down after a replan for load
    weighed: int | None = None  # the level last weighed: not again until the load moves to another
    due: int | None = None  # the level to weigh at this look
    change: LoadChange | None = None  # a replan for load judged worth it, not begun yet
    reason: str = ""  # the last verdict, in words

    def looked(self, look: Look, following: bool) -> None:
        self.due = None
        if not following:  # no ring serves (or members may not stand by): nothing to sample
            self.last = None
            return
        if self.last is not None and self.last[1] > 0 and look.now > self.last[0]:
            self.spans.append((self.last[0], look.now, self.last[1]))
        self.last = (look.now, look.running)
        start = look.now - self.window_s
        while self.spans and self.spans[0][1] <= start:
            self.spans.popleft()
        within = [(end - max(begin, start), n) for begin, end, n in self.spans if end > start]
        busy = sum(seconds for seconds, _ in within)
        if busy < self.window_s * LOAD_BUSY_SHARE:
            self.measured = None
            return
        self.measured = sum(seconds * n for seconds, n in within) / busy
        level = max(1, int(self.measured + 0.5))
        moved = abs(self.measured - self.planned) >= 0.5 + LOAD_HYSTERESIS
        if moved and level not in (self.planned, self.weighed) and self.change is None and look.now >= self.not_before:
            self.due = level

    @property
    def busy(self) -> bool:
        """Whether the last look saw requests running: the load is sampled then."""
        return self.last is not None and self.last[1] > 0

    def judge(self, _look: Look) -> list[Command] | None:
        """The rule: a level to weigh, and nothing before it decided. It is weighed once."""
        if self.due is None:
            return None
        self.weighed, self.due = self.due, None
        return [PriceLoad(self.weighed)]

    def judged(self, verdict: LoadJudged) -> bool:
        """A verdict came: True when it calls for a replan, which waits for a moment without requests."""
        self.reason = verdict.reason
        if not verdict.worth_it:
            return False
        self.change = LoadChange(verdict.users, verdict.reason, verdict.now)
        self.not_before = verdict.now + self.cooldown_s
        self.cooldown_s *= 2
        return True

    def begin(self) -> str:
        """A replan begins: it is planned for the change's load, if one waits; its reason, if so."""
        change, self.change = self.change, None
        if change is None:
            return ""
        self.planned = change.users
        return change.why

    def replanned(self) -> None:
        """A new ring serves: its load is read afresh, and every level may be weighed again."""
        self.spans.clear()
        self.last, self.measured, self.weighed = None, None, None


@dataclass
class SessionCore:
    """The host's whole lifecycle, pure: `handle(event)` changes the state and returns the commands
    for the shell (`runner.HostRunner`) to carry out, in order; a command that answers (`ANSWERED`)
    comes last, and its answer is the next event. It reads no clock and does no I/O."""

    policy: ServingPolicy = field(default_factory=ServingPolicy)
    networked: bool = True  # members may come and go; False: one machine's own stages
    phase: Phase = Phase.GATHERING
    guesses: GuessBudget = field(default_factory=GuessBudget)
    join_line: str = ""
    deployment: _Deployment | None = None  # the deployment under way, while DEPLOYING
    paused: bool = False  # /v1 holds requests for a replan by choice
    deploying: tuple[str, ...] = ()  # the members of the deployment under way
    lowerings: Lowerings = field(default_factory=Lowerings)
    ring: frozenset[str] = frozenset()  # the members of the ring that serves
    standby: frozenset[str] = frozenset()  # linked, and left out of the ring: it is faster without them
    epoch: int = 0  # the serving ring's: a stage's report of another epoch is stale
    broken: str | None = None  # a stage's report that it stopped
    newcomers: frozenset[str] = frozenset()  # admitted, waiting for a plan that takes them in
    newcomers_waiting_since: float | None = None  # since when they wait on a busy ring
    held_since: float | None = None  # requests a broken ring left wait for the next ring since then
    rebalances: RebalanceSchedule = field(init=False)
    load: LoadWatch = field(init=False)
    last_look: float = 0.0

    def __post_init__(self) -> None:
        self.rebalances = RebalanceSchedule(self.policy.rebalance_cooldown_s)
        self.load = LoadWatch(self.policy.load_window_s, self.policy.load_cooldown_s)

    @classmethod
    def one_machine(cls, policy: ServingPolicy) -> SessionCore:
        """A session of this machine's own stages, loading them: `ServedAlone` once they serve."""
        return cls(policy, networked=False, phase=Phase.DEPLOYING, deployment=_Start())

    @property
    def wants_rendezvous_session(self) -> bool:
        """Whether the session at the rendezvous must live on: while anyone may still join (a
        member that blips rejoins through it); once the guess budget is spent, relay traffic
        alone keeps it."""
        return self.networked and self.guesses.admitting and self.phase not in (Phase.FAILED, Phase.STOPPING)

    def next_deadline(self) -> float:
        """When the shell is to look next if nothing happens first (aioquic's `get_timer`); never
        sooner than LOOK_GAP_S after the last look, so a deadline no look moves cannot spin it."""
        due = [self.last_look + LOOK_AT_LEAST_EVERY_S]
        if self.held_since is not None:
            due.append(self.held_since + self.policy.resume_within_s)
        if self.phase == Phase.SERVING:
            if self.newcomers_waiting_since is not None:
                due.append(self.newcomers_waiting_since + self.policy.newcomer_patience_s)
            if self._rebalancing and self.rebalances.next_check > self.last_look:  # else the next look
                due.append(self.rebalances.next_check)
            if self._following_load and self.load.busy:  # the load is sampled by looks
                due.append(self.last_look + self.policy.load_window_s / LOAD_LOOKS)
            if self.load.change is not None:
                due.append(self.load.change.waiting_since + self.policy.newcomer_patience_s)
        return max(min(due), self.last_look + LOOK_GAP_S)

    def handle(self, event: Event) -> list[Command]:
        if self.phase == Phase.STOPPING:
            return []  # members leave when the session ends: that is not a failure
        match event:
            case Look():
                return self._looked(event)
            case Interrupted(reason=reason):
                held = self.paused  # requests waiting for a planned replan: there will be none
                self.phase, self.paused = Phase.STOPPING, False
                return [*([Unready((), failure=reason)] if held else []), AbandonRing(reason)]
            case Stopped():
                self.phase = Phase.STOPPING
                return []
            case StageBroken(report=report, epoch=epoch):
                if epoch == self.epoch and self.ring:
                    self.broken = self.broken or report
                return []
            case StartFailed(message=message, refused=refused) if self.phase != Phase.FAILED:
                self.phase, self.deployment = Phase.FAILED, None
                return [self._fail(_start_failure(message, refused), exit=True)]
            case Opened(join_line=line) if self.phase == Phase.GATHERING:
                self.join_line = line
                return []
            case Gathered(members=members) if self.phase == Phase.GATHERING:
                if not members:  # every joiner left before the roster was accepted
                    self.phase, self.deployment = Phase.DEPLOYING, _Start()
                    return self._no_member_left(_Start())
                return self._deploy(_Start(), members)
            case JoinerRefused(name=name, error=error, guess=guess) if self.phase == Phase.GATHERING:
                # Sent away, its seat free again: the session goes on forming with the same code.
                if guess and self.guesses.spent_by_one_more():
                    self.phase = Phase.FAILED
                    return [Warn(f"refused {name}", error), self._fail(_GUESSED_WHILE_FORMING, exit=True)]
                return [Warn(f"refused {name}", error)]
            case CodeRefused(error=error) if self.phase == Phase.GATHERING:
                # The forming failed as a whole: a new code follows, and those who had joined
                # join again with it.
                return [
                    Warn("refused a member", error),
                    Say("that code is void now; a new one follows"),
                    RenewCode(f"the session was closed: {error}"),
                ]
            case NewcomerChecked():
                return self._newcomer_checked(event)
            case Judged(now=now, worth_it=worth_it, reason=reason):
                if not worth_it or self.phase != Phase.SERVING:
                    return []
                self.rebalances.begun(now)
                why = "rebalancing by what the stages measured serving"
                return [Say(f"{why}: {reason}"), *self._replan_by_choice(why)]
            case LoadJudged():
                if self.phase != Phase.SERVING or not self.load.judged(event):
                    return []
                return [Say(f"the load calls for a replan, once no request runs: {event.reason}")]
            case Opened() | Gathered() | CodeRefused() | JoinerRefused() | StartFailed():
                return []
        return self._deploying(event)

    # --- serving ---
    def _looked(self, look: Look) -> list[Command]:
        self.last_look = look.now
        commands: list[Command] = []
        if self.held_since is not None and look.now - self.held_since >= self.policy.resume_within_s:
            # A replan may move stages for minutes: a client waits this long at the most.
            self.held_since = None
            commands.append(
                FailHeld(f"the ring broke, and no new ring served within {self.policy.resume_within_s:g} s")
            )
        if self.phase not in (Phase.SERVING, Phase.PAUSED, Phase.WAITING):
            return commands
        self._apply(look)
        commands += self._standby_left(look)
        commands += [self.guesses.answer(member) for member in look.arrivals]
        rules = (
            self._replan_after_break,
            self._take_in_newcomers,
            self._change_for_load,
            self._newcomers_left,
            self.rebalances.judge,
            self.load.judge,
        )
        for rule in rules:
            decided = rule(look)
            if decided is not None:
                return commands + decided
        return commands

    def _apply(self, look: Look) -> None:
        """What a look changes: the newcomers still there, since when they wait, and the rebalance
        schedule (an idle ring's report refreshes without news, and is judged only on news)."""
        self.newcomers = (self.newcomers & look.alive & look.listed) - self.ring
        if not self.newcomers:
            self.newcomers_waiting_since = None
        elif self.newcomers_waiting_since is None and not look.idle:
            self.newcomers_waiting_since = look.now
        self.rebalances.looked(look, self._rebalancing)
        self.load.looked(look, self._following_load)

    def _standby_left(self, look: Look) -> list[Command]:
        """Members standing by whose links went down: nothing to replan, but their seats are freed."""
        left = tuple(sorted(self.standby - look.alive))
        if not left:
            return []
        self.standby -= set(left)
        verb = "was" if len(left) == 1 else "were"
        return [Say(f"{_names(look, left)}, who {verb} standing by, left"), SendAway(left)]

    @property
    def _rebalancing(self) -> bool:
        return self.policy.rebalance and self.networked and self.phase == Phase.SERVING

    @property
    def _following_load(self) -> bool:
        return self.policy.follow_load and self.networked and self.phase == Phase.SERVING and bool(self.ring)

    def _replan_after_break(self, look: Look) -> list[Command] | None:
        lost = tuple(sorted(self.ring - look.alive))
        if not lost and self.broken is None and look.engine_error is None:
            return None
        if not self.networked:
            error = look.engine_error or "a stage stopped"
            return self._retire_then_deploy(
                _Recover(error),
                [RecordIncident("a stage failed", error), Unready(("the host to replan without the failed stage",))],
                Retire(error, learn=False),
            )
        if not self.ring:  # serving alone, and that engine failed
            self.phase = Phase.FAILED
            return [self._fail(f"serving alone failed: {look.engine_error or 'no engine'}")]
        error = look.engine_error or self.broken or f"lost {_names(look, lost)}"
        self.paused = False  # requests held for newcomers are turned away now: the ring broke
        self.load.begin()  # planned for the load a change waited to serve, if one did
        first: list[Command] = [
            RecordIncident("the ring broke", error),
            Unready(("the host to replan with the members that are left",)),
        ]
        return self._retire_then_deploy(
            _Replan(error, after_break=True), [*first, *([SendAway(lost)] if lost else [])], Retire(error)
        )

    def _take_in_newcomers(self, look: Look) -> list[Command] | None:
        if not self.newcomers:
            return None
        names = _names(look, tuple(sorted(self.newcomers)))
        if look.idle:
            return self._replan_by_choice(f"taking in {names}")
        waited = self.newcomers_waiting_since
        if self.phase == Phase.SERVING and waited is not None and look.now - waited >= self.policy.newcomer_patience_s:
            return self._hold_new_requests(f"taking in {names}")
        return []

    def _hold_new_requests(self, replan: str) -> list[Command]:
        """Under steady load a moment without requests may never come: new requests wait while
        those running and queued finish, so nothing in flight is lost; then the replan (`replan`
        says which) comes."""
        self.phase, self.paused = Phase.PAUSED, True
        return [
            Say(f"the requests running finish first; new ones wait for the replan {replan}"),
            Unready((f"the requests running to finish, then the host to replan {replan}",), True),
        ]

    def _change_for_load(self, look: Look) -> list[Command] | None:
        """Who serves changes for the load at a moment without requests; after the host's patience,
        new requests wait while those running finish, as for newcomers."""
        change = self.load.change
        if change is None:
            return None
        if look.idle:
            return self._replan_by_choice()
        if self.phase == Phase.SERVING and look.now - change.waiting_since >= self.policy.newcomer_patience_s:
            return self._hold_new_requests("for the load")
        return []

    def _newcomers_left(self, look: Look) -> list[Command] | None:
        if self.phase != Phase.PAUSED:
            return None
        self.phase, self.paused = Phase.SERVING, False
        return [Resume(), Say("the newcomers left before the replan; serving on with the ring as it is")]

    def _newcomer_checked(self, checked: NewcomerChecked) -> list[Command]:
        if checked.error is None:
            self.newcomers |= {checked.member} - self.ring
            return [Say(f"{checked.name} verified and linked; it joins the ring once no request is running")]
        commands: list[Command] = [Warn(f"did not admit {checked.name}", checked.error)]
        if checked.guess and self.guesses.spent_by_one_more():
            commands.append(Say(_GUESSED_WHILE_SERVING))
        return commands

    def _replan_by_choice(self, why: str = "") -> list[Command]:
        """Replan a ring that is not broken (no request in flight): requests that come meanwhile
        wait for the new ring rather than be turned away. A change the load called for goes with it."""
        why = "; ".join(reason for reason in (why, self.load.begin()) if reason)
        self.paused = True
        return self._retire_then_deploy(
            _Replan(why, f", {why}"),
            [Unready((f"the host to replan, {why}",), paused=True)],
            Retire(f"the host is replanning, {why}"),
        )

    def _fail(self, message: str, exit: bool = False) -> Fail:
        """Nothing serves: requests a broken ring left end with the failure too."""
        self.held_since = None
        return Fail(message, exit)

    # --- deploying ---
    def _retire_then_deploy(self, deployment: _Deployment, first: list[Command], retire: Retire) -> list[Command]:
        self.phase, self.deployment = Phase.DEPLOYING, deployment
        return [*first, retire]

    def _deploy(self, deployment: _Deployment, members: tuple[str, ...]) -> list[Command]:
        self.phase, self.deployment, self.deploying = Phase.DEPLOYING, deployment, members
        self.newcomers -= set(members)
        return [Deploy(members, self._planned_load)]

    @property
    def _planned_load(self) -> int | None:
        """The load a deployment is planned for: the load served, where members may stand by; else
        the session's room (None)."""
        return self.load.planned if self.policy.follow_load else None

    def _deploying(self, event: Event) -> list[Command]:
        deployment = self.deployment
        if self.phase != Phase.DEPLOYING or deployment is None:
            return []
        match event:
            case Retired(alive=alive, held_since=held_since):
                if held_since is not None and self.held_since is None:
                    self.held_since = held_since
                if isinstance(deployment, _Recover):
                    return [ServeAlone("replanned")]
                return self._deploy(deployment, alive) if alive else self._no_member_left(deployment)
            case MemberFailed(shortage=MemoryShortage() as shortage):
                # Planned again with less of its memory rather than lose all it can hold.
                smallest, name = event.smallest_stage_bytes, event.name or event.member
                lowered = self.lowerings.replan(
                    event.member, name, event.message, shortage, smallest, self.deploying, self._planned_load
                )
                return _left_out(event.member, f"{event.message} ({lowered})") if isinstance(lowered, str) else lowered
            case OwnShortOfMemory(message=message, shortage=shortage, smallest_stage_bytes=smallest):
                lowered = self.lowerings.replan(
                    None, "this machine", message, shortage, smallest, self.deploying, self._planned_load
                )
                if isinstance(lowered, str):
                    return self._no_ring(deployment, f"{message} ({lowered})", False)
                return lowered
            case MemberFailed(member=member, message=message):
                return _left_out(member, message)
            case Dismissed(member=member, alive=alive):
                left = tuple(m for m in alive if m != member)
                return self._deploy(deployment, left) if left else self._no_member_left(deployment)
            case Deployed(members=members, epoch=epoch, standby=standby):
                commands: list[Command] = []
                if isinstance(deployment, _Replan):
                    standing = f"; {len(standby)} standing by" if standby else ""
                    text = f"replanned with {len(members) + 1} members{deployment.why}{standing}"
                    commands.append(Say(text, "replanned"))
                self.ring, self.epoch, self.standby = frozenset(members), epoch, frozenset(standby)
                self.newcomers -= self.ring | self.standby
                self.load.replanned()
                return commands + self._serving(deployment)
            case ServedAlone():
                self.ring, self.standby = frozenset(), frozenset()
                return self._serving(deployment)
            case DeployFailed(message=message, refused=refused):
                return self._no_ring(deployment, message, refused)
        return []

    def _no_member_left(self, deployment: _Deployment) -> list[Command]:
        if isinstance(deployment, _Replan):
            self.ring, self.standby = frozenset(), frozenset()
            return [ForgetRing(), ServeAlone(f"replanned{deployment.why}: no member is left")]
        return [ServeAlone("every member failed its part")]

    def _serving(self, deployment: _Deployment) -> list[Command]:
        """A ring (or this machine alone) serves: the requests a broken ring left go on on it."""
        self.phase, self.deployment, self.paused, self.broken, self.held_since = Phase.SERVING, None, False, None, None
        if isinstance(deployment, _Replan) and deployment.after_break and self.guesses.admitting and self.join_line:
            return [Say(f"a seat is free again; to fill it: {self.join_line}")]
        return []

    def _no_ring(self, deployment: _Deployment, message: str, refused: bool) -> list[Command]:
        """Nothing serves. At the start the host ends; later it waits for members to join again,
        while anyone may."""
        self.deployment, self.paused = None, False
        if isinstance(deployment, _Start):
            self.phase = Phase.FAILED
            return [self._fail(_start_failure(message, refused), exit=True)]
        if isinstance(deployment, _Recover):
            self.phase = Phase.FAILED
            return [self._fail(f"{deployment.error}; the host cannot serve alone: {message}")]
        why = "the members that are left cannot hold the model" if refused else "replanning failed"
        self.ring, self.standby, self.broken = frozenset(), frozenset(), None
        commands: list[Command] = [ForgetRing(), self._fail(f"{deployment.error}; {why}: {message}")]
        if not self.guesses.admitting:
            self.phase = Phase.FAILED
            return commands
        self.phase = Phase.WAITING
        commands.append(Say(f"waiting for members to join again: {self.join_line}"))
        if deployment.after_break and self.join_line:
            commands.append(Say(f"a seat is free again; to fill it: {self.join_line}"))
        return commands


def _left_out(member: str, message: str) -> list[Command]:
    return [Warn("leaving a member out", message), Dismiss(member, f"the host left this member out: {message}")]


def _start_failure(message: str, refused: bool) -> str:
    return f"the model does not fit: {message}" if refused else f"the session could not start: {message}"


_GUESSED = (
    f"{GUESS_BUDGET} joiners failed to prove the session code, which may be someone guessing it (each try wins "
    "with a chance of 1 in 2^44)"
)
_GUESSED_WHILE_FORMING = (
    f"{_GUESSED}: this host admits no one from now on, and stops. Start it again for a new code, and give that "
    "code only to the people whose machines are to join"
)
_GUESSED_WHILE_SERVING = (
    f"this session admits no more members: {_GUESSED}. Its members serve on; to take in others, start the host "
    "again for a new code, and give it only to the people whose machines are to join"
)


def _names(look: Look, members: tuple[str, ...]) -> str:
    return ", ".join(look.names.get(m, m) for m in members)
