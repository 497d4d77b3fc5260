"""The end of a child process's log: what it said last before it died, for the error about it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import IO

LOG_TAIL_LINES = 12
LINES_BEFORE_CRASH = 3  # what it was doing when it crashed
CRASH_REPORT_LINES = 30  # the crashing thread's stack comes first in faulthandler's report
KEPT_LINES = 200  # of a log read as it is written: enough to hold a whole crash report
MAX_LINE = 400  # characters of one line kept: a progress bar redrawn without newlines is one long line
CRASH_REPORT_START = "Fatal Python error"  # how faulthandler begins


def lines_worth_showing(lines: Sequence[str]) -> list[str]:
    """Of a dead process's last lines, those that say what happened: Python's crash report where
    there is one (faulthandler's, with the few lines before it), else the last few."""
    kept = [line.rstrip()[:MAX_LINE] for line in lines if line.strip()]
    starts = [i for i, line in enumerate(kept) if line.startswith(CRASH_REPORT_START)]
    if starts:
        return kept[max(0, starts[-1] - LINES_BEFORE_CRASH) : starts[-1] + CRASH_REPORT_LINES]
    return kept[-LOG_TAIL_LINES:]


def last_lines(log: IO[str], max_bytes: int = 32_768) -> list[str]:
    """`lines_worth_showing` of a log file, reading at most its last `max_bytes`."""
    log.flush()
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - max_bytes))
    return lines_worth_showing(log.read().splitlines())
