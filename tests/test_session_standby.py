"""Who serves, end to end on loopback: a real `kafila host` and real `kafila join` members, where
one member costs more than it saves. It stands by, linked and out of the ring, says why in
/status and `kafila status`, and is taken in when a member of the ring is lost and the model
needs it. (The pure choice is test_session_who_serves.py.)"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import openai
from host_process import (
    Host,
    running_host,
    said,
    seeded_cache,
    serving_past,
    session_probe,
    start_member,
    stop,
    until_status,
    wait_ready,
)
from rich.console import Console
from serving_checks import unsplit_greedy
from tiny_models import write_tiny_model

from kafila.cli.status_command import render_status
from kafila.contracts import HostStatus
from kafila.planner.cost import ChainPrefix
from kafila.planner.types import ServingSpec
from kafila.runtime.gguf.manifest import read_manifest

PROMPT = "the quick brown fox"
CONTEXT, CONCURRENCY = 2048, 4  # a cache of 1 MiB a block: what makes --memory's 1 MiB floor fit
COMMON = (
    "--context", str(CONTEXT), "--concurrency", str(CONCURRENCY), "--threads", "1", "--rendezvous-port", "0",
    "--stun-port", "0", "--no-rebalance",
)  # fmt: skip
CHOOSING = {"KAFILA_EVERY_MEMBER_SERVES": "0"}  # tests/conftest.py asks every member to serve elsewhere


def one_block_at_most(model: Path) -> str:
    """A host `--memory` with room for one block and its cache, never two nor the head: the model
    needs a member besides the host."""
    manifest = read_manifest(model)
    prefix = ChainPrefix.of(manifest, ServingSpec(context=CONTEXT, concurrency=CONCURRENCY))
    lend = min(int(prefix.resident_matrix(True)[i, i + 1]) for i in range(manifest.n_blocks)) - 1
    return f"{lend}B"


def slow_machine(cache: Path) -> Path:
    """A member's cache whose probe says its machine is a hundred times slower than this one, and
    5 s a token at the least: far slower than loopback's trips, whatever this busy machine's own
    probe read (from a microsecond to 260 ms a token, seen) and however long the load makes a
    trip (146 ms, seen in CI: a near member priced 50 ms faster lost to that edge); a link's round
    trip stays below its idle bound (4 s), past which it is down."""
    probe = json.loads(session_probe().read_text())
    device = probe["device"]
    overhead_us, bandwidth_gb_s = max(device["overhead_us"] * 100, 5e6), min(device["bandwidth_gb_s"] / 100, 0.5)
    device.update(overhead_us=overhead_us, bandwidth_gb_s=bandwidth_gb_s, head_bandwidth_gb_s=None)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "probe.json").write_text(json.dumps(probe))
    return cache


def member(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in status["members"] if m["name"] == name)


def test_a_member_that_costs_more_than_it_saves_stands_by_and_is_taken_in_when_a_ring_member_is_lost(
    tmp_path: Path,
) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    expected = unsplit_greedy(model, PROMPT, 8)
    joiners: list[subprocess.Popen[str]] = []
    args = ("--model", model, "--members", "3", *COMMON, "--memory", one_block_at_most(model))
    slow = slow_machine(tmp_path / "slow")
    try:
        with running_host(*args, ready=False, env=CHOOSING) as host:
            code, rendezvous = host.join_line()
            joiners.append(start_member(code, rendezvous, "near", seeded_cache(tmp_path / "near"), "--threads", "1"))
            joiners.append(start_member(code, rendezvous, "slow", slow, "--threads", "1"))
            wait_ready(host, timeout=120)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            assert (
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
                == expected
            )

            status = until_status(host, lambda s: bool(s.get("ready")), "serving")
            slow_entry, near_entry = member(status, "slow"), member(status, "near")
            assert slow_entry["role"] == "stands-by" and "blocks" not in slow_entry, (status["members"], host.output())
            assert slow_entry["link"] == "up"  # joined, linked, out of the ring
            assert slow_entry["why"].startswith("slow stands by: its stage would take "), slow_entry["why"]
            assert near_entry["role"] == "serves" and "blocks" in near_entry, status
            assert status["plan"]["standby"] == ["slow"] and "slow" not in status["plan"]["ring"], status["plan"]
            assert (
                status["plan"]["concurrency"] == 1 and status["plan"]["predicted_ms_per_token"] > 0
            )  # one user, at first
            assert said(host, slow_entry["why"]), host.output()  # `kafila host` says it too
            console = Console(record=True, width=250)
            render_status(HostStatus.model_validate(status), console)  # what `kafila status` prints of it
            table = console.export_text()
            assert "(stands by)" in table and slow_entry["why"] in table.replace("\n", " "), table

            joiners[0].kill()  # the near member is lost: the host cannot hold the model without the slow one
            replanned = until_status(host, serving_past(status["epoch"]), "a replan without the near member")
            slow_entry = member(replanned, "slow")
            assert slow_entry["role"] == "serves" and "blocks" in slow_entry, replanned
            assert slow_entry["why"] == "slow serves: the others cannot hold the model without it"
            assert replanned["plan"]["standby"] == [] and "slow" in replanned["plan"]["ring"], replanned["plan"]
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == expected

            # The near member comes back: the replan that takes it in leaves the slow one out again,
            # and the slow one drops the stage it served.
            joiners.append(start_member(code, rendezvous, "near", seeded_cache(tmp_path / "near"), "--threads", "1"))
            again = until_status(
                host,
                lambda s: serving_past(replanned["epoch"])(s) and member(s, "slow").get("role") == "stands-by",
                "the near member back in, and the slow one standing by again",
            )
            assert "blocks" not in member(again, "slow") and member(again, "near")["role"] == "serves", again
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == expected
    finally:
        outputs = [stop(joiner) for joiner in joiners]
    slow_said = outputs[1]
    standing = "standing by, out of the ring: slow stands by"
    assert slow_said.index(standing) < slow_said.index("serving blocks") < slow_said.rindex(standing), slow_said


BLOCK_MS = 2000.0  # what a block costs a token in the load test's prices


def priced_like(cache: Path, block_ms: float, overhead_ms: float, model: Path) -> Path:
    """A machine's cache whose probe prices the tiny model's blocks at about `block_ms` each a
    token and a step's own work at `overhead_ms`: a model thousands of times larger, as it were, so
    that loopback's round trips weigh nothing beside its stages (on a loaded machine, up to 146 ms
    seen), and past the 20× by which what a stage measures serving may move its price
    (`SERVED_SCALE_LIMITS`): the choice stays the probe's."""
    probe = json.loads(session_probe().read_text())
    smallest = min(read_manifest(model).block_bytes)
    probe["device"].update(
        bandwidth_gb_s=smallest / (block_ms * 1e-3) / 1e9, overhead_us=overhead_ms * 1e3, head_bandwidth_gb_s=None
    )
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "probe.json").write_text(json.dumps(probe))
    return cache


def users_until(host: Host, count: int, reason: str) -> str:
    """`count` users asking one greedy completion after another until the host's weighing of the
    load gives a reason starting with `reason`; then they stop, so the ring idles and the replan
    can come. That reason."""
    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    done = threading.Event()

    def user() -> None:
        while not done.is_set():
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)

    users = [threading.Thread(target=user, daemon=True) for _ in range(count)]
    for thread in users:
        thread.start()
    try:
        weighed = until_status(
            host, lambda s: ((s.get("load") or {}).get("reason") or "").startswith(reason), f"{reason}, weighed"
        )
    finally:
        done.set()
        for thread in users:
            thread.join(timeout=60)
    return str(weighed["load"]["reason"])


def test_a_member_standing_by_for_one_user_is_taken_in_when_four_users_come_and_left_out_when_they_go(
    tmp_path: Path,
) -> None:
    """The host can hold a block and no more, near the rest. The extra member's every step costs
    3 s of its own (a block 2 s): for one user, that is more than its block saves on the pass every
    token makes, so it stands by; for four at once the slowest stage sets the pace, and the extra
    stage takes a block off near's three. The host measures the load served, takes it in, and
    leaves it out again when one user is left."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    expected = unsplit_greedy(model, PROMPT, 8)
    joiners: list[subprocess.Popen[str]] = []
    host_cache = priced_like(tmp_path / "host", BLOCK_MS, 100.0, model)
    load_knobs = {"KAFILA_LOAD_WINDOW_S": "2", "KAFILA_LOAD_COOLDOWN_S": "1"}
    env = {**CHOOSING, "KAFILA_CACHE": str(host_cache), **load_knobs}
    args = ("--model", model, "--members", "3", *COMMON, "--memory", one_block_at_most(model))
    try:
        with running_host(*args, ready=False, env=env) as host:
            code, rendezvous = host.join_line()
            for name, overhead_ms in (("near", 100.0), ("extra", 3000.0)):
                cache = priced_like(tmp_path / name, BLOCK_MS, overhead_ms, model)
                joiners.append(start_member(code, rendezvous, name, cache, "--threads", "1"))
            wait_ready(host, timeout=120)
            status = until_status(host, lambda s: bool(s.get("ready")), "serving")
            extra = member(status, "extra")
            assert extra["role"] == "stands-by" and "blocks" not in extra, (status["members"], host.output())
            assert status["plan"]["concurrency"] == 1 and status["load"]["planned"] == 1, status

            reason = users_until(host, 4, "extra taken in")
            load = int(reason.removeprefix("extra taken in: at ").split(" ")[0])
            assert load >= 2 and reason.startswith(f"extra taken in: at {load} users at once, its "), reason
            assert said(host, f"the load calls for a replan, once no request runs: {reason}"), host.output()
            replanned = until_status(
                host,
                lambda s: serving_past(status["epoch"])(s) and member(s, "extra").get("role") == "serves",
                "the extra member taken in",
            )
            assert "blocks" in member(replanned, "extra") and replanned["plan"]["standby"] == [], replanned
            assert replanned["plan"]["concurrency"] == load and replanned["load"]["planned"] == load
            assert said(host, f"replanned with 3 members, {reason}"), host.output()
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == expected
            console = Console(record=True, width=250)
            render_status(HostStatus.model_validate(replanned), console)
            assert f"load: planned for {load} requests at once" in console.export_text()

            reason = users_until(host, 1, "extra left out")
            assert reason.startswith("extra left out: at 1 user at once, its "), reason
            alone = until_status(
                host,
                lambda s: serving_past(replanned["epoch"])(s) and member(s, "extra").get("role") == "stands-by",
                "the extra member left out again",
            )
            assert alone["plan"]["standby"] == ["extra"] and alone["load"]["planned"] == 1, alone
            assert said(host, f"replanned with 2 members, {reason}; 1 standing by"), host.output()
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == expected
    finally:
        for joiner in joiners:
            stop(joiner)
