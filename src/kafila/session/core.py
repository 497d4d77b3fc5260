"""The host's decisions, pure: what to do next, given what happened and what its session looks like.

`SessionCore` is the whole lifecycle as a state machine (gathering, deploying, serving, paused,
waiting, failed, stopping). The shell (`runner.HostRunner`) feeds it typed events, carries out
the commands `handle` returns, in order, and feeds back the answer of the last one; several
times a second it also feeds what it sees of the serving session (`Observed`). The core reads no
clock and does no I/O: events bring the time. So a test drives every path with made-up events
(tests/test_session_core.py), as aioquic's tests drive a connection with made-up datagrams.

While a ring serves, `ServingCore` decides; its rules, in the order they are tried (the first
that applies decides):
1. members arrived: check their code (the session core decides whether anyone may);
2. the ring broke (a member lost, a stage's report of failure, the engine's error): replan with
   those left;
3. admitted newcomers wait: replan with them once no request runs; under steady load, after
   `newcomer_patience_s`, hold new requests so the running ones can finish;
4. the newcomers left before their replan: stop holding requests;
5. an idle ring, every `rebalance_check_s` after any cool-down: judge whether to divide again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kafila.contracts import EventKind

GUESS_BUDGET = 3  # failed proofs of the code a host takes in its whole life, over every code it issues
MEMORY_LOWERINGS = 3  # smaller shares a member that runs out of memory gets before it is left out
MEMORY_LOWERED_TO = 0.75  # of what the stage it could not load needed
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
    names: Mapping[str, str] = field(default_factory=dict)  # member id → the name people read
    measurements: object = None  # what the stages measured serving, compared between judgements


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


# --- the whole lifecycle ----------------------------------------------------------------------


class Phase(StrEnum):
    GATHERING = "gathering"  # members join and prove the code
    DEPLOYING = "deploying"  # a plan's stages are cut, delivered and loaded (or this machine loads alone)
    SERVING = "serving"  # a ring serves, or this machine alone
    PAUSED = "paused"  # requests wait while those running finish, for the newcomers' replan
    WAITING = "waiting"  # nothing can serve: the session waits for members to join again
    FAILED = "failed"  # nothing serves and nothing will: /v1 says why
    STOPPING = "stopping"  # the person at the host ended it


# Events: what happened, with what the shell saw when it did. ------------------------------------


@dataclass(frozen=True)
class Observed:
    """A look at the serving session (the shell's tick)."""

    view: SessionView


@dataclass(frozen=True)
class Opened:
    """A session opened at the rendezvous; `join_line` is what a member runs to join it."""

    join_line: str


@dataclass(frozen=True)
class Gathered:
    """Every seat is taken by a member that proved the code, linked and said what it holds."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class CodeRefused:
    """The session's forming failed as a whole (it did not fill in time, say): a new code follows."""

    error: str


@dataclass(frozen=True)
class JoinerRefused:
    """While the session formed, a joiner failed its part and was sent away, its seat free again;
    `guess`: it failed the code's proof (a wrong secret), so it may have been a guess."""

    name: str
    error: str
    guess: bool = False


@dataclass(frozen=True)
class NewcomerChecked:
    """An admission ended; `guess`: it failed the code's proof, so it may have been a guess."""

    name: str
    error: str | None = None
    guess: bool = False


@dataclass(frozen=True)
class Retired:
    """The engine and this machine's stage are stopped; `alive` are the members still linked."""

    alive: tuple[str, ...]


@dataclass(frozen=True)
class Deployed:
    machines: int  # in the ring, this one included


@dataclass(frozen=True)
class MemoryShortage:
    """A member's stage did not fit in its memory: what the plan thought it needed, and what the
    member said it could hold, if it could tell."""

    blocks: tuple[int, int]  # [first, end)
    needed_bytes: int  # the plan's estimate: weights, KV cache and llama.cpp's context
    can_hold_bytes: int | None = None


@dataclass(frozen=True)
class MemberFailed:
    """A member failed its part of a deployment (stalled, left, or could not take its stage);
    `shortage`: it could not load its stage for lack of memory, so a smaller share may fit it,
    down to `smallest_stage_bytes` (a block and its cache)."""

    member: str
    message: str
    shortage: MemoryShortage | None = None
    smallest_stage_bytes: int = 0
    name: str = ""  # the member's name, as people read it


@dataclass(frozen=True)
class OwnShortOfMemory:
    """This host could not load its own share of a deployment for lack of memory: a smaller one
    may fit, down to `smallest_stage_bytes`, as for a member."""

    message: str
    shortage: MemoryShortage
    smallest_stage_bytes: int = 0


@dataclass(frozen=True)
class Dismissed:
    member: str
    alive: tuple[str, ...]  # the members still linked once it went


@dataclass(frozen=True)
class DeployFailed:
    """No ring came of the deployment: `refused`, the plan found the model does not fit."""

    message: str
    refused: bool = False


@dataclass(frozen=True)
class ServedAlone:
    pass


@dataclass(frozen=True)
class Judged:
    """The idle ring's measurements were priced: a division clearly faster fits, or not."""

    now: float
    worth_it: bool
    reason: str = ""


@dataclass(frozen=True)
class Interrupted:
    """Ctrl-C or SIGTERM: the host ends."""

    reason: str


Event = (
    Observed | Opened | Gathered | CodeRefused | JoinerRefused | NewcomerChecked | Retired | Deployed
    | MemberFailed | OwnShortOfMemory | Dismissed | DeployFailed | ServedAlone | Judged | Interrupted
)  # fmt: skip


# Commands: what the shell is to do. Those marked "→" answer with the event named. --------------


@dataclass(frozen=True)
class Say:
    """Tell the person at the host; `kind` files it on the host's event timeline (`/events`)."""

    text: str
    kind: EventKind = "note"


@dataclass(frozen=True)
class Warn:
    what: str
    detail: str


@dataclass(frozen=True)
class RecordIncident:
    """Warn, and keep it for /status."""

    what: str
    detail: str


@dataclass(frozen=True)
class Unready:
    """/v1 turns new requests away, saying what it waits for; `paused`: they wait instead (a
    replan by choice); `failure`: nothing will serve, and why."""

    waiting_for: tuple[str, ...]
    paused: bool = False
    failure: str | None = None


@dataclass(frozen=True)
class Resume:
    """Serve on with the engine as it is."""


@dataclass(frozen=True)
class Refuse:
    """Turn a joiner away without checking its code."""

    member: str
    reason: str


@dataclass(frozen=True)
class Retire:
    """→ Retired. Stop the engine (after pricing its machines by what they measured, if `learn`)."""

    reason: str
    learn: bool = True


@dataclass(frozen=True)
class SendAway:
    """Free lost members' seats at the rendezvous: their connections there can outlive their links
    by minutes (an uplink that went down), and each must be able to join again at once."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class Deploy:
    """→ Deployed, MemberFailed or DeployFailed. Plan over this host and `members`, and serve."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class LowerOwnMemory:
    """Plan with at most `memory_bytes` of this host's memory from now on (it ran out loading its
    own share)."""

    memory_bytes: int


@dataclass(frozen=True)
class LowerMemory:
    """Plan with at most `memory_bytes` of the member's memory from now on (it ran out loading its
    share)."""

    member: str
    memory_bytes: int


@dataclass(frozen=True)
class Dismiss:
    """→ Dismissed. Send a member home with the reason."""

    member: str
    reason: str


@dataclass(frozen=True)
class ForgetRing:
    """No ring is deployed any more: nothing to watch for breaks."""


@dataclass(frozen=True)
class ServeAlone:
    """→ ServedAlone or DeployFailed. Every block on this machine."""

    why: str


@dataclass(frozen=True)
class PriceRebalance:
    """→ Judged. Price the idle ring by what its stages measured."""


@dataclass(frozen=True)
class RenewCode:
    """→ Opened, then Gathered or CodeRefused. End this session at the rendezvous and open another."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """Nothing serves: /v1 and the host's terminal say why. `exit`: the host ends too."""

    message: str
    exit: bool = False


@dataclass(frozen=True)
class AbandonRing:
    """End every wait on the ring at once and stop the engine, from a signal handler."""

    reason: str


Command = (
    Say | Warn | RecordIncident | Unready | Resume | Admit | Refuse | Retire | Deploy | LowerMemory | LowerOwnMemory
    | Dismiss
    | ForgetRing | ServeAlone | PriceRebalance | RenewCode | SendAway | Fail | AbandonRing
)  # fmt: skip
ANSWERED = (Retire, Deploy, Dismiss, ServeAlone, PriceRebalance, RenewCode)  # commands answered by an event


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
class SessionCore:
    """The host's whole lifecycle, pure: `handle(event)` changes the state and returns the commands
    for the shell (`runner.HostRunner`) to carry out, in order; a command that answers (`ANSWERED`)
    comes last, and its answer is the next event. It reads no clock and does no I/O."""

    serving: ServingCore
    networked: bool = True  # members may come and go; False: one machine's own stages
    phase: Phase = Phase.GATHERING
    admitting: bool = True  # until GUESS_BUDGET joiners have failed the code's proof (maybe guesses)
    failed_proofs: int = 0  # over the host's whole life, every code it issued
    join_line: str = ""
    deployment: _Deployment | None = None  # the deployment under way, while DEPLOYING
    paused: bool = False  # /v1 holds requests for a replan by choice
    deploying: tuple[str, ...] = ()  # the members of the deployment under way
    lowerings: dict[str, int] = field(default_factory=dict)  # member → smaller shares it was given
    own_lowerings: int = 0  # smaller shares this host gave itself

    @classmethod
    def one_machine(cls, serving: ServingCore) -> SessionCore:
        """A session of this machine's own stages, loading them: `ServedAlone` once they serve."""
        return cls(serving, networked=False, phase=Phase.DEPLOYING, deployment=_Start())

    @property
    def wants_rendezvous_session(self) -> bool:
        """Whether the session at the rendezvous must live on: while anyone may still join (a
        member that blips rejoins through it); once the guess budget is spent, relay traffic
        alone keeps it."""
        return self.networked and self.admitting and self.phase not in (Phase.FAILED, Phase.STOPPING)

    def handle(self, event: Event) -> list[Command]:
        if self.phase == Phase.STOPPING:
            return []  # members leave when the session ends: that is not a failure
        match event:
            case Interrupted(reason=reason):
                return self._interrupted(reason)
            case Observed(view=view):
                return self._observed(view)
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
                if guess and self._guessed():
                    self.phase = Phase.FAILED
                    return [Warn(f"refused {name}", error), Fail(_GUESSED_WHILE_FORMING, exit=True)]
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
            case Judged():
                return self._judged(event)
            case Opened() | Gathered() | CodeRefused() | JoinerRefused():
                return []
        return self._deploying(event)

    # --- serving ---
    def _observed(self, view: SessionView) -> list[Command]:
        if self.phase not in (Phase.SERVING, Phase.PAUSED, Phase.WAITING):
            return []
        commands: list[Command] = [self._admission(member) for member in view.arrivals]
        match self.serving.next_action(replace(view, arrivals=())):
            case ReplanAfterBreak(lost=lost):
                commands += self._after_break(view, lost)
            case ReplanWithNewcomers(newcomers=newcomers):
                commands += self._replan_by_choice(f"taking in {_names(view, newcomers)}")
            case HoldRequests(newcomers=newcomers):
                # Under steady load a moment without requests may never come: new requests wait
                # while those running and queued finish, so nothing in flight is lost.
                names = _names(view, newcomers)
                self.phase, self.paused = Phase.PAUSED, True
                commands += [
                    Say(f"the requests running finish first; new ones wait for the replan taking in {names}"),
                    Unready((f"the requests running to finish, then the host to replan taking in {names}",), True),
                ]
            case StopHolding():
                self.phase, self.paused = Phase.SERVING, False
                if not view.ready and view.engine:
                    commands += [
                        Resume(),
                        Say("the newcomers left before the replan; serving on with the ring as it is"),
                    ]
            case JudgeRebalance():
                if self.serving.worth_judging(view.measurements):
                    commands.append(PriceRebalance())
        return commands

    def _admission(self, member: str) -> Command:
        """Who may take a freed seat: anyone who proves the code, until someone fails to."""
        if self.admitting:
            return Admit(member)
        return Refuse(member, "this session admits no more members; the host must start over with a new code")

    def _newcomer_checked(self, checked: NewcomerChecked) -> list[Command]:
        if checked.error is None:
            return [Say(f"{checked.name} verified and linked; it joins the ring once no request is running")]
        commands: list[Command] = [Warn(f"did not admit {checked.name}", checked.error)]
        if checked.guess and self._guessed():
            commands.append(Say(_GUESSED_WHILE_SERVING))
        return commands

    def _guessed(self) -> bool:
        """Count a failed proof of the code; True when that spends the budget: no one is admitted
        from then on, so anyone guessing the secret gets GUESS_BUDGET tries in all."""
        self.failed_proofs += 1
        if self.failed_proofs >= GUESS_BUDGET:
            self.admitting = False
        return not self.admitting

    def _after_break(self, view: SessionView, lost: tuple[str, ...]) -> list[Command]:
        if not self.networked:
            error = view.engine_error or "a stage stopped"
            return self._retire_then_deploy(
                _Recover(error),
                [RecordIncident("a stage failed", error), Unready(("the host to replan without the failed stage",))],
                Retire(error, learn=False),
            )
        if not view.deployed:  # serving alone, and that engine failed
            self.phase = Phase.FAILED
            return [Fail(f"serving alone failed: {view.engine_error or 'no engine'}")]
        error = view.engine_error or view.broken or f"lost {_names(view, lost)}"
        self.paused = False  # requests held for newcomers are turned away now: the ring broke
        first: list[Command] = [
            RecordIncident("the ring broke", error),
            Unready(("the host to replan with the members that are left",)),
        ]
        return self._retire_then_deploy(
            _Replan(error, after_break=True), [*first, *([SendAway(lost)] if lost else [])], Retire(error)
        )

    def _replan_by_choice(self, why: str) -> list[Command]:
        """Replan a ring that is not broken (no request in flight): requests that come meanwhile
        wait for the new ring rather than be turned away."""
        self.paused = True
        return self._retire_then_deploy(
            _Replan(why, f", {why}"),
            [Unready((f"the host to replan, {why}",), paused=True)],
            Retire(f"the host is replanning, {why}"),
        )

    def _judged(self, judged: Judged) -> list[Command]:
        if not judged.worth_it or self.phase != Phase.SERVING:
            return []
        self.serving.rebalanced(judged.now)
        why = "rebalancing by what the stages measured serving"
        return [Say(f"{why}: {judged.reason}"), *self._replan_by_choice(why)]

    def _interrupted(self, reason: str) -> list[Command]:
        held = self.paused  # requests waiting for a planned replan: there will be none
        self.phase, self.paused = Phase.STOPPING, False
        return [*([Unready((), failure=reason)] if held else []), AbandonRing(reason)]

    # --- deploying ---
    def _retire_then_deploy(self, deployment: _Deployment, first: list[Command], retire: Retire) -> list[Command]:
        self.phase, self.deployment = Phase.DEPLOYING, deployment
        return [*first, retire]

    def _deploy(self, deployment: _Deployment, members: tuple[str, ...]) -> list[Command]:
        self.phase, self.deployment, self.deploying = Phase.DEPLOYING, deployment, members
        return [Deploy(members)]

    def _deploying(self, event: Event) -> list[Command]:
        deployment = self.deployment
        if self.phase != Phase.DEPLOYING or deployment is None:
            return []
        match event:
            case Retired(alive=alive):
                if isinstance(deployment, _Recover):
                    return [ServeAlone("replanned")]
                return self._deploy(deployment, alive) if alive else self._no_member_left(deployment)
            case MemberFailed(shortage=MemoryShortage() as shortage):
                return self._short_of_memory(event, shortage)
            case OwnShortOfMemory():
                return self._own_short_of_memory(deployment, event)
            case MemberFailed(member=member, message=message):
                return self._leave_out(member, message)
            case Dismissed(member=member, alive=alive):
                left = tuple(m for m in alive if m != member)
                return self._deploy(deployment, left) if left else self._no_member_left(deployment)
            case Deployed(machines=machines):
                commands: list[Command] = []
                if isinstance(deployment, _Replan):
                    commands.append(Say(f"replanned with {machines} members{deployment.why}", "replanned"))
                return commands + self._serving(deployment)
            case ServedAlone():
                return self._serving(deployment)
            case DeployFailed(message=message, refused=refused):
                return self._no_ring(deployment, message, refused)
        return []

    @staticmethod
    def _leave_out(member: str, message: str) -> list[Command]:
        return [Warn("leaving a member out", message), Dismiss(member, f"the host left this member out: {message}")]

    def _short_of_memory(self, failed: MemberFailed, shortage: MemoryShortage) -> list[Command]:
        """A member ran out of memory loading its share: plan the same members again with less of
        its memory (MEMORY_LOWERED_TO of what the share needed, or what it said it can hold, if
        less), rather than lose all it can hold; left out after MEMORY_LOWERINGS smaller shares,
        or once it could not hold even the smallest stage."""
        member, name = failed.member, failed.name or failed.member
        lowered = _lowered(shortage)
        times = self.lowerings.get(member, 0)
        if times >= MEMORY_LOWERINGS:
            return self._leave_out(member, f"{failed.message} (still short of memory after {times} smaller shares)")
        if lowered < failed.smallest_stage_bytes:
            return self._leave_out(member, f"{failed.message} (it cannot hold even the smallest stage)")
        self.lowerings[member] = times + 1
        first, end = shortage.blocks
        return [
            Warn(
                f"{name} ran out of memory loading blocks {first}-{end - 1} (needed "
                f"{shortage.needed_bytes / 2**30:.2f} GiB); replanning with {lowered / 2**30:.2f} GiB for it",
                failed.message,
            ),
            LowerMemory(member, lowered),
            Deploy(self.deploying),
        ]

    def _own_short_of_memory(self, deployment: _Deployment, short: OwnShortOfMemory) -> list[Command]:
        """This host ran out of memory loading its own share: plan the same members again with less
        of its memory, as for a member. No ring goes without the host, so once that is spent (or
        not even the smallest stage fits) nothing serves."""
        lowered = _lowered(short.shortage)
        if self.own_lowerings >= MEMORY_LOWERINGS:
            return self._no_ring(
                deployment, f"{short.message} (still short after {self.own_lowerings} smaller shares)", False
            )
        if lowered < short.smallest_stage_bytes:
            return self._no_ring(deployment, f"{short.message} (it cannot hold even the smallest stage)", False)
        self.own_lowerings += 1
        first, end = short.shortage.blocks
        return [
            Warn(
                f"this machine ran out of memory loading blocks {first}-{end - 1} (needed "
                f"{short.shortage.needed_bytes / 2**30:.2f} GiB); replanning with {lowered / 2**30:.2f} GiB of it",
                short.message,
            ),
            LowerOwnMemory(lowered),
            Deploy(self.deploying),
        ]

    def _no_member_left(self, deployment: _Deployment) -> list[Command]:
        if isinstance(deployment, _Replan):
            return [ForgetRing(), ServeAlone(f"replanned{deployment.why}: no member is left")]
        return [ServeAlone("every member failed its part")]

    def _serving(self, deployment: _Deployment) -> list[Command]:
        self.phase, self.deployment, self.paused = Phase.SERVING, None, False
        return self._seat_free(deployment)

    def _seat_free(self, deployment: _Deployment) -> list[Command]:
        if isinstance(deployment, _Replan) and deployment.after_break and self.admitting and self.join_line:
            return [Say(f"a seat is free again; to fill it: {self.join_line}")]
        return []

    def _no_ring(self, deployment: _Deployment, message: str, refused: bool) -> list[Command]:
        """Nothing serves. At the start the host ends; later it waits for members to join again,
        while anyone may."""
        self.deployment, self.paused = None, False
        if isinstance(deployment, _Start):
            self.phase = Phase.FAILED
            return [
                Fail(
                    f"the model does not fit: {message}" if refused else f"the session could not start: {message}",
                    exit=True,
                )
            ]
        if isinstance(deployment, _Recover):
            self.phase = Phase.FAILED
            return [Fail(f"{deployment.error}; the host cannot serve alone: {message}")]
        why = "the members that are left cannot hold the model" if refused else "replanning failed"
        commands: list[Command] = [ForgetRing(), Fail(f"{deployment.error}; {why}: {message}")]
        if not self.admitting:
            self.phase = Phase.FAILED
            return commands
        self.phase = Phase.WAITING
        return [*commands, Say(f"waiting for members to join again: {self.join_line}"), *self._seat_free(deployment)]


def _lowered(shortage: MemoryShortage) -> int:
    """The memory to plan a machine that ran out with: MEMORY_LOWERED_TO of what its share needed,
    or what it said it can hold, if less."""
    lowered = int(shortage.needed_bytes * MEMORY_LOWERED_TO)
    return lowered if shortage.can_hold_bytes is None else min(lowered, shortage.can_hold_bytes)


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


def _names(view: SessionView, members: tuple[str, ...]) -> str:
    return ", ".join(view.names.get(m, m) for m in members)
