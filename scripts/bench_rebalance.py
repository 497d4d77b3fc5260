"""A ring whose member runs slower than its probe said: kept as planned, and rebalanced.

    python scripts/bench_rebalance.py [--rounds 3] [--tokens 32] [--small] [--busy-later]

Two one-core "machines" on this one, as in bench_concurrency.py: a `kafila host` on core 0 and
a `kafila join` member on core 1, one llama.cpp thread each, serving the TinyLlama-1.1B-shaped
Q8_0 model that script writes (random weights, 1.03 GB, nearly all of it blocks). Both are
priced by the same generic probe, taken on a quiet machine, but core 1 also runs a busy loop
for the whole run: another program started on the member's machine after it probed, so its
stage runs at about half the speed its price says. The first plan divides the blocks evenly,
and the member's stage is the ring's bottleneck.

Two sessions side by side, both up for the whole run, idle while the other is measured:
- `--no-rebalance`: the first division kept;
- the default: after a few warm-up requests (enough single-token decodes on every stage) the
  host finds a division at least 25% faster by what the stages measured and replans.
With --busy-later the busy loop starts only after both sessions have served 512 tokens one at a
time on a quiet machine (a game started on the gaming PC an hour into a session): the stages'
time per token alone is the mean of their last 256 decodes alone, so the host should see the
change within a few requests; the script counts them.
Then, rounds interleaved: one user's tokens/s and 4 concurrent users' (the openai client,
streaming, prefill included; two waves in flight, the default across machines), and each
stage's measured ms per token decoded alone. Medians, and the ratio of the two sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench_concurrency import FULL, MESSAGES, SMALL, ensure_model
from bench_serve import concurrent, through_api

from kafila.session.local_members import started_on

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import Host, planned_and_measured, refreshed_status, running_host, start_member, stop, wait_ready

USERS = (1, 4)
CONFIGS = {"--no-rebalance": "kept as planned", "--rebalance": "rebalancing (the default)"}


def busy_loop_on(core: int) -> subprocess.Popen[bytes]:
    """Another program on the member's machine: a Python busy loop on its one core."""
    with started_on((core,)):
        return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def pair(stack: ExitStack, model: Path, flag: str, caches: Path) -> Host:
    """A host on core 0 and a member on core 1, each with this machine's quiet probe."""
    options = ("--members", "2", "--threads", "1", "--context", "512", "--concurrency", "4", flag)
    options += ("--every-member-serves",)  # the pair, however its trips weigh
    ports = ("--rendezvous-port", "0", "--stun-port", "0", "--discovery-port", "0")
    env = {"KAFILA_CACHE": str(caches / f"host{flag}"), "KAFILA_PRICE_MODEL": "off"}  # both planned on one probe
    with started_on((0,)):
        host = stack.enter_context(
            running_host("--model", model, *options, *ports, "--name", "host", ready=False, env=env)
        )
    code, rendezvous = host.join_line()
    with started_on((1,)):
        member = start_member(
            code, rendezvous, "member", caches / f"member{flag}", "--model", str(model), "--threads", "1"
        )
    stack.callback(stop, member)
    wait_ready(host)
    return host


REBALANCING = "rebalancing by what the stages measured serving:"


def rebalanced_within(host: Host, wait_s: float) -> bool:
    """Whether the host starts a rebalance within `wait_s` (it looks at an idle ring every 2 s);
    if it does, once it serves again."""
    deadline = time.monotonic() + wait_s
    while REBALANCING not in host.output():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    while "replanned with 2 members, rebalancing" not in host.output():
        if host.process.poll() is not None:
            raise RuntimeError(f"the host stopped while rebalancing:\n{host.output()}")
        time.sleep(0.5)
    wait_ready(host)
    return True


def warm_up(host: Host, tokens: int, wait_s: float = 15) -> None:
    """Requests enough for every stage to time MIN_STEPS_TO_REBALANCE tokens alone; then, if the
    host rebalances, until it serves again."""
    for _ in range(max(2, -(-40 // max(1, tokens - 1)))):
        through_api(host.base_url, tokens, MESSAGES)
    rebalanced_within(host, wait_s)


def rebalance_under_load(host: Host, tokens: int, most: int) -> int | None:
    """Requests, one at a time, until the host rebalances; how many it took (None: not in `most`)."""
    for count in range(1, most + 1):
        through_api(host.base_url, tokens, MESSAGES)
        if rebalanced_within(host, 3):
            return count
    return None


def stages(host: Host) -> list[dict[str, Any]]:
    """Each stage's holder, blocks and measured ms per token alone, in block order."""
    return planned_and_measured(refreshed_status(host))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per user per request")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--busy-later", action="store_true", help="start the busy loop after a quiet session")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark needs two cores: one per machine")
    from kafila.runtime.machine.this_machine import cache_dir, this_device

    model = ensure_model(SMALL if args.small else FULL)
    probe = this_device()
    print(f"generic probe (shared by both machines): b = {probe.bandwidth_gb_s} GB/s, o = {probe.overhead_us} µs")
    rates: dict[tuple[str, int], list[float]] = {(flag, users): [] for flag in CONFIGS for users in USERS}
    readings: dict[str, list[list[dict[str, Any]]]] = {flag: [] for flag in CONFIGS}
    first_division: list[dict[str, Any]] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kafila-rebalance-") as root:
        caches = Path(root)
        for flag in CONFIGS:
            for who in ("host", "member"):
                (caches / f"{who}{flag}").mkdir()
                shutil.copy(cache_dir() / "probe.json", caches / f"{who}{flag}" / "probe.json")
        if not args.busy_later:
            hog = busy_loop_on(1)
            stack.callback(hog.kill)
        hosts: dict[str, Host] = {}
        for flag in CONFIGS:
            print(f"starting a host on core 0 and a member on core 1 ({flag}) ...", flush=True)
            hosts[flag] = pair(stack, model, flag, caches)
            if not first_division:
                first_division = stages(hosts[flag])
        print("warming up both sessions ...", flush=True)
        for host in hosts.values():
            warm_up(host, args.tokens)
        took = ""
        if args.busy_later:
            quiet = -(-512 // (args.tokens - 1))
            print(f"{quiet} more requests on the quiet machine, then the busy loop starts ...", flush=True)
            for host in hosts.values():
                for _ in range(quiet):
                    through_api(host.base_url, args.tokens, MESSAGES)
            hog = busy_loop_on(1)
            stack.callback(hog.kill)
            most = 30
            count = rebalance_under_load(hosts["--rebalance"], args.tokens, most)
            for _ in range(count or most):  # the same requests under the busy loop for the other session
                through_api(hosts["--no-rebalance"].base_url, args.tokens, MESSAGES)
            after = f"rebalanced after {count} more" if count else f"did not rebalance in {most} more"
            took = f"; the busy loop started after {quiet + 2} quiet requests of {args.tokens} tokens; the host {after}"
        for round_ in range(args.rounds):
            order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
            for flag in order:
                for users in USERS if round_ % 2 == 0 else tuple(reversed(USERS)):
                    rates[flag, users].append(concurrent(hosts[flag].base_url, args.tokens, users, MESSAGES))
                readings[flag].append(stages(hosts[flag]))
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        verdict = next(
            (line for line in hosts["--rebalance"].output().splitlines() if "measured serving: the slowest" in line),
            "it kept the plan",
        )
        times_rebalanced = hosts["--rebalance"].output().count(REBALANCING)

    size = SMALL if args.small else FULL
    print(
        f"\n{size.label}, {model.stat().st_size / 1e9:.2f} GB; a host on core 0 and a member on core 1, one thread "
        f"each, a busy loop on core 1{took}; {args.tokens} tokens per user; {args.rounds} rounds interleaved, "
        "medians\n"
    )
    spans = [f"{s['name']} {s['blocks'][0]}–{s['blocks'][1] - 1}" for s in first_division]
    print(f"first plan: {' + '.join(spans)}")
    print(f"host: {verdict.strip()} (rebalanced {times_rebalanced}× in the run)\n")
    print("| session | stages (ms per token alone, measured) | 1 user tokens/s | 4 users tokens/s |")
    print("|---|---|---|---|")
    medians: dict[tuple[str, int], float] = {}
    for flag, label in CONFIGS.items():
        last = readings[flag][-1]
        described = []
        for i, stage in enumerate(last):
            times = [r[i]["measured"] for r in readings[flag] if r[i]["measured"] is not None]
            ms = f"{statistics.median(times):.1f} ms" if times else "?"
            described.append(f"{stage['name']} {stage['blocks'][0]}–{stage['blocks'][1] - 1}: {ms}")
        for users in USERS:
            medians[flag, users] = statistics.median(rates[flag, users])
        print(f"| {label} (`{flag}`) | {'; '.join(described)} | {medians[flag, 1]:.1f} | {medians[flag, 4]:.1f} |")
    for users in USERS:
        ratio = medians["--rebalance", users] / medians["--no-rebalance", users]
        print(f"{users} user{'s' if users > 1 else ''}: rebalanced / kept {ratio:.2f}×")
    print(json.dumps({f"{flag} {users}": r for (flag, users), r in rates.items()}))


if __name__ == "__main__":
    main()
