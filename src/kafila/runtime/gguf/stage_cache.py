"""A bounded stage-file cache: each new division would otherwise add another copy of the model.

Stage files are named by their sha256 (`<64 hex digits>.gguf`). A host cuts the whole model for
every division it plans, so a session that replans twice would hold the model three times over,
and a member keeps every stage it was ever sent. After each cut or delivery the cache drops the
files used least recently until it holds at most its budget: by default twice what the caller
has in use (its plan's files and about one earlier plan's worth), or `KAFILA_STAGE_CACHE_GB`.

It never drops a file the caller has in use, nor one used in the last hour: several kafila
processes on one machine (the demo's host and members, or two sessions) share the cache, and
each knows only its own files. Partial transfers (`.partial`) are left alone, so a transfer
can still resume. A partial fetch from the hub (`hub-partial/<key>`, a stage's journal and what
arrived) resumes too, but one left for a day (a fetch ahead that the plan did not need, a stage
fetched no more) goes at the next fetch: it can hold a stage's size.

The choice is pure (`choose_evictions`); `trim_stage_cache` reads the folder and deletes.

A stage fetched from the hub is found again by what it is a stage of (`HubStageKey`: repository,
commit, file, block range, head or not), with no model file here to key it by; a stage cut from a
local file is found by that file (`slicer.cached_slices`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

STAGE_CACHE_ENV = "KAFILA_STAGE_CACHE_GB"
RECENT_S = 3600.0  # a file used this recently may be another process's: it stays
PARTIAL_KEPT_S = 86_400.0  # a partial hub fetch untouched this long is given up
HUB_PARTIAL = "hub-partial"
_STAGE_FILE = re.compile(r"^[0-9a-f]{64}\.gguf$")
HUB_INDEX = "hub-stages.json"


@dataclass(frozen=True)
class CachedFile:
    name: str
    size: int
    used_at: float  # the file's modification time: written, or marked used since


def stage_cache_budget(in_use_bytes: int, setting: str | None) -> int:
    """The cache's budget in bytes: `setting` gigabytes (10^9 bytes), or twice what is in use."""
    if setting is None or not setting.strip():
        return 2 * in_use_bytes
    try:
        gigabytes = float(setting)
    except ValueError:
        gigabytes = math.nan
    if not math.isfinite(gigabytes) or gigabytes < 0:
        raise ValueError(f"{STAGE_CACHE_ENV} must be a number of gigabytes (0 or more), not {setting!r:.40}")
    return int(gigabytes * 1e9)


def check_stage_cache_setting() -> None:
    """ValueError with the reason unless `KAFILA_STAGE_CACHE_GB` is unset or a size: said at start,
    not when the first cut is trimmed."""
    stage_cache_budget(0, os.environ.get(STAGE_CACHE_ENV))


def choose_evictions(
    files: Sequence[CachedFile], in_use: Iterable[str], budget_bytes: int, now: float, recent_s: float = RECENT_S
) -> list[str]:
    """The files to delete, least recently used first, until the rest fit in the budget (or only
    files in use or used recently are left)."""
    keep = set(in_use)
    total = sum(f.size for f in files)
    evictable = sorted(
        (f for f in files if f.name not in keep and now - f.used_at >= recent_s), key=lambda f: f.used_at
    )
    chosen = []
    for file in evictable:
        if total <= budget_bytes:
            break
        chosen.append(file.name)
        total -= file.size
    return chosen


def mark_used(path: Path) -> None:
    """Bring a cached file to the front of the queue: a hit is a use."""
    with contextlib.suppress(OSError):
        os.utime(path)


def stage_files(directory: Path) -> list[CachedFile]:
    """The stage files in the folder (named by their sha256), none if there is no folder; a file
    removed while we look is simply not there."""
    files = []
    with contextlib.suppress(OSError):
        for path in Path(directory).iterdir():
            if _STAGE_FILE.match(path.name):
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    files.append(CachedFile(path.name, stat.st_size, stat.st_mtime))
    return files


def trim_stage_cache(directory: Path, in_use: Iterable[Path], budget_bytes: int | None = None) -> list[Path]:
    """Delete the least recently used stage files beyond the budget; returns what went.

    Best effort: a file another process deleted first, or one that cannot be deleted, is passed by.
    """
    names = {Path(p).name for p in in_use}
    files = stage_files(directory)
    if budget_bytes is None:
        budget_bytes = stage_cache_budget(
            sum(f.size for f in files if f.name in names), os.environ.get(STAGE_CACHE_ENV)
        )
    removed = []
    for name in choose_evictions(files, names, budget_bytes, time.time()):
        path = Path(directory) / name
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def make_room(directory: Path, incoming_bytes: int) -> list[Path]:
    """Before a cut or a transfer of `incoming_bytes`: trim so that the new files will fit the budget
    they set (by default, twice their size), on a disk that old cuts may have filled."""
    budget = stage_cache_budget(incoming_bytes, os.environ.get(STAGE_CACHE_ENV))
    return trim_stage_cache(directory, [], max(0, budget - incoming_bytes))


def choose_stale_partials(
    touched: Sequence[tuple[str, float]], keep: str, now: float, kept_s: float = PARTIAL_KEPT_S
) -> list[str]:
    """The partial fetches (name, when anything in it last changed) to give up: every one but
    `keep` left untouched for `kept_s`."""
    return [name for name, at in touched if name != keep and now - at >= kept_s]


def trim_partial_fetches(directory: Path, keep: str) -> list[Path]:
    """Delete the partial hub fetches in `directory` that `choose_stale_partials` gives up; returns
    what went. Best effort, as `trim_stage_cache`."""
    root = Path(directory) / HUB_PARTIAL
    touched = []
    with contextlib.suppress(OSError):
        for work in root.iterdir():
            with contextlib.suppress(OSError):
                times = [work.stat().st_mtime, *(entry.stat().st_mtime for entry in work.iterdir())]
                touched.append((work.name, max(times)))
    removed = []
    for name in choose_stale_partials(touched, keep, time.time()):
        shutil.rmtree(root / name, ignore_errors=True)
        removed.append(root / name)
    return removed


@dataclass(frozen=True)
class HubStageKey:
    """A stage of a model on the hub, as the cache knows it: the same repository, commit, file (a
    split model's first part), blocks and head or not make the same stage file, byte for byte."""

    repo_id: str
    commit: str
    file: str
    first: int
    end: int
    is_head: bool

    def text(self) -> str:
        return json.dumps(astuple(self))

    def digest(self) -> str:
        """A short name for folders of this stage's work (its partial fetch)."""
        return hashlib.sha256(self.text().encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CachedStage:
    path: Path
    sha256: str
    n_bytes: int


def _hub_index(directory: Path) -> dict[str, object]:
    try:
        index = json.loads((directory / HUB_INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def find_hub_stage(directory: Path, key: HubStageKey) -> CachedStage | None:
    """The stage file kept for `key`, while it is there with the size it had (marked used), else None."""
    entry = _hub_index(directory).get(key.text())
    if not isinstance(entry, dict):
        return None
    name, size = entry.get("name"), entry.get("n_bytes")
    if not isinstance(name, str) or not _STAGE_FILE.match(name) or not isinstance(size, int):
        return None
    path = directory / name
    try:
        if path.stat().st_size != size:
            return None
    except OSError:
        return None
    mark_used(path)
    return CachedStage(path, name.removesuffix(".gguf"), size)


def hub_stages_of(directory: Path, repo_id: str, commit: str, file: str) -> list[tuple[HubStageKey, CachedStage]]:
    """The stages of one model (repository, commit, file) kept here, each while it is there with the
    size it had."""
    found = []
    for text in _hub_index(directory):
        try:
            key = HubStageKey(*json.loads(text))
        except (TypeError, ValueError):
            continue
        if (key.repo_id, key.commit, key.file) == (repo_id, commit, file):
            kept = find_hub_stage(directory, key)
            if kept is not None:
                found.append((key, kept))
    return found


def remember_hub_stage(directory: Path, key: HubStageKey, path: Path) -> None:
    """Note that `path` (a stage file in `directory`) is the stage `key` names; entries whose files
    are gone are dropped. Best effort: a lost entry costs a fetch, never a wrong stage."""
    index = {k: v for k, v in _hub_index(directory).items() if _present(directory, v)}
    index[key.text()] = {"name": path.name, "n_bytes": path.stat().st_size}
    partial = directory / f"{HUB_INDEX}.{os.getpid()}.partial"
    with contextlib.suppress(OSError):
        partial.write_text(json.dumps(index))
        os.replace(partial, directory / HUB_INDEX)


def _present(directory: Path, entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("name"), str) and (directory / entry["name"]).is_file()
