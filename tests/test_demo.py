"""The README's main job: `kafila host --demo` serves the bundled gemma-3-270m with two local
members through the embedded rendezvous, answers the official client, and Ctrl-C ends it all."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
from host_process import running_host


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


def test_the_demo_serves_gemma_on_three_members_and_ends_cleanly() -> None:
    with running_host("--demo", "--context", "1024", "--concurrency", "2") as host:
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        pid = host.process.pid
        (model,) = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
        )
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens > 0
        members = demo_members(pid)
        assert len(members) == 2
        host.process.send_signal(signal.SIGINT)
        assert host.process.wait(timeout=60) == 0, host.output()
        deadline = time.monotonic() + 20
        while any(running(m) for m in members) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(m) for m in members)
        assert "3 stages" in host.output()
        assert "Traceback" not in host.output() and "the ring broke" not in host.output()
        assert "on this machine too" not in host.output()  # the demo sets its processes up to share cores
