"""The model a host serves, and what the host reads of it: its manifest to plan from, the stage
files of a plan, what it samples and embeds with when the head is on a member, and the whole file
only where it serves every block.

A local file (`LocalModel`) is all of these at once: the host cuts every stage from it and knows
each stage's sha256. A model on the hub (`HubOnlyModel`) is known by its header alone
(`hub.ranges.read_hub_header`): the host fetches by range only its own stage (and, with the head
on a member, the vocabulary and token embedding), each member fetches its own, and the whole file
is downloaded only to serve alone. A hub model whose whole file this host already holds is a
`LocalModel` that offers members the hub too.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from kafila.contracts import HubModel, Progress
from kafila.hub.fetch import fetch_model
from kafila.hub.ranges import HubHeader, fetch_stage, fetch_vocabulary
from kafila.hub.reference import HubReference, merged_name
from kafila.planner.types import ModelManifest
from kafila.runtime.engine.engines import PrefixCut, prefix_cut_from, prefix_cut_of
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import StageFile, cached_slices, stage_piece
from kafila.runtime.machine.this_machine import hash_model
from kafila.session.fetch_ahead import AheadFetch, OwnStage


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a plan as the host knows it: its blocks, its size, and its file where the host
    holds one (it cut it, or fetched it: its own stage); a stage a member fetches from the hub
    itself has none here, and its size is its tensors' bytes."""

    first_block: int
    end_block: int
    is_head: bool
    n_bytes: int
    file: StageFile | None = None

    @property
    def sha256(self) -> str | None:
        return self.file.sha256 if self.file is not None else None


def held(file: StageFile) -> PlannedStage:
    return PlannedStage(file.first_block, file.end_block, file.is_head, file.n_bytes, file)


class HostModel(Protocol):
    """What the host needs of the model it serves, wherever its bytes are."""

    @property
    def name(self) -> str:
        """Its name for the API and the rendezvous: the file's stem."""
        ...

    @property
    def label(self) -> str:
        """Where it is, for a person: its path, or hf://repository/file@commit."""
        ...

    @property
    def manifest(self) -> ModelManifest: ...

    @property
    def hub(self) -> HubModel | None:
        """The model on the hub, for members to fetch their stages from; None for a local file."""
        ...

    async def identity(self, progress: Progress) -> str | None:
        """The whole file's sha256, for members with their own copy and pricings by model (a split
        model on the hub: a stable name of its parts instead)."""
        ...

    def stages(self, counts: Sequence[int], cache: Path, progress: Progress) -> list[PlannedStage]:
        """The plan's stages (blocking), each with its file where the host holds the whole model;
        for a model known by its header, none yet: the host gets its own with `stage_file`."""
        ...

    def stage_file(self, stage: PlannedStage, cache: Path, progress: Progress) -> StageFile:
        """A stage's file (blocking): this host's own, or one a member could not make itself."""
        ...

    def own_stages(self, own: Sequence[PlannedStage], progress: Progress) -> None:
        """The plan's stages this host holds, told before it gets their files (blocking): what it
        fetched ahead of the plan (`session.fetch_ahead`) is let end or halted."""
        ...

    def vocabulary(self, cache: Path, progress: Progress) -> Path:
        """A file with the model's tokenizer, chat template and token embedding (blocking)."""
        ...

    def prefix_cut(self) -> PrefixCut: ...

    def whole(self, progress: Progress, say: Callable[[str], None]) -> Path:
        """The whole file, to serve every block here (blocking)."""
        ...


@dataclass
class LocalModel:
    """A model file on this machine (given, or downloaded from the hub before: then `hub` is offered
    to the members, and the stage sha256s the host cuts are what they check their fetches by)."""

    path: Path
    hub: HubModel | None = None

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def label(self) -> str:
        return str(self.path)

    @functools.cached_property
    def manifest(self) -> ModelManifest:
        return read_manifest(self.path)

    async def identity(self, progress: Progress) -> str | None:
        return await hash_model(self.path, functools.partial(progress, f"hashing {self.path.name} (once)"))

    def stages(self, counts: Sequence[int], cache: Path, progress: Progress) -> list[PlannedStage]:
        cutting = functools.partial(progress, f"cutting {self.path.name} into {len(counts)} stage files")
        return [held(file) for file in cached_slices(self.path, counts, cache, cutting)]

    def stage_file(self, stage: PlannedStage, cache: Path, progress: Progress) -> StageFile:
        assert stage.file is not None, "every stage of a local file is cut"
        return stage.file

    def own_stages(self, own: Sequence[PlannedStage], progress: Progress) -> None:
        return  # nothing is fetched ahead of a local file's plan

    def vocabulary(self, cache: Path, progress: Progress) -> Path:
        return self.path

    def prefix_cut(self) -> PrefixCut:
        return prefix_cut_of(self.path)

    def whole(self, progress: Progress, say: Callable[[str], None]) -> Path:
        return self.path


@dataclass
class HubOnlyModel:
    """A model on the hub known by its header alone: this host fetches only what it serves."""

    header: HubHeader
    reference: HubReference  # what `--model` named, at the commit planned from
    ahead: AheadFetch | None = None  # this host's stage of a provisional plan, fetched before the first plan

    @property
    def hub(self) -> HubModel:
        return self.header.model

    @property
    def name(self) -> str:
        return PurePosixPath(merged_name(self.hub.parts[0].path)).stem

    @property
    def label(self) -> str:
        return self.hub.label

    @functools.cached_property
    def manifest(self) -> ModelManifest:
        return self.header.manifest()

    async def identity(self, progress: Progress) -> str | None:
        """The file's sha256 as the hub lists it (every fetch checks it against the hub's HEAD); for a
        model split in parts, whose merged file no one here hashes, a sha256 of what names the
        parts at the commit: the same model always gives it, so pricings learned serving it apply."""
        parts = self.hub.parts
        if len(parts) == 1 and parts[0].sha256 is not None:
            return parts[0].sha256
        named = [self.hub.repo_id, self.hub.commit, *(f"{p.path} {p.sha256 or p.header_sha256}" for p in parts)]
        return hashlib.sha256("\n".join(named).encode()).hexdigest()

    def stages(self, counts: Sequence[int], cache: Path, progress: Progress) -> list[PlannedStage]:
        planned, first = [], 0
        for index, count in enumerate(counts):
            end, is_head = first + count, index == len(counts) - 1
            piece = stage_piece(self.header.header.reader, first, end, is_head, self.label)
            planned.append(PlannedStage(first, end, is_head, max(1, piece.data_bytes())))
            first = end
        return planned

    def stage_file(self, stage: PlannedStage, cache: Path, progress: Progress) -> StageFile:
        if stage.file is not None:
            return stage.file
        first, end, head = stage.first_block, stage.end_block, stage.is_head
        # the header this host read from the hub at the commit and planned from: not fetched again
        return fetch_stage(self.hub, first, end, head, cache, progress, planned=self.header)

    def own_stages(self, own: Sequence[PlannedStage], progress: Progress) -> None:
        ahead, self.ahead = self.ahead, None  # the first plan settles it; later ones find what it kept
        if ahead is not None:
            ahead.settle([OwnStage(s.first_block, s.end_block, s.is_head) for s in own], progress)

    def vocabulary(self, cache: Path, progress: Progress) -> Path:
        return fetch_vocabulary(self.hub, cache, progress, planned=self.header)

    def prefix_cut(self) -> PrefixCut:
        return prefix_cut_from(self.header.header.reader)

    def whole(self, progress: Progress, say: Callable[[str], None]) -> Path:
        say(f"this machine serves every block of {self.label}: it downloads the whole file (its whole stage)")
        return fetch_model(self.reference, progress).path
