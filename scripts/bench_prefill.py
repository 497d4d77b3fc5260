"""Pipelined prefill in the NAT lab: time to first token of a long prompt, pipelined against not.

The three-home session of bench_wan.py (tests/helpers/lab_session.py: gemma on a 3-member ring,
the host holding the head, one edge relayed), every ring edge at `--rtt` ms round trip. Two
sessions in one run, the same lab: first with KAFILA_PREFILL_CHUNKS=1 (a prompt crosses the ring
one n_batch chunk after another), then with the default (its chunks ride successive waves,
sized by the cost model, planner/prefill.py). Both keep three waves in flight, as on three
machines (KAFILA_PIPELINE_WAVES=3: the lab's homes share one machine id). Each measures `--repeats` prompts of about
`--prompt-tokens` tokens, each one new from its first word (no prefix is reused), one token each.

Beside the ratio, the limit (the issue's): the slowest stage's prefill of the whole prompt plus
one chunk's trip round the ring, each stage at the better of the ms per prompt row it measured
in the two sessions (/status), a step of one row added to each stage's share of the trip.

Each home's kafila is held to its own CPUs where the machine has them (`--cores`, taskset):
on a 2-core machine three homes cannot each have one, which the output says.

    python scripts/bench_prefill.py [--rtt 40] [--prompt-tokens 2000] [--repeats 3]   (root, nftables, conntrack)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from lab_session import HOMES, HOST, LabSession, benchmark_gemma, lab_session
from natlab_wan import WanLink

from kafila.runtime.engine.stage import Vocabulary
from kafila.runtime.llama.model import VocabularyOnly

WORDS = (
    "river stone lantern orchard harbor meadow copper window thunder garden silver market candle "
    "forest ladder pepper marble violin tunnel compass feather anchor velvet canyon blanket"
).split()


def long_prompt(vocabulary: Vocabulary, serial: int, tokens: int) -> str:
    """About `tokens` tokens of words, beginning with its own number, so no request reuses another's prefix."""
    words = [f"Request {serial}:"]
    text = ""
    while True:
        words += [WORDS[(len(words) * 7 + serial) % len(WORDS)] for _ in range(64)]
        candidate = " ".join(words)
        if len(vocabulary.tokenize(candidate)) > tokens:
            return text or candidate
        text = candidate


def default_cores() -> dict[str, str]:
    """Each home its own CPU where there are enough. On fewer, each member its own (they hold the
    blocks; the host holds the head, whose prompt rows cost little) and the host on any."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= len(HOMES):
        return {name: str(cpu) for name, cpu in zip(HOMES, cpus, strict=False)}
    if len(cpus) < len(HOMES) - 1:
        return {}
    members = [name for name in HOMES if name != HOST]
    return {**{name: str(cpu) for name, cpu in zip(members, cpus, strict=False)}, HOST: ",".join(map(str, cpus))}


def measure(session: LabSession, vocabulary: Vocabulary, first: int, tokens: int, repeats: int) -> dict[str, Any]:
    api = session.api
    assert api is not None
    # A long prompt first, so that the stages have measured a prompt's rows before the timed ones.
    api("completions", prompts=[long_prompt(vocabulary, first, tokens)], max_tokens=1, stream=True)
    session.until(lambda s: all(st.get("prefill_ms_per_token") for st in s.get("stages", [])), "prefill measured", 60)
    ttfts = []
    for serial in range(first + 1, first + 1 + repeats):
        (result,) = api("completions", prompts=[long_prompt(vocabulary, serial, tokens)], max_tokens=1, stream=True)
        if "error" in result or result.get("ttft_s") is None:
            raise RuntimeError(f"a request failed: {result}")
        ttfts.append(result["ttft_s"] * 1e3)
    status = session.status()
    return {"ttfts": ttfts, "status": status}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt", type=float, default=40.0, help="round trip of every ring edge, ms")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", default="", help="home=cpus,... (default: each home its own where there are enough)")
    args = parser.parse_args()
    model = benchmark_gemma()
    if model is None:
        return 2
    vocabulary = Vocabulary(VocabularyOnly(model))
    cores = dict(part.split("=", 1) for part in args.cores.split()) if args.cores else default_cores()
    context = str(max(1024, 2 * args.prompt_tokens))
    # The lab's homes share this machine's id, which the host would count as one machine, keeping
    # one wave in flight; three, as on three machines, in both sessions.
    os.environ["KAFILA_PIPELINE_WAVES"] = str(len(HOMES))
    runs: dict[str, dict[str, Any]] = {}
    for mode, setting in (("unpipelined", "1"), ("pipelined", None)):
        if setting is None:
            os.environ.pop("KAFILA_PREFILL_CHUNKS", None)
        else:
            os.environ["KAFILA_PREFILL_CHUNKS"] = setting
        with (
            tempfile.TemporaryDirectory() as tmp,
            lab_session(model, Path(tmp), WanLink(args.rtt / 4), host_args=("--context", context), cores=cores) as s,
        ):
            runs[mode] = measure(s, vocabulary, 1000 * len(runs), args.prompt_tokens, args.repeats)
            print(f"measured {mode}: {runs[mode]['ttfts']}", file=sys.stderr)
    os.environ.pop("KAFILA_PREFILL_CHUNKS", None)

    off, on = (statistics.median(runs[m]["ttfts"]) for m in ("unpipelined", "pipelined"))
    status = runs["pipelined"]["status"]
    stages = status["stages"]
    prefill = status.get("prefill") or {}
    chunk = prefill.get("chunk_rows") or 0
    ring_ms = prefill.get("ring_ms") or 1.5 * args.rtt
    # Each stage at the better of its two sessions' ms a prompt row: what it can do, not what
    # small chunks or a busy machine made of it in one of them.
    unpipelined = runs["unpipelined"]["status"]["stages"]
    pairs = zip(stages, unpipelined, strict=True)
    per_row = [min(a["prefill_ms_per_token"], b["prefill_ms_per_token"]) for a, b in pairs]
    steps = [st.get("ms_per_token_alone") or 0.0 for st in stages]
    trip = ring_ms + sum(step + chunk * p for step, p in zip(steps, per_row, strict=True))
    limit = args.prompt_tokens * max(per_row) + trip
    print(f"Cores: {', '.join(f'{h} {c}' for h, c in cores.items()) or 'unpinned'} of {os.cpu_count()} here; "
          f"load average {os.getloadavg()[0]:.1f} at the end.")  # fmt: skip
    print(f"{args.prompt_tokens}-token prompts, {args.rtt:g} ms per hop, median of {args.repeats}.")
    per_token = ", ".join(f"{st['prefill_ms_per_token']:.3f}" for st in stages)
    print(f"Stages' prefill ms per token: {per_token}; chunk {chunk} rows, {prefill.get('chunks')} out at once; "
          f"ring {ring_ms:.0f} ms one way round.\n")  # fmt: skip
    print("| unpipelined TTFT | pipelined TTFT | ratio | limit | limit / unpipelined |")
    print("|---|---|---|---|---|")
    print(f"| {off:.0f} ms | {on:.0f} ms | {on / off:.2f} | {limit:.0f} ms | {limit / off:.2f} |")
    for mode, run in runs.items():
        figures = ", ".join(f"{st.get('prefill_ms_per_token') or 0:.2f}" for st in run["status"]["stages"])
        print(f"{mode}: {', '.join(f'{t:.0f}' for t in run['ttfts'])} ms; stages' prefill ms per token {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
