"""A repository on the hub, listed: the commit its revision names and its files, with the hub's
typed refusals. It imports huggingface_hub and nothing heavier, so that `kafila host` asks for the
listing before it imports the rest of itself (`cli.early_start`).

huggingface_hub reads HF_TOKEN, HF_ENDPOINT and HF_HUB_CACHE itself; nothing here sets them.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

from kafila.hub.reference import HubFile, HubReference

Listing = tuple[str, list[HubFile], str | None]  # the commit, its files, why the cache's were taken (None: the hub's)


class ModelFetchError(Exception):
    """The hub could not give the model: unreachable, no such repository, a refused or corrupt file."""


class HubUnreachable(ModelFetchError):
    """The hub did not answer (no route, refused, timed out, HF_HUB_OFFLINE): another source may."""


class HubRefused(ModelFetchError):
    """The hub answered no: a gated or private repository without a token that may read it, or no
    such repository, revision or file."""


def listing(reference: HubReference, endpoint: str | None, hub_cache: Path | None) -> Listing:
    """The repository's commit at the reference's revision and its files, with LFS hashes; where
    the hub cannot be reached (or HF_HUB_OFFLINE is set), what an earlier run left in the cache."""
    try:
        info = HfApi(endpoint=endpoint).model_info(reference.repo_id, revision=reference.revision, files_metadata=True)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise refusal(error, reference.repo_id, reference.revision) from None
    except HfHubHTTPError as error:
        raise refusal(error, reference.repo_id, reference.revision, f"could not list {reference.repo_id}") from None
    except Exception as error:  # unreachable: refused, no name, a timeout (httpx's errors), or HF_HUB_OFFLINE
        cached = _cached_listing(reference, hub_cache)
        if cached is None:
            raise HubUnreachable(
                f"could not reach the hub for {reference.repo_id}, and no earlier download of it is cached: {error}"
            ) from None
        return (*cached, str(error) or type(error).__name__)
    if info.sha is None or info.siblings is None:
        raise ModelFetchError(f"the hub gave no file listing for {reference.repo_id}")
    if REGEX_COMMIT_HASH.fullmatch(info.sha) is None:  # it names folders in the caches
        raise ModelFetchError(f"the hub named {reference.repo_id}'s commit {info.sha[:80]!r}, not a commit hash")
    files = [HubFile(s.rfilename, s.size, s.lfs.sha256.lower() if s.lfs is not None else None) for s in info.siblings]
    return info.sha, files, None


def refusal(error: HfHubHTTPError, repo_id: str, revision: str, doing: str | None = None) -> ModelFetchError:
    """The hub's no, in words and typed: refused (4xx), or unreachable where it failed (5xx, 429)."""
    if isinstance(error, GatedRepoError):
        return HubRefused(f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN to a token of yours")
    if isinstance(error, RevisionNotFoundError):
        return HubRefused(f"{repo_id} has no revision {revision}")
    if isinstance(error, RepositoryNotFoundError):
        return HubRefused(f"no repository {repo_id} on the hub (or it is private: set HF_TOKEN)")
    status = error.response.status_code if error.response is not None else 0
    what = f"{doing or repo_id} on the hub: {error}"
    return HubUnreachable(what) if status >= 500 or status == 429 else HubRefused(what)


def repo_storage(reference: HubReference, hub_cache: Path | None) -> Path:
    """The repository's folder in the hub's cache (its documented layout: refs/, snapshots/, blobs/)."""
    return Path(hub_cache or hub_constants.HF_HUB_CACHE) / repo_folder_name(
        repo_id=reference.repo_id, repo_type="model"
    )


def _cached_listing(reference: HubReference, hub_cache: Path | None) -> tuple[str, list[HubFile]] | None:
    """The files of the commit an earlier run downloaded and checked (a file that failed its check
    was deleted), without hashes: they were checked when they came."""
    storage = repo_storage(reference, hub_cache)
    try:
        commit = (storage / "refs" / reference.revision).read_text().strip()
        snapshot = storage / "snapshots" / commit
        files = [HubFile(path.relative_to(snapshot).as_posix()) for path in snapshot.rglob("*.gguf") if path.is_file()]
    except (OSError, ValueError):
        return None
    return (commit, files) if files and REGEX_COMMIT_HASH.fullmatch(commit) else None
