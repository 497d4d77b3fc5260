"""This host's own stage fetched from the hub before its plan, while the members are still to come.

A host with `--members N` serving a model known by its header waits for people to type its join
line: seconds, often minutes. Its downlink idles meanwhile, and once the plan is made every
machine fetches at once from the same hub, the host among them. So the host plans provisionally
as soon as it has measured itself: every member a machine like it, every one serving
(`provisional_stage`), and fetches the stage that plan gives it (`AheadFetch`: the same
`fetch_stage` as after the plan, into the same stage cache, checked the same way against the
header planned from). When the real plan comes (`AheadFetch.settle`, `keeps_fetching`): a stage
that shares most of the bytes fetched ahead lets the fetch end, and is then taken as it is, or
fetches only what it lacks (the stage cache's kept tensors, as a replan's); a stage that shares
less halts it (its journal kept, for a later fetch of the same stage). What is fetched ahead is
at most the stage the provisional plan gives this host.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kafila.background import in_background
from kafila.contracts import FleetDevice, ModelPricing, Progress
from kafila.hub.ranges import HubHeader, RangeSettings, fetch_stage
from kafila.planner.types import ModelManifest, PlanRefused, ServingSpec
from kafila.session.pricing import Machine, RingPricing

KEEP_SHARE = 0.5  # a fetch ahead goes on to its end where the plan's own stages hold this share of its bytes


@dataclass(frozen=True)
class OwnStage:
    """Blocks [first, end) of the model, with the head or not: a stage this host holds."""

    first: int
    end: int
    is_head: bool

    def words(self) -> str:
        blocks = f"blocks {self.first}-{self.end - 1}" if self.end > self.first else "no blocks"
        return f"{blocks}{' and the head' if self.is_head else ''}"


def provisional_stage(
    manifest: ModelManifest,
    device: FleetDevice,
    members: int,
    session: ServingSpec,
    pricings: tuple[ModelPricing, ...] = (),
    model_sha256: str | None = None,
) -> OwnStage | None:
    """The stage a plan of `members` machines gives this host (the first), were every other one a
    machine like it and every one serving: the share it would hold among equals, the head with it
    where it can hold the head (`plan_serving_host_choice`). None where that plan gives it none,
    or no plan fits."""
    ids = [f"machine-{index}" for index in range(max(1, members))]
    machines = {name: Machine(name, device, pricings) for name in ids}
    prices = RingPricing(manifest, session, model_sha256=model_sha256, host=ids[0])
    try:
        plan = prices.plan(machines, ids)
    except PlanRefused:
        return None
    own = next((stage for stage in plan.stages if stage.device == ids[0]), None)
    if own is None or own.end <= own.start:
        return None
    return OwnStage(own.start, own.end, own.is_head)


def stage_bytes(manifest: ModelManifest, stage: OwnStage) -> int:
    """The weights' bytes of `stage`: its blocks, and the head's where it holds it."""
    return sum(manifest.block_bytes[stage.first : stage.end]) + (manifest.head_bytes if stage.is_head else 0)


def shared_bytes(manifest: ModelManifest, ahead: OwnStage, own: Sequence[OwnStage]) -> int:
    """The bytes of `ahead` that the plan's `own` stages hold too."""
    held = {block for stage in own for block in range(stage.first, stage.end)}
    blocks = sum(manifest.block_bytes[block] for block in range(ahead.first, ahead.end) if block in held)
    head = ahead.is_head and any(stage.is_head for stage in own)
    return blocks + (manifest.head_bytes if head else 0)


def keeps_fetching(manifest: ModelManifest, ahead: OwnStage, own: Sequence[OwnStage]) -> bool:
    """Whether the fetch ahead of the plan goes on to its end once the plan gives this host `own`:
    where those stages hold at least `KEEP_SHARE` of its bytes (the fetch after the plan then takes
    them from it); else it halts, and the plan's stages are fetched as they are."""
    total = stage_bytes(manifest, ahead)
    return total > 0 and shared_bytes(manifest, ahead, own) >= KEEP_SHARE * total


class ProgressRelay:
    """A fetch's progress handed on to whatever shows it now: the bars of the host's wait for its
    members, then those of the plan's deployment (each is its own display)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._to: Progress | None = None

    def __call__(self, what: str, done: int, total: int) -> None:
        with self._lock:
            if self._to is not None:
                self._to(what, done, total)

    def to(self, progress: Progress | None) -> None:
        with self._lock:
            self._to = progress


class AheadFetch:
    """The provisional plan's stage for this host, fetched from the hub in a thread of its own
    (`fetch_stage`, into `cache`, against the `header` it planned from), begun at once."""

    def __init__(
        self,
        header: HubHeader,
        stage: OwnStage,
        manifest: ModelManifest,
        cache: Path,
        *,
        endpoint: str | None = None,
        settings: RangeSettings | None = None,
    ) -> None:
        self.stage, self._manifest = stage, manifest
        self.progress = ProgressRelay()
        self._halt = threading.Event()
        fetch = functools.partial(
            fetch_stage, header.model, stage.first, stage.end, stage.is_head, cache, self.progress,
            endpoint=endpoint, settings=settings, halt=self._halt, planned=header,
        )  # fmt: skip
        self._done = in_background("kafila-fetch-ahead", fetch)

    @property
    def done(self) -> bool:
        return self._done.done()

    def settle(self, own: Sequence[OwnStage], progress: Progress) -> bool:
        """Once the plan gives this host `own`: let the fetch end, its progress shown by `progress`,
        or halt it (`keeps_fetching`), and wait for it (blocking). True where it ended with its
        stage in the cache; a fetch that failed is the fetch after the plan's to say why."""
        if keeps_fetching(self._manifest, self.stage, own):
            self.progress.to(progress)
        else:
            self.halt()
        try:
            self._done.result()
        except Exception:  # halted, or the hub's refusal, met again after the plan
            return False
        return True

    def halt(self) -> None:
        self._halt.set()
