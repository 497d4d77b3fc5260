"""Whole sessions on loopback: `kafila host --members N` and real `kafila join` processes, introduced
by the host's embedded rendezvous, verified with the code's secret, linked over QUIC, served
through the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import urlopen

import numpy as np
import openai
import pytest
from edit_workload import edit_prompt
from host_process import (
    READY_TIMEOUT_S,
    Host,
    refreshed_status,
    running_host,
    running_rendezvous,
    said,
    seeded_cache,
    serving_alone,
    serving_past,
    start_member,
    status_of,
    stop,
    until_event,
    until_status,
    wait_ready,
)
from openai.types import Completion
from serving_checks import (
    NEAR_TIE,
    PROMPTS,
    check_concurrent_streams,
    unsplit_greedy,
    unsplit_logprobs,
    unsplit_margin_where_parted,
    unsplit_text,
)
from tiny_models import TINY_SHAPES, write_tiny_model, write_wide_model
from waiting import until

from kafila.contracts import FleetDevice
from kafila.network.pake import TrustError
from kafila.network.rendezvous_client import RendezvousClient, send_abort
from kafila.planner.cost import ChainPrefix
from kafila.planner.fleet import device_of
from kafila.planner.rebalance import REBALANCE_GAIN
from kafila.planner.types import ServingSpec
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.backends import backend_report
from kafila.runtime.llama.model import ContextSettings
from kafila.session.core import GUESS_BUDGET
from kafila.session.pricing import MIN_STEPS_TO_REBALANCE

PROMPT = "the quick brown fox"
# A prompt whose greedy answer has no near-tie, so that the session's, prefilled in other chunks
# than the unsplit model's, is that model's answer (docs/architecture.md, "Exactness").
COPY = (
    '<start_of_turn>user\nCopy this text: {"name": "kafila", "members": 3, "model": "gemma"}<end_of_turn>\n'
    "<start_of_turn>model\n"
)
COMMON = ("--context", "256", "--concurrency", "4", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")


@contextmanager
def session(
    tmp_path: Path,
    model: Path,
    members: int,
    *extra: str,
    outputs: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[Host, list[subprocess.Popen[str]]]]:
    """A host and its joiners; after the host has stopped, the joiners' outputs land in `outputs`,
    and on a failure in the test's stderr, beside the host's in the assertion."""
    joiners: list[subprocess.Popen[str]] = []
    failed = False
    try:
        args = ("--model", model, "--members", str(members), *COMMON, *extra)
        with running_host(*args, ready=False, env=env) as host:
            code, rendezvous = host.join_line()
            joiners += [
                start_member(code, rendezvous, f"member-{i}", tmp_path / f"cache-{i}", "--threads", "1")
                for i in range(members - 1)
            ]
            yield host, joiners
    except BaseException:
        failed = True
        raise
    finally:
        for joiner in joiners:
            text = stop(joiner)
            if outputs is not None:
                outputs.append(text)
            if failed:
                print(f"--- {' '.join(map(str, joiner.args[3:]))} said:\n{text}", file=sys.stderr)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("session") / "tiny.gguf", "llama", n_blocks=4)


def serves_like_one_process(client: openai.OpenAI, model: Path) -> None:
    """A greedy completion is the unsplit model's, and a streamed chat completion the whole one's."""
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text and result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    streamed = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content


def test_three_machines_serve_what_one_process_does(tmp_path: Path, model: Path) -> None:
    outputs: list[str] = []
    quiet = {"KAFILA_SESSION_IDLE_S": "1.5"}  # the embedded rendezvous ends idle sessions fast
    with session(tmp_path, model, 3, outputs=outputs, env=quiet) as (host, _joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny"]
        serves_like_one_process(client, model)
        for _round in range(3):  # streams ending while the idle engine refreshes its stage report
            check_concurrent_streams(client, "tiny", lambda prompt, n: unsplit_greedy(model, prompt, n))
            refreshed_status(host)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        assert len(status["members"]) == 3
        assert {m.get("path") for m in status["members"] if not m["host"]} == {"direct"}
        here = backend_report()  # every member runs on this machine: each says so in its hello
        assert all(m["backend"]["serving"] == here.serving for m in status["members"]), status["members"]
        assert all(m["backend"]["cpu_features"] == here.cpu_features for m in status["members"])
        assert all(0 < m["rtt_ms"] < 1000 for m in status["members"] if not m["host"])
        assert sum(b - a for a, b in (m["blocks"] for m in status["members"])) == 4
        assert [e["path"] for e in status["edges"]] == ["direct"] * 3  # host → m → m → host
        assert status["pipeline_waves"] == 1  # three members, one machine: overlapping stages would contend
        assert all(e["rtt_ms"] is not None and 0 < e["rtt_ms"] < 1000 for e in status["edges"])
        with urlopen(f"{host.base_url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        for member in status["members"]:  # measured, predicted and round trip, as /status has them
            first, end = member["blocks"]
            blocks = f'blocks="{first}-{end - 1}"'
            assert f"kafila_stage_ms_per_token{{{blocks}}}" in metrics, metrics
            assert f"kafila_stage_ms_per_token_alone{{{blocks}}}" in metrics, metrics
            assert f'kafila_stage_predicted_ms_per_token{{{blocks},member="{member["name"]}"}}' in metrics, metrics
            if not member["host"]:
                assert f'kafila_link_rtt_ms{{member="{member["name"]}",path="direct"}}' in metrics, metrics
        table = subprocess.run(
            [sys.executable, "-m", "kafila", "status", "--url", host.base_url], capture_output=True, text=True,
            timeout=60, check=True, env={**os.environ, "COLUMNS": "200"},
        ).stdout  # fmt: skip
        assert "ready" in table and "member-0" in table and "member-1" in table and "host (head)" in table
        assert "backend" in table and table.count(here.serving[0]) >= 3
        assert "Ring edges" in table and table.count("direct") >= 3
        # No relay and no signal for seconds: only the host's renewals keep the session at the
        # rendezvous, so that a member that blips can still rejoin it.
        _, rendezvous = host.join_line()
        with urlopen(f"http://{rendezvous}/v1/health", timeout=10) as response:
            assert json.loads(response.read())["sessions"] == 1
        # members started by hand on the host's machine: the host says how to set them up to share it
        assert "member-0, member-1 run on this machine too" in host.output() or (
            "member-1, member-0 run on this machine too" in host.output()
        ), host.output()
        assert "OMP_PROC_BIND=true for the host and for every `kafila join`" in host.output()
        alone = {tuple(s["range"]): s["ms_per_token_alone"] for s in status["stages"]}
        for member in status["members"]:  # each row shows its stage's time alone, as /status has it
            row = next(line for line in table.splitlines() if f" {member['name']} " in line)
            assert f"{alone[tuple(member['blocks'])]:.2f}" in row, (row, alone)
    assert len(outputs) == 2
    assert all("receiving stage" in out for out in outputs), outputs  # separate caches: the host sent each its file
    assert all("the session ended" in out for out in outputs), outputs


def test_a_mixture_of_experts_served_by_three_machines_is_what_one_process_serves(tmp_path: Path) -> None:
    """A tiny qwen3moe (8 experts, 2 a token) cut across three members: greedy completions, a
    streamed chat and concurrent streams are the unsplit model's, token for token."""
    moe = write_tiny_model(tmp_path / "tiny.gguf", "qwen3moe", n_blocks=6)
    with session(tmp_path, moe, 3) as (host, _joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        serves_like_one_process(client, moe)
        check_concurrent_streams(client, "tiny", lambda prompt, n: unsplit_greedy(moe, prompt, n))
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        held = [m["blocks"][1] - m["blocks"][0] for m in status["members"]]
        assert len(held) == 3 and all(n >= 1 for n in held) and sum(held) == 6, status


def test_gemma_through_three_members_reuses_a_chats_earlier_turn_and_answers_as_a_full_prefill(
    tmp_path: Path, gemma_path: Path
) -> None:
    """The real gemma-3-270m (sliding-window layers) across three members: a second turn that
    extends the first reuses the rows every stage kept, and its greedy answer is the unsplit
    model's for the whole prompt."""
    first = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"
    with session(tmp_path, gemma_path, 3) as (host, _joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        one = client.completions.create(model=model, prompt=first, max_tokens=12, temperature=0)
        second = f"{first}{one.choices[0].text}<end_of_turn>\n<start_of_turn>user\nAnd two more.<end_of_turn>\n"
        second += "<start_of_turn>model\n"
        two = client.completions.create(model=model, prompt=second, max_tokens=12, temperature=0)
        # Asked to write back a line it was shown, with n-gram drafts (the host's default): drafts
        # kept across the three members, and the greedy answer all the same. (How many a trip keeps
        # follows the window the cost rule grows from 2, by the trips and rows this run measured.)
        copy = client.completions.create(model=model, prompt=COPY, max_tokens=24, temperature=0)
        speculation = status_of(host)["speculation"]
    assert one.usage is not None and two.usage is not None and two.usage.prompt_tokens_details is not None
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens, two.usage
    assert two.choices[0].text == unsplit_greedy(gemma_path, second, 12)
    assert copy.choices[0].text == unsplit_greedy(gemma_path, COPY, 24)
    assert speculation["mode"] == "ngram" and speculation["off"] is None, speculation
    assert speculation["accepted_tokens"] > 0 and speculation["accepted_per_trip"] > 0, speculation


# The edit workload's first lines, and the tokens a greedy answer to them runs to: with a token
# and its drafts verified in one decode, the text parted from the unspeculated one at its ~40th
# token through three members (llama.cpp's product of several rows rounds otherwise than its
# product of one, and a near-tie went the other way).
EDIT_LINES, EDIT_TOKENS = 60, 64


def test_gemma_through_three_members_drafts_an_edit_and_answers_exactly_as_without_drafts(
    tmp_path: Path, gemma_path: Path
) -> None:
    """The real gemma-3-270m across three members, asked to write back bench_wan's file with a
    variable renamed, greedy: with n-gram drafts (19-23 of 64 tokens kept here), exactly the
    tokens the same session gives without them, since every stage decodes a greedy request's
    token and drafts one row a decode, as they go without drafts. (Not the unsplit model's: a
    prompt prefilled in other chunks may tip a near-tie the other way, drafts or none.)"""
    prompt = edit_prompt(EDIT_LINES)
    texts: dict[str, str] = {}
    for speculate in ("off", "ngram"):
        with session(tmp_path / speculate, gemma_path, 3, "--context", "2048", "--speculate", speculate) as (host, _):
            wait_ready(host)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            edit = client.completions.create(model=model, prompt=prompt, max_tokens=EDIT_TOKENS, temperature=0)
            texts[speculate] = edit.choices[0].text
            speculation = status_of(host)["speculation"]
    assert edit.usage is not None and edit.usage.completion_tokens == EDIT_TOKENS
    assert speculation["mode"] == "ngram" and speculation["accepted_tokens"] >= EDIT_TOKENS // 8, speculation
    assert texts["ngram"] == texts["off"]


def test_gemma_with_the_head_on_a_member_drafts_an_edit_with_log_probabilities_as_without_drafts(
    tmp_path: Path, gemma_path: Path
) -> None:
    """The real gemma-3-270m across three members, the host too small for the head: the head
    member answers a greedy request's drafted rows with each row's largest logits and, as the
    request asks for log probabilities, each row's log-sum-exp and top entries (a ROWS frame's
    trailer). With n-gram drafts, the same tokens, log probabilities and alternatives as the same
    session gives without them (one request at a time: rows decoded alone round alike)."""
    prompt = edit_prompt(EDIT_LINES)
    answers: dict[str, Any] = {}
    for speculate in ("off", "ngram"):
        extra = (*head_elsewhere(gemma_path), "--speculate", speculate)
        with session(tmp_path / speculate, gemma_path, 3, *extra) as (host, _):
            wait_ready(host, timeout=120)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            edit = client.completions.create(
                model=model, prompt=prompt, max_tokens=EDIT_TOKENS // 2, temperature=0, logprobs=3
            )
            answers[speculate] = edit.choices[0]
            status = status_of(host)
            host_name = next(m["name"] for m in status["members"] if m["host"])
            assert status["plan"]["head"] != host_name, status["plan"]
    speculation = status["speculation"]
    assert speculation["mode"] == "ngram" and speculation["accepted_tokens"] > 0, speculation
    off, ngram = answers["off"], answers["ngram"]
    assert ngram.text == off.text
    assert off.logprobs is not None and ngram.logprobs is not None
    assert ngram.logprobs.tokens == off.logprobs.tokens
    assert np.allclose(ngram.logprobs.token_logprobs or [], off.logprobs.token_logprobs or [], atol=1e-4)
    for drafted, alone in zip(ngram.logprobs.top_logprobs or [], off.logprobs.top_logprobs or [], strict=True):
        assert drafted.keys() == alone.keys(), (drafted, alone)
        assert np.allclose([drafted[t] for t in alone], list(alone.values()), atol=1e-4)


def test_only_the_planned_ring_edges_come_up_and_every_stage_loads(tmp_path: Path, model: Path) -> None:
    outputs: list[str] = []
    with session(tmp_path, model, 4, outputs=outputs) as (host, _joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        edges = status["edges"]
        assert len(edges) == 4 and all(e["path"] == "direct" for e in edges), edges
        assert [e["to"] for e in edges] == [e["from"] for e in edges[1:] + edges[:1]]  # a closed ring
        loaded = [int(a) for a in re.findall(r"loaded blocks (\d+)-\d+", host.output())]
    # Three members in a ring with the host: two edges between members, not the mesh's three,
    # each brought up by both of its ends; and each member's stage loaded once (all told at once:
    # tests/test_deploy_loads.py).
    assert sum(out.count("linked to ring neighbour") for out in outputs) == 4, outputs
    assert len(loaded) == 3 and len(set(loaded)) == 3, loaded


def udp_ports(pid: int) -> set[int]:
    """The UDP ports a process has bound (`ss`), for dropping one link's packets between two."""
    listing = subprocess.run(["ss", "-uanpH"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in listing.splitlines() if f"pid={pid}," in line}


@contextmanager
def dropped_between(ports_a: set[int], ports_b: set[int]) -> Iterator[None]:
    """Drop every UDP packet between two sets of local ports, both ways, with nftables."""
    table = f"kafila_test_{os.getpid()}"

    def drop(a: set[int], b: set[int]) -> str:
        return f"udp sport {{ {', '.join(map(str, a))} }} udp dport {{ {', '.join(map(str, b))} }} drop"

    chain = f"type filter hook output priority 0\n{drop(ports_a, ports_b)}\n{drop(ports_b, ports_a)}\n"
    rules = f"table inet {table} {{\nchain out {{\n{chain}}}\n}}\n"
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
    try:
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], check=False)


@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("nft", "ss")), reason="needs root, nft and ss"
)
def test_a_ring_link_that_breaks_between_members_is_rebuilt_through_the_relay(tmp_path: Path, model: Path) -> None:
    with session(tmp_path, model, 3) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        ports = [udp_ports(j.pid) for j in joiners]
        assert all(ports), ports
        epoch = status_of(host)["epoch"]
        with dropped_between(*ports):  # the two members' sockets: their direct edge, and only it
            until_status(host, serving_past(epoch), "a replan after the edge between the members broke", 60)
            assert said(host, "replanned with 3 members"), host.output()
            with urlopen(f"{host.base_url}/status", timeout=10) as response:
                edges = json.loads(response.read())["edges"]
            between = [e for e in edges if "member" in e["from"] and "member" in e["to"]]
            assert [e["path"] for e in between] == ["relayed"], edges
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)


def head_elsewhere(model: Path) -> tuple[str, ...]:
    """Host options that leave it room for any one block and its cache, but never with the head too."""
    from kafila.runtime.gguf.manifest import read_manifest

    manifest = read_manifest(model)
    context, concurrency = 2048, 4  # a cache of 1 MiB a block: what makes --memory's 1 MiB floor fit
    session = ServingSpec(context=context, concurrency=concurrency)
    prefix = ChainPrefix.of(manifest, session)
    lend = min(int(prefix.resident_matrix(True)[i, i + 1]) for i in range(manifest.n_blocks)) - 1
    return ("--context", str(context), "--concurrency", str(concurrency), "--memory", f"{lend}B")


def serve_with_a_member_model(
    tmp_path: Path, model: Path, member_model: Path, *host_args: str
) -> tuple[str, dict[str, Any]]:
    """A host and one member started with `--model member_model`; the session must serve the
    host's model exactly. Returns what the member printed, and the member's entry in /status."""
    with running_host("--model", model, "--members", "2", *COMMON, *host_args, ready=False) as host:
        code, rendezvous = host.join_line()
        member = start_member(code, rendezvous, "member", tmp_path / "cache", "--model", str(member_model))
        try:
            wait_ready(host)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
            said = until_status(
                host, lambda s: all("stage_source" in m for m in s["members"] if not m.get("host")), "stage sources"
            )
        finally:
            output = stop(member)
    return output, next(m for m in said["members"] if m["name"] == "member")


@pytest.mark.parametrize("role", ["blocks", "head"])
def test_a_member_with_the_same_model_slices_its_stage_and_receives_nothing(
    tmp_path: Path, model: Path, role: str
) -> None:
    own_copy = tmp_path / "copy.gguf"
    own_copy.write_bytes(model.read_bytes())
    extra = head_elsewhere(model) if role == "head" else ()
    output, status = serve_with_a_member_model(tmp_path, model, own_copy, *extra)
    assert "slicing blocks" in output and "receiving stage" not in output, output
    assert status["stage_source"] == "slice" and status["stage_bytes"] > 0, status  # cut from its own copy
    assert ("and the head" in output) == (role == "head"), output
    assert re.search(r"slicing blocks \d+-\d+ from copy\.gguf: done in \d", output), output  # no bar in a log


def test_a_member_with_another_model_file_receives_its_stage_and_says_why(tmp_path: Path, model: Path) -> None:
    other = write_tiny_model(tmp_path / "other.gguf", "llama", n_blocks=4, seed=99)  # same shape, other weights
    output, status = serve_with_a_member_model(tmp_path, model, other)
    assert status["stage_source"] == "host", status
    assert "receiving stage" in output and "other.gguf is not the host's model file" in output, output
    assert "slicing blocks" not in output, output
    assert re.search(r"stage \d+ from the host: done in \d", output), output  # no bar in a log: a line
    assert "hashing other.gguf (once): done in" in output, output


def test_a_member_that_leaves_a_three_member_ring_is_planned_around_at_the_prices_served(
    tmp_path: Path, model: Path
) -> None:
    """After serving, a member is killed. The replan prices the machines left by what their stages
    measured decoding one token at a time: each machine's cost function is scaled by measured /
    predicted, so its new stage is predicted at that scale times the generic probe's price."""
    from kafila.contracts import FleetDevice
    from kafila.runtime.gguf.manifest import read_manifest

    share_this_machines_probe(tmp_path, 3)  # cache-2 is the host's
    # A tiny model's stages take about 15 times what this machine's probe predicts, near the 20x
    # beyond which a measurement is taken for a stall (and /status's rounding of predictions of a
    # few hundredths of a millisecond to 3 decimals is then percents): the probe's overhead is set
    # where the predictions land within a few times the measurements.
    for i in range(3):
        probe = tmp_path / f"cache-{i}" / "probe.json"
        record = json.loads(probe.read_text())
        record["device"]["overhead_us"] = PLAUSIBLE_OVERHEAD_US
        probe.write_text(json.dumps(record))
    generic = FleetDevice.model_validate(json.loads((tmp_path / "cache-2" / "probe.json").read_text())["device"])
    device = device_of(generic)
    assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
    manifest = read_manifest(model)

    def generic_ms(blocks: list[int], head: bool) -> float:
        assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
        seconds = device.overhead_s + sum(manifest.block_bytes[blocks[0] : blocks[1]]) / device.bandwidth_bytes_per_s
        head_bandwidth = device.head_bandwidth_bytes_per_s or device.bandwidth_bytes_per_s
        return 1e3 * (seconds + (manifest.head_bytes / head_bandwidth if head else 0.0))

    env = {"KAFILA_CACHE": str(tmp_path / "cache-2")}
    with session(tmp_path, model, 3, "--name", "the-host", env=env) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(2):  # 30 single-token decodes on every stage
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        # every decode of both: the replan learns from the stages' reports then, and a status taken
        # after the first request alone would give another median
        before = until_status(host, every_stage_timed(30), "a stage report with those decodes")  # refreshed every 2 s
        measured = {tuple(s["range"]): s for s in before["stages"]}
        scale = {}
        for member in before["members"]:
            stage = measured[tuple(member["blocks"])]
            assert stage["steps_alone"] >= 16 and stage["ms_per_token_alone"] > 0, stage
            assert member["priced_on"] == "the generic probe", member
            scale[member["name"]] = stage["ms_per_token_alone"] / member["predicted_ms_per_token"]
        joiners[0].kill()
        until_status(host, serving_past(before["epoch"]), "a replan without the member killed", 60)
        assert said(host, "replanned with 2 members"), host.output()
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        assert status["epoch"] == 2 and len(status["plan"]["division"]) == 2
        assert "by what their stages measured serving" in host.output(), host.output()
        for member in status["members"]:
            if "blocks" not in member:
                continue
            assert member["priced_on"] == "serving", member
            head = member["name"] == status["plan"]["head"]
            expected = scale[member["name"]] * generic_ms(member["blocks"], head)
            assert member["predicted_ms_per_token"] == pytest.approx(expected, rel=0.02, abs=2e-3), (member, scale)


# It streams a 93 MB stage to member-0 at least twice: on loopback, with two CPU burners beside other
# tests (load 14-16), one took 71.5 s at 1.3 MB/s and the test ran past the default 300 s
@pytest.mark.timeout(900)
def test_a_member_slower_than_it_claimed_gives_blocks_back_once_its_stage_has_been_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """member-0 holds a pricing of the model that claims five times its real speed, so the plan gives
    it most of the blocks, and its stage is the ring's bottleneck. Once every stage has timed enough
    tokens, the host, at a moment without requests, plans again with prices that pass through the
    measured times, finds the slowest stage clearly faster divided more evenly, and moves blocks
    back; the new ring serves the same greedy text and is not divided again while its stages
    measure alike against what it predicted for them. (That `--no-rebalance`
    keeps the first division is the session core's rule: tests/test_session_core.py.)"""
    from kafila.contracts import ModelPricing
    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.machine.model_probe import price_model_here
    from kafila.runtime.machine.this_machine import save_model_pricing

    # 24 blocks: with 12, the head's fixed cost on the host left the best division (priced by what
    # the stages measured) about 20% faster than [11, 1], near the 25% a rebalance must gain
    model = write_wide_model(tmp_path / "tiny.gguf", n_blocks=24)
    digest = file_sha256(model)
    share_this_machines_probe(tmp_path, 2)  # cache-1 is the host's
    # The host's pricing of the model, measured here now, under the load the ring will serve under,
    # and member-0's five times as fast. Not the session's generic probe: measured once, at a
    # load average of 14-16 it read 240 ms a step's overhead (none, quieter), 100-250 times what
    # the stages then took serving, past the 20x by which serving reprices a machine
    # (SERVED_SCALE_LIMITS), so the host kept its price and the plan stood.
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache-1"))
    honest, _ = price_model_here(model, digest, 1 << 30, n_threads=1, served_blocks=12)
    # Five times: a stage measured more than SERVED_SCALE_LIMITS (20x) off its price does not
    # reprice its machine (6 times a quiet probe, served 3.5 times slower in CI, was past it), and
    # priced under the load it serves under, the load moves a stage's time less than that; three
    # left too little: at load 10-16 the host's pricing came out 2.4 times the member's against
    # what they served, and the even division was 24% faster, not the 25% a rebalance must gain
    boast = 5.0
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache-0"))
    save_model_pricing(
        ModelPricing(
            model_sha256=digest,
            bandwidth_gb_s=honest.bandwidth_gb_s * boast,
            head_bandwidth_gb_s=(honest.head_bandwidth_gb_s or honest.bandwidth_gb_s) * boast,
            overhead_us=honest.overhead_us / boast,
        )
    )
    env = {"KAFILA_CACHE": str(tmp_path / "cache-1"), "KAFILA_REBALANCE_COOLDOWN_S": "1"}
    with session(tmp_path, model, 2, "--name", "the-host", "--rebalance", env=env) as (host, _joiners):
        wait_ready(host)

        def status() -> dict[str, Any]:
            with urlopen(f"{host.base_url}/status", timeout=10) as response:
                return dict(json.loads(response.read()))

        def blocks(of: dict[str, Any]) -> dict[str, int]:
            return {m["name"]: m["blocks"][1] - m["blocks"][0] for m in of["members"] if "blocks" in m}

        first = status()
        assert blocks(first)["member-0"] >= 18, first
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        expected = unsplit_greedy(model, PROMPT, 24)
        timed_enough = every_stage_timed(MIN_STEPS_TO_REBALANCE)
        serve_until(host, client, expected, timed_enough, "every stage timing enough single-token decodes")
        until_status(host, rebalancing_past(first["epoch"]), "a rebalance judged worth it")
        # A request that comes during the replan waits for the new ring and is served by it.
        during = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        assert during.choices[0].text == expected
        after = until_status(host, serving_past(first["epoch"]), "serving on the rebalanced ring", 60)
        assert said(host, "replanned with 2 members"), host.output()
        assert after["epoch"] == first["epoch"] + 1, after
        assert blocks(after)["member-0"] < blocks(first)["member-0"], (first, after)
        assert all(m["priced_on"] == "serving" for m in after["members"] if "blocks" in m), after
        line = next(line for line in host.output().splitlines() if "measured serving: the slowest" in line)
        assert "worth it" in line, line
        # The new ring serves the same text, and once its own stages have timed enough, they keep it
        # while they measure what it was planned with; a stage the load slowed more than the others
        # (CI: the slowest measured 9.6 ms a token where 4.4 was planned) is news it may follow.
        divided_again = serving_past(after["epoch"])
        serve_until(
            host, client, expected, lambda s: timed_enough(s) or divided_again(s), "the new ring's stages timing enough"
        )
        reading = until_status(
            host, lambda s: s.get("rebalance") is not None or divided_again(s), "the new ring judged", 20
        )
        said_rebalancing = "rebalancing by what the stages measured serving:"
        if divided_again(reading) or reading["rebalance"]["reason"].endswith("worth it"):
            until(lambda: host.output().count(said_rebalancing) == 2, host.output, 10)
            second = [line for line in host.output().splitlines() if said_rebalancing in line][1]
            scales = re.search(r"\(each stage ([0-9.e+]+) to ([0-9.e+]+) times its planned time\)", second)
            assert scales is not None and float(scales[2]) / float(scales[1]) >= UNEVEN_ENOUGH, second
            again = until_status(host, divided_again, "serving on the ring divided again", 60)
            reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
            assert reply.choices[0].text == expected, again
            return
        assert reading["epoch"] == after["epoch"], reading
        assert host.output().count(said_rebalancing) == 1, host.output()
        table = subprocess.run(
            [sys.executable, "-m", "kafila", "status", "--url", host.base_url], capture_output=True, text=True,
            timeout=60, check=True, env={**os.environ, "COLUMNS": "200"},
        ).stdout  # fmt: skip
        assert "rebalance: the " in table, table


# How unevenly a ring's stages must measure against what its plan predicted before its division
# can be worth changing: where each stage's measured time is its prediction times s, and every s is
# within 1 / (1 - REBALANCE_GAIN) of every other, no division priced by those measurements beats the
# slowest measured by the gain (test_rebalance.py holds it over random fleets). Less a tenth, as a
# session's plan also weighs round trips, which do not scale with the stages.
UNEVEN_ENOUGH = 0.9 / (1 - REBALANCE_GAIN)


def an_honest_member_then_forms_the_session(
    host: Host, code: str, rendezvous: str, tmp_path: Path, model: Path
) -> None:
    """A member with the right code joins, the session forms, and it serves what one process does."""
    member = start_member(code, rendezvous, "member", tmp_path / "cache-0", "--threads", "1")
    try:
        wait_ready(host, timeout=90)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        assert result.choices[0].text == unsplit_greedy(model, PROMPT, 6)
    except BaseException:
        print("member:", stop(member))
        raise
    finally:
        stop(member)


def test_a_wrong_session_code_is_refused_and_the_same_code_then_forms_the_session(tmp_path: Path, model: Path) -> None:
    with running_host("--model", model, "--members", "2", *COMMON, ready=False) as host:
        code, rendezvous = host.join_line()
        address, port = rendezvous.rsplit(":", 1)
        if address != "127.0.0.1":  # the embedded rendezvous listens on the address it announces, and no other
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        channel, secret = "-".join(code.split("-")[:3]), code.split("-")[3:]
        wrong = f"{channel}-{'-'.join([*secret[:-1], 'zebra' if secret[-1] != 'zebra' else 'tiger'])}"
        intruder = start_member(wrong, rendezvous, "intruder", tmp_path / "cache-x")
        output = intruder.communicate(timeout=90)[0]
        assert intruder.returncode == 1
        assert "code" in output.lower() and "Traceback" not in output
        assert "refused intruder" in host.output() and status_of(host)["admitting"] is True  # the code lives on
        an_honest_member_then_forms_the_session(host, code, rendezvous, tmp_path, model)


def test_joiners_that_send_garbage_abort_go_silent_or_leave_the_last_seat_leave_the_seat_open(
    tmp_path: Path, model: Path
) -> None:
    """Anyone who reads the code's public words can join: garbage, an abort, silence, or taking
    the last seat and leaving at once each cost that joiner its seat, not the session its code
    or the host its life. An honest member then joins with the same code and the ring serves."""
    env = {"KAFILA_TRUST_EXCHANGE_S": "2"}  # silence is found out in 2 s, not 30
    with running_host("--model", model, "--members", "2", *COMMON, ready=False, env=env) as host:
        code, rendezvous = host.join_line()
        url = f"ws://{rendezvous}/v1/session"

        async def attacks() -> None:
            async def joiner(name: str) -> RendezvousClient:
                device = FleetDevice(name=name, memory_gib=8)
                client = await RendezvousClient.join(url, code, capability=device, fingerprint="ab" * 32)
                await client.wait_ready(10)
                return client

            garbler = await joiner("garbler")
            await garbler.send_signal(garbler.host_id, "not a trust message at all")
            assert await garbler.wait_closed(20) is None  # sent away: removed at the rendezvous
            aborter = await joiner("aborter")
            await send_abort(aborter, [aborter.host_id], TrustError("changed my mind"))
            assert await aborter.wait_closed(20) is None
            silent = await joiner("silent")
            assert await silent.wait_closed(20) is None
            leaver = await joiner("leaver")
            await leaver.leave()

        asyncio.run(asyncio.wait_for(attacks(), 90))
        status = until_status(host, lambda status: "leaver" not in str(status.get("members")), "the last seat free")
        assert status["admitting"] is True and host.process.poll() is None
        for name in ("garbler", "aborter", "silent"):
            assert f"refused {name}" in host.output(), host.output()
        an_honest_member_then_forms_the_session(host, code, rendezvous, tmp_path, model)


def test_a_model_too_big_for_the_members_is_refused_naming_the_device(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "deep.gguf", "llama", n_blocks=8)  # 64 M tokens of its KV: about 68 GB
    outputs: list[str] = []
    with session(tmp_path, model, 2, "--context", "1048576", "--concurrency", "64", outputs=outputs) as (host, _):
        host.process.wait(timeout=120)
        assert host.process.returncode == 1
        assert "cannot hold" in host.output() and "short by" in host.output()
    assert "the session ended" in outputs[0] and "cannot hold" in outputs[0]


def test_a_member_lending_too_little_memory_is_refused_by_name(tmp_path: Path, model: Path) -> None:
    """`kafila join --memory` caps what a member offers; the plan that needs more from it is refused
    before anything loads, naming that member, and every member hears why."""
    outputs: list[str] = []
    with running_host("--model", model, "--members", "2", *COMMON, "--context", "65536", ready=False) as host:
        code, rendezvous = host.join_line()
        member = start_member(code, rendezvous, "frugal", tmp_path / "cache", "--threads", "1", "--memory", "16MiB")
        try:
            host.process.wait(timeout=120)
        finally:
            outputs.append(stop(member))
        assert host.process.returncode == 1
        assert "'frugal' cannot hold" in host.output(), host.output()
    assert "cannot hold" in outputs[0] and "receiving stage" not in outputs[0], outputs[0]


@pytest.mark.parametrize("bad", ["lots", "-5G", "512"])
def test_kafila_join_refuses_a_memory_that_is_no_size(bad: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "join", "7-crimson-harbor-lemon-tiger-orbit-cactus",
         "--rendezvous", "127.0.0.1:9", "--memory", bad], check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "--memory" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_member_that_cannot_take_its_stage_is_left_out_and_the_rest_serve(tmp_path: Path, model: Path) -> None:
    """One member's stage cache is a file, not a folder, so no stage file can land there: it
    reports failure, the host sends it home saying why and plans again with the other member."""
    broken = tmp_path / "broken-cache"
    broken.mkdir()
    (broken / "stages").write_text("not a folder")
    members: list[subprocess.Popen[str]] = []
    try:
        with running_host("--model", model, "--members", "3", *COMMON, ready=False) as host:
            code, rendezvous = host.join_line()
            members.append(start_member(code, rendezvous, "good", tmp_path / "cache", "--threads", "1"))
            members.append(start_member(code, rendezvous, "unlucky", broken, "--threads", "1"))
            wait_ready(host, timeout=120)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
            with urlopen(f"{host.base_url}/status", timeout=10) as response:
                chain = [m["name"] for m in json.loads(response.read())["members"] if "blocks" in m]
            assert "good" in chain and "unlucky" not in chain, chain
            members[1].wait(timeout=30)  # sent home
            sent_home = until_event(host, "left", "unlucky was sent home")  # on the web page's timeline too
            assert "the host left this member out" in sent_home["detail"], sent_home
    finally:
        outputs = [stop(member) for member in members]
    assert "the host left this member out" in outputs[1], outputs[1]
    assert "the session ended" in outputs[0], outputs[0]


def test_a_joiner_stopped_with_ctrl_c_leaves_without_a_traceback(tmp_path: Path, model: Path) -> None:
    with running_host("--model", model, "--members", "2", *COMMON, ready=False) as host:
        code, rendezvous = host.join_line()
        member = start_member(code, rendezvous, "member", tmp_path / "cache", "--threads", "1")
        try:
            wait_ready(host)
        finally:
            output = stop(member)
    assert "left the session" in output and "Traceback" not in output, output


PLAUSIBLE_OVERHEAD_US = 150.0  # a tiny model's stage decodes in a few tenths of a millisecond here


def share_this_machines_probe(tmp_path: Path, members: int) -> None:
    """Give each member of `session` the host's own probe of this machine, as members on identical
    hardware would measure: otherwise each measures itself while the others do, and their noisy
    numbers, not the layout a test means, decide the division. (start_member seeds its own.)"""
    for i in range(members):
        seeded_cache(tmp_path / f"cache-{i}")


def test_machines_that_priced_the_model_are_planned_with_their_own_numbers(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine that ran `kafila probe --model` on the model served keeps that pricing; as a
    member it reports it in `hello`, and the plan prices its stage with it. Each stage's
    predicted time is then the cost model's c = o + bytes / b (+ head bytes / b_head) with that
    machine's numbers: member-0's and member-1's own, the host's from the generic probe, since it
    priced another model only. (A host that priced this model prices members without their own by
    it: test_first_plan_pricing.py.)"""
    from kafila.contracts import FleetDevice, ModelPricing
    from kafila.runtime.gguf.manifest import read_manifest
    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.machine.this_machine import save_model_pricing

    share_this_machines_probe(tmp_path, 3)  # cache-2 is the host's
    digest = file_sha256(model)
    other_model = "0" * 64  # a pricing of another model, which must not be taken for this one's
    priced = {
        "cache-1": ModelPricing(model_sha256=digest, bandwidth_gb_s=2.5, head_bandwidth_gb_s=5.0, overhead_us=900.0),
        "cache-0": ModelPricing(model_sha256=digest, bandwidth_gb_s=1.5, head_bandwidth_gb_s=3.0, overhead_us=700.0),
        "cache-2": ModelPricing(model_sha256=other_model, bandwidth_gb_s=9.0, head_bandwidth_gb_s=9.0, overhead_us=1.0),
    }
    for cache, pricing in priced.items():
        monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / cache))
        save_model_pricing(pricing)
    generic = FleetDevice.model_validate(json.loads((tmp_path / "cache-2" / "probe.json").read_text())["device"])
    manifest = read_manifest(model)
    env = {"KAFILA_CACHE": str(tmp_path / "cache-2")}
    with session(tmp_path, model, 3, "--name", "the-host", env=env) as (host, _joiners):
        wait_ready(host)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        numbers = {"member-1": priced["cache-1"], "member-0": priced["cache-0"]}
        for member in status["members"]:
            first, end = member["blocks"]
            pricing = numbers.get(member["name"])
            device = device_of(generic.priced(pricing))
            assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
            head = manifest.head_bytes / (device.head_bandwidth_bytes_per_s or device.bandwidth_bytes_per_s)
            expected = device.overhead_s + sum(manifest.block_bytes[first:end]) / device.bandwidth_bytes_per_s
            expected += head if member["name"] == status["plan"]["head"] else 0.0
            assert member["predicted_ms_per_token"] == pytest.approx(expected * 1e3, abs=2e-3), (member, status)
            assert member["priced_on"] == ("the model" if pricing is not None else "the generic probe"), member
        own_then_generic = (
            r"priced on this model's own stages for member-[01], member-[01]; from the generic probe for the-host"
        )
        assert re.search(own_then_generic, host.output()), host.output()  # the members in the order they joined
        # The planner's own time in milliseconds: a few for four blocks (it once printed a thousand times that).
        planned_ms = float(re.findall(r"planned in ([0-9.]+) ms", host.output())[0])
        assert 0 < planned_ms < 500, host.output()
        table = subprocess.run(
            [sys.executable, "-m", "kafila", "status", "--url", host.base_url], capture_output=True, text=True,
            timeout=60, check=True, env={**os.environ, "COLUMNS": "200"},
        ).stdout  # fmt: skip
        starred = [
            line.split("│")[1].strip() for line in table.splitlines() if line.rstrip().endswith("│") and " * " in line
        ]
        assert starred == ["the-host"], table
        assert "* predicted from the generic probe" in table, table


def test_a_host_too_small_for_the_head_serves_with_the_head_on_a_member(tmp_path: Path) -> None:
    """`--memory` on the host leaves room for a block and its cache but not for the head as well:
    the plan puts the head on a member, which answers each step with logits; the host embeds,
    serves its own blocks as a plain stage and samples. Output is the unsplit model's, and when
    the head member leaves, the head moves to the member that is left.

    Six blocks of sizes S M L S M L make the host's stage fall in the middle of the first ring
    (it takes one S or M block; both rotations that keep the head off it tie, and the first is
    kept: the three machines share one probe), and at block 0 of the second, so both ways of
    feeding it are exercised."""
    (tmp_path / "six").mkdir()
    model = write_tiny_model(tmp_path / "six" / "tiny.gguf", "llama", n_blocks=6)
    share_this_machines_probe(tmp_path, 2)
    outputs: list[str] = []
    with session(tmp_path, model, 3, *head_elsewhere(model), outputs=outputs) as (host, joiners):
        wait_ready(host, timeout=120)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        serves_like_one_process(client, model)
        check_concurrent_streams(client, "tiny", lambda prompt, n: unsplit_greedy(model, prompt, n))
        # OpenAI's default sampling (top_p 1, no top-k) needs the whole row: the head samples it
        # itself, with the request's seed, and draws what the host's sampler would have.
        sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=11)
        drawn = unsplit_text(model, PROMPT, 12, SamplingSettings(temperature=0.9, top_k=0, top_p=1.0, seed=11))
        assert sampled.choices[0].text == drawn != unsplit_greedy(model, PROMPT, 12)
        # Its log probabilities too: the head sends the row's log-sum-exp and top entries with the token.
        asked = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=11, logprobs=3
        ).choices[0]
        assert asked.text == drawn and asked.logprobs is not None and asked.logprobs.token_logprobs is not None
        expected = unsplit_logprobs(model, PROMPT, 12, SamplingSettings(temperature=0.9, top_k=0, top_p=1.0, seed=11))
        assert np.allclose(asked.logprobs.token_logprobs, expected, atol=2e-3)
        tops = asked.logprobs.top_logprobs or []
        assert len(tops) == len(expected) and all(list(t.values()) == sorted(t.values(), reverse=True) for t in tops)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        host_entry = next(m for m in status["members"] if m["host"])
        head = status["plan"]["head"]
        assert head != host_entry["name"] and head.startswith("member-"), status["plan"]
        assert 0 < host_entry["blocks"][0] < host_entry["blocks"][1] < 6, status  # fed by a member, feeding one
        hops = [(e["from"], e["to"]) for e in status["edges"]]
        assert (head, host_entry["name"]) in hops and len(hops) >= 3, hops  # the logits come back to the host
        assert [b for _a, b in hops] == [a for a, _b in hops[1:] + hops[:1]], hops  # a closed ring
        assert all(e["path"] == "direct" for e in status["edges"]), status["edges"]
        assert sorted(tuple(s["range"]) for s in status["stages"]) == sorted(
            tuple(m["blocks"]) for m in status["members"]
        )  # every stage reports, the host's and the head's among them
        assert f"the head on {head}" in host.output()
        table = subprocess.run(
            [sys.executable, "-m", "kafila", "status", "--url", host.base_url], capture_output=True, text=True,
            timeout=60, check=True, env={**os.environ, "COLUMNS": "200"},
        ).stdout  # fmt: skip
        assert "member (head)" in table and "host (head)" not in table, table
        heads = [j for j, name in zip(joiners, ("member-0", "member-1"), strict=True) if name == head]
        heads[0].kill()
        until_status(host, serving_past(status["epoch"]), "a replan without the head's member", 90)
        assert said(host, "replanned with 2 members"), host.output()
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
        sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=11)
        assert sampled.choices[0].text == drawn  # the new head samples it, as the first did
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        assert status["plan"]["head"] != head and status["plan"]["head"].startswith("member-"), status
        assert next(m for m in status["members"] if m["host"])["blocks"][0] == 0, status  # fed by its own engine
    assert any("and the head" in out for out in outputs), outputs


def test_a_host_that_holds_no_block_embeds_samples_and_serves_while_members_hold_the_model(tmp_path: Path) -> None:
    """`--memory 1MiB` with a cache of 2 MiB a block: the host cannot hold any block, so it takes no
    stage; the members hold every block and the head, and the host only embeds, samples and
    serves. The ring runs host → member → member → host."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    extra = ("--context", "4096", "--concurrency", "4", "--memory", "1MiB")  # 128 B a token a block: 2 MiB each
    with session(tmp_path, model, 3, *extra) as (host, _joiners):
        wait_ready(host, timeout=120)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        serves_like_one_process(client, model)
        with urlopen(f"{host.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
        host_entry = next(m for m in status["members"] if m["host"])
        assert "blocks" not in host_entry and status["plan"]["head"].startswith("member-"), status
        spans = sorted(tuple(m["blocks"]) for m in status["members"] if "blocks" in m)  # as the probes divide them
        assert len(spans) == 2 and spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == 4, status
        hops = [(e["from"], e["to"]) for e in status["edges"]]
        assert len(hops) == 3 and [b for _a, b in hops] == [a for a, _b in hops[1:] + hops[:1]], hops  # closed
        assert (status["plan"]["head"], host_entry["name"]) in hops, hops  # the head answers the host
        assert "holds no stage" in host.output()


def rebalancing_past(epoch: int) -> Callable[[dict[str, Any]], bool]:
    """A rebalance judged worth it is under way, or already done."""

    def judged(status: dict[str, Any]) -> bool:
        verdict = status.get("rebalance") or {}
        return str(verdict.get("reason", "")).endswith("worth it") or serving_past(epoch)(status)

    return judged


def every_stage_timed(steps: int) -> Callable[[dict[str, Any]], bool]:
    """Every stage of the plan has reported at least `steps` single-token decodes."""

    def timed(status: dict[str, Any]) -> bool:
        reported = {tuple(s["range"]): s["steps_alone"] for s in status.get("stages", [])}
        planned = [tuple(m["blocks"]) for m in status.get("members", []) if "blocks" in m]
        return bool(planned) and all(reported.get(blocks, 0) >= steps for blocks in planned)

    return timed


def serve_until(
    host: Host, client: openai.OpenAI, expected: str, condition: Callable[[dict[str, Any]], bool], what: str
) -> None:
    """Greedy completions of PROMPT, each the unsplit model's text, until the host's /status shows
    `condition`: how many single-token decodes a request gives the stages varies with how many of
    its steps carried n-gram drafts (those are not single-token decodes)."""
    for _ in range(12):
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        assert reply.choices[0].text == expected
        try:
            until_status(host, condition, what, timeout=2.5)  # the stage report refreshes every 2 s
            return
        except AssertionError:
            continue
    until_status(host, condition, what, timeout=1)


def took_in(name: str, epoch: int) -> Callable[[dict[str, Any]], bool]:
    """Serving on a plan newer than `epoch` in which the member `name` holds blocks."""

    def in_ring(status: dict[str, Any]) -> bool:
        holding = [m for m in status.get("members", []) if m.get("name") == name and "blocks" in m]
        return serving_past(epoch)(status) and bool(holding)

    return in_ring


def holding_for(name: str) -> Callable[[dict[str, Any]], bool]:
    """New requests held (not ready, not failed) for a replan taking in `name`."""
    return lambda status: not status["ready"] and any(f"taking in {name}" in w for w in status["waiting_for"])


PATIENT = {"KAFILA_NEWCOMER_PATIENCE_S": "1"}  # newcomers wait 1 s for a moment without requests


def lose_a_member(host: Host, joiners: list[subprocess.Popen[str]]) -> openai.OpenAI:
    """Kill the second member; once the host serves again with the rest, a client for it."""
    epoch = until_status(host, serving_past(0), "serving", READY_TIMEOUT_S)["epoch"]  # forming, as wait_ready allows
    joiners[1].kill()
    until_status(host, serving_past(epoch), "a replan without the member killed")
    return openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@dataclass
class Load:
    finished: list[tuple[str, str | None]] = field(default_factory=list)  # text, finish reason
    turned_away: list[int] = field(default_factory=list)  # status codes of refused requests
    broken: list[BaseException] = field(default_factory=list)  # streams that started and failed


@contextmanager
def steady_load(client: openai.OpenAI, max_tokens: int, users: int = 2) -> Iterator[Load]:
    """`users` clients streaming completions back to back, without a pause, until the block ends.
    Their answers differ in length (the i-th `max_tokens + 20 i`), so that they do not all end in
    the same step and leave the host idle between one request and the next."""
    load, done = Load(), threading.Event()

    def user(index: int) -> None:
        while not done.is_set():
            try:
                stream = client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=max_tokens + 20 * index, temperature=0, stream=True
                )
            except openai.APIStatusError as refused:
                load.turned_away.append(refused.status_code)
                time.sleep(0.05)
                continue
            try:
                chunks = [c.choices[0] for c in stream if c.choices]
                load.finished.append(("".join(c.text for c in chunks), chunks[-1].finish_reason))
            except BaseException as error:  # reported by the test, not lost in the thread
                load.broken.append(error)

    threads = [threading.Thread(target=user, args=(index,)) for index in range(users)]
    for thread in threads:
        thread.start()
    try:
        yield load
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=300)


def take_in(
    host: Host,
    client: openai.OpenAI,
    model: Path,
    joiners: list[subprocess.Popen[str]],
    name: str,
    cache: Path,
    members: int,
) -> dict[str, Any]:
    """`kafila join` with the host's code as `name`; once the host has replanned to take it in,
    the ring serves what one process does. Returns the host's /status."""
    code, rendezvous = host.join_line()
    epoch = status_of(host).get("epoch") or 0  # none while serving alone
    joiners.append(start_member(code, rendezvous, name, cache, "--threads", "1"))
    until_status(host, took_in(name, epoch), f"a ring that takes in {name}")
    assert said(host, f"replanned with {members} members, taking in {name}"), host.output()
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    return status_of(host)


def test_a_member_that_left_can_be_replaced_and_a_wrong_code_then_closes_the_session(
    tmp_path: Path, model: Path
) -> None:
    """A member dies and the host replans with two; `kafila join` again with the same code takes
    the free seat: the host verifies it, links it, and at a moment without requests replans with
    three, serving what one process does. Newcomers with a wrong secret are refused, and after
    the guess budget's worth of them the session admits no one, not even with the right code."""
    outputs: list[str] = []
    with session(tmp_path, model, 3, outputs=outputs) as (host, joiners):
        client = lose_a_member(host, joiners)
        # The same machine comes back (its name, its cache): a newcomer to the rendezvous and the host.
        status = take_in(host, client, model, joiners, "member-1", tmp_path / "cache-1", 3)
        code, rendezvous = host.join_line()
        serving = {m["name"] for m in status["members"] if "blocks" in m}
        assert serving == {status["plan"]["ring"][0], "member-0", "member-1"}, status  # named plainly again
        (gone,) = [m["name"] for m in status["members"] if m.get("left")]  # its old self, told apart by id
        assert re.fullmatch(r"member-1 \(m\d\)", gone), status
        assert sum(b - a for a, b in (m["blocks"] for m in status["members"] if "blocks" in m)) == 4
        assert "a seat is free again; to fill it: kafila join " in host.output()

        joiners[0].kill()  # a seat for a guesser
        until_status(host, serving_past(status["epoch"]), "a replan without member-0")
        for number in range(GUESS_BUDGET):  # one wrong secret, or two, close nothing; the budget's last does
            assert status_of(host)["admitting"] is True
            guess = code.rsplit("-", 1)[0] + ("-zebra" if not code.endswith("-zebra") else "-tiger")
            cache = tmp_path / f"cache-guess-{number}"
            guesser = start_member(guess, rendezvous, f"guesser-{number}", cache, "--threads", "1")
            assert guesser.wait(timeout=60) != 0
        until_status(host, lambda status: status.get("admitting") is False, "a session that admits no one")
        assert said(host, "this session admits no more members"), host.output()
        late = start_member(code, rendezvous, "late", tmp_path / "cache-late", "--threads", "1")
        assert late.wait(timeout=60) != 0
        refused = stop(late)
        assert "admits no more members" in refused, refused
        assert "taking in late" not in host.output()
        again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert again.choices[0].text == unsplit_greedy(model, PROMPT, 12)
        assert "did not admit guesser" in host.output() and "Traceback" not in host.output()


def test_a_host_serving_alone_takes_a_newcomer_back_into_a_ring(tmp_path: Path, model: Path) -> None:
    """Its only member gone, the host serves alone; a newcomer with the code makes it a ring again,
    and /status describes the ring, not the machine alone."""
    with session(tmp_path, model, 2) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        joiners[0].kill()
        until_status(host, serving_alone, "serving alone")
        assert said(host, "serving on this machine alone"), host.output()
        status = take_in(host, client, model, joiners, "newcomer", tmp_path / "cache-new", 2)
        assert [m["name"] for m in status["members"] if "blocks" in m and not m["host"]] == ["newcomer"], status
        assert status["plan"] is not None and len(status["edges"]) == 2, status


def test_under_steady_load_a_newcomer_waits_for_the_running_requests_not_for_silence(
    tmp_path: Path, model: Path
) -> None:
    """Two clients keep the host busy without a pause. After the patience (here 1 s) the host holds
    new requests back, lets those running finish, and replans with the newcomer; the held requests
    then run on the new ring. No request is turned away, every stream ends whole, and the ring
    then serves what one process does."""
    with session(tmp_path, model, 3, env=PATIENT) as (host, joiners):
        client = lose_a_member(host, joiners)
        code, rendezvous = host.join_line()
        with steady_load(client, max_tokens=200) as load:
            until_status(host, lambda status: status["running"] >= 1, "the load running")
            epoch = status_of(host)["epoch"]
            joiners.append(start_member(code, rendezvous, "newcomer", tmp_path / "cache-new", "--threads", "1"))
            until_status(host, took_in("newcomer", epoch), "a ring that takes in the newcomer")
        assert said(host, "replanned with 3 members, taking in newcomer"), host.output()
        assert "new ones wait for the replan taking in newcomer" in host.output()
        assert not load.broken, load.broken
        start = unsplit_greedy(model, PROMPT, 3)  # whole: to their length, each as the model begins it
        assert load.finished and all(t.startswith(start) and why == "length" for t, why in load.finished), load
        assert not load.turned_away, load.turned_away
        with urlopen(f"{host.base_url}/metrics", timeout=10) as response:
            held = [line for line in response.read().decode().splitlines() if line.startswith("kafila_requests_held_")]
        assert held and float(held[0].split()[1]) >= 1, held
        wait_ready(host, timeout=60)
        again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert again.choices[0].text == unsplit_greedy(model, PROMPT, 12)


def test_a_member_that_slept_joins_again_by_itself_and_a_lost_host_ends_it(tmp_path: Path, model: Path) -> None:
    """A member stopped for longer than the links' idle bound (a laptop that slept): the host
    replans without it. Woken, it finds its host link gone, joins again with the same code, and
    the host takes it back. When the host itself is killed, the member's join again fails, and it
    exits saying why."""
    with session(tmp_path, model, 3) as (host, joiners):
        epoch = until_status(host, serving_past(0), "serving")["epoch"]
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        sleeper = joiners[1]
        sleeper.send_signal(signal.SIGSTOP)
        try:
            epoch = until_status(host, serving_past(epoch), "a replan without the member asleep")["epoch"]
        finally:
            sleeper.send_signal(signal.SIGCONT)
        until_status(host, took_in("member-1", epoch), "a ring that takes the member back")
        assert said(host, "replanned with 2 members"), host.output()
        assert said(host, "replanned with 3 members, taking in member-1"), host.output()
        result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
        host.process.kill()
        assert sleeper.wait(timeout=60) != 0
        output = stop(sleeper)
        assert "lost the host" in output and "joining the session again" in output, output
        assert "Traceback" not in output, output


def test_a_newcomer_that_goes_while_requests_are_held_leaves_the_ring_serving(tmp_path: Path, model: Path) -> None:
    """Steady load holds new requests back for a newcomer (patience 1 s); the newcomer is killed
    before the running requests end: the host serves on with the ring it has, without a replan."""
    with session(tmp_path, model, 3, "--context", "2048", "--concurrency", "2", env=PATIENT) as (host, joiners):
        client = lose_a_member(host, joiners)
        code, rendezvous = host.join_line()
        with steady_load(client, max_tokens=1500) as load:  # the requests running at the hold outlast the kill
            until_status(host, lambda status: status["running"] >= 1, "the load running")
            newcomer = start_member(code, rendezvous, "newcomer", tmp_path / "cache-new", "--threads", "1")
            joiners.append(newcomer)
            until_status(host, holding_for("newcomer"), "requests held for the newcomer")
            assert "new ones wait for the replan taking in newcomer" in host.output()
            epoch = status_of(host)["epoch"]
            newcomer.kill()
            until_status(host, lambda status: status["ready"], "serving again without the newcomer")
            assert status_of(host)["epoch"] == epoch  # no replan
            assert said(host, "the newcomers left before the replan"), host.output()
        assert not load.broken, load.broken
        assert "replanned with 3 members" not in host.output()
        wait_ready(host, timeout=10)
        again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert again.choices[0].text == unsplit_greedy(model, PROMPT, 12)


def test_a_host_that_cannot_serve_alone_waits_for_members_to_join_again(tmp_path: Path) -> None:
    """The host lends too little memory for any block (`--memory 1MiB`); its only member dies under
    a stream, so nothing can serve: the stream, paused for a new ring, ends with an error within
    5 s of the host knowing there is none; the host says why, and that it waits for members, and
    a newcomer with the code makes it serve again."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    extra = ("--context", "4096", "--concurrency", "4", "--memory", "1MiB")  # 128 B a token a block: 2 MiB each
    with session(tmp_path, model, 2, *extra) as (host, joiners):
        wait_ready(host, timeout=120)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        greedy = {"max_tokens": 400, "temperature": 0}  # a sampler the host keeps: it waits for a new ring
        stream = iter(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **greedy))
        next(stream)
        joiners[0].send_signal(signal.SIGSTOP)  # surely mid-answer when it dies
        joiners[0].kill()
        until_status(host, lambda status: "cannot hold" in (status.get("error") or ""), "a host that cannot serve")
        knew = time.monotonic()
        with pytest.raises(openai.APIError, match="cannot hold"):
            for _chunk in stream:
                pass
        assert time.monotonic() - knew < 5.0
        assert said(host, "waiting for members to join again: kafila join "), host.output()
        with pytest.raises(HTTPError) as unready:  # 503 while nothing serves, saying why
            urlopen(f"{host.base_url}/health", timeout=10)
        assert unready.value.code == 503 and "cannot hold" in unready.value.read().decode()
        take_in(host, client, model, joiners, "newcomer", tmp_path / "cache-new", 2)


def test_a_member_killed_mid_stream_pauses_the_stream_and_it_ends_as_an_unbroken_one_would(
    tmp_path: Path, model: Path
) -> None:
    """A greedy stream on a ring of three: a member dies after the first chunks. The stream pauses
    while the host replans around it, then goes on where it stopped on the new ring, ending in
    the text an unbroken run gives. On that ring, a seeded stream loses the last member after its
    first chunks: the host, serving alone now, goes on with the same sampler, to the text its
    seed gives unbroken."""
    with session(tmp_path, model, 3) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        stream = iter(
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=120, temperature=0, stream=True)
        )
        text = "".join(next(stream).choices[0].text for _ in range(3))
        first, last = joiners
        first.send_signal(signal.SIGSTOP)  # the ring stops mid-answer, then loses the member
        first.kill()
        text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == unsplit_greedy(model, PROMPT, 120)
        assert said(host, "the broken ring left go on on this one"), host.output()

        until_status(host, lambda status: status["ready"] and len(blocks_held(status)) == 2, "serving on two")
        seeded = {"temperature": 0.8, "seed": 7, "max_tokens": 120}
        stream = iter(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **seeded))
        text = "".join(next(stream).choices[0].text for _ in range(3))
        last.send_signal(signal.SIGSTOP)
        last.kill()
        text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        settings = SamplingSettings(temperature=0.8, top_p=1.0, top_k=0, seed=7)
        assert text == unsplit_text(model, PROMPT, 120, settings)
        assert said(host, "serving on this machine alone"), host.output()


@pytest.fixture(scope="session")
def looping_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose greedy text keeps falling into repeats that n-gram drafts catch, and
    leaving them (a tied output and a large embedding: the current token's logit often wins), so
    that trips keep drafts and have others cut."""
    shape = replace(TINY_SHAPES["llama"], embd_std=3.0, tied_output=True)
    return write_tiny_model(tmp_path_factory.mktemp("looping") / "looping.gguf", "llama", n_blocks=4, shape=shape)


def test_a_text_parted_from_the_unsplit_one_is_found_with_the_margin_where_it_parts(looping_model: Path) -> None:
    """The check the member-loss test below leans on: the unsplit text itself does not part; one
    whose tenth token is another parts there, at that row's margin, which is no near-tie here."""
    reference = unsplit_greedy(looping_model, PROMPT, 30)
    assert unsplit_margin_where_parted(looping_model, PROMPT, reference) is None
    assert unsplit_margin_where_parted(looping_model, PROMPT, reference[:-3]) is None  # a stream cut short
    engine = open_engine(looping_model, [4], ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1))
    try:
        prompt = engine.tokenize(PROMPT)
        row, tokens = engine.step(0, 0, prompt, decode=False), []
        while len(tokens) < 9:
            tokens.append(int(np.argmax(row)))
            row = engine.step(0, len(prompt) + len(tokens) - 1, tokens[-1:], decode=True)
        other = engine.detokenize([*tokens, int(np.argsort(row)[-2])])  # the tenth: the runner-up
    finally:
        engine.close()
    margin = unsplit_margin_where_parted(looping_model, PROMPT, other + "zz")
    assert margin is not None and margin > NEAR_TIE, margin


def test_a_member_lost_mid_speculation_leaves_a_stream_that_ends_as_one_without_the_loss(
    tmp_path: Path, looping_model: Path
) -> None:
    """Issue 37: a greedy stream on a ring of three drafts tokens (n-gram, the host's default) and
    has drafted trips behind it when a member stops and dies. The stream goes on on the new ring,
    which drafts for it again, and ends with the text a run without the loss gives."""
    model = looping_model
    with session(tmp_path, model, 3) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        stream = iter(
            client.completions.create(model="looping", prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
        )
        text = "".join(next(stream).choices[0].text for _ in range(40))
        first = joiners[0]
        first.send_signal(signal.SIGSTOP)  # the ring stops mid-answer, drafts out or rejected rows not yet cut
        lost = status_of(host)
        assert lost["running"] == 1 and lost["speculation"]["trips"] > 0, lost["speculation"]  # drafting, not over
        first.kill()
        text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        # The new ring prefills the history the old one decoded row by row: where the texts part,
        # only at a near-tie of the unsplit model's (none in most runs).
        margin = unsplit_margin_where_parted(model, PROMPT, text)
        assert margin is None or margin < NEAR_TIE, (margin, text, host.output()[-4000:])
        assert said(host, "the broken ring left go on on this one"), host.output()
        after = status_of(host)
        assert after["epoch"] > lost["epoch"] and after["speculation"]["trips"] > 0, after  # drafting again


def blocks_held(status: dict[str, Any]) -> dict[str, list[int]]:
    """Each member's blocks in the plan /status shows (a member that left holds none)."""
    return {m["name"]: m["blocks"] for m in status["members"] if "blocks" in m}


def test_four_streams_all_go_on_through_a_lost_member(tmp_path: Path, model: Path) -> None:
    """Four streams on a ring of two, and a fifth request not streamed queued behind them, lose the
    member after the streams' first chunks: each pauses, then finishes on this machine alone, every
    token asked for, each its own prompt's continuation, and the fifth is answered whole."""
    with session(tmp_path, model, 2) as (host, joiners):
        wait_ready(host)
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        usage = {"include_usage": True}

        def start(prompt: str) -> Iterator[Completion]:
            return iter(
                client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True, stream_options=usage
                )
            )

        streams = [start(prompt) for prompt in PROMPTS]
        texts = [next(stream).choices[0].text for stream in streams]
        (member,) = joiners
        member.send_signal(signal.SIGSTOP)  # the ring stops with all four mid-answer
        answered: list[int] = []
        seen = openai.DefaultHttpxClient(event_hooks={"response": [lambda r: answered.append(r.status_code)]})
        retrying = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", timeout=120, http_client=seen)
        whole: dict[str, str] = {}
        asking = threading.Thread(
            target=lambda: whole.update(
                text=retrying.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
                .choices[0]
                .text
            )
        )
        asking.start()  # queued behind the four: it waits with them
        until_status(host, lambda status: status["running"] + status["queue_depth"] == 5, "five requests taken")
        member.kill()
        for i, stream in enumerate(streams):
            chunks = list(stream)
            texts[i] += "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40, chunks[-1]
        for prompt, text in zip(PROMPTS, texts, strict=True):
            assert text.startswith(unsplit_greedy(model, prompt, 3).rstrip("\ufffd")), prompt
        asking.join(timeout=120)
        assert answered == [200], answered  # answered whole, not a 503 to retry
        assert whole["text"].startswith(unsplit_greedy(model, PROMPT, 3).rstrip("\ufffd")), whole


def test_a_host_whose_rendezvous_goes_says_so_and_serves_on(tmp_path: Path, model: Path) -> None:
    """The rendezvous dies while the ring serves: the ring's own links carry on, and the host
    records that no one can join any more, with what to do."""
    joiner: subprocess.Popen[str] | None = None
    with running_rendezvous() as rendezvous:  # the SIGKILL below is what it must end by
        args = ("--model", model, "--members", "2", "--context", "256", "--concurrency", "4", "--threads", "1",
                "--rendezvous", rendezvous.address)  # fmt: skip
        try:
            with running_host(*args, ready=False) as host:
                code, printed = host.join_line()
                assert printed == rendezvous.address
                joiner = start_member(code, rendezvous.address, "member-0", tmp_path / "cache-0", "--threads", "1")
                until_status(host, serving_past(0), "serving")
                rendezvous.process.kill()
                status = until_status(
                    host, lambda s: any(i["what"] == "the rendezvous session ended" for i in s["incidents"]),
                    "saying the rendezvous ended the session",
                )  # fmt: skip
                (incident,) = [i for i in status["incidents"] if i["what"] == "the rendezvous session ended"]
                assert "no member can join" in incident["detail"] and "new code" in incident["detail"]
                client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
                result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
                assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
        finally:
            if joiner is not None:
                stop(joiner)
