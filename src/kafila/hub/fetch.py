"""The thin shell around `huggingface_hub`: download the chosen GGUF of a repository's listing
(`hub.listing`) once into the hub's cache (resumable), and check it against the sha256 the hub
lists before anyone uses it.

huggingface_hub reads HF_TOKEN, HF_ENDPOINT and HF_HUB_CACHE itself; nothing here sets them.
`endpoint` and `hub_cache` exist for callers that must differ from the environment (tests in one process).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.utils import tqdm as HubTqdm

from kafila.contracts import HubModel, Progress
from kafila.hub.listing import ModelFetchError, listing, repo_storage
from kafila.hub.reference import HubChoice, HubFile, HubReference, choose_file, merged_name
from kafila.runtime.gguf.gguf_file import GGUFFormatError
from kafila.runtime.gguf.gguf_merge import merge_parts
from kafila.runtime.machine.this_machine import cache_dir as kafila_cache
from kafila.runtime.machine.this_machine import model_sha256


@dataclass(frozen=True)
class FetchedModel:
    """A model file from the hub, in its cache and checked: what `--model` then means."""

    path: Path
    choice: HubChoice
    commit: str
    offline: str | None = None  # why the hub was not asked, where the cache's copy was taken instead


def fetch_model(
    reference: HubReference,
    progress: Progress | None = None,
    *,
    endpoint: str | None = None,
    hub_cache: Path | None = None,
) -> FetchedModel:
    """Resolve `reference` on the hub and download its file, once: a later call finds it in the
    cache and downloads nothing. A file whose sha256 is not the one the hub lists is deleted and
    refused. A split GGUF's parts are all downloaded, checked and merged into one file, kept in
    Kafila's cache: its GGUF reader, planner and slicer read a model from one file."""
    commit, files, offline = listing(reference, endpoint, hub_cache)
    choice = choose_file(reference, files)
    if not choice.split:
        path = _download(reference, choice.first, commit, progress, endpoint, hub_cache)
    else:
        path = merged_path(choice, commit)
        if not path.is_file():  # written whole or not at all: the parts were checked before it was
            parts = [_download(reference, part, commit, progress, endpoint, hub_cache) for part in choice.parts]
            what = f"merging {len(parts)} parts into {path.name}"
            try:
                merge_parts(parts, path, (lambda done, total: progress(what, done, total)) if progress else None)
            except (GGUFFormatError, OSError) as error:
                raise ModelFetchError(f"{reference}: merging its {len(parts)} parts failed: {error}") from None
    if offline is None:
        _remember(reference, commit, hub_cache)
    return FetchedModel(path, choice, commit, offline)


def cached_whole(model: HubModel, hub_cache: Path | None = None) -> Path | None:
    """The whole file of `model` where an earlier download left it here, checked (a file is checked
    as it arrives, and its hash is kept: `model_sha256`); else None, with nothing downloaded."""
    first = model.parts[0]
    if len(model.parts) > 1:
        merged = _merged_at(model.repo_id, first.path, model.commit)
        return merged if merged.is_file() else None
    found = try_to_load_from_cache(model.repo_id, first.path, cache_dir=hub_cache, revision=model.commit)
    if not isinstance(found, str):
        return None
    path = Path(found)
    try:
        if path.stat().st_size != first.size or (first.sha256 is not None and model_sha256(path) != first.sha256):
            return None
    except OSError:
        return None
    return path


def merged_path(choice: HubChoice, commit: str) -> Path:
    """Where a split model's parts, merged, are kept: Kafila's cache, by repository and commit
    (the parts stay in the hub's cache; `hf cache` deletes them)."""
    return _merged_at(choice.repo_id, choice.first.path, commit)


def _merged_at(repo_id: str, first_part: str, commit: str) -> Path:
    return kafila_cache() / "hub-merged" / repo_id.replace("/", "--") / commit / merged_name(first_part)


def _download(
    reference: HubReference,
    file: HubFile,
    commit: str,
    progress: Progress | None,
    endpoint: str | None,
    hub_cache: Path | None,
) -> Path:
    """One file into the hub's cache, once, then checked against the listing."""
    name = Path(file.path).name
    try:
        local = hf_hub_download(
            reference.repo_id,
            file.path,
            revision=commit,  # the listing's commit: the file the hash below was listed for
            endpoint=endpoint,
            cache_dir=hub_cache,
            tqdm_class=_bar_class(f"downloading {name}", progress) if progress else None,
        )
    except Exception as error:  # the hub's errors, the disk's, and httpx's (whose module differs between versions)
        raise ModelFetchError(f"downloading {file.path} from {reference.repo_id} failed: {error}") from None
    path = Path(local)
    _check(path, file, progress)
    return path


def _remember(reference: HubReference, commit: str, hub_cache: Path | None) -> None:
    """`refs/<revision>` → the commit whose file was checked: what a run without the hub finds.
    (Downloading by commit, huggingface_hub writes no ref itself.)"""
    ref = repo_storage(reference, hub_cache) / "refs" / reference.revision
    with contextlib.suppress(OSError):
        if not ref.is_file() or ref.read_text().strip() != commit:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)


def _check(path: Path, file: HubFile, progress: Progress | None) -> None:
    """Refuse, and delete from the cache, a file that is not the one the hub lists. The hash is
    remembered by path, size and time (`model_sha256`), so a cached model is hashed once."""
    size = path.stat().st_size
    if file.size is not None and size != file.size:
        _discard(path)
        raise ModelFetchError(f"{file.path}: the hub lists {file.size} bytes, the download has {size}; deleted it")
    if file.sha256 is None:
        return  # a file kept in git, not LFS: the hub lists no sha256 (GGUF models are in LFS)
    what = f"checking {path.name}"
    digest = model_sha256(path, (lambda done, total: progress(what, done, total)) if progress else None)
    if digest != file.sha256:
        _discard(path)
        raise ModelFetchError(
            f"{file.path}: its sha256 is {digest}, the hub lists {file.sha256}; the file is corrupt or not the "
            "one listed, and was deleted from the cache"
        )


def _discard(path: Path) -> None:
    """The cache's blob and the snapshot's link to it: a later run downloads it afresh."""
    blob = path.resolve()
    for each in (path, blob):
        with contextlib.suppress(OSError):
            each.unlink()


def _bar_class(what: str, progress: Progress) -> type[HubTqdm]:
    """A tqdm that draws nothing itself and tells `progress` the bytes written, the way every long
    job in kafila is shown. It has `update_transfer`, so a Xet download (most GGUFs on the hub)
    makes one bar of it rather than two (bytes written, bytes received); the second is ignored."""

    class Bar(HubTqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = int(kwargs.get("initial") or 0)
            progress(what, self.done, self._whole())

        def _whole(self) -> int:
            return int(getattr(self, "total", None) or 0)  # the Xet reporter raises it as it learns more

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            progress(what, self.done, self._whole())
            return None

        def update_transfer(self, n: float | None = 1) -> None:
            return None

        def set_transfer_postfix_str(self, postfix: str, refresh: bool = False) -> None:
            return None

    return Bar
