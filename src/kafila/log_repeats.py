"""A log that an attacker cannot flood: a line repeated past a few a second is summarised.

Anything the network can provoke at a rate (a refused socket, a malformed stream, a failed
accept) would otherwise write one line each, hundreds of thousands of them, and bury the one
line that matters. `RepeatSummary` lets `per_second` records of one kind (logger, level and
unformatted message) through each second, drops the rest, and says how many it dropped on the
next record of that kind that passes. `summarise_repeats` is how the `kafila` program logs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

PER_SECOND = 5
MAX_KINDS = 1024  # kinds of line followed at once; past it the longest followed is forgotten


@dataclass
class _Window:
    started: float
    passed: int = 0
    dropped: int = 0


class RepeatSummary(logging.Filter):
    def __init__(self, per_second: int = PER_SECOND, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_second, self.clock = per_second, clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        kind = (record.name, record.levelno, str(record.msg))
        window = self._windows.get(kind)
        if window is None:
            while len(self._windows) >= MAX_KINDS:
                del self._windows[next(iter(self._windows))]
            window = self._windows[kind] = _Window(now)
        elif now - window.started >= 1.0:
            if window.dropped:
                said = f"(and {window.dropped} more like it in the last {now - window.started:.0f} s)"
                record.msg, record.args = f"{record.getMessage()} {said}", None
            self._windows[kind] = window = _Window(now)
        if window.passed < self.per_second:
            window.passed += 1
            return True
        window.dropped += 1
        return False


def summarise_repeats(per_second: int = PER_SECOND) -> logging.Handler:
    """Log warnings and worse to stderr as Python does by default, but with repeats summarised."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.addFilter(RepeatSummary(per_second))
    logging.getLogger().addHandler(handler)
    return handler
