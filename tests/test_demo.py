"""The README's main job: `kafila host --demo` serves the bundled SmolLM2-135M-Instruct with two
local members through the embedded rendezvous, answers the official client as a chat model, and
Ctrl-C ends it all."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import openai
from host_process import running_host, wait_ready
from tiny_models import write_tiny_model

from kafila.runtime.llama.threads import core_shares, cores_by_physical


def demo_members(host: int) -> list[int]:
    """The `kafila join` processes this host started (other demos on the machine are not ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == host and b"kafila" in cmdline and b"demo-member-" in cmdline:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Still alive, and still a `kafila join` (a reaped pid may be reused); a zombie has ended."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z" and b"demo-member-" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def test_the_demo_answers_like_a_chat_model_on_three_members_and_ends_cleanly() -> None:
    with running_host("--demo", "--context", "1024", "--concurrency", "2") as host:
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        pid = host.process.pid
        (model,) = [m.id for m in client.models.list()]
        assert model == "SmolLM2-135M-Instruct.Q4_1"
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0, max_tokens=48
        )
        answer = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason == "stop" and re.search(r"\b4\b|\bfour\b", answer, re.I), answer
        assert not re.search(r"\b(3|5|22)\b", answer), answer
        members = demo_members(pid)
        assert len(members) == 2
        host.process.send_signal(signal.SIGINT)
        assert host.process.wait(timeout=60) == 0, host.output()
        deadline = time.monotonic() + 20
        while any(running(m) for m in members) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(m) for m in members)
        assert "3 stages" in host.output()
        # The API's address is given once, on the line that says the session serves; before it, what it waits for.
        output = host.output()
        assert output.count(host.base_url.removeprefix("http://")) == 1, output
        assert "waiting for 2 members to join" in output.split("ready: ")[0], output
        (ready,) = [line for line in output.splitlines() if host.base_url.removeprefix("http://") in line]
        assert ready.startswith(f"ready: {model} on {host.base_url}/v1, as 3 stages"), ready
        assert "Traceback" not in host.output() and "the ring broke" not in host.output()
        assert "on this machine too" not in host.output()  # the demo sets its processes up to share cores


def incidents(base_url: str) -> list[dict[str, Any]]:
    with urlopen(f"{base_url}/status", timeout=10) as response:
        found: list[dict[str, Any]] = json.loads(response.read())["incidents"]
    return found


def test_a_demo_member_that_crashes_is_named_with_its_signal_and_last_lines(tmp_path: Path) -> None:
    """A local member dying by a signal (a native crash in llama.cpp) is reported by the host: the
    member's name, the signal, and the last lines it printed (its faulthandler traceback); the
    session then replans without it and serves on."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=6)
    with running_host("--demo", "--model", model, "--context", "256", "--threads", "1") as host:
        members = demo_members(host.process.pid)
        assert len(members) == 2 and incidents(host.base_url) == []
        victim = next(m for m in members if b"demo-member-1" in (Path("/proc") / str(m) / "cmdline").read_bytes())
        os.kill(victim, signal.SIGSEGV)
        deadline = time.monotonic() + 60
        while not (found := [i for i in incidents(host.base_url) if i["what"] == "demo-member-1 died"]):
            assert time.monotonic() < deadline, host.output()
            time.sleep(0.2)
        detail = found[0]["detail"]
        assert detail.startswith("demo-member-1 (a member on this machine) died with SIGSEGV")
        assert "CPU features" in detail and "Likely cause" in detail
        assert "Fatal Python error: Segmentation fault" in detail  # what the member printed last
        wait_ready(host)  # replanned with the member that is left
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=2, timeout=60)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text is not None


def held_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets a process's threads may run on, each thread's read from /proc (one set where
    the process is held whole)."""
    found = set()
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            found.add(frozenset(os.sched_getaffinity(int(task.name))))
    return found


def test_the_demo_holds_each_process_to_cores_of_its_own_as_separate_machines(tmp_path: Path) -> None:
    """With as many cores as processes, the host and each member are held, every thread, to
    their own cores (disjoint, together all this machine's), and each member computes with one
    thread a physical core of its share, as a machine of its own would."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=6)
    usable = os.sched_getaffinity(0)
    shares = core_shares(cores_by_physical(Path("/proc/cpuinfo").read_text(), usable), 2)
    with running_host("--demo", "--members", "2", "--model", model, "--context", "256") as host:
        (member,) = demo_members(host.process.pid)
        command = (Path("/proc") / str(member) / "cmdline").read_bytes().split(b"\0")
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text is not None
        if shares is None:  # one core: nothing to divide, both keep it all
            assert held_cpus(host.process.pid) == held_cpus(member) == {frozenset(usable)}
            assert b"--threads" not in command
            return
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            assert json.loads(response.read())["pipeline_waves"] == 2  # as many waves out as machines
        assert held_cpus(host.process.pid) == {frozenset(shares[0].cpus)}, host.output()
        assert held_cpus(member) == {frozenset(shares[1].cpus)}, host.output()
        assert set(shares[0].cpus).isdisjoint(shares[1].cpus) and {*shares[0].cpus, *shares[1].cpus} == usable
        assert command[command.index(b"--threads") + 1] == str(shares[1].threads).encode()
        assert "the demo holds each of its 2 processes to cores of its own" in host.output()
        assert "on this machine too" not in host.output()
