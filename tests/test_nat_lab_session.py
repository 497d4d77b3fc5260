"""Whole `kafila host` / `kafila join` sessions across the NAT lab: three homes behind real Linux
NATs, each uplink 20 ms one way (the lab's user-space delay line), a real `kafila rendezvous` on
the lab's internet with both its addresses, and the official `openai` client inside the host's
home. The homes make one ring edge relay (a symmetric NAT and a port-restricted one) and the
other two go direct.

Module scope: one session serves every test here, in order; the faults come last."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from host_process import Host
from llama_cpp import Llama
from natlab_fixtures import NAT_BEHAVIOUR, PUBLIC_ADDRESSES, NatLab, natlab_required  # noqa: F401
from natlab_wan import WanLink
from serving_checks import PROMPTS, unsplit_greedy

from kafila.contracts import NatBehaviour
from kafila.planner.reachability import predict_edge
from kafila.runtime.chat_template import ChatTemplate

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HOMES = {"home-pc": "port-restricted", "far-laptop": "symmetric", "near-desktop": "full-cone"}
HOST, RELAYED, DIRECT = "home-pc", "far-laptop", "near-desktop"
WAN = WanLink(delay_ms=20)
RENDEZVOUS = f"{PUBLIC_ADDRESSES[0]}:8470"
API_PORT = 8000
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


class LabApi:
    """The host's API as a client inside its home sees it (scripts/lab_api_agent.py)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def __call__(self, op: str, timeout: float = 180.0, **request: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps({"op": op, **request}) + "\n").encode())
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            raise AssertionError(f"the API agent did not answer {op} in {timeout} s")
        answer = json.loads(self.process.stdout.readline() or b'{"error": "the agent exited"}')
        if "error" in answer:
            raise AssertionError(f"{op}: {answer['error']}")
        return answer["ok"]


@dataclass
class LabSession:
    lab: NatLab
    host: Host
    tmp: Path
    code: str = ""
    members: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    api: LabApi | None = None

    def join(self, name: str) -> None:
        """`kafila join` in the member's home, as its owner would type it."""
        log = (self.tmp / f"{name}.log").open("a")
        self.members[name] = self.lab.run_home(
            self.lab.homes[name],
            [sys.executable, "-m", "kafila", "join", self.code, "--rendezvous", RENDEZVOUS, "--name", name,
             "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "KAFILA_CACHE": str(self.tmp / f"cache-{name}"), "COLUMNS": "200"},
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


def ring_of(names: set[str], epoch_after: int = 0) -> Callable[[dict[str, Any]], bool]:
    """Serving, on a plan newer than `epoch_after`, with exactly these members holding blocks."""

    def holds(status: dict[str, Any]) -> bool:
        serving = {m["name"] for m in status.get("members", []) if m.get("blocks") and not m.get("left")}
        return bool(status.get("ready")) and status.get("epoch", 0) > epoch_after and serving == names

    return holds


def nat(home: str) -> NatBehaviour:
    mapping, filtering, _ = NAT_BEHAVIOUR[HOMES[home]]
    return NatBehaviour.model_validate({"mapping": mapping, "filtering": filtering})


@pytest.fixture(scope="module")
def session(
    natlab_required: None,  # noqa: F811
    gemma_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LabSession]:
    tmp = tmp_path_factory.mktemp("lab-session")
    with NatLab() as lab:
        for name, kind in HOMES.items():
            lab.set_wan(lab.add_home(name, kind), WAN)
        rendezvous = lab.run_public(
            [sys.executable, "-m", "kafila", "rendezvous", "--host", PUBLIC_ADDRESSES[0], "--alt-address",
             PUBLIC_ADDRESSES[1], "--session-idle", "10"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert rendezvous.stdout is not None and rendezvous.stdout.readline().startswith("READY")
        log = tmp / "host.log"
        process = lab.run_home(
            lab.homes[HOST],
            [sys.executable, "-m", "kafila", "host", "--model", str(gemma_path), "--members", "3", "--rendezvous",
             RENDEZVOUS, "--port", str(API_PORT), "--context", "1024", "--concurrency", "4", "--threads", "1",
             "--name", HOST],
            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "KAFILA_CACHE": str(tmp / "cache-host"), "COLUMNS": "200"},
        )  # fmt: skip
        lab_session = LabSession(lab, Host(process, f"http://127.0.0.1:{API_PORT}", log), tmp)
        code, printed_rendezvous = lab_session.host.join_line(timeout=180)
        assert printed_rendezvous == RENDEZVOUS  # what the other homes must type, never a LAN address
        lab_session.code = code
        for name in (RELAYED, DIRECT):
            lab_session.join(name)
        agent = lab.run_home(
            lab.homes[HOST],
            [sys.executable, str(SCRIPTS / "lab_api_agent.py"), lab_session.host.base_url, gemma_path.stem],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        lab_session.api = LabApi(agent)
        lab_session.until(ring_of(set(HOMES)), "serving with all three homes", timeout=600)
        yield lab_session


def reference_chat(model: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The same chat, greedy, in one process of llama.cpp (llama-cpp-python's `Llama`), on the
    prompt the model's own template renders."""
    llama = Llama(str(model), n_ctx=1024, n_threads=1, verbose=False)
    try:
        bos, eos = (
            llama.detokenize([token], special=True).decode() for token in (llama.token_bos(), llama.token_eos())
        )
        rendered = ChatTemplate(llama.metadata.get("tokenizer.chat_template"), bos, eos, "gemma3").render(messages)
        tokens = llama.tokenize(rendered.text.encode(), add_bos=not rendered.starts_with_bos, special=True)
        reply = llama.create_completion(tokens, max_tokens=max_tokens, temperature=0)
        return str(reply["choices"][0]["text"])  # type: ignore[index]
    finally:
        llama.close()


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> str:
    return reference_chat(gemma_path, CHAT, 24)


def test_three_homes_serve_what_one_process_does_over_the_edges_the_planner_predicted(
    session: LabSession, gemma_path: Path, reference: str
) -> None:
    api = session.api
    assert api is not None
    chat = api("chat", messages=CHAT, max_tokens=24)
    assert chat["text"] == reference
    started = api("start", id="first", messages=CHAT, max_tokens=24)
    streamed = api("result", id="first")
    assert streamed["error"] is None and streamed["text"] == chat["text"] and streamed["chunks"] > 1, started
    serves_correctly(session, reference, gemma_path)
    for prompt in PROMPTS:  # one at a time, each exactly what one process gives
        (alone,) = api("completions", prompts=[prompt], max_tokens=8, stream=False)
        assert alone["text"] == unsplit_greedy(gemma_path, prompt, 8), prompt

    status = session.status()
    for edge in status["edges"]:
        predicted = predict_edge(nat(edge["from"]), nat(edge["to"]))
        assert edge["path"] == predicted.value, edge
        # every edge crosses two homes' uplinks each way: at least 4 × 20 ms
        assert edge["rtt_ms"] is not None and 75 < edge["rtt_ms"] < 1000, edge
    assert sorted(e["path"] for e in status["edges"]) == ["direct", "direct", "relayed"]

    # The relayed member had no model: its stage came over the relay, and is what its name says.
    stages = list((session.tmp / f"cache-{RELAYED}" / "stages").glob("*.gguf"))
    assert stages, session.member_log(RELAYED)
    for stage in stages:
        assert hashlib.sha256(stage.read_bytes()).hexdigest() == stage.stem


def serves_correctly(session: LabSession, reference: str, gemma_path: Path) -> None:
    """The chat is exactly one process's; four streams batched together all finish, each begun
    as its own prompt begins (a batch's kernels may break a later near-tie the other way:
    serving_checks.check_concurrent_streams)."""
    api = session.api
    assert api is not None
    assert api("chat", messages=CHAT, max_tokens=24)["text"] == reference
    results = api("completions", prompts=list(PROMPTS), max_tokens=16, stream=True)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert "error" not in result and result["finish"] == "length" and result["tokens"] == 16, result
        assert result["text"].startswith(unsplit_greedy(gemma_path, prompt, 1)), prompt


def test_two_percent_loss_on_a_homes_link_leaves_the_output_correct(
    session: LabSession, reference: str, gemma_path: Path
) -> None:
    near = session.lab.homes[DIRECT]
    _, dropped_before = session.lab.wan_counts(near)
    session.lab.set_wan(near, WanLink(delay_ms=WAN.delay_ms, loss=0.02))
    try:
        serves_correctly(session, reference, gemma_path)
        assert session.lab.wan_counts(near)[1] > dropped_before  # packets were lost, and QUIC made up for them
    finally:
        session.lab.set_wan(near, WAN)
    assert ring_of(set(HOMES))(session.status())  # nothing was replanned for it


def test_the_relayed_member_killed_mid_stream_fails_it_at_once_then_the_ring_replans_and_takes_it_back(
    session: LabSession, reference: str, gemma_path: Path
) -> None:
    api = session.api
    assert api is not None
    epoch = session.status()["epoch"]
    api("start", id="long", messages=CHAT, max_tokens=400)
    deadline = time.monotonic() + 60
    while api("progress", id="long")["chunks"] < 2:  # the stream has begun
        assert time.monotonic() < deadline, "the stream never began"
        time.sleep(0.1)
    session.members[RELAYED].kill()
    killed = time.time()
    ended = api("result", id="long", timeout=60)
    assert ended["error"] is not None and ended["error_at"] - killed < 5.0, ended
    replanned = session.until(ring_of({HOST, DIRECT}, epoch), "a replan without the killed member")
    serves_correctly(session, reference, gemma_path)

    session.join(RELAYED)  # the laptop comes back with the same code: no one at the host does anything
    back = session.until(ring_of(set(HOMES), replanned["epoch"]), "taking the member back")
    assert sorted(e["path"] for e in back["edges"]) == ["direct", "direct", "relayed"]
    serves_correctly(session, reference, gemma_path)


def test_a_home_whose_uplink_goes_down_for_ten_seconds_comes_back_into_the_ring(
    session: LabSession, reference: str, gemma_path: Path
) -> None:
    near = session.lab.homes[DIRECT]
    epoch = session.until(ring_of(set(HOMES)), "serving with all three")["epoch"]
    session.lab.set_wan(near, WanLink(delay_ms=WAN.delay_ms, down=True))
    time.sleep(10)  # the outage itself (a laptop's lid), not a wait for anything
    session.lab.set_wan(near, WAN)
    session.until(ring_of(set(HOMES), epoch), "the ring with the home that was cut off")
    serves_correctly(session, reference, gemma_path)
    assert "Traceback" not in session.host.output()
