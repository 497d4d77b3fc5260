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

The host runs with `--speculate off`: the floor counts one row a token, and drafts would add
their own gains and costs, which differ by prompt (at 0 ms, 34 to 66 tokens/s over these
prompts with n-gram drafts on); `--speculate` below measures those.

Also the stage files' transfer rate as the session formed, over the relayed edge and the
direct ones (from the host's report of each transfer), with the relay's cap beside them.

With `--speculate`, instead: speculative decoding against none, at each round trip, one user
(`--speculate off` in one session and each of `--arms` (default `ngram`; `draft` runs `--draft
MODEL` on the host, by default the target itself) in another, each its own lab, all open at once
and asked in turn, so that all meet the same load), three workloads (`--workloads`): **edit**, the
prompt holds a 210-line source file and asks for it back with one identifier renamed (greedy);
**chat**, free text, sampled (seeded) and greedy. Tokens/s after the first, each way, their
ratio, the ring's limit each way, tokens a trip, drafted tokens kept and sent per trip that
carried drafts (from /status), whether the text was the same, the cost rule's measured trip,
drafted row and draft decode, and the machine's load.

    python scripts/bench_wan.py [--rtts 0 10 40 100] [--tokens 32] [--repeats 3]   (root, nftables, conntrack)
    PYTHONPATH=$PWD/src python scripts/bench_wan.py --speculate [--rtts 0 10 40 100] [--tokens 64] [--repeats 1]
        [--arms ngram draft] [--draft MODEL] [--workloads edit chat]

(The lab's `kafila` processes import kafila as this process does: without PYTHONPATH, from
wherever the editable install points, which may be another checkout.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from edit_workload import edit_prompt
from lab_session import DIRECT, HOMES, RELAYED, LabSession, benchmark_gemma, lab_session
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


# The edit workload's file: a 210-line Python module (scripts/bench_data/inventory.py.txt), 2,000
# tokens (so the host serves 4,096 a sequence), asked back with one identifier renamed, as a
# document to continue (gemma-3-270m is a base model). Chat is free text, sampled (seeded, so the
# same text each way), whose drafts are mostly missed, the case the cost rule must keep from
# losing; and the same greedy, where this small model falls into loops that drafts catch. The
# edit's prompt is `edit_workload.edit_prompt` (tests/helpers), which the tests check speculation on.
SPECULATION_CONTEXT = 4096


CHAT = "The old lighthouse keeper had lived alone on the island for thirty years. Every evening he"
WORKLOADS = {  # name → (prompt, temperature, seed)
    "chat": (CHAT, 0.8, 7),
    "chat, greedy": (CHAT, 0.0, None),
    "edit": (edit_prompt(None), 0.0, None),
}


def serving(session: LabSession) -> dict[str, Any]:
    """/status once the ring serves and reports its speculation."""
    return session.until(lambda s: s.get("ready") and s.get("speculation") is not None, "serving")


def speculation_rates(
    sessions: dict[str, LabSession], rtt_ms: float, tokens: int, repeats: int, workloads: list[str]
) -> dict[str, Any]:
    """One user's decode tokens/s on each workload in each session, the sessions' requests taken
    in turn (off, ngram, draft, off, ...) so that all meet the same load; the drafts meanwhile,
    from /status."""
    for session in sessions.values():
        assert session.api is not None
        session.api("completions", prompts=[CHAT], max_tokens=4, stream=True)  # warm at this round trip
    out: dict[str, Any] = {"rtt": rtt_ms, **{mode: {} for mode in sessions}}
    for name in workloads:
        prompt, temperature, seed = WORKLOADS[name]
        request = {"prompts": [prompt], "max_tokens": tokens, "temperature": temperature, "seed": seed}
        # Serving, and the ring's counters (a replan, a rebalance say, starts a ring with its own):
        before = {mode: serving(session) for mode, session in sessions.items()}
        results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in sessions}
        for _ in range(repeats):
            for mode, session in sessions.items():
                assert session.api is not None
                result = session.api("completions", **request)[0]
                if "error" in result or result["tokens"] < 2:
                    raise RuntimeError(f"a request failed at {rtt_ms} ms, --speculate {mode}: {result}")
                results[mode].append(result)
        for mode, session in sessions.items():
            status = serving(session)
            if status["epoch"] != before[mode]["epoch"]:
                print(f"the {mode} ring was replanned during {name} at {rtt_ms} ms: its drafts are not counted",
                      file=sys.stderr)  # fmt: skip
                before[mode] = status
            was, now = before[mode]["speculation"], status["speculation"]
            made = sum(r["tokens"] - 1 for r in results[mode])  # after the first, which the prompt's trip made
            kept = now["accepted_tokens"] - was["accepted_tokens"]
            trips = now["trips"] - was["trips"]
            out[mode][name] = {
                "decode_s": sum(r["seconds"] - r["ttft_s"] for r in results[mode]),
                "drafted": now["drafted_tokens"] - was["drafted_tokens"],
                "kept_all": kept,
                "drafted_trips": trips,  # one user: the waves that carried drafts
                "rate": statistics.median(decode_rate(r) for r in results[mode]),
                "rates": [decode_rate(r) for r in results[mode]],
                "tokens": statistics.median(r["tokens"] for r in results[mode]),
                "per_trip": made / max(1, made - kept),  # each trip makes one token and keeps its drafts
                "kept": kept / trips if trips else 0.0,
                "window": (now["drafted_tokens"] - was["drafted_tokens"]) / trips if trips else 0.0,
                "texts": [r["text"] for r in results[mode]],
                # drafts in flight: waves sent behind another of the request's, and those a reject made stale
                "behind": now.get("waves_behind", 0) - was.get("waves_behind", 0),
                "stale": now.get("waves_stale", 0) - was.get("waves_stale", 0),
            }
            stages = status["stages"]
            out[mode]["stages_ms"] = sum(s.get("ms_per_token_alone") or s.get("ms_per_token") or 0.0 for s in stages)
            out[mode]["trip_ms"], out[mode]["row_ms"] = now.get("trip_ms"), now.get("row_ms")
            out[mode]["fixed_ms"] = now.get("fixed_ms")  # what a wave's carrying drafts adds once
            out[mode]["draft_ms"] = now.get("draft_ms")
            # what drafts in flight are priced by: the stages' decodes by rows, and the ring's PING trip
            out[mode]["decode_ms_by_rows"] = [s.get("decode_ms_by_rows") for s in stages]
            out[mode]["ring_ms"] = (status.get("prefill") or {}).get("ring_ms")
    return out


def speculation_host_args(arm: str, draft: Path) -> tuple[str, ...]:
    """`kafila host`'s arguments for one arm: `--speculate off|ngram`, or `draft` with `--draft`."""
    speculate = ("--speculate", arm, *(("--draft", str(draft)) if arm == "draft" else ()))
    return (*speculate, "--context", str(SPECULATION_CONTEXT))


def bench_speculation(
    model: Path,
    rtts: list[float],
    tokens: int,
    repeats: int,
    arms: list[str],
    draft: Path,
    workloads: list[str],
    texts: Path | None = None,
) -> None:
    """A session without drafts and one for each arm, all open at once (each its own lab), their
    requests in turn; each arm against the one without; `texts`: where to write every answer."""
    rows: list[dict[str, Any]] = []
    loads: list[float] = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        sessions: dict[str, LabSession] = {}
        for mode in ("off", *arms):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            sessions[mode] = stack.enter_context(
                lab_session(model, tmp, WanLink(FORMED_AT_RTT_MS / 4), host_args=speculation_host_args(mode, draft))
            )
        for rtt in rtts:
            for session in sessions.values():
                set_rtt(session, rtt)
            loads.append(os.getloadavg()[0])
            rows.append(speculation_rates(sessions, rtt, tokens, repeats, workloads))
            figures = {mode: {n: {k: f for k, f in v.items() if k != "texts"} if isinstance(v, dict) else v
                              for n, v in rows[-1][mode].items()} for mode in sessions}  # fmt: skip
            print(f"measured at {rtt:g} ms (load {loads[-1]:.1f}): {figures}", file=sys.stderr)
    loads.append(os.getloadavg()[0])
    if texts is not None:  # where an arm's text parted from off's, and how
        answers = {f"{row['rtt']:g}": {m: {n: row[m][n]["texts"] for n in workloads} for m in sessions} for row in rows}
        texts.write_text(json.dumps(answers, indent=1))
    print(f"One user, up to {tokens} tokens a request, median of {repeats}, the sessions' requests in turn;")
    print("decode tokens/s after the first. Load average (1 min) on this machine as each round trip began, and")
    print("at the end: " + ", ".join(f"{load:.1f}" for load in loads) + f". Draft model (draft arm): {draft.name}.")
    print("Ring limit: one token a trip of 1.5 × RTT + Σ stage ms (off's stages, /status); an arm's is that times")
    print("its tokens a trip, as if drafted rows were free. Trip, rows, draft decode: the cost rule's (/status).")
    print("Drafts' own effect: the arm's decode time against that time less its drafted waves' cost (at the")
    print("rule's fitted line: what carrying drafts adds to a wave, then a row) and draft decodes plus a trip")
    print("for each draft kept, on its own ring: what the drafts did, without the sessions' difference.\n")
    print("| per-hop RTT | workload | arm | tokens | off tokens/s | limit | arm tokens/s | limit | arm / off "
          "| drafts' own effect | tokens a trip | drafts kept a drafted trip | drafts a drafted trip "
          "| same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        off = row["off"]
        limit = 1e3 / (1.5 * row["rtt"] + off["stages_ms"])
        for name in workloads:
            for arm in arms:
                a, b, on = off[name], row[arm][name], row[arm]
                trip_ms, row_ms, draft_ms = on["trip_ms"] or 0.0, on["row_ms"] or 0.0, on["draft_ms"] or 0.0
                drafted_ms = b["drafted_trips"] * (on["fixed_ms"] or 0.0) + b["drafted"] * (row_ms + draft_ms)
                undrafted_s = b["decode_s"] + (b["kept_all"] * trip_ms - drafted_ms) / 1e3
                print(
                    f"| {row['rtt']:g} ms | {name} | {arm} | {b['tokens']:g} | {a['rate']:.1f} | {limit:.1f} "
                    f"| {b['rate']:.1f} | {limit * b['per_trip']:.1f} | {b['rate'] / a['rate']:.2f} "
                    f"| {undrafted_s / b['decode_s']:.2f} | {b['per_trip']:.2f} | {b['kept']:.2f} | {b['window']:.2f} "
                    f"| {'yes' if a['texts'] == b['texts'] else 'no'} |"
                )
    print("\n| per-hop RTT | arm | Σ stage ms (off) | a trip | a wave with drafts, beyond its rows (fitted) "
          "| a drafted row (fitted) | a draft decode |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for arm in arms:
            on = row[arm]
            shown = [
                f"{on[key]:.1f} ms" if on[key] is not None else "—"
                for key in ("trip_ms", "fixed_ms", "row_ms", "draft_ms")
            ]
            print(f"| {row['rtt']:g} ms | {arm} | {row['off']['stages_ms']:.1f} | {' | '.join(shown)} |")
    print("\n| per-hop RTT | workload | arm | each request's tokens/s, off | each request's, arm | waves behind "
          "| of them stale |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for name in workloads:
            for arm in arms:
                a, b = row["off"][name], row[arm][name]
                off_rates, arm_rates = (" ".join(f"{rate:.1f}" for rate in each["rates"]) for each in (a, b))
                waves = f"{b['behind']} | {b['stale']}"
                print(f"| {row['rtt']:g} ms | {name} | {arm} | {off_rates} | {arm_rates} | {waves} |")


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
    parser.add_argument("--speculate", action="store_true", help="drafts against none (see above)")
    parser.add_argument("--arms", nargs="+", choices=["ngram", "draft"], default=["ngram"], help="with --speculate")
    parser.add_argument("--draft", type=Path, help="the draft arm's model (default: the target itself)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--texts", type=Path, help="with --speculate: write each answer's text here (JSON)")
    args = parser.parse_args()
    model = benchmark_gemma()
    if model is None:
        return 2
    if args.speculate:
        draft = args.draft or model
        bench_speculation(model, args.rtts, args.tokens, args.repeats, args.arms, draft, args.workloads, args.texts)
        return 0
    toll_only = ("--speculate", "off")  # the floor is a row a token: drafts would mix their own gains and costs in
    with (
        tempfile.TemporaryDirectory() as tmp,
        lab_session(model, Path(tmp), WanLink(FORMED_AT_RTT_MS / 4), host_args=toll_only) as session,
    ):
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
