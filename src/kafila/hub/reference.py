"""The pure core of models by name: what a `--model` value names, and which file of a repository's
listing it means. No network here; `kafila.hub.fetch` asks the hub and downloads.

Forms: `hf://org/repo:QUANT`, `org/repo:QUANT`, `org/repo` (its one GGUF), `org/repo/path/file.gguf`
and the same with `hf://`. Without `hf://`, a value naming an existing local file is that file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

PREFIX = "hf://"

# The hub's own rule for a repository id, bounded: letters, digits, `.`, `_`, `-`; no `--` or `..`.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO = re.compile(rf"^({_NAME})/({_NAME})$")
_QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# Quant labels as GGUF repositories name their files: Q4_K_M, IQ2_XXS, Q8_0, BF16, F16, MXFP4, UD-Q4_K_XL…
_QUANT_IN_NAME = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[A-Z0-9]+)*|TQ[12]_0|BF16|F16|F32|MXFP4(?:_MOE)?))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
MAX_REFERENCE = 512


class ModelNameError(ValueError):
    """A model name that cannot be resolved: bad syntax, no such quant, several files."""


@dataclass(frozen=True)
class HubReference:
    """A repository on the hub and what to take from it: a quant, a file, or its only GGUF."""

    repo_id: str
    quant: str | None = None
    filename: str | None = None
    revision: str = "main"

    def __str__(self) -> str:
        tail = f"/{self.filename}" if self.filename else (f":{self.quant}" if self.quant else "")
        return f"{PREFIX}{self.repo_id}{tail}"


@dataclass(frozen=True)
class HubFile:
    """One file of a repository's listing; `sha256` where the hub keeps it in LFS."""

    path: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class HubChoice:
    """The file a reference means: one GGUF, or every part of a split one, first part first."""

    repo_id: str
    parts: tuple[HubFile, ...]

    @property
    def split(self) -> bool:
        return len(self.parts) > 1

    @property
    def first(self) -> HubFile:
        return self.parts[0]


def parse_reference(value: str, local_file_exists: bool = False) -> HubReference | None:
    """The hub reference `value` makes, or None where it is a local path.

    `hf://…` is always the hub; otherwise `org/repo:QUANT` or `org/repo/…/file.gguf` is, unless a
    local file of that name exists (`local_file_exists`). Paths starting `/`, `.` or `~` are local.
    """
    text = value.strip()
    explicit = text.startswith(PREFIX)
    if explicit:
        text = text[len(PREFIX) :]
    elif local_file_exists or not text or text[0] in "/.~\\":
        return None
    if len(text) > MAX_REFERENCE:
        raise ModelNameError(f"the model name is longer than {MAX_REFERENCE} characters")
    if ":" in text:
        repo, _, quant = text.partition(":")
        if _REPO.match(repo) is None:
            return _not_a_reference(value, explicit, f"{repo!r} is not a repository id (org/name)")
        if _QUANT.match(quant) is None:
            return _not_a_reference(value, explicit, f"{quant!r} is not a quant name (like Q4_K_M)")
        return HubReference(repo, quant=quant)
    pieces = text.split("/")
    if len(pieces) == 2 and explicit:
        if _REPO.match(text) is None:
            raise ModelNameError(f"{value!r}: {text!r} is not a repository id (org/name)")
        return HubReference(text)
    if len(pieces) < 3 or not pieces[-1].lower().endswith(".gguf"):
        return _not_a_reference(value, explicit, "give hf://org/repo:QUANT or hf://org/repo/file.gguf")
    repo, filename = "/".join(pieces[:2]), "/".join(pieces[2:])
    if _REPO.match(repo) is None or any(p in ("", ".", "..") for p in pieces[2:]):
        return _not_a_reference(value, explicit, f"{repo!r} is not a repository id, or the file path is not one")
    return HubReference(repo, filename=filename)


def _not_a_reference(value: str, explicit: bool, why: str) -> HubReference | None:
    """Where `hf://` said so, a bad name is an error; a plain value is then taken as a local path."""
    if explicit:
        raise ModelNameError(f"{value!r}: {why}")
    return None


def quant_of(filename: str) -> str | None:
    """The quant label a GGUF file name carries (`Qwen3-8B-Q4_K_M.gguf` → `Q4_K_M`), if any."""
    found = _QUANT_IN_NAME.findall(PurePosixPath(filename).name)
    return found[-1].upper() if found else None


def choose_file(reference: HubReference, files: Sequence[HubFile]) -> HubChoice:
    """The file `reference` means among a repository's `files`: by exact path, by quant (the
    quant as a whole word of the name, case-insensitive), or the only GGUF. A split model comes
    with all its parts; a reference that matches none or several files is a clear error."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf") and not _is_projector(f.path)]
    if reference.filename is not None:
        chosen = [f for f in files if f.path == reference.filename]
        if not chosen:
            raise ModelNameError(
                f"{reference.repo_id} has no file {reference.filename!r}; its GGUF files: {_names(ggufs)}"
            )
        if _SPLIT.match(PurePosixPath(chosen[0].path).name):  # a part of a split model: all of them
            return _complete(reference.repo_id, _groups(ggufs)[_group_key(chosen[0].path)])
        return HubChoice(reference.repo_id, (chosen[0],))
    if not ggufs:
        raise ModelNameError(f"{reference.repo_id} has no GGUF files")
    groups = _groups(ggufs)
    if reference.quant is None:
        if len(groups) == 1:
            return _complete(reference.repo_id, next(iter(groups.values())))
        raise ModelNameError(
            f"{reference.repo_id} has several GGUF models; name one: {reference}:QUANT, with QUANT one of "
            f"{_quants(ggufs)}"
        )
    wanted = re.compile(rf"(?<![A-Za-z0-9]){re.escape(reference.quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matching = {key: parts for key, parts in groups.items() if wanted.search(key)}
    if not matching:
        raise ModelNameError(
            f"{reference.repo_id} has no GGUF file for quant {reference.quant}; it has: {_quants(ggufs)}"
        )
    if len(matching) > 1:
        raise ModelNameError(
            f"quant {reference.quant} matches several files in {reference.repo_id}: "
            f"{', '.join(sorted(matching))}; name one: hf://{reference.repo_id}/FILE.gguf"
        )
    return _complete(reference.repo_id, next(iter(matching.values())))


def merged_name(path: str) -> str:
    """The file name a split model's parts are merged into: `m-Q8_0-00001-of-00002.gguf` → `m-Q8_0.gguf`."""
    return PurePosixPath(_group_key(path)).name


def _is_projector(path: str) -> bool:
    """Vision projectors ride along in GGUF repositories; they are no model to serve."""
    return PurePosixPath(path).name.lower().startswith("mmproj")


def _group_key(path: str) -> str:
    """A split model's parts share a key: the path without `-0000N-of-0000M`."""
    name = PurePosixPath(path)
    split = _SPLIT.match(name.name)
    return str(name.with_name(split["stem"] + ".gguf")) if split else path


def _groups(ggufs: Sequence[HubFile]) -> dict[str, list[HubFile]]:
    groups: dict[str, list[HubFile]] = {}
    for file in ggufs:
        groups.setdefault(_group_key(file.path), []).append(file)
    return groups


def _complete(repo_id: str, parts: Sequence[HubFile]) -> HubChoice:
    """A single file as it is; a split model's parts in order, refused when any is missing."""
    if len(parts) == 1 and not _SPLIT.match(PurePosixPath(parts[0].path).name):
        return HubChoice(repo_id, (parts[0],))
    numbered = sorted(parts, key=lambda f: int(_split_of(f.path)[0]))
    count = _split_of(numbered[0].path)[1]
    if [int(_split_of(f.path)[0]) for f in numbered] != list(range(1, count + 1)):
        raise ModelNameError(
            f"{repo_id}: the split model {numbered[0].path} should have {count} parts, the repository has "
            f"{len(numbered)}"
        )
    return HubChoice(repo_id, tuple(numbered))


def _split_of(path: str) -> tuple[int, int]:
    found = _SPLIT.match(PurePosixPath(path).name)
    return (int(found["part"]), int(found["count"])) if found else (1, 1)


def _names(files: Sequence[HubFile]) -> str:
    return ", ".join(sorted(f.path for f in files)[:40]) or "none"


def _quants(ggufs: Sequence[HubFile]) -> str:
    labels = sorted({q for f in ggufs if (q := quant_of(f.path)) is not None})
    return ", ".join(labels) if labels else f"(no quant in their names) {_names(ggufs)}"
