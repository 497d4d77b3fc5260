"""Progress bars for stage files, the same on the host (one per member) and on a member."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kafila.cli.errors import stderr

Update = Callable[[str, int, int], None]  # (what, bytes done, bytes in all)


@contextlib.contextmanager
def transfer_bars() -> Iterator[Update]:
    """One bar per thing named in the updates, gone once the block ends (the log lines stay)."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=stderr, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bars.add_task(what, total=total)
            bars.update(tasks[what], completed=done)

        yield update
