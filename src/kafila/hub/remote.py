"""A model's file on the hub at a pinned commit, read by range (`RemoteFile`), and the bytes of its
header read from it (`read_header_bytes`): the first thing a host with members needs of a model on
the hub, which `kafila host` begins before it imports the rest of itself (`cli.early_start`). So
this imports huggingface_hub and nothing heavier (no numpy, no GGUF reader); `kafila.hub.ranges`
reads the header and fetches the stages.

huggingface_hub builds the URL (`hf_hub_url`) and the headers (`build_hf_headers`: HF_TOKEN),
reads the endpoint (HF_ENDPOINT), asks for the file's metadata (`get_hf_file_metadata`: commit,
sha256, size, the CDN's location) and retries a request that fails to open
(`http_stream_backoff`). Kafila's part: checking that each answer is the range asked of the file
planned from (the hub's `http_get` takes a Range but checks no Content-Range), and resuming a range
cut off where it broke.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import constants as hub_constants
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

from kafila.hub.listing import HubUnreachable, ModelFetchError, listing, refusal
from kafila.hub.reference import HubFile, HubReference, choose_file
from kafila.runtime.gguf.header_extent import HeaderExtent

HEADER_FIRST_READ = 8 << 20  # a large vocabulary's header is a few MB: one request, which stops at its end
DRAIN_BYTES = 256 << 10  # less than this left of a header's answer is read to its end: the connection is kept
HEADER_SHARE = 16  # nor more than this share of the file at first: a small model's header is small too
RETRIES = 5  # a range cut off this many times running, with no byte more: the hub is not reachable
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class HubMismatch(ModelFetchError):
    """The hub's copy is not the one planned from: its header, size, sha256 or a range's bytes differ."""


@dataclass(frozen=True)
class PartHeader:
    """A part's first bytes as read: its header, exactly (`whole`), or, where `HeaderExtent` could
    not walk it, what was read of it (the reader then parses on from there)."""

    file: HubFile
    remote: RemoteFile
    data: bytes
    whole: bool


@dataclass(frozen=True)
class HeaderBytes:
    """A model on the hub at a commit, as far as its parts' header bytes."""

    repo_id: str
    commit: str
    parts: tuple[PartHeader, ...]


class RemoteFile:
    """One file at the pinned commit: its metadata asked once and checked against what was planned,
    then its bytes fetched by range from where the hub sends them (its CDN, for LFS files)."""

    def __init__(
        self, repo_id: str, commit: str, path: str, endpoint: str | None, size: int | None, sha256: str | None
    ) -> None:
        self.name = f"{repo_id}/{path}"
        self.repo_id, self.commit = repo_id, commit
        url = hf_hub_url(repo_id, path, revision=commit, endpoint=endpoint)
        try:
            meta = get_hf_file_metadata(url, endpoint=endpoint)
        except Exception as error:
            raise self._failed(error, f"asking for {self.name}") from None
        if meta.commit_hash is not None and meta.commit_hash != commit:
            raise HubMismatch(f"{self.name}: the hub serves commit {meta.commit_hash[:40]!r}, not {commit}")
        if size is not None and meta.size is not None and meta.size != size:
            raise HubMismatch(f"{self.name}: the hub serves {meta.size} bytes, the model planned from has {size}")
        if sha256 is not None and meta.etag is not None and _SHA256.match(meta.etag) and meta.etag != sha256:
            raise HubMismatch(
                f"{self.name}: the hub's copy has sha256 {meta.etag}, the model planned from has {sha256}: "
                "not the same file"
            )
        known = meta.size if meta.size is not None else size
        if known is None:
            raise HubMismatch(f"{self.name}: the hub gives no size for it")
        self.size = known
        self.location = meta.location
        self.headers = build_hf_headers()
        self.headers["Accept-Encoding"] = "identity"  # the bytes as stored: ranges count them
        if _origin(self.location) != _origin(url):
            self.headers.pop("authorization", None)  # a signed CDN address: the token stays with the hub

    def _failed(self, error: Exception, doing: str) -> ModelFetchError:
        if isinstance(error, ModelFetchError):
            return error
        if isinstance(error, HfHubHTTPError):
            return refusal(error, self.repo_id, self.commit, doing)
        return HubUnreachable(f"{doing}: the hub did not answer: {error or type(error).__name__}")

    def read(self, start: int, length: int, write: Callable[[bytes], None], done: int = 0) -> None:
        """Bytes [start + done, start + length) of the file, handed to `write` as they arrive (none
        held back: a cut loses nothing that came); a connection cut off is resumed where it broke,
        up to RETRIES times running with no byte more."""
        misses = 0
        cut: Exception | None = None
        while done < length:
            before = done
            asked = {**self.headers, "Range": f"bytes={start + done}-{start + length - 1}"}
            with contextlib.ExitStack() as stack:
                try:
                    response = stack.enter_context(
                        http_stream_backoff(
                            "GET", self.location, headers=asked, timeout=hub_constants.HF_HUB_DOWNLOAD_TIMEOUT
                        )
                    )
                    hf_raise_for_status(response)
                except HfHubHTTPError as error:
                    raise self._failed(error, f"fetching {self.name}") from None
                except Exception as error:  # the network's: httpx's or httpx2's, by huggingface_hub's version
                    cut = error
                else:
                    self._check_range(response, start + done, start + length)
                    arriving = response.iter_bytes()
                    while True:
                        try:
                            chunk = next(arriving)
                        except StopIteration:
                            break
                        except Exception as error:  # cut off while the bytes came
                            cut = error
                            break
                        if done + len(chunk) > length:
                            raise HubMismatch(f"{self.name}: the hub sent more than the {length} bytes asked")
                        write(chunk)
                        done += len(chunk)
            if done < length:
                misses = 0 if done > before else misses + 1
                if misses >= RETRIES:
                    why = f"{cut}" if cut is not None else "the answer ended early"
                    raise HubUnreachable(f"fetching {self.name}: cut off {RETRIES} times without progress: {why}")
                time.sleep(0.2 * misses)  # a hub that fails at once is not asked again at once

    def _check_range(self, response: Any, start: int, end: int) -> None:
        """HubMismatch unless the answer is the range asked, of a file of the planned size."""
        if response.status_code != 206:
            raise HubMismatch(f"{self.name}: the hub answered a range request with {response.status_code}, not 206")
        given = response.headers.get("Content-Range", "")
        found = _CONTENT_RANGE.match(given.strip())
        if found is None or int(found[1]) != start or int(found[2]) != end - 1:
            raise HubMismatch(f"{self.name}: asked for bytes {start}-{end - 1}, the hub sent {given[:80]!r}")
        if found[3] != "*" and int(found[3]) != self.size:
            raise HubMismatch(f"{self.name}: the hub's copy has {found[3]} bytes, the model planned from {self.size}")


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def read_bytes(remote: RemoteFile, start: int, length: int) -> bytes:
    out = bytearray()
    remote.read(start, length, out.extend)
    return bytes(out)


def read_header_bytes(
    reference: HubReference, *, endpoint: str | None = None, first_read: int = HEADER_FIRST_READ
) -> HeaderBytes:
    """The model `reference` names, as far as its header's bytes: the revision resolved to a commit,
    each part's file asked for once (`RemoteFile`) and its first bytes read by range, up to the end of
    its header (`HeaderExtent`) and no further than the connection has on its way."""
    commit, files, offline = listing(reference, endpoint, None)
    if offline is not None:
        raise HubUnreachable(f"could not reach the hub for {reference.repo_id}: {offline}")
    choice = choose_file(reference, files)
    parts = []
    for file in choice.parts:
        remote = RemoteFile(choice.repo_id, commit, file.path, endpoint, file.size, file.sha256)
        parts.append(_first_bytes(file, remote, first_read))
    return HeaderBytes(choice.repo_id, commit, tuple(parts))


def _first_bytes(file: HubFile, remote: RemoteFile, first_read: int) -> PartHeader:
    """The part's header, however long: read up to a first piece (`first_read`, or a share of a
    small file: its header is small too), and on up to twice as far as long as the header goes on;
    stopped where it ends."""
    extent = HeaderExtent()
    asked = min(max(min(first_read, remote.size // HEADER_SHARE), 64), remote.size)
    while True:
        _read_into(remote, extent, asked)
        if extent.complete or extent.unknown:
            break
        if asked >= remote.size:
            raise HubMismatch(f"{remote.name}: the GGUF header runs past the end of the file")
        asked = min(2 * asked, remote.size)
    if extent.unknown:
        return PartHeader(file, remote, bytes(extent.data), whole=False)
    assert extent.length is not None
    return PartHeader(file, remote, bytes(extent.data[: extent.length]), whole=True)


class _HeaderEnds(Exception):
    """The header's bytes are all in: the read stops there."""


def _read_into(remote: RemoteFile, extent: HeaderExtent, end: int) -> None:
    """The file's bytes from where `extent` holds them to `end`, fed to it until its header is
    complete; the read stops there, unless what is left of the answer is less than `DRAIN_BYTES`
    (read and dropped, so that the connection is kept for the next request)."""
    start = len(extent.data)
    received = 0

    def take(chunk: bytes) -> None:
        nonlocal received
        received += len(chunk)
        if extent.complete:
            return
        if extent.feed(chunk) and end - start - received > DRAIN_BYTES:
            raise _HeaderEnds

    with contextlib.suppress(_HeaderEnds):
        remote.read(start, end - start, take)
