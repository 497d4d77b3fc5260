"""A line the network can provoke at a rate is summarised, not written a hundred thousand times
(issue 33: 524,000 "Too many open files" lines buried the log)."""

from __future__ import annotations

import logging
import subprocess
import sys

from kafila.log_repeats import PER_SECOND, RepeatSummary


def record(message: str, *args: object, name: str = "kafila.link", level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, args, None)


def test_past_a_few_a_second_a_kind_of_line_is_dropped_and_the_next_one_through_says_how_many() -> None:
    now = [100.0]
    summary = RepeatSummary(per_second=3, clock=lambda: now[0])
    passed = [summary.filter(record("rejected stream %d", i)) for i in range(1000)]
    assert passed == [True] * 3 + [False] * 997
    assert summary.filter(record("another kind of line"))  # each kind has its own allowance
    assert summary.filter(record("rejected stream %d", 1, name="kafila.other"))
    now[0] += 1.5
    later = record("rejected stream %d", 1000)
    assert summary.filter(later)
    assert later.getMessage() == "rejected stream 1000 (and 997 more like it in the last 2 s)"
    assert [summary.filter(record("rejected stream %d", i)) for i in range(3)] == [True, True, False]


def test_the_program_s_log_summarises_a_flood_of_one_line() -> None:
    """What `kafila`'s entry point installs, in a process of its own that logs 100,000 warnings."""
    script = (
        "import logging\n"
        "from kafila.log_repeats import summarise_repeats\n"
        "summarise_repeats()\n"
        "log = logging.getLogger('kafila.api')\n"
        "for i in range(100_000):\n"
        "    log.warning('accept failed: [Errno 24] Too many open files (%d)', i)\n"
        "log.error('the line that matters')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    lines = result.stderr.splitlines()
    assert "the line that matters" in lines
    assert sum("Too many open files" in line for line in lines) < 20 * PER_SECOND  # under 20 s of allowance
