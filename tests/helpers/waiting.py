"""Waiting on state, never on time: poll a condition until it holds, or fail within a deadline
saying what never happened. One for plain code, one for a coroutine's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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
