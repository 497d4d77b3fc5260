"""The end of a child process's log: what it said last before it died, for the error about it."""

from __future__ import annotations

import os
from typing import IO

LOG_TAIL_LINES = 12
MAX_LINE = 400  # characters of one line kept: a progress bar redrawn without newlines is one long line


def last_lines(log: IO[str], count: int = LOG_TAIL_LINES, max_bytes: int = 16_384) -> list[str]:
    """The last `count` non-empty lines of a log file, reading at most its last `max_bytes`."""
    log.flush()
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - max_bytes))
    lines = [line.rstrip()[:MAX_LINE] for line in log.read().splitlines() if line.strip()]
    return lines[-count:]
