"""The device probe in a child process, so that a native crash there is an error a person can read.

The probe runs llama.cpp's first prompt batch on a machine, where a CPU-specific fault in its
kernels shows first (AMX: `cpu_safety`). In the caller's process that would be a bare
"Segmentation fault" and a dead host; in a child it is a death by a signal, which the parent
explains: the signal, the CPU features llama.cpp reported, the likely cause and the setting that
avoids it. The result is cached (`this_machine`), so a host pays for the child once per machine.

The model-stage probe a host runs before its first plan goes the same way
(`model_probe.model_probe_in_child`, through `run_in_child` and `child_main`).

The child speaks JSON lines on the stdout it was given (progress, then a result or an error);
its own fd 1 is pointed at stderr, so nothing native can garble them. Its stderr is kept and its
last lines go into the error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from pydantic import ValidationError

from kafila.contracts import Strict
from kafila.runtime.llama.cpu_safety import died_by_signal, signal_of
from kafila.runtime.llama.loading import repack_choice, system_info
from kafila.runtime.llama.process_log import last_lines
from kafila.runtime.machine.probe import DeviceProbe, LlamaCppMissing, ProbeError, ProgressFn, load_llama_cpp, run_probe

CHILD_COMMAND = (sys.executable, "-m", "kafila.runtime.machine.probe_child")
PROBE_TIMEOUT_S = 600.0  # the probe ends itself in well under a minute; this catches a hang
INTERRUPTED = 130  # the child's status after Ctrl-C, as a shell reports one
MAX_LINE = 1 << 20  # characters of one message; a result is a few kilobytes


Result = TypeVar("Result", bound=Strict)


def _quiet(_text: str, _fraction: float) -> None:
    return None


def probe_in_child(
    progress: ProgressFn = _quiet,
    command: Sequence[str] = CHILD_COMMAND,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> DeviceProbe:
    """`run_probe` in a child process: its result, or a ProbeError saying why there is none.

    `command` starts the child; tests give one that dies on purpose.
    """
    return run_in_child(DeviceProbe, command, progress, timeout_s)


def run_in_child(
    kind: type[Result],
    command: Sequence[str],
    progress: ProgressFn = _quiet,
    timeout_s: float = PROBE_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Result:
    """A child that speaks as `child_main` does: its result as a `kind`, or a ProbeError saying
    why there is none; `env`, the child's whole environment (by default this process's)."""
    load_llama_cpp()  # a missing or broken llama.cpp is said here, as the child would say it
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        process = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True, encoding="utf-8",
            env=dict(env) if env is not None else None,
        )  # fmt: skip
        timed_out = threading.Event()

        def kill_if_hung() -> None:
            timed_out.set()
            process.kill()

        timer = threading.Timer(timeout_s, kill_if_hung)
        timer.daemon = True
        timer.start()
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        try:
            assert process.stdout is not None
            while line := process.stdout.readline(MAX_LINE):
                message = _message(line)
                if "progress" in message:
                    text, fraction = message["progress"]
                    progress(str(text), float(fraction))
                elif "result" in message:
                    result = message["result"]
                elif "error" in message:
                    error = message
            process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:  # the caller was interrupted: the child goes with it
                process.kill()
                process.wait()
        return _outcome(kind, process.returncode, result, error, log, timed_out.is_set(), timeout_s)


def _message(line: str) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    if not isinstance(message, dict):
        return {}
    progress = message.get("progress")
    if "progress" in message and not (
        isinstance(progress, list) and len(progress) == 2 and isinstance(progress[1], int | float)
    ):
        return {}
    return message


def _outcome(
    kind: type[Result],
    returncode: int,
    result: dict[str, Any] | None,
    error: dict[str, Any] | None,
    log: IO[str],
    timed_out: bool,
    timeout_s: float,
) -> Result:
    if timed_out:
        tail = " | ".join(last_lines(log)[-3:]) or "nothing"
        raise ProbeError(f"the probe did not finish in {timeout_s:.0f} s and was stopped; it said last: {tail}")
    if signal_of(returncode) is not None:
        what = "the probe's llama.cpp process (its first prompt batch on this machine)"
        raise ProbeError(died_by_signal(what, returncode, system_info(), repack_choice(), last_lines(log)))
    if returncode == INTERRUPTED:
        raise ProbeError("the probe was interrupted (Ctrl-C)")
    if error is not None:
        text = str(error.get("error") or "the probe failed")
        raise LlamaCppMissing(text) if error.get("kind") == "missing" else ProbeError(text)
    if returncode == 0 and result is not None:
        try:
            return kind.model_validate(result)
        except ValidationError as invalid:
            raise ProbeError(f"the probe's child sent an unreadable result: {invalid.errors()[0]['msg']}") from None
    tail = " | ".join(last_lines(log)[-5:]) or "nothing on its stderr"
    raise ProbeError(f"the probe's process exited with status {returncode} and no result: {tail}")


# ---------------------------------------------------------------------------------------------
# The child.
# ---------------------------------------------------------------------------------------------


def _send(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def main() -> None:
    child_main(run_probe)


def child_main(work: Callable[[ProgressFn], Strict]) -> None:
    """Run `work` as the child of `run_in_child`: progress and its result as JSON lines on the
    stdout it was given, an error of the probe's kinds as one too."""
    if hasattr(signal, "SIGPIPE"):  # Windows has none
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    faulthandler.enable()  # a native crash leaves the Python stack in the log the parent reads
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    parent = os.getppid()

    def report(text: str, fraction: float) -> None:
        if os.getppid() != parent:  # the parent has gone: nobody waits for this measurement
            raise SystemExit(1)
        _send(channel, {"progress": [text, fraction]})

    try:
        result = work(report)
    except LlamaCppMissing as missing:
        _send(channel, {"error": str(missing), "kind": "missing"})
        raise SystemExit(1) from None
    except ProbeError as failed:
        _send(channel, {"error": str(failed), "kind": "probe"})
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(INTERRUPTED) from None
    _send(channel, {"result": result.model_dump(mode="json")})
    with contextlib.suppress(OSError):
        channel.close()


if __name__ == "__main__":
    main()
