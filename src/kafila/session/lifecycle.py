"""The host lifecycle's vocabulary: its phases, the events its shell hands the session core, and
the commands the core hands back (`session.core` decides; `session.runner` carries out)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kafila.contracts import EventKind

Measurements = tuple[tuple[tuple[int, int], int], ...]  # each stage's blocks [first, end) and its steps timed alone


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
class Look:
    """What the shell sees of the serving session when it wakes: after each batch of events, and
    at the core's `next_deadline()`. Facts that are a state, not a happening, come this way."""

    now: float  # monotonic seconds
    alive: frozenset[str] = frozenset()  # members whose link is up
    listed: frozenset[str] = frozenset()  # members the rendezvous still lists in the session
    arrivals: tuple[str, ...] = ()  # joined since the session formed, their code not yet checked
    idle: bool = True  # no request running or queued (or no engine)
    running: int = 0  # requests the engine serves at once (in a slot, prefilling or decoding)
    engine_error: str | None = None  # the engine loop's failure
    measurements: Measurements | None = None  # what the idle ring's stages measured serving
    names: Mapping[str, str] = field(default_factory=dict)  # member id → the name people read


@dataclass(frozen=True)
class StageBroken:
    """A stage of the ring deployed in `epoch` stopped (a serving member said so, or this host's own)."""

    report: str
    epoch: int


@dataclass(frozen=True)
class StartFailed:
    """The session could not start (before any deployment answered): `refused`, the model does not fit."""

    message: str
    refused: bool = False


@dataclass(frozen=True)
class Stopped:
    """The host ends by its own course (its server stopped): what follows is no failure."""

    reason: str


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
    """An admission of `member` ended: verified and linked if no `error`, and then it waits for a
    plan that takes it in; `guess`: it failed the code's proof, so it may have been a guess."""

    name: str
    error: str | None = None
    guess: bool = False
    member: str = ""


@dataclass(frozen=True)
class Retired:
    """The engine and this machine's stage are stopped; `alive` are the members still linked;
    `held_since`: requests the broken ring left have waited since then for the next ring."""

    alive: tuple[str, ...]
    held_since: float | None = None


@dataclass(frozen=True)
class Deployed:
    """A ring of this host and `members` serves; its stages' reports carry `epoch`; `standby`:
    the members linked and left out of it, since it is faster without them."""

    members: tuple[str, ...]
    epoch: int = 0
    standby: tuple[str, ...] = ()


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
class LoadJudged:
    """Who serves was weighed at `users` requests at once (`planner.who_serves.judge_load`): other
    members would be clearly faster at that load, or not; `reason` says which, in words."""

    now: float
    users: int
    worth_it: bool
    reason: str = ""


@dataclass(frozen=True)
class Interrupted:
    """Ctrl-C or SIGTERM: the host ends."""

    reason: str


Event = (
    Look | StageBroken | StartFailed | Stopped | Opened | Gathered | CodeRefused | JoinerRefused | NewcomerChecked
    | Retired | Deployed | MemberFailed | OwnShortOfMemory | Dismissed | DeployFailed | ServedAlone | Judged
    | LoadJudged | Interrupted
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
class Admit:
    """Check a joiner's code in the background; its `NewcomerChecked` comes later."""

    member: str


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
    """→ Deployed, MemberFailed or DeployFailed. Plan over this host and `members` for `load`
    requests at once (None: as many as the session has room for), and serve."""

    members: tuple[str, ...]
    load: int | None = None


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
class PriceLoad:
    """→ LoadJudged. Weigh who serves at `users` requests at once against the ring as it serves."""

    users: int


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
class FailHeld:
    """End the requests a broken ring left, waiting for the next: none came in time."""

    message: str


@dataclass(frozen=True)
class AbandonRing:
    """End every wait on the ring at once and stop the engine, from a signal handler."""

    reason: str


Command = (
    Say | Warn | RecordIncident | Unready | Resume | Admit | Refuse | Retire | Deploy | LowerMemory | LowerOwnMemory
    | Dismiss
    | ForgetRing | ServeAlone | PriceRebalance | PriceLoad | RenewCode | SendAway | Fail | FailHeld | AbandonRing
)  # fmt: skip
ANSWERED = (Retire, Deploy, Dismiss, ServeAlone, PriceRebalance, PriceLoad, RenewCode)  # commands answered by an event
