"""The demo's members: `kafila join` processes that the host starts on its own machine.

Their output goes on to the host's own streams as they print it, and their last lines are kept,
so that a member that dies (a native crash in llama.cpp kills it by a signal) is reported by the
host with its name, the signal and what it said last, rather than only as a link gone quiet.
Where the machine has a core a process, each member is started held to its own share of them
(`CoreShare`), with one llama.cpp thread a core, as a machine of its own would compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from kafila.runtime.llama.cpu_safety import died_by_signal, signal_of
from kafila.runtime.llama.loading import repack_choice, system_info
from kafila.runtime.llama.process_log import KEPT_LINES, MAX_LINE, lines_worth_showing
from kafila.runtime.llama.threads import CoreShare

READERS_DRAIN_S = 2.0  # after a member exits, how long its last lines may take to be read


class LocalMember:
    """One `kafila join` on this machine; `on_exit` hears from another thread when it has ended."""

    def __init__(
        self, name: str, command: list[str], on_exit: Callable[[LocalMember], None], cpus: tuple[int, ...] = ()
    ) -> None:
        self.name = name
        self.tail: deque[str] = deque(maxlen=KEPT_LINES)
        with started_on(cpus):
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, encoding="utf-8", errors="replace",
            )  # fmt: skip
        self._readers = [
            threading.Thread(target=self._forward, args=(self.process.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._forward, args=(self.process.stderr, "stderr"), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._watch, args=(on_exit,), daemon=True, name=f"watch-{name}").start()

    def _forward(self, source: IO[str] | None, stream: str) -> None:
        if source is None:
            return
        for line in source:
            if line.strip():
                self.tail.append(line.rstrip()[:MAX_LINE])
            target = getattr(sys, stream)  # looked up each time: a live progress display swaps it
            with contextlib.suppress(OSError, ValueError):  # the host's own output is gone: keep reading
                target.write(line)
                target.flush()

    def _watch(self, on_exit: Callable[[LocalMember], None]) -> None:
        self.process.wait()
        for reader in self._readers:
            reader.join(READERS_DRAIN_S)
        on_exit(self)

    def failure(self) -> str | None:
        """What ended this member, in words, if it ended badly: a signal (explained), or a non-zero
        status; None while it runs or after a clean exit."""
        code = self.process.poll()
        if code is None or code == 0:
            return None
        who = f"{self.name} (a member on this machine)"
        if signal_of(code) is not None:
            return died_by_signal(who, code, system_info(), repack_choice(), lines_worth_showing(self.tail))
        lines = "\n  ".join(lines_worth_showing(self.tail))
        return f"{who} exited with status {code}" + (f". Its last lines:\n  {lines}" if lines else "")

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for it to leave (the session's end tells it to); terminate it if it does not."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def started_on(cpus: tuple[int, ...]) -> Iterator[None]:
    """A process started inside holds to `cpus` from its first instruction: a child inherits the
    affinity of the thread that starts it, so this thread takes `cpus` for the while (nothing
    where `cpus` is empty)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class DemoMembers:
    """The demo's members, started as a person would start `kafila join` on other machines; one
    that ends badly is reported through `on_failure(what, detail)` on the host's event loop (a
    native crash names its signal)."""

    def __init__(self, on_failure: Callable[[str, str], None]) -> None:
        self.members: list[LocalMember] = []
        self._on_failure = on_failure

    def start(self, code: str, rendezvous: str, count: int, shares: Sequence[CoreShare] = ()) -> None:
        """Start `count` members; with `shares`, one a member, each holds to its own cores and
        computes with its share's threads, as a machine of its own would."""
        loop = asyncio.get_running_loop()

        def ended(member: LocalMember) -> None:
            with contextlib.suppress(RuntimeError):  # the host's loop has closed: it is exiting anyway
                loop.call_soon_threadsafe(self._ended, member)

        for number in range(1, count + 1):
            name = f"demo-member-{number}"
            command = [sys.executable, "-m", "kafila", "join", code, "--rendezvous", rendezvous, "--name", name]
            share = shares[number - 1] if shares else None
            if share is not None:
                command += ["--threads", str(share.threads)]
            self.members.append(LocalMember(name, command, ended, share.cpus if share else ()))

    def _ended(self, member: LocalMember) -> None:
        failure = member.failure()
        if failure is not None:
            self._on_failure(f"{member.name} {'died' if member.process.returncode < 0 else 'exited'}", failure)

    async def stop(self) -> None:
        for member in self.members:
            await asyncio.to_thread(member.stop)
