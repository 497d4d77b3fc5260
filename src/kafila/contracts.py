"""Types that cross package boundaries, defined once.

The planner, the network, the runtime, the session and the API each keep their own types inside;
what one hands another is one of these frozen models, serialised only at the HTTP and wire edges.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kafila.untrusted import check_name

# A long job's progress: (what, done, in all), as `kafila.cli.bars` draws it; `CountProgress` is
# one named job's (done, in all), a `Progress` with its `what` given.
Progress = Callable[[str, int, int], None]
CountProgress = Callable[[int, int], None]
Tell = Callable[[str], None]  # a line for the person at this machine (`say` in the session's shells)


class Strict(BaseModel):
    """Frozen, no unknown fields, no NaN or infinity: what every boundary type is built on."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# NATs: what the network measures and the planner predicts edges from.
# ---------------------------------------------------------------------------------------------


class Mapping(StrEnum):
    """RFC 4787 mapping behaviour: how a NAT reuses its external port across destinations."""

    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


Filtering = Mapping  # RFC 4787 uses the same three words for filtering.


class NatClass(StrEnum):
    """The coarse classes of the paper, for members that measured no more than that."""

    PERMISSIVE = "permissive"
    ORDINARY = "ordinary"
    RESTRICTIVE = "restrictive"


class NatBehaviour(Strict):
    mapping: Mapping
    filtering: Filtering

    @property
    def maps_endpoint_dependently(self) -> bool:
        return self.mapping is not Mapping.ENDPOINT_INDEPENDENT

    @property
    def filters_by_address_and_port(self) -> bool:
        return self.filtering is Mapping.ADDRESS_AND_PORT_DEPENDENT

    def cannot_punch(self, other: NatBehaviour) -> bool:
        """Whether no hole punch gets through between a machine behind this NAT and one behind
        `other`: one side maps endpoint-dependently (a new port for each peer, so the address it
        advertised is not the one it punches from) and the other does too, or filters by address
        and port (so it drops what comes from that unadvertised port). The punches seen between
        every pair of NATs failed for these pairs alone (docs/nat-lab.md)."""

        def blocks(symmetric: NatBehaviour, peer: NatBehaviour) -> bool:
            return symmetric.maps_endpoint_dependently and (
                peer.maps_endpoint_dependently or peer.filters_by_address_and_port
            )

        return blocks(self, other) or blocks(other, self)

    @classmethod
    def from_class(cls, nat_class: NatClass) -> NatBehaviour:
        """Read a class as the behaviour it implies, assuming the worst where the class is silent.

        `ordinary` says nothing about filtering, so it is taken as address-and-port-dependent;
        `restrictive` means endpoint-dependent mapping, whose filtering no longer matters.
        """
        if nat_class is NatClass.PERMISSIVE:
            return cls(mapping=Mapping.ENDPOINT_INDEPENDENT, filtering=Mapping.ENDPOINT_INDEPENDENT)
        if nat_class is NatClass.ORDINARY:
            return cls(mapping=Mapping.ENDPOINT_INDEPENDENT, filtering=Mapping.ADDRESS_AND_PORT_DEPENDENT)
        return cls(mapping=Mapping.ADDRESS_AND_PORT_DEPENDENT, filtering=Mapping.ADDRESS_AND_PORT_DEPENDENT)


# ---------------------------------------------------------------------------------------------
# Stage statistics: what each stage measures serving, reported round the ring.
# ---------------------------------------------------------------------------------------------

MAX_REPORTED_BLOCK = 1 << 16
MAX_REPORTED_ROW_COUNTS = 32  # decode sizes a stage reports its recent times for
MAX_DECODE_ROWS = 1 << 16
Milliseconds = Annotated[float, Field(ge=0)]
# What a stage may report as a time: above a day is no measurement, and the host's pricing sums
# and multiplies these (by rows, by stages), which must stay finite.
MAX_REPORTED_MS = 86_400_000.0
ReportedMs = Annotated[float, Field(ge=0, le=MAX_REPORTED_MS)]


class StageReport(Strict):
    """One stage's measured decode times. Block stages report theirs round the ring (a PING
    frame, as JSON), the head its own; the host prices replans and rebalances with them, and
    `/status` and `/metrics` show them."""

    range: tuple[  # the stage's blocks, [first, end)
        Annotated[int, Field(ge=0, le=MAX_REPORTED_BLOCK)], Annotated[int, Field(ge=1, le=MAX_REPORTED_BLOCK)]
    ]
    ms_per_token: ReportedMs | None = None  # every decode row, batched ones included
    ms_per_token_alone: ReportedMs | None = None  # recent decodes of one row: what the planner prices
    steps_alone: Annotated[int, Field(ge=0)] = 0  # decodes of one row so far: a new one means fresh figures
    prefill_ms_per_token: ReportedMs | None = None  # prompts' rows: what pipelined prefill's chunks are sized by
    # Recent decodes' median ms by their rows (rows ascending): the waves in flight are priced by them.
    decode_ms_by_rows: Annotated[
        list[tuple[Annotated[int, Field(ge=1, le=MAX_DECODE_ROWS)], ReportedMs]],
        Field(max_length=MAX_REPORTED_ROW_COUNTS),
    ] = Field(default_factory=list)
    seconds: Annotated[float, Field(ge=0)] | None = None  # all the time it spent decoding, prompts included
    rows: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _blocks_in_order(self) -> StageReport:
        first, end = self.range
        if first >= end:
            raise ValueError(f"a stage's blocks run from first to end, not {first} to {end}")
        return self

    def wire(self) -> dict[str, object]:
        """As JSON, for the ring and `/status`."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# llama.cpp's backends: the devices its build sees, and which of them serve a machine's stages.
# ---------------------------------------------------------------------------------------------

DeviceKind = Literal["cpu", "gpu", "igpu", "accel"]  # ggml_backend_dev_type, in its order
MAX_BACKEND_DEVICES = 16
MAX_REPORTED_FEATURES = 64
# Names and descriptions come from other machines too (a member's hello): bounded, one line each.
DeviceName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]
DeviceText = Annotated[str, Field(max_length=160, pattern=r"^[^\x00-\x1f\x7f]*$")]
FeatureName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[^\x00-\x1f\x7f]+$")]


class BackendDevice(Strict):
    """One ggml backend device as llama.cpp's build sees it: "CPU", "CUDA0", "Metal", "Vulkan0"."""

    name: DeviceName
    description: DeviceText  # "NVIDIA GeForce RTX 4090", "Apple M2 Pro", the CPU's model
    kind: DeviceKind
    free_bytes: Annotated[int, Field(ge=0)]
    total_bytes: Annotated[int, Field(ge=0)]


class BackendReport(Strict):
    """Which of llama.cpp's devices serve a machine's stages (`serving`: its GPUs where the build
    offloads and has one, else the CPU), every device it sees, and the CPU's features as llama.cpp
    reports them; `idle_gpu` names a GPU the machine has that this build leaves unused."""

    serving: Annotated[list[DeviceName], Field(min_length=1, max_length=MAX_BACKEND_DEVICES)]
    gpu_offload: bool
    devices: Annotated[list[BackendDevice], Field(max_length=MAX_BACKEND_DEVICES)] = Field(default_factory=list)
    cpu_features: Annotated[list[FeatureName], Field(max_length=MAX_REPORTED_FEATURES)] = Field(default_factory=list)
    idle_gpu: DeviceName | None = None

    @property
    def on_gpu(self) -> bool:
        return any(device.kind in ("gpu", "igpu") for device in self.devices if device.name in self.serving)

    def summary(self, with_features: bool = True) -> str:
        """One line: the serving devices with what they are and their free memory, or the CPU with
        its features (`with_features`: where nothing else shows them)."""
        by_name = {device.name: device for device in self.devices}
        parts = []
        for name in self.serving:
            device = by_name.get(name)
            if device is None:
                parts.append(name)
            elif device.kind == "cpu":
                features = ", ".join(self.cpu_features) or "no features reported"
                what = [device.description] if device.description else []
                what += [features] if with_features else []
                parts.append(f"{name} ({'; '.join(what)})" if what else name)
            else:
                free = f"{device.free_bytes / 2**30:.1f} of {device.total_bytes / 2**30:.1f} GiB free"
                parts.append(f"{name} ({device.description}, {free})" if device.description else f"{name} ({free})")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# The host's status: what `/status` says, and `kafila status` and `/metrics` read.
# ---------------------------------------------------------------------------------------------

Blocks = tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]]  # [first, end)


class MemberStatus(Strict):
    """One machine of the session as the host sees it. Fields that do not apply are left unset,
    and so are absent from `/status` (`SessionStatus.wire`)."""

    name: str
    id: str | None = None
    host: bool = False  # the machine serving the API
    path: str | None = None  # how its link goes: direct, relayed
    link: Literal["up", "down"] | None = None
    left: bool = False  # gone from the session, not only from its link
    joining: bool = False  # admitted, waiting for the next plan
    role: Literal["serves", "stands-by"] | None = None  # in the ring, or linked and left out of it
    why: str | None = None  # why it serves or stands by, in words
    rtt_ms: float | None = None
    blocks: Blocks | None = None
    predicted_ms_per_token: float | None = None
    priced_on: str | None = None  # where its stage's price came from
    stages: list[int] | None = None  # one machine split into local stages: their block counts
    backend: BackendReport | None = None  # llama.cpp's devices there, as it said when it joined
    # Where its stage file came from: fetched by its ranges from the hub, sent by the host, found in
    # its cache, or cut from its own copy of the model (`join --model`); its size, the seconds it
    # took, and why not from the hub where the host offered that.
    stage_source: Literal["hub", "host", "cache", "slice"] | None = None
    stage_bytes: int | None = None
    stage_seconds: float | None = None
    stage_why: str | None = None


class EdgeStatus(Strict):
    """One link of the ring, in the order a token crosses them (`from` on the wire)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    source: str = Field(alias="from")
    to: str
    path: str | None = None
    rtt_ms: float | None = None


class PlanStatus(Strict):
    tier: str
    ring: list[str]
    head: str
    division: list[int] | None = None
    predicted_bottleneck_ms: float | None = None
    standby: list[str] = Field(default_factory=list)  # members linked and left out of the ring
    concurrency: int | None = None  # the load who serves was chosen for
    predicted_ms_per_token: float | None = None  # the time per token they were chosen by, at that load


class RebalanceStatus(Strict):
    reason: str
    measured_bottleneck_ms: float
    planned_bottleneck_ms: float | None = None


class LoadStatus(Strict):
    """The load a session serves, where members may stand by: who serves is weighed again when it moves."""

    planned: int  # requests at once the serving ring was planned for
    measured: float | None = None  # mean requests at once while the ring was busy, over the window; None: too idle
    reason: str | None = None  # the last weighing of who serves at another load, in words


class SessionStatus(Strict):
    """The session's part of `/status`: who is in it, the plan, the ring's edges, the last verdict
    on a rebalance and the load served; one machine split locally says its division only."""

    members: list[MemberStatus] = Field(default_factory=list)
    code: str | None = None  # the session code: in /status only for the API key's holder
    admitting: bool | None = None  # whether a freed seat may still be taken (the guess budget not spent)
    failed_proofs: int | None = None  # exchanges begun and not proved (possible guesses), against `guess_budget`
    guess_budget: int | None = None
    epoch: int | None = None
    edges: list[EdgeStatus] = Field(default_factory=list)
    plan: PlanStatus | None = None
    rebalance: RebalanceStatus | None = None
    load: LoadStatus | None = None
    division: list[int] | None = None

    def wire(self) -> dict[str, object]:
        """As `/status` shows it: what was set, and no more."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


class Incident(Strict):
    """Something that went wrong in the session (a stage or member died, the ring broke), kept for `/status`."""

    what: str
    detail: str
    at: float  # Unix time


EventKind = Literal["joined", "left", "replanned", "ready", "incident", "warning", "failed", "note"]


class HostEvent(Strict):
    """One thing that happened to the session, as the host's `/events` stream sends it (and its
    web page's timeline shows it): a member joined or left, the ring was replanned, something
    went wrong. `id` counts up from 1 over the host's life, so a client that reconnects can ask
    for what came after the last one it saw."""

    id: Annotated[int, Field(ge=1)]
    kind: EventKind
    text: str
    detail: str = ""
    at: float  # Unix time

    def wire(self) -> dict[str, object]:
        return self.model_dump(mode="json")


class SpeculationStatus(Strict):
    """Speculative decoding on the ring serving now (`kafila host --speculate`)."""

    mode: str  # ngram, draft or off
    off: str | None = None  # why no sequence drafts, where none does
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    trips: int = 0  # trips that carried drafts
    accepted_per_trip: float = 0.0  # drafted tokens kept per such trip
    mean_window: float = 0.0  # drafted tokens per such trip
    waves_behind: int = 0  # waves sent behind another of the same sequence's still out (drafts in flight)
    waves_stale: int = 0  # of them, those a reject ahead made stale, their rows cut unread
    # What the cost rule weighs (`draft_cost.TripCost`): a decode wave's trip without drafts, what
    # a wave's carrying drafts at all adds to it once, and each drafted row's cost beyond that, as
    # the waves landed show them; None until measured (fixed_ms: or from a host before it).
    trip_ms: Milliseconds | None = None
    row_ms: Milliseconds | None = None
    fixed_ms: Milliseconds | None = None
    # A draft model's decode a drafted token, on the host before the wave leaves (`--draft`): the
    # cost rule adds it to a drafted trip. None with n-gram drafts, or until the draft has drafted.
    draft_ms: Milliseconds | None = None


class PrefillStatus(Strict):
    """Pipelined prefill on the ring serving now: a prompt's chunks in successive waves, so that
    while one chunk is at a stage the next is at the stage before it (KAFILA_PREFILL_CHUNKS)."""

    chunks: Annotated[int, Field(ge=1)]  # chunks of one prompt allowed out round the ring at once; 1: off
    most_chunks_out: Annotated[int, Field(ge=0)] = 0  # the most chunks of one prompt seen out at once
    chunk_rows: Annotated[int, Field(ge=1)] | None = None  # the last pipelined prompt's chunk length (the cost model's)
    ring_ms: Milliseconds | None = None  # the last stage report's trip round the ring, one way, which it prices


class StagesCover(Strict):
    """What the ring serving now had done when its stages' report in `/status` was taken: a
    client that has had its replies waits for `requests` to reach `/status`'s finished and
    failed together, and then reads a report with its work in it, rather than waiting out the
    report's refresh on the clock."""

    requests: Annotated[int, Field(ge=0)]  # finished or failed on this ring
    generated_tokens: Annotated[int, Field(ge=0)]


class HostStatus(SessionStatus):
    """All of `/status`: the server's state, the stages' reports and the session's part."""

    model: str
    ready: bool
    waiting_for: list[str] = Field(default_factory=list)
    error: str | None = None
    join: str | None = None  # the line that joins a member (the session code): only for the API key's holder
    context_per_sequence: int
    queue_depth: int = 0
    running: int = 0
    pipeline_waves: int | None = None
    tokens_per_s: float = 0.0
    requests: dict[str, int] = Field(default_factory=dict)  # finished, failed
    requests_by_dialect: dict[str, int] = Field(default_factory=dict)  # every request to a dialect's routes
    stages: list[StageReport] = Field(default_factory=list)
    stages_cover: StagesCover | None = None  # None until the ring's first report
    incidents: list[Incident] = Field(default_factory=list)
    speculation: SpeculationStatus | None = None
    prefill: PrefillStatus | None = None


# ---------------------------------------------------------------------------------------------
# Models on the hub: what the host planned from, which the members fetch their stages by.
# ---------------------------------------------------------------------------------------------


class HubPart(Strict):
    """One file of a model on the hub (a split model has several), as the host planned from it."""

    path: str = Field(min_length=1, max_length=1000)
    size: int = Field(ge=0)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # the file's, as the hub lists it (LFS)
    header_bytes: int = Field(gt=0)  # where its tensor data begins
    header_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class HubModel(Strict):
    """A model on the hub at a commit, as the host planned from it: what a machine needs to fetch its
    own stage, and to check that it is a stage of the model planned (`fetch_stage`)."""

    repo_id: str = Field(min_length=3, max_length=200)
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    parts: tuple[HubPart, ...] = Field(min_length=1, max_length=1000)

    @property
    def label(self) -> str:
        return f"hf://{self.repo_id}/{self.parts[0].path}@{self.commit[:12]}"


# ---------------------------------------------------------------------------------------------
# Machines: what a member says of itself to the rendezvous, the host and the planner.
# ---------------------------------------------------------------------------------------------

MAX_MEMBERS = 32  # a person's own machines; the exact ring search covers 16


class ModelPricing(Strict):
    """One device's cost numbers for one model, measured on the model itself (`kafila probe --model`).

    The generic probe times wide synthetic blocks, which are bandwidth-bound by design; a narrow
    model's blocks are not, and its head streams faster than its blocks. A device that has priced
    a model's own stages plans that model with these numbers instead.
    """

    model_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bandwidth_gb_s: Annotated[float, Field(gt=0, le=1e6)]
    head_bandwidth_gb_s: Annotated[float, Field(gt=0, le=1e6)]
    overhead_us: Annotated[float, Field(ge=0, le=1e7)]
    # What this machine spent a token as a session's host beyond its stages (the API, sampling,
    # batching, detokenising, its links), measured serving the model; None: not measured. Apart
    # with the head here (it then also takes each row of logits and samples from the whole row)
    # and without it (a stage of blocks, or none).
    host_work_us: Annotated[float, Field(ge=0, le=1e7)] | None = None
    host_work_with_head_us: Annotated[float, Field(ge=0, le=1e7)] | None = None


class FleetDevice(Strict):
    """A machine's profile: its memory and measured speeds, as a fleet file or a probe gives them."""

    name: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(check_name)]
    memory_gib: Annotated[float, Field(gt=0, le=2**20)]
    bandwidth_gb_s: Annotated[float, Field(gt=0, le=1e6)] | None = None
    head_bandwidth_gb_s: Annotated[float, Field(gt=0, le=1e6)] | None = None
    overhead_us: Annotated[float, Field(ge=0, le=1e7)] | None = None
    tflops: Annotated[float, Field(gt=0, le=1e6)] | None = None
    nat: NatClass | NatBehaviour | None = None
    rtt_ms: Annotated[float, Field(ge=0, le=60_000)] | None = None
    # As the session's host, its own work a token beside its stage (`ModelPricing.host_work_us`).
    host_work_us: Annotated[float, Field(ge=0, le=1e7)] | None = None
    host_work_with_head_us: Annotated[float, Field(ge=0, le=1e7)] | None = None

    def lending(self, memory_bytes: int | None) -> FleetDevice:
        """This device with at most `memory_bytes` of its memory offered (`--memory`), or as it is."""
        if memory_bytes is None:
            return self
        return self.model_copy(update={"memory_gib": min(self.memory_gib, max(1, memory_bytes) / 2**30)})

    def besides(self, held_bytes: int) -> FleetDevice:
        """This device less `held_bytes` that something else of this machine's holds (the host's
        draft model): what is left for the model's blocks."""
        if held_bytes <= 0:
            return self
        return self.model_copy(update={"memory_gib": max(self.memory_gib - held_bytes / 2**30, 1 / 2**30)})

    def priced(self, pricing: ModelPricing | None) -> FleetDevice:
        """This device with a model's own o, b and b_head in place of the generic ones (and the host's
        own work a token, where the pricing measured it), or as it is."""
        if pricing is None:
            return self
        priced = {"bandwidth_gb_s", "head_bandwidth_gb_s", "overhead_us", "host_work_us", "host_work_with_head_us"}
        return self.model_copy(update=pricing.model_dump(include=priced, exclude_none=True))
