"""Control messages between the host and each member, as JSON in PING frames on one reserved stream.

The host decides everything (plan, stage files, context sizes); members report what they have
and what they did. Every message is a strict pydantic model: a member or host that receives
anything else gets a `ControlError` naming what was wrong, never a crash.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from kafila.contracts import BackendReport, HubModel, ModelPricing
from kafila.validation import first_problem
from kafila.wire.frames import TRANSFER_SEQUENCE_IDS, Frame, Kind

CONTROL_SEQUENCE = 2**64 - 1  # the control stream's sequence id: request slots are small numbers
MAX_CONTROL_BYTES = 64 * 1024
MAX_MODEL_PRICINGS = 16
MAX_MEMORY_BYTES = 2**60  # beyond any machine's memory, and beyond exact int64 arithmetic
MAX_CACHED_STAGES = 512  # with the pricings, a hello of the most of each stays under MAX_CONTROL_BYTES
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
MemberId = Annotated[str, Field(min_length=1, max_length=64)]
Fingerprint = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Reason = Annotated[str, Field(max_length=4000)]
# Where a member's stage file came from: fetched by its ranges from the hub, sent by the host, found
# in its cache, or cut from its own copy of the model (`join --model`).
StageSource = Literal["hub", "host", "cache", "slice"]


class ControlError(ValueError):
    """A control message that breaks the protocol."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Hello(_Message):
    """member → host, once its links are up: what it already holds, so nothing is sent twice."""

    type: Literal["hello"] = "hello"
    model_sha256: Sha256 | None = None  # of the whole model file it was started with (`--model`)
    cached_stages: list[Sha256] = Field(default_factory=list, max_length=MAX_CACHED_STAGES)
    machine: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")] | None = None  # `presence.machine_tag`
    # The models this machine priced on their own stages (`kafila probe --model`), by sha256: the
    # host plans it with the one it serves, if that is among them, and with its generic probe if not.
    priced_models: list[ModelPricing] = Field(default_factory=list, max_length=MAX_MODEL_PRICINGS)
    # Which of llama.cpp's devices serve its stages, for the host's /status: bounded like every
    # string from the network (a few kB at the most).
    backend: BackendReport | None = None


class Assign(_Message):
    """host → member: the stage to hold, where its bytes come from, and its ring neighbours.

    The member links to its neighbours and gets the file at once, answers `Staged`, and loads
    only when the host says `Load`: the host tells every member at once, once all are staged.
    """

    type: Literal["assign"] = "assign"
    epoch: Annotated[int, Field(ge=0)]  # bumps on every replan; messages of older epochs are stale
    stage_index: Annotated[int, Field(ge=0)]
    first_block: Annotated[int, Field(ge=0)]
    end_block: Annotated[int, Field(ge=1)]
    # The stage file's, where the host holds it (it cut it, or fetched it); None only where the member
    # makes it from a source both trust without the host's file: the hub at `hub`'s commit, checked
    # against its headers (`fetch_stage`), or its own copy of the model (slice, by the model's sha256).
    sha256: Sha256 | None
    size: Annotated[int, Field(ge=1)]  # the file's bytes; where the host holds no file, its tensor bytes
    # slice: cut it from the member's own copy of the model; hub: fetch its ranges from `hub`, and
    # where that fails, say so (`StageWanted`) and receive it from the host as with transfer.
    source: Literal["cache", "transfer", "slice", "hub"]
    predecessor: MemberId
    successor: MemberId
    n_ctx: Annotated[int, Field(ge=16, le=1 << 30)]
    n_batch: Annotated[int, Field(ge=1, le=1 << 16)]
    n_seq_max: Annotated[int, Field(ge=1, le=256)]
    relink: list[MemberId] = Field(default_factory=list, max_length=2)  # neighbours whose old link broke
    # The certificate fingerprints the host verified for the ring neighbours other than itself:
    # the member pins these, not the rendezvous's word (a newcomer was never in its roster).
    fingerprints: dict[MemberId, Fingerprint] = Field(default_factory=dict, max_length=2)
    # The head: the model's last blocks and its output. It answers each step with a LOGITS row,
    # to its successor, the host (which cannot hold the head itself, or the plan put it here).
    head: bool = False
    # The plan's estimate of the stage's memory (weights and KV cache): a member with less free
    # says so before it tries to load (`StageFailedReport.out_of_memory`).
    need_bytes: Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)] | None = None
    # With source hub: the model on the hub at the commit the host planned from, with each part's
    # size and header sha256; the member checks what the hub sends against it (`fetch_stage`).
    hub: HubModel | None = None
    # The sequence id of the transfer that will carry the file from the host (source transfer, or
    # hub where the member asks for it): the member takes that offer, passing over any the host
    # offered for an earlier plan and stopped before the member read it.
    transfer: Annotated[int, Field(ge=TRANSFER_SEQUENCE_IDS.start, lt=TRANSFER_SEQUENCE_IDS.stop)] | None = None

    @model_validator(mode="after")
    def _hub_named(self) -> Assign:
        if (self.source == "hub") != (self.hub is not None):
            raise ValueError("a hub model goes with source hub, and only with it")
        if self.sha256 is None and self.source not in ("hub", "slice"):
            raise ValueError(f"a stage from {self.source} is named by its sha256")
        return self


class StageWanted(_Message):
    """member → host, for an `Assign` with source hub: the hub would not give this member its stage
    (unreachable, refused, or not the bytes planned from); the host sends it, as for transfer."""

    type: Literal["wanted"] = "wanted"
    epoch: Annotated[int, Field(ge=0)]
    reason: Reason


EdgePath = Literal["direct", "relayed"]


class RingEdge(_Message):
    """How one of a member's ring links goes, for the host's status."""

    peer: MemberId
    path: EdgePath
    rtt_ms: Annotated[float, Field(ge=0, le=600_000)] | None = None


class Staged(_Message):
    """member → host: links to both ring neighbours are up and the stage file is here, verified."""

    type: Literal["staged"] = "staged"
    epoch: Annotated[int, Field(ge=0)]
    edges: list[RingEdge] = Field(default_factory=list, max_length=2)
    # Where the stage file came from and how long getting it took, for the host's /status; `why`:
    # why it did not come from the hub, where the host offered that.
    source: StageSource | None = None
    seconds: Annotated[float, Field(ge=0, le=1e7)] | None = None
    why: Reason | None = None


class Load(_Message):
    """host → member: load the staged file and start serving (its successor is ready)."""

    type: Literal["load"] = "load"
    epoch: Annotated[int, Field(ge=0)]


class Loaded(_Message):
    """member → host: the assigned stage is loaded and serving."""

    type: Literal["loaded"] = "loaded"
    epoch: Annotated[int, Field(ge=0)]
    stage_index: Annotated[int, Field(ge=0)]
    seconds: Annotated[float, Field(ge=0)]


class StageFailedReport(_Message):
    """member → host: the assignment could not be carried out, or a serving stage lost a ring link."""

    type: Literal["failed"] = "failed"
    epoch: Annotated[int, Field(ge=0)]
    message: Annotated[str, Field(max_length=4000)]
    lost_peer: MemberId | None = None  # while serving: the neighbour whose link went down
    # The stage did not fit in this machine's memory (llama.cpp could not allocate, or too little
    # was free to try): the host plans again with a smaller share for it rather than leave it out.
    out_of_memory: bool = False
    can_hold_bytes: Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)] | None = None  # what was free, if it could tell


class StandBy(_Message):
    """host → member: the plan of `epoch` leaves it out of the ring (it costs more than it saves):
    it drops its stage and its ring links, and stays linked to the host for the next plan."""

    type: Literal["standby"] = "standby"
    epoch: Annotated[int, Field(ge=0)]
    reason: Annotated[str, Field(max_length=1000)]


class End(_Message):
    """host → member: the session is over."""

    type: Literal["end"] = "end"
    reason: Annotated[str, Field(max_length=1000)]


ControlMessage = Annotated[
    Hello | Assign | StageWanted | Staged | Load | Loaded | StageFailedReport | StandBy | End,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


def control_frame(message: ControlMessage) -> Frame:
    return Frame(Kind.PING, CONTROL_SEQUENCE, payload=message.model_dump_json().encode())


def parse_control(frame: Frame) -> ControlMessage:
    if frame.sequence_id != CONTROL_SEQUENCE or frame.kind is not Kind.PING:
        raise ControlError(f"a {frame.kind.name} frame on sequence {frame.sequence_id} is not a control message")
    if len(frame.payload) > MAX_CONTROL_BYTES:
        raise ControlError(f"a control message of {len(frame.payload)} bytes; the limit is {MAX_CONTROL_BYTES}")
    try:
        return _ADAPTER.validate_json(frame.payload)
    except ValidationError as error:
        where, what = first_problem(error)
        raise ControlError(f"malformed control message ({where}: {what})") from None
