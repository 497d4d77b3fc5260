"""Who serves across the NAT lab: four homes, one of them behind a 150 ms edge. The host and
the three members are real `kafila host` / `kafila join` processes on a tiny model, each member
lending room for half the model and the host for a block: the model needs two members besides the
host. The far laptop stands by, since its edge costs more than its blocks save, and is taken in
when a near member is killed, since the model then needs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from host_process import Host, seeded_cache
from lab_session import API_PORT, RENDEZVOUS, SCRIPTS, LabApi, LabSession
from natlab import PUBLIC_ADDRESSES, NatLab
from natlab_fixtures import natlab_wan_required  # noqa: F401
from natlab_wan import WanLink
from serving_checks import unsplit_greedy
from tiny_models import write_tiny_model
from waiting import line_from

from kafila.planner.cost import ChainPrefix
from kafila.planner.types import ServingSpec
from kafila.runtime.gguf.manifest import read_manifest

pytestmark = pytest.mark.timeout(300)

HOST, NEAR, OTHER, FAR = "home-pc", "near-desktop", "near-mini", "far-laptop"
NEAR_WAN, FAR_WAN = WanLink(delay_ms=1), WanLink(delay_ms=74)  # the far laptop's edges: 2 × (74 + 1) = 150 ms
CONTEXT, CONCURRENCY = 2048, 4  # a cache of 1 MiB a block
PROMPT = "the quick brown fox"


def lending(model: Path) -> tuple[int, int]:
    """(the host's, each member's) `--memory` in bytes: the host holds one block and no more, a
    member two and no more, with the head or without."""
    manifest = read_manifest(model)
    prefix = ChainPrefix.of(manifest, ServingSpec(context=CONTEXT, concurrency=CONCURRENCY))
    needs = [prefix.resident_matrix(head) for head in (False, True)]
    n = manifest.n_blocks

    def need(blocks: int, most: bool) -> int:
        spans = [int(m[a, a + blocks]) for m in needs for a in range(n - blocks + 1)]
        return max(spans) if most else min(spans)

    host, member = max(int(needs[0][a, a + 1]) for a in range(n)), need(2, most=True)
    assert host < need(2, most=False) and member < need(3, most=False)
    return host, member


def serving(names: set[str], after_epoch: int = 0) -> Any:
    def holds(status: dict[str, Any]) -> bool:
        ring = {m["name"] for m in status.get("members", []) if m.get("blocks")}
        return bool(status.get("ready")) and status.get("epoch", 0) > after_epoch and ring == names

    return holds


def test_a_member_behind_a_150_ms_edge_stands_by_and_is_taken_in_when_a_near_member_is_killed(
    natlab_wan_required: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    host_bytes, member_bytes = lending(model)
    choosing = {"KAFILA_EVERY_MEMBER_SERVES": "0"}  # tests/conftest.py sets "1" for the other sessions
    with NatLab() as lab:
        for name in (HOST, NEAR, OTHER, FAR):
            lab.set_wan(lab.add_home(name, "full-cone"), FAR_WAN if name == FAR else NEAR_WAN)
        rendezvous = lab.run_public(
            [sys.executable, "-m", "kafila", "rendezvous", "--host", PUBLIC_ADDRESSES[0], "--alt-address",
             PUBLIC_ADDRESSES[1]],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert line_from(rendezvous.stdout, "the lab's rendezvous's READY line").startswith("READY")
        log = tmp_path / "host.log"
        process = lab.run_home(
            lab.homes[HOST],
            [sys.executable, "-m", "kafila", "host", "--model", str(model), "--members", "4", "--rendezvous",
             RENDEZVOUS, "--port", str(API_PORT), "--context", str(CONTEXT), "--concurrency", str(CONCURRENCY),
             "--threads", "1", "--memory", f"{host_bytes}B", "--no-rebalance", "--name", HOST],
            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **choosing, "KAFILA_CACHE": str(seeded_cache(tmp_path / "cache-host"))},
        )  # fmt: skip
        session = LabSession(lab, Host(process, f"http://127.0.0.1:{API_PORT}", log), tmp_path)
        session.code, _ = session.host.join_line(timeout=60)
        for name in (NEAR, OTHER, FAR):
            session.members[name] = lab.run_home(
                lab.homes[name],
                [sys.executable, "-m", "kafila", "join", session.code, "--rendezvous", RENDEZVOUS, "--name", name,
                 "--threads", "1", "--memory", f"{member_bytes}B"],
                stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "KAFILA_CACHE": str(seeded_cache(tmp_path / f"cache-{name}")), "COLUMNS": "200"},
            )  # fmt: skip
        session.api = api = LabApi(
            lab.run_home(
                lab.homes[HOST],
                [sys.executable, str(SCRIPTS / "lab_api_agent.py"), session.host.base_url, model.stem],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        )
        expected = unsplit_greedy(model, PROMPT, 6)

        status = session.until(serving({HOST, NEAR, OTHER}), "serving without the far laptop", timeout=120)
        far = next(m for m in status["members"] if m["name"] == FAR)
        assert far["role"] == "stands-by" and far["link"] == "up" and "blocks" not in far, status["members"]
        assert far["why"].startswith(f"{FAR} stands by: its edges add"), far["why"]
        assert status["plan"]["standby"] == [FAR]
        assert 140 < far["rtt_ms"] < 400, far  # what it was weighed by: its measured round trip to the host
        ring = [(e["from"], e["to"]) for e in status["edges"]]
        assert all(a == b for (_, a), (b, _) in pairwise([*ring, ring[0]])) and FAR not in {a for a, _ in ring}
        (answer,) = api("completions", prompts=[PROMPT], max_tokens=6, stream=False)
        assert answer["text"] == expected, answer

        session.members[NEAR].kill()
        killed = time.monotonic()
        status = session.until(serving({HOST, OTHER, FAR}, status["epoch"]), "taking the far laptop in", timeout=90)
        far = next(m for m in status["members"] if m["name"] == FAR)
        assert far["role"] == "serves" and far["why"] == f"{FAR} serves: the others cannot hold the model without it"
        assert status["plan"]["standby"] == []
        (answer,) = api("completions", prompts=[PROMPT], max_tokens=6, stream=False)
        assert answer["text"] == expected, answer
        print(
            f"the far laptop serving {time.monotonic() - killed:.1f} s after a near member was killed", file=sys.stderr
        )
