"""A model on the hub, fetched by the bytes each machine needs: its header to plan from, and one
stage's tensors to serve, by HTTP Range requests at a pinned commit (`resolve/<commit>/<file>`).
Nobody downloads the whole model.

Each file is read by range as `kafila.hub.remote.RemoteFile` reads it (huggingface_hub's URL, token,
endpoint and metadata; each answer checked to be the range asked; a range cut off resumed where it
broke); here, what arrived is kept across runs (`_Journal`).

In the session, the host plans from `read_hub_header` and fetches its own stage with `fetch_stage`
(and, where the head is on a member, the vocabulary and token embedding it samples and embeds with:
`fetch_vocabulary`); each member fetches its own stage with the `HubModel` the host read
(`session/member.py`). Only a machine that serves every block downloads the whole file
(docs/architecture.md, "Stages by ranges").
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from kafila.contracts import HubModel, HubPart, Progress
from kafila.hub.listing import ModelFetchError
from kafila.hub.reference import HubReference, merged_name
from kafila.hub.remote import (
    HEADER_FIRST_READ,
    HeaderBytes,
    HubMismatch,
    PartHeader,
    RemoteFile,
    read_bytes,
    read_header_bytes,
)
from kafila.planner.types import ModelManifest
from kafila.runtime.gguf.arriving import Arrival, arrival_at, arriving
from kafila.runtime.gguf.gguf_file import FastGGUFReader, GGUFFormatError, HeaderIncomplete, HeaderReader
from kafila.runtime.gguf.header import JOIN_GAP, ByteRun, ModelHeader, TensorSpan, check_spans, fetch_runs
from kafila.runtime.gguf.manifest import manifest_of
from kafila.runtime.gguf.slicer import (
    SliceError,
    StageFile,
    StageLayout,
    StagePiece,
    check_room,
    disk_full_said,
    stage_layout,
    stage_piece,
    vocabulary_piece,
)
from kafila.runtime.gguf.stage_cache import (
    HUB_PARTIAL,
    HubStageKey,
    find_hub_stage,
    hub_stages_of,
    make_room,
    remember_hub_stage,
    trim_partial_fetches,
    trim_stage_cache,
)
from kafila.runtime.machine.this_machine import cache_dir as kafila_cache

REMOTES_FRESH_S = 60.0  # what the hub said of a file is taken again for this long (its CDN's address is signed)
HASH_READ = 4 << 20  # the stage file is hashed in reads of this many bytes, as they land
IN_PLACE = "in place"  # the journal's plan: bytes at their place in the stage file (not packed back to back)
_STAGE, _SIDE = "stage.partial", "scaled.bin"  # the stage file as it arrives; the tensors it holds scaled, as fetched


class FetchHalted(Exception):
    """The caller halted the fetch (`fetch_stage`'s `halt`): what arrived is kept in its journal, for
    a later fetch of the same stage to resume from."""


def stage_key(model: HubModel, first: int, end: int, is_head: bool) -> HubStageKey:
    """Where the stage cache keeps this model's blocks [first, end) (and the head, or not)."""
    return HubStageKey(model.repo_id, model.commit, model.parts[0].path, first, end, is_head)


@dataclass(frozen=True)
class HubHeader:
    """What the host plans from: the model on the hub at a commit, and its header(s) read as one model;
    with what the hub said of each part's file as its header was read (`remotes`),
    which a fetch begun soon after takes rather than asking again (`fresh_remotes`)."""

    model: HubModel
    header: ModelHeader
    remotes: tuple[RemoteFile, ...] = field(default=(), compare=False, repr=False)
    read_at: float = field(default_factory=time.monotonic, compare=False, repr=False)

    def fresh_remotes(self) -> tuple[RemoteFile, ...]:
        """The parts' files as the header's read found them, while that is recent (`REMOTES_FRESH_S`:
        the hub may send a file's bytes from a signed address that expires); else none."""
        return self.remotes if time.monotonic() - self.read_at < REMOTES_FRESH_S else ()

    def manifest(self) -> ModelManifest:
        """The planner's manifest, the same as `read_manifest` gives for the whole file."""
        stem = PurePosixPath(merged_name(self.model.parts[0].path)).stem
        return manifest_of(self.header.reader, self.model.label, stem)


@dataclass(frozen=True)
class RangeSettings:
    """How a stage's ranges are fetched: in pieces of at most `piece_bytes`, `workers` at a time,
    each piece's progress noted in the journal every `journal_bytes` (what a process cut off
    fetches again, at most, per piece); tensors less than `join_gap` apart fetched as one range."""

    workers: int = 8
    piece_bytes: int = 16 << 20
    journal_bytes: int = 1 << 20
    join_gap: int = JOIN_GAP


def read_hub_header(
    reference: HubReference,
    *,
    endpoint: str | None = None,
    first_read: int = HEADER_FIRST_READ,
    read: HeaderBytes | None = None,
) -> HubHeader:
    """The model `reference` names, known from its header alone: the revision resolved to a commit,
    each part's header fetched by range (`read_header_bytes`: a first read of up to `first_read`
    bytes, stopped where the header ends; or its bytes already `read`), nothing of the weights."""
    found = read if read is not None else read_header_bytes(reference, endpoint=endpoint, first_read=first_read)
    readers, parts = [], []
    for part in found.parts:
        header, reader = _kept_header(part)
        readers.append(reader)
        parts.append(
            HubPart(
                path=part.file.path,
                size=part.remote.size,
                sha256=part.file.sha256,
                header_bytes=len(header),
                header_sha256=hashlib.sha256(header).hexdigest(),
            )
        )
    model = HubModel(repo_id=found.repo_id, commit=found.commit, parts=tuple(parts))
    return HubHeader(model, _joined(model, readers), tuple(part.remote for part in found.parts))


def fetch_stage(
    model: HubModel,
    first: int,
    end: int,
    is_head: bool,
    out_dir: str | os.PathLike[str],
    progress: Progress | None = None,
    *,
    endpoint: str | None = None,
    settings: RangeSettings | None = None,
    halt: threading.Event | None = None,
    planned: HubHeader | None = None,
) -> StageFile:
    """The stage file of blocks [first, end) (`is_head`: with the head) of `model`, fetched by the
    ranges of exactly the tensors it holds and cut by the slicer: byte for byte the file the
    slicer cuts from the whole model. A stage kept from before is taken without fetching; a fetch
    cut off resumes from what it kept. The headers are fetched again and must be the ones planned
    from, byte for byte (not where `planned` is given: the headers this process read from the hub
    at that commit and planned from, the host's; what the hub said of the files then is taken too,
    while fresh), and every tensor must lie where its header says
    in a file of the planned size: else `HubMismatch`. `HubRefused` and `HubUnreachable` where the hub says no or is not
    there: the caller falls back to another source. Setting `halt` stops the fetch where it is
    (`FetchHalted`)."""
    out = Path(out_dir)
    key = stage_key(model, first, end, is_head)
    kept = find_hub_stage(out, key)
    if kept is not None:
        return StageFile(0, first, end, is_head, kept.path, kept.sha256, kept.n_bytes)
    stage = _fetch_piece(
        model,
        lambda header: stage_piece(header.reader, first, end, is_head, model.label),
        out,
        key,
        f"blocks {first}-{end - 1}",
        progress,
        endpoint,
        settings or RangeSettings(),
        halt,
        planned,
    )
    remember_hub_stage(out, key, stage.path)
    trim_stage_cache(out, [stage.path])
    return stage


def _partial_dir(out: Path, key: HubStageKey) -> Path:
    """Where a fetch of the piece `key` works: its file as it arrives, before it is renamed after
    its sha256, and its journal."""
    return out / HUB_PARTIAL / key.digest()


def partial_stage(model: HubModel, first: int, end: int, is_head: bool, out_dir: str | os.PathLike[str]) -> Path:
    """Where `fetch_stage` writes that stage as it arrives."""
    return _partial_dir(Path(out_dir), stage_key(model, first, end, is_head)) / _STAGE


async def arriving_stage(
    model: HubModel, first: int, end: int, is_head: bool, out_dir: str | os.PathLike[str], until: asyncio.Future[Any]
) -> tuple[Path, Arrival] | None:
    """The stage file `fetch_stage` fetches into `out_dir` in this process, as soon as it is laid
    out (its header in place) and its tensors begin arriving, with their arrival: llama.cpp may
    begin loading it (`runtime.gguf.arriving`). The file is renamed once complete, and a fetch that
    fails settles it incomplete; None where `until` is done with no such fetch under way."""
    path = partial_stage(model, first, end, is_head, out_dir)
    arrival = await arrival_at(path, until)
    return None if arrival is None else (path, arrival)


def fetch_vocabulary(
    model: HubModel,
    out_dir: str | os.PathLike[str],
    progress: Progress | None = None,
    *,
    endpoint: str | None = None,
    settings: RangeSettings | None = None,
    planned: HubHeader | None = None,
) -> Path:
    """What a host whose head is on a member tokenizes, samples and embeds with, fetched by the one
    range of the token embedding (`slicer.vocabulary_piece`: the model's metadata and that tensor);
    kept in `out_dir` by the model's commit and file, as a stage is, and checked as `fetch_stage`
    checks one (`planned` as there)."""
    out = Path(out_dir)
    key = stage_key(model, 0, 0, False)  # no stage has no blocks: the vocabulary's own key
    kept = find_hub_stage(out, key)
    if kept is not None:
        return kept.path
    made = _fetch_piece(
        model, lambda header: vocabulary_piece(header.reader, model.label), out, key, "the vocabulary",
        progress, endpoint, settings or RangeSettings(), planned=planned,
    )  # fmt: skip
    remember_hub_stage(out, key, made.path)
    return made.path


def _fetch_piece(
    model: HubModel,
    cut: Callable[[ModelHeader], StagePiece],
    out: Path,
    key: HubStageKey,
    what: str,
    progress: Progress | None,
    endpoint: str | None,
    settings: RangeSettings,
    halt: threading.Event | None = None,
    planned: HubHeader | None = None,
) -> StageFile:
    """The piece `cut` makes of the model's headers (fetched again and checked, or those `planned`
    from), its tensors fetched by their ranges straight to their places in the stage file
    (`_fetch_into`, journalled in a work folder), refused before a byte is fetched where the disk
    cannot hold it."""
    fresh = planned.fresh_remotes() if planned is not None and planned.model == model else ()
    remotes = fresh or [
        RemoteFile(model.repo_id, model.commit, part.path, endpoint, part.size, part.sha256) for part in model.parts
    ]
    header = planned.header if planned is not None else None
    if header is None:
        readers = [_checked_header(remote, part) for remote, part in zip(remotes, model.parts, strict=True)]
        header = _joined(model, readers)
    piece = cut(header)
    here = _kept_tensors(out, model, header, {t.name for t in piece.source_tensors()})
    wanted = [t for t in piece.source_tensors() if t.name not in here]
    spans = header.spans_of(wanted)
    runs = fetch_runs(spans, settings.join_gap)
    layout = stage_layout(piece)
    work = _partial_dir(out, key)
    trim_partial_fetches(out, keep=work.name)
    make_room(out, layout.size)
    name = PurePosixPath(model.parts[0].path).name
    check_room(out, layout.size - _held(work / _STAGE), f"the rest of {what} of {name}")  # before a byte is fetched
    plan = json.dumps(
        [model.model_dump(mode="json"), [asdict(run) for run in runs], settings.piece_bytes, layout.size, IN_PLACE]
    )
    reused = f" ({sum(int(t.nbytes) for t in here.values()) / 1e6:.1f} MB of it kept here)" if here else ""
    what_now = f"fetching {what} of {name}{reused}"
    with disk_full_said(out, f"{what} of {name} arrived"):
        digest = _fetch_into(remotes, runs, spans, layout, here, work, plan, what_now, progress, settings, halt)
        final = out / f"{digest}.gguf"
        os.replace(work / _STAGE, final)
    shutil.rmtree(work, ignore_errors=True)
    return StageFile(0, piece.first, piece.end, piece.is_head, final, digest, layout.size)


def _held(path: Path) -> int:
    """The bytes a partial stage file holds on disk (it is sparse where nothing arrived yet)."""
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def _kept_tensors(out: Path, model: HubModel, header: ModelHeader, needed: set[str]) -> dict[str, np.ndarray]:
    """The bytes of the `needed` tensors that stages of the same model kept in `out` hold as they
    were fetched (`StagePiece.copied`), each checked to be as long as the header says: a replan
    that gives this machine more blocks fetches only the rest."""
    found: dict[str, np.ndarray] = {}
    for key, kept in hub_stages_of(out, model.repo_id, model.commit, model.parts[0].path):
        if key.end <= key.first or not needed - set(found):
            continue  # the vocabulary's entry; or nothing left to find
        try:
            copies = stage_piece(header.reader, key.first, key.end, key.is_head, model.label).copied()
            stored = {t.name: t for t in FastGGUFReader(kept.path).tensors}
        except (GGUFFormatError, SliceError, OSError):
            continue  # a division this header does not allow, or a file gone: fetched instead
        for source, name in copies.items():
            tensor = stored.get(name)
            if source in needed and source not in found and tensor is not None:
                raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
                if len(raw) == header.spans[source].n_bytes:
                    found[source] = raw
    return found


def _joined(model: HubModel, readers: Sequence[HeaderReader]) -> ModelHeader:
    """The parts' headers as one model, every tensor checked to lie in its part as the header says."""
    try:
        header = ModelHeader(readers, [part.path for part in model.parts])
        check_spans(header.spans.values(), header.header_bytes, [part.size for part in model.parts])
    except GGUFFormatError as error:
        raise HubMismatch(f"{model.label} on the hub: {error}") from None
    return header


def _header_path(remote: RemoteFile) -> Path:
    """Where a file's header is kept for its reader (read from the disk): by repository, commit and
    a hash of the path, so no name the hub gives becomes a path here."""
    digest = hashlib.sha256(remote.name.encode()).hexdigest()[:24]
    folder = kafila_cache() / "hub-headers" / remote.repo_id.replace("/", "--") / remote.commit
    return folder / f"{digest}.gguf-header"


def _keep_header(remote: RemoteFile, header: bytes) -> HeaderReader:
    """The header on disk, written whole or not at all, and read."""
    path = _header_path(remote)
    try:
        if not path.is_file() or path.read_bytes() != header:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
            partial.write_bytes(header)
            os.replace(partial, path)
        return HeaderReader(path)
    except GGUFFormatError as error:
        raise HubMismatch(f"{remote.name} on the hub is not a GGUF model Kafila reads: {error}") from None


def _kept_header(part: PartHeader) -> tuple[bytes, HeaderReader]:
    """The part's header, kept on disk and read: as read, where it was read whole; else found by
    parsing the bytes read, read on twice as far each time as long as the header ends beyond them."""
    remote, data = part.remote, part.data
    if part.whole:
        reader = _keep_header(remote, data)
        if reader.header_bytes != len(data):
            raise HubMismatch(f"{remote.name}: its header is {reader.header_bytes} bytes, not {len(data)}")
        return data, reader
    probe = _header_path(remote).with_suffix(f".{os.getpid()}.{threading.get_ident()}.probe")
    probe.parent.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            probe.write_bytes(data)
            try:
                length = HeaderReader(probe).header_bytes
                break
            except HeaderIncomplete:
                if len(data) >= remote.size:
                    raise HubMismatch(f"{remote.name}: the GGUF header runs past the end of the file") from None
                data += read_bytes(remote, len(data), min(len(data), remote.size - len(data)))
            except GGUFFormatError as error:
                raise HubMismatch(f"{remote.name} on the hub is not a GGUF model Kafila reads: {error}") from None
    finally:
        probe.unlink(missing_ok=True)
    header = data[:length]
    return header, _keep_header(remote, header)


def _checked_header(remote: RemoteFile, part: HubPart) -> HeaderReader:
    """The part's header fetched again, refused unless it is byte for byte the one planned from."""
    header = read_bytes(remote, 0, part.header_bytes)
    digest = hashlib.sha256(header).hexdigest()
    if digest != part.header_sha256:
        raise HubMismatch(
            f"{remote.name}: the header on the hub at {remote.commit[:12]} is not the one planned from "
            f"(sha256 {digest}, planned {part.header_sha256})"
        )
    reader = _keep_header(remote, header)
    if reader.header_bytes != part.header_bytes:
        raise HubMismatch(f"{remote.name}: its header is {reader.header_bytes} bytes, planned {part.header_bytes}")
    return reader


@dataclass(frozen=True)
class _Piece:
    """A part of a range fetched by one worker at a time."""

    part: int
    start: int
    length: int


def _pieces(runs: Sequence[ByteRun], size: int) -> list[_Piece]:
    return [
        _Piece(run.part, run.start + at, min(size, run.length - at))
        for run in runs
        for at in range(0, run.length, size)
    ]


@dataclass(frozen=True)
class _Segment:
    """Source bytes [start, end) of a piece's part, written from `at` on in the stage file, or in the
    side file where they are a tensor the stage holds scaled (`side`)."""

    start: int
    end: int
    at: int
    side: bool


def _segments(pieces: Sequence[_Piece], spans: Sequence[TensorSpan], layout: StageLayout) -> list[list[_Segment]]:
    """Where each piece's bytes go: each tensor's straight to its place in the stage file (a scaled
    one's to the side file, back to back, scaled into the stage once all arrived); the bytes between
    tensors a joined range carries, nowhere."""
    found: list[list[_Segment]] = [[] for _ in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i].part, pieces[i].start))
    keys = [(pieces[i].part, pieces[i].start) for i in order]
    side = 0
    for span in sorted(spans, key=lambda s: (s.part, s.start)):
        scaled = span.name in layout.scales
        base = side if scaled else layout.places[span.name]
        side += span.n_bytes if scaled else 0
        at = max(0, bisect.bisect_right(keys, (span.part, span.start)) - 1)
        for index in order[at:]:
            piece = pieces[index]
            if piece.part != span.part or piece.start >= span.end:
                break
            start, end = max(piece.start, span.start), min(piece.start + piece.length, span.end)
            if start < end:
                found[index].append(_Segment(start, end, base + start - span.start, scaled))
    return found


class _Journal:
    """What arrived of each piece, a line as each write lands (after the bytes): a fetch cut off, the
    process gone included, resumes from it. Kept beside the bytes, with the plan it belongs to; a
    different plan starts afresh."""

    def __init__(self, work: Path, plan: str, pieces: Sequence[_Piece]) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.path = work / "journal"
        plan_path = work / "plan.json"
        try:
            same = plan_path.read_text() == plan
        except OSError:
            same = False
        if not same:  # another plan's bytes, or an older Kafila's (its packed `ranges.bin`): gone
            for stale in work.iterdir():
                if stale.is_file() and stale != plan_path:
                    stale.unlink(missing_ok=True)
            plan_path.write_text(plan)
        self.done = [0] * len(pieces)
        with contextlib.suppress(OSError):
            for line in self.path.read_text().splitlines():
                index, _, count = line.partition(" ")
                if index.isdigit() and count.isdigit() and int(index) < len(pieces):
                    self.done[int(index)] = max(self.done[int(index)], min(int(count), pieces[int(index)].length))
        self.lock = threading.Lock()
        self.file = self.path.open("a")

    def record(self, index: int, done: int) -> int:
        """Note the piece's bytes so far; the bytes of every piece so far."""
        with self.lock:
            self.file.write(f"{index} {done}\n")
            self.file.flush()
            self.done[index] = done
            return sum(self.done)


class _Hasher:
    """The stage file's sha256, taken from a thread as its bytes land: up to the first byte a piece
    or scaled tensor still to come will write (`pending`, its least offset), read back while the
    hub sends the rest, so that the last byte in leaves little to hash."""

    def __init__(self, fd: int, size: int, pending: dict[object, int]) -> None:
        self.fd, self.size, self.pending = fd, size, dict(pending)
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.stopped = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="kafila-stage-hash", daemon=True)
        self.thread.start()

    def landed(self, key: object) -> None:
        """What `key` writes is in the file."""
        with self.changed:
            self.pending.pop(key, None)
            self.changed.notify()

    def result(self) -> str:
        """The sha256, once nothing is pending."""
        self.thread.join()
        if self.hashed != self.size:
            raise ModelFetchError(f"the stage file was hashed to byte {self.hashed} of {self.size}")
        return self.digest.hexdigest()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify()
        self.thread.join()

    def _frontier(self) -> int:
        return min(self.pending.values(), default=self.size)

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.stopped and self.hashed >= self._frontier() and self.hashed < self.size:
                    self.changed.wait()
                if self.stopped or self.hashed >= self.size:
                    return
                until = self._frontier()
            while self.hashed < until:
                data = os.pread(self.fd, min(until - self.hashed, HASH_READ), self.hashed)
                if not data:
                    return  # shorter than laid out: `result` says so
                self.digest.update(data)
                self.hashed += len(data)


def _write_at(fd: int, data: memoryview, at: int) -> None:
    while data:
        written = os.pwrite(fd, data, at)
        data, at = data[written:], at + written


class _Stopped(Exception):
    """Another piece failed: this one stops where it is (its journal kept)."""


def _fetch_into(
    remotes: Sequence[RemoteFile],
    runs: Sequence[ByteRun],
    spans: Sequence[TensorSpan],
    layout: StageLayout,
    here: dict[str, np.ndarray],
    work: Path,
    plan: str,
    what: str,
    progress: Progress | None,
    settings: RangeSettings,
    halt: threading.Event | None = None,
) -> str:
    """Every run's tensors into their places in `work/stage.partial` (laid out by `layout`; the
    tensors `here` copied in from stages kept here), pieces in parallel, resuming what an earlier
    fetch of the same plan kept, and hashed as they land: the stage's sha256; `FetchHalted` once
    `halt` is set."""
    pieces = _pieces(runs, max(1, settings.piece_bytes))
    journal = _Journal(work, plan, pieces)
    segments = _segments(pieces, spans, layout)
    total = sum(p.length for p in pieces)
    stop = threading.Event()
    shown = threading.Lock()
    stage_fd = os.open(work / _STAGE, os.O_RDWR | os.O_CREAT, 0o644)
    stack = contextlib.ExitStack()
    side_fd = os.open(work / _SIDE, os.O_RDWR | os.O_CREAT, 0o644)
    hasher: _Hasher | None = None
    try:
        layout.start(stage_fd)
        arrival = stack.enter_context(arriving(stage_fd))  # a load may begin now: it waits for the bytes
        for name, kept in here.items():
            _write_at(stage_fd, memoryview(layout.scaled(name, kept.tobytes())), layout.places[name])
        pending: dict[object, int] = {
            index: min(s.at for s in found if not s.side)
            for index, found in enumerate(segments)
            if journal.done[index] < pieces[index].length and any(not s.side for s in found)
        }
        scaled = [span for span in spans if span.name in layout.scales]
        pending.update({span.name: layout.places[span.name] for span in scaled})
        hasher = _Hasher(stage_fd, layout.size, pending)
        if progress is not None:
            progress(what, sum(journal.done), total)

        def fetch(index: int) -> None:
            piece = pieces[index]
            done = journal.done[index]
            if halt is not None and halt.is_set():
                raise FetchHalted
            if done >= piece.length or stop.is_set():
                return
            noted = done
            places = segments[index]

            def write(chunk: bytes) -> None:
                nonlocal done, noted
                if halt is not None and halt.is_set():
                    raise FetchHalted
                if stop.is_set():
                    raise _Stopped
                here_at = piece.start + done
                view = memoryview(chunk)
                for segment in places:
                    start, end = max(here_at, segment.start), min(here_at + len(chunk), segment.end)
                    if start < end:
                        fd = side_fd if segment.side else stage_fd
                        _write_at(fd, view[start - here_at : end - here_at], segment.at + start - segment.start)
                done += len(chunk)
                if done - noted < settings.journal_bytes and done < piece.length:
                    return
                noted = done  # the bytes are with the system before the journal says they are
                so_far = journal.record(index, done)
                if progress is not None:
                    with shown:
                        progress(what, so_far, total)

            remotes[piece.part].read(piece.start, piece.length, write, done)
            assert hasher is not None
            hasher.landed(index)

        with ThreadPoolExecutor(max(1, settings.workers), thread_name_prefix="kafila-ranges") as pool:
            futures: list[Future[None]] = [pool.submit(fetch, i) for i in range(len(pieces))]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                stop.set()
                for future in futures:
                    future.cancel()
                raise failed
        side = 0
        for span in sorted(scaled, key=lambda s: (s.part, s.start)):
            fetched = os.pread(side_fd, span.n_bytes, side)
            _write_at(stage_fd, memoryview(layout.scaled(span.name, fetched)), layout.places[span.name])
            side += span.n_bytes
            hasher.landed(span.name)
        arrival.settle(True)  # every byte written: a load waiting may read them as the hash catches up
        return hasher.result()
    finally:
        stack.close()
        if hasher is not None:
            hasher.stop()
        journal.file.close()
        os.close(stage_fd)
        os.close(side_fd)
