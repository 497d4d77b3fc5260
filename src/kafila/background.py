"""Work begun as soon as a command knows it will need it, in a thread of its own, for the command
to take later: the NAT tests (`session.presence.NatTests`), a hub model's header
(`cli.early_start.HeaderRead`), the host's own stage fetched ahead of its plan
(`session.fetch_ahead.AheadFetch`). Each overlaps what the command does meanwhile (importing,
loading llama.cpp, waiting for members) instead of following it."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_background(name: str, work: Callable[[], T]) -> concurrent.futures.Future[T]:
    """`work` begun now in a daemon thread named `name` (Ctrl-C never waits for it): its result, or
    what it raised, in the future, raised where the future is taken."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as error:  # said where the result is taken
            done.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
