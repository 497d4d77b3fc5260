"""Stage files whose tensor bytes are still arriving, which llama.cpp may begin loading meanwhile.

A stage fetched from the hub is laid out first (its GGUF header, metadata and tensor table written,
the file at its full size) and its tensors' bytes land afterwards. llama.cpp reads a model in two
steps: the header, the metadata and the vocabulary (for a 262k-token vocabulary, most of a small
stage's load), then each tensor's data in `load_all_data`, which asks its progress callback before
every tensor. A load of a file still arriving (`arrival_of`) gets a callback that waits there until
every byte is in (`LlamaModel`): the first part overlaps the fetch, and no tensor byte is read
before it has landed. A fetch that fails settles its arrival incomplete, and the load is aborted.

Files are known by their inode, not their path: the fetch renames its file once complete, and a
load begun under the old name reads the same file. The fetch runs in a thread; a deployment in the
event loop that would load a file as soon as it begins arriving awaits `arrival_at`, woken by the
registration itself rather than looking again and again.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_FileId = tuple[int, int]  # (st_dev, st_ino)


class Arrival:
    """One file's bytes arriving: `settle` once they all landed (True) or never will (False)."""

    def __init__(self) -> None:
        self._settled = threading.Event()
        self._complete = False
        self._lock = threading.Lock()
        self._waiting = 0

    def settle(self, complete: bool) -> None:
        """Said once; later calls are ignored (a fetch's failure after its success cannot undo it)."""
        if not self._settled.is_set():
            self._complete = complete
            self._settled.set()

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    @property
    def waiting(self) -> int:
        """The loads waiting for the bytes now."""
        with self._lock:
            return self._waiting

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until settled (or `timeout`): True where every byte landed."""
        with self._lock:
            self._waiting += 1
        try:
            self._settled.wait(timeout)
        finally:
            with self._lock:
                self._waiting -= 1
        return self._settled.is_set() and self._complete


_lock = threading.Lock()
_arriving: dict[_FileId, Arrival] = {}
_watchers: list[Callable[[], object]] = []  # told each time a file begins arriving


def _file_id(stat: os.stat_result) -> _FileId:
    return (stat.st_dev, stat.st_ino)


@contextmanager
def arriving(fd: int) -> Iterator[Arrival]:
    """The file open at `fd` is arriving while this lasts: a load of it waits for its bytes. Left
    unsettled on the way out (a failure, a halt), it settles incomplete."""
    key, arrival = _file_id(os.fstat(fd)), Arrival()
    with _lock:
        _arriving[key] = arrival
        for began in _watchers:  # under the lock: no watcher is told once `_watching` has ended
            began()
    try:
        yield arrival
    finally:
        arrival.settle(False)  # no-op where it settled complete
        with _lock:
            if _arriving.get(key) is arrival:
                del _arriving[key]


def arrival_of(path: str | os.PathLike[str]) -> Arrival | None:
    """The arrival of the file at `path` where its bytes are still arriving in this process; None
    where they are all in (or it never arrived here), or where there is no such file."""
    try:
        key = _file_id(Path(path).stat())
    except OSError:
        return None
    with _lock:
        return _arriving.get(key)


@contextmanager
def _watching(began: Callable[[], object]) -> Iterator[None]:
    """`began()` is called, in the registering thread and under the registry's lock (so it must be
    quick and not call back in here), each time a file begins arriving while this lasts."""
    with _lock:
        _watchers.append(began)
    try:
        yield
    finally:
        with _lock:
            _watchers.remove(began)


async def arrival_at(path: str | os.PathLike[str], until: asyncio.Future[Any]) -> Arrival | None:
    """The arrival of the file at `path` as soon as its bytes begin arriving in this process (at
    once where they are arriving now), from whichever thread registers it; None where `until` is
    done first."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def done(_until: asyncio.Future[Any]) -> None:
        changed.set()

    until.add_done_callback(done)
    try:
        with _watching(lambda: loop.call_soon_threadsafe(changed.set)):
            while (arrival := arrival_of(path)) is None and not until.done():
                await changed.wait()
                changed.clear()  # before looking again: a file registered since wakes the next wait
    finally:
        until.remove_done_callback(done)
    return arrival
