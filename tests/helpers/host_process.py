"""A real `kafila host` process for tests: started on a free port, waited for, stopped cleanly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from waiting import line_from

READY_TIMEOUT_S = 120.0
JOIN_LINE = re.compile(r"kafila\s+join\s+(\S+)\s+--rendezvous\s+(\S+)")  # the line the host prints for its members


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Host:
    process: subprocess.Popen[str]
    base_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[int]:
        """Pids of the stage processes this host started."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == self.process.pid and b"kafila.runtime.engine.worker" in cmdline:
                found.append(int(entry.name))
        return found

    def join_line(self, timeout: float = 60.0) -> tuple[str, str]:
        """The session code and rendezvous address the host printed for its members."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = JOIN_LINE.search(self.output())
            if found is not None:
                return found.group(1), found.group(2)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the host printed no join line: {self.output()}")


def stop(process: subprocess.Popen[str], timeout: float = 20.0) -> str:
    """Ctrl-C, as a person would; a kill if it does not end in time. Returns its piped output."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.stdout.read() if process.stdout else ""


_MEASURE = "from kafila.runtime.machine.this_machine import this_device; this_device()"


def session_probe() -> Path:
    """This test session's one probe of this machine: probe.json in the session's KAFILA_CACHE
    (tests/conftest.py sets it), measured in a child process the first time it is asked for, as
    `kafila host` and `kafila join` measure and keep it."""
    path = Path(os.environ["KAFILA_CACHE"]) / "probe.json"
    if not path.exists():
        subprocess.run([sys.executable, "-c", _MEASURE], check=True, timeout=300, capture_output=True)
    return path


def seeded_cache(cache: Path) -> Path:
    """`cache`, a process's own KAFILA_CACHE, holding the session's probe (unless it has one):
    a member starts from it as from its own earlier run on this machine, rather than running
    the full hardware probe again (once for every member of every test), and members on one
    machine are priced alike rather than by their own noisy numbers."""
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "probe.json").exists():
        shutil.copy(session_probe(), cache / "probe.json")
    return cache


def start_member(
    code: str, rendezvous: str, name: str, cache: Path, *extra: str, seed_probe: bool = True
) -> subprocess.Popen[str]:
    """A real `kafila join` with its own cache, as if on another machine; its output is piped. The
    cache starts with the session's probe of this machine unless `seed_probe` is False."""
    command = [sys.executable, "-m", "kafila", "join", code, "--rendezvous", rendezvous, "--name", name, *extra]
    env = {**os.environ, "KAFILA_CACHE": str(seeded_cache(cache) if seed_probe else cache), "COLUMNS": "200"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_ready(host: Host, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if host.process.poll() is not None:
            raise RuntimeError(f"kafila host exited with {host.process.returncode}: {host.output()}")
        try:
            with urlopen(f"{host.base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"kafila host was not ready in {timeout} s: {host.output()}")
        time.sleep(0.2)


def status_of(host: Host) -> dict[str, Any]:
    """The host's /status, as it came."""
    with urlopen(f"{host.base_url}/status", timeout=10) as response:
        status: dict[str, Any] = json.loads(response.read())
    return status


def until_status(
    host: Host, condition: Callable[[dict[str, Any]], bool], what: str, timeout: float = 90.0
) -> dict[str, Any]:
    """/status once `condition` holds of it: a wait on the host's state, not on its words or the clock."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while True:
        try:
            last = status_of(host)
            if condition(last):
                return last
        except (URLError, OSError, ValueError):
            pass  # not listening yet, or answering mid-restart
        if host.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the host never got to {what}; its last status: {last}; its output: {host.output()}")
        time.sleep(0.2)


def until_event(host: Host, kind: str, text: str, timeout: float = 30.0) -> dict[str, Any]:
    """The first event of `kind` whose text has `text` on the host's /events stream (those kept,
    then those to come): the host's typed account of what happened, waited on as it comes."""
    deadline = time.monotonic() + timeout
    with urlopen(f"{host.base_url}/events", timeout=timeout) as stream:
        while time.monotonic() < deadline and (line := stream.readline()):
            if line.startswith(b"data: "):
                event: dict[str, Any] = json.loads(line[6:])
                if event["kind"] == kind and text in event["text"]:
                    return event
    raise AssertionError(f"no {kind} event saying {text!r} in {timeout} s; the host's output: {host.output()}")


def said(host: Host, text: str, timeout: float = 10.0) -> bool:
    """Whether the host's log has `text`, allowing the moment its words take to follow its state:
    an assertion on what a person is told, made once the state it reports has been reached."""
    deadline = time.monotonic() + timeout
    while text not in host.output():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def serving_past(epoch: int) -> Callable[[dict[str, Any]], bool]:
    """Serving again on a plan newer than `epoch` (a replan has finished)."""
    return lambda status: bool(status.get("ready")) and (status.get("epoch") or 0) > epoch


def serving_alone(status: dict[str, Any]) -> bool:
    """Serving with every block on the host (`kafila host` fell back to it)."""
    return bool(status.get("ready")) and [m.get("name") for m in status.get("members", [])] == ["this machine"]


@dataclass(frozen=True)
class Rendezvous:
    """A running `kafila rendezvous`: its HTTP address, HOST:PORT, and its process, for a test that
    kills it."""

    address: str
    process: subprocess.Popen[str]


@contextmanager
def running_rendezvous() -> Iterator[Rendezvous]:
    """A real `kafila rendezvous` on loopback, on free ports. It prints READY, then HTTP, and stops
    cleanly when asked to; one that ended before that must have been killed by the test."""
    server = subprocess.Popen(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--stun-port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ended_early = False
    try:
        ready = line_from(server.stdout, "the rendezvous's READY line").split()
        http = line_from(server.stdout, "the rendezvous's HTTP line").split()
        assert ready[0] == "READY" and http[0] == "HTTP", (ready, http)
        yield Rendezvous(http[1], server)
    finally:
        ended_early = server.poll() is not None
        if not ended_early:
            server.terminate()
        server.communicate(timeout=10)
    assert server.returncode == (-signal.SIGKILL if ended_early else 0), server.returncode


@contextmanager
def running_host(
    *args: str | Path,
    api_key: str | None = None,
    ready: bool = True,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (sys.executable, "-m", "kafila"),
) -> Iterator[Host]:
    """`kafila host` with `args` on a free port; `launcher`: how `kafila` is started. A host on the
    test session's cache starts from the session's probe, as its members do (`seeded_cache`):
    measured here, under the probe's own bound, not inside what a test allows the host to start
    (at a load average of 16 the probe took 40 s of the 60 a join line is waited for). Outside the
    test suite (the benchmarks in scripts/) there is no session cache, and the host measures as any."""
    if "KAFILA_CACHE" not in (env or {}) and "KAFILA_CACHE" in os.environ:  # a benchmark's host has its own
        session_probe()
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        command = [*launcher, "host", "--port", str(port), *map(str, args)]
        environment = {**os.environ, "COLUMNS": "200", **(env or {})}
        environment.pop("KAFILA_API_KEY", None)
        if api_key is not None:
            command += ["--api-key", api_key]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=environment)
    host = Host(process, f"http://127.0.0.1:{port}", Path(log.name))
    try:
        if ready:
            wait_ready(host)
        yield host
    finally:
        stop(process, timeout=30)
        host.log.unlink(missing_ok=True)


def one_user(host: Host, model: str, prompt: str, requests: int, tokens: int) -> float:
    """One user's greedy completions, after a short one to warm the ring; its tokens/s."""
    import openai

    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)  # warm
    started, made = time.perf_counter(), 0
    for _ in range(requests):
        result = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0)
        made += result.usage.completion_tokens if result.usage else 0
    return made / (time.perf_counter() - started)


def report_covers_requests(status: dict[str, Any]) -> bool:
    """The stages' report in `status` was taken after every request its ring has finished or failed
    (`stages_cover`): a client that has had its replies finds its work in it."""
    cover, requests = status.get("stages_cover"), status.get("requests") or {}
    return cover is not None and cover["requests"] >= requests.get("finished", 0) + requests.get("failed", 0)


def refreshed_status(host: Host, timeout: float = 30.0) -> dict[str, Any]:
    """/status once its stage report covers every request the ring has finished: the engine loop
    refreshes the report every 2 s, so a client's work since shows in the next one."""
    return until_status(host, report_covers_requests, "a stage report with every finished request", timeout)


def planned_and_measured(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stage of the plan in /status, in block order: who holds it, whether it is the head, its
    predicted ms per token, where that price came from, and its measured ms per single-row decode."""
    measured = {tuple(s["range"]): s.get("ms_per_token_alone") for s in status["stages"]}
    found = [
        {
            "name": m["name"],
            "blocks": tuple(m["blocks"]),
            "head": m["name"] == status["plan"]["head"],
            "predicted": m["predicted_ms_per_token"],
            "priced_on": m.get("priced_on"),
            "measured": measured.get(tuple(m["blocks"])),
        }
        for m in status["members"]
        if "blocks" in m
    ]
    return sorted(found, key=lambda stage: stage["blocks"])
