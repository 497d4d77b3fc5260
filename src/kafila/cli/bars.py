"""Progress of long work on model files (hashing, cutting, sending stage files): bars on a
terminal, the same on the host and on a member; a line at each start and end in a log."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, DownloadColumn, TextColumn, TransferSpeedColumn
from rich.progress import Progress as Bars

from kafila.cli.errors import shown, stderr
from kafila.contracts import Progress
from kafila.units import human_bytes


@contextlib.contextmanager
def transfer_bars() -> Iterator[Progress]:
    """One bar per thing named in the updates, gone once the block ends (the log lines stay).

    Where stderr is no terminal (a log file, a service's journal) no bar is drawn, and a bar
    that ends with the block leaves nothing behind, so each thing gets a line as it starts and
    one as it is done instead: minutes of cutting a large model should not read as a hang.
    """
    if not stderr.is_terminal:
        yield _logged()
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Bars(*columns, console=stderr, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bars.add_task(shown(what), total=total)  # a member's name may be in it
            bars.update(tasks[what], completed=done)

        yield update


def _logged() -> Progress:
    started: dict[str, tuple[float, int]] = {}  # what → when its first update came, and its bytes done then
    ended: set[str] = set()
    lock = threading.Lock()  # a cut reports from two threads: the writer's watcher and the hash

    def update(what: str, done: int, total: int) -> None:
        with lock:
            _update(what, done, total)

    def _update(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if what not in started:
            started[what] = (now, done)
            stderr.print(f"{shown(what)}: {human_bytes(total)}", highlight=False, soft_wrap=True)
        if done >= total and what not in ended:
            ended.add(what)
            since, before = started[what]
            seconds = now - since
            rate = f", {human_bytes(int((done - before) / seconds))}/s" if seconds > 0.5 else ""
            stderr.print(f"{shown(what)}: done in {seconds:.1f} s{rate}", highlight=False, soft_wrap=True)

    return update
