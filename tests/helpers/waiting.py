"""Waiting on state, never on time: poll a condition until it holds, or fail within a deadline
saying what never happened. One for plain code, one for a coroutine's, and one for a line from a
child process's pipe."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import IO, AnyStr

What = str | Callable[[], str]  # what was awaited; a callable is asked only on failure (it may show a count)


def _said(what: What) -> str:
    return what() if callable(what) else what


def until(condition: Callable[[], object], what: What, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Poll `condition` until it is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never within {timeout:g} s: {_said(what)}"
        time.sleep(interval)


async def until_async(
    condition: Callable[[], object], what: What, timeout: float = 30.0, interval: float = 0.01
) -> None:
    """`until` in a coroutine: the event loop runs between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"never within {timeout:g} s: {_said(what)}")
        await asyncio.sleep(interval)


def line_from(stream: IO[AnyStr] | None, what: What, timeout: float = 60.0) -> AnyStr:
    """The next line a child process writes to `stream` (its pipe), as `readline` returns it (empty
    at the end); AssertionError naming `what` when none comes within `timeout` s. A thread reads,
    as a pipe's buffered reader may already hold the line that select would not report."""
    assert stream is not None, f"no pipe to read {_said(what)} from"
    got: list[AnyStr] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert got, f"never within {timeout:g} s: {_said(what)}"
    return got[0]
