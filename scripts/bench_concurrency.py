"""Concurrency benchmark in the regime the target names: 4 users against 1 on a 2-stage ring,
on a model whose decode at batch one is bound by memory bandwidth rather than arithmetic.

    python scripts/bench_concurrency.py [--rounds 3] [--tokens 32] [--threads N] [--small]
                                        [--weights f16|bf16|f32] [--every-matrix]

Why this model. The target ("with 4 concurrent users on a 2-stage ring, aggregate tokens/s at
least 3× one user's") rests on decode at batch one being bandwidth-bound: every token streams
all the weights from memory, while the arithmetic for one row is small, so a step that decodes
4 sequences reads the same bytes and costs little more than a step that decodes one.
bench_serve.py's gemma-3-270m is the wrong regime on a 2-vCPU machine: its weights are tiny
and its 262,144-token vocabulary makes the output projection's arithmetic dominate each row,
so 4 rows cost about 2.2× one row. No bigger model can be downloaded, so this script writes
one (tests/helpers/tiny_models.py's writer with a custom shape, random weights): TinyLlama-1.1B's
block shape (llama, 22 blocks, n_embd 2048, n_ff 5632, 32 query heads and 4 KV heads of 64),
every matrix Q8_0, and the tiny models' vocabulary of a few hundred tokens, so the blocks'
weights (about 1.03 GB) are nearly all of each token's work and the head is negligible. The
file is written once under $KAFILA_CACHE/bench (default ~/.cache/kafila/bench) and reused
while the shape is the same. --small writes a 4-block, n_embd 256 model instead, for a quick
check that the script works; its numbers mean nothing.

--weights f16 stores the feed-forward matrices and attn_v in f16 (the writer keeps attention's
q, k and output in Q8_0): about 1.7 GB. On a CPU, f16 weights are where the target's premise
holds best: each weight costs twice the bytes of Q8_0 to read, and a row's arithmetic on it is
no dearer, so a step of 4 rows is nearer the cost of one. f32 doubles that again (3.3 GB), and
`--every-matrix` stores attention's q, k and output as --weights too (f32: 3.9 GB), so that
nothing but the tiny embedding and output is quantized: the premise in its purest form on a CPU.

What it measures, all in one run, rounds interleaved, medians:
1. one engine step decoding 1, 2 and 4 sequences at once on the unsplit model, in this process
   (bench_serve.step_cost): what a batch row costs here, which bounds what 4 users can gain;
2. aggregate tokens/s of 1 user against 4 concurrent streaming users through the real server
   (`kafila host --stages 2`, local stage processes, --context 512 --concurrency 4), with the
   official openai client (bench_serve.concurrent): generated tokens of all users divided by
   the wall time from the first request to the last token, so prefill is included; the prompt
   is short (about a dozen tokens: the model carries a plain chat template) so that decode
   dominates, as it does for a real model's short chat turn;
3. the same on the same ring with one wave in flight (KAFILA_PIPELINE_WAVES=1: every running
   request in one step, one stage busy at a time), and with `--stages 1` (the unsplit model
   behind the same server), for reference.
Both hosts stay up for the whole run, idle while the other is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

from bench_serve import concurrent, step_cost, through_api

from kafila.session.local_members import started_on

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import Host, running_host, start_member, stop, wait_ready
from tiny_models import BF16, F16, F32, Q8_0, ModelShape, write_tiny_model

# Words the tiny vocabulary holds, about one token each: 13 prompt tokens with BOS and the newline.
MESSAGES = [{"role": "user", "content": "hello world, the model is in the block of kafila"}]
# The messages' text alone. Without a template the server would use llama.cpp's llama3 one,
# whose header markup the tiny vocabulary spells out byte by byte (about 100 tokens of prefill,
# where a real llama3 tokenizer needs a dozen), and prefill would then dominate the run.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
USERS = (1, 4)
TARGET = 3.0


@dataclass(frozen=True)
class Size:
    label: str
    shape: ModelShape
    n_blocks: int


def _llama(n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int) -> ModelShape:
    """A llama block shape with every matrix Q8_0 and its own output projection."""
    return ModelShape(
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, tied_output=False,
        embd_std=1.0, ffn_types=(Q8_0,), attn_v_type=Q8_0,
    )  # fmt: skip


WEIGHTS = {"q8_0": Q8_0, "f16": F16, "bf16": BF16, "f32": F32}


def with_weights(size: Size, weights: str, every_matrix: bool = False) -> Size:
    """The same shape with the feed-forward matrices and attn_v stored as `weights`, and with
    `every_matrix` attention's q, k and output too (only the embedding and output stay Q8_0)."""
    if weights == "q8_0":
        return size
    kind = WEIGHTS[weights]
    shape = dataclasses.replace(size.shape, ffn_types=(kind,), attn_v_type=kind)
    if every_matrix:
        shape = dataclasses.replace(shape, attn_qko_type=kind)
    return Size(f"{size.label}, {weights} {'blocks' if every_matrix else 'feed-forward'}", shape, size.n_blocks)


def weights_of(shape: ModelShape) -> str:
    name = next(name for name, kind in WEIGHTS.items() if shape.ffn_types == (kind,))
    return f"{name}-all" if shape.attn_qko_type == shape.ffn_types[0] != Q8_0 else name


def storage_of(shape: ModelShape) -> str:
    name = weights_of(shape)
    if name.endswith("-all"):
        return f"every block matrix {name.removesuffix('-all')}, the embedding and output Q8_0"
    return f"{name} feed-forward and attn_v, other matrices Q8_0"


FULL = Size("TinyLlama-1.1B-shaped llama", _llama(2048, 32, 4, 64, 5632), n_blocks=22)
SMALL = Size("small llama (--small: a smoke test, not a measurement)", _llama(256, 4, 2, 64, 704), n_blocks=4)


def cache_dir() -> Path:
    return Path(os.environ.get("KAFILA_CACHE", Path.home() / ".cache" / "kafila")) / "bench"


def ensure_model(size: Size, seed: int = 0) -> Path:
    """The model file for `size`: reused if one with the same shape is there, written otherwise."""
    s = size.shape
    digest = hashlib.sha256(repr((s, size.n_blocks, seed, CHAT_TEMPLATE)).encode()).hexdigest()[:10]
    name = (
        f"random-llama-{size.n_blocks}x{s.n_embd}-ff{s.n_ff}-h{s.n_head}kv{s.n_head_kv}-{weights_of(s)}-{digest}.gguf"
    )
    path = cache_dir() / name
    if path.exists():
        print(f"model: {path} (reused, {path.stat().st_size / 1e9:.3f} GB)", flush=True)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    print(f"model: writing {path} ...", flush=True)
    started = time.perf_counter()
    write_tiny_model(partial, "llama", n_blocks=size.n_blocks, seed=seed, shape=s, chat_template=CHAT_TEMPLATE)
    os.replace(partial, path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"model: wrote {path.stat().st_size / 1e9:.3f} GB in {time.perf_counter() - started:.0f} s "
        f"(this process's peak RSS so far {peak:.0f} MB)",
        flush=True,
    )
    return path


def stage_ranges(host: Host) -> str:
    """The block ranges the host's stages serve, from /status, chain order, head last: e.g. "0-11 + 11-22"."""
    try:
        with urlopen(f"{host.base_url}/status", timeout=5) as response:
            status = json.load(response)
        ranges = [f"{a}-{b}" for a, b in (s["range"] for s in status.get("stages") or [] if "range" in s)]
    except (OSError, ValueError, KeyError, TypeError):
        return "?"
    return " + ".join(ranges) or "?"


def two_pinned_machines(stack: ExitStack, model: Path, waves: str) -> Host:
    """A host and one `kafila join` member over QUIC on loopback, each pinned to its own core with
    one thread: two one-core machines, as near as one machine can come to a ring of two."""
    options = ("--members", "2", "--threads", "1", "--context", "512", "--concurrency", "4")
    options += ("--every-member-serves",)  # the two machines, however their trip weighs
    ports = ("--rendezvous-port", "0", "--stun-port", "0", "--discovery-port", "0")
    with started_on((0,)):
        host = stack.enter_context(
            running_host("--model", model, *options, *ports, ready=False, env={"KAFILA_PIPELINE_WAVES": waves})
        )
    code, rendezvous = host.join_line()
    with started_on((1,)):
        member = start_member(
            code, rendezvous, "core-1", cache_dir() / "member", "--model", str(model), "--threads", "1"
        )
    stack.callback(stop, member)
    wait_ready(host)
    return host


def prompt_tokens(host: Host) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=1, temperature=0,  # type: ignore[arg-type]
    )  # fmt: skip
    return reply.usage.prompt_tokens if reply.usage else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per user per request")
    parser.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1), help="per stage process")
    parser.add_argument("--small", action="store_true", help="a much smaller model: a quick smoke run")
    parser.add_argument("--no-pinned", action="store_true", help="skip the two pinned one-core machines")
    parser.add_argument("--weights", choices=tuple(WEIGHTS), default="q8_0", help="feed-forward and attn_v storage")
    parser.add_argument(
        "--every-matrix", action="store_true", help="store attention's q, k and output as --weights too"
    )
    args = parser.parse_args()
    size = with_weights(SMALL if args.small else FULL, args.weights, args.every_matrix)
    model = ensure_model(size)
    weight_gb = model.stat().st_size / 1e9
    threads = str(args.threads)
    # label → (stages, extra environment): waves on (the default) and off, on the same ring
    configs: dict[str, tuple[str, dict[str, str]]] = {
        "2 stages": ("2", {}),
        "2 stages, two waves": ("2", {"KAFILA_PIPELINE_WAVES": "2"}),
        "1 stage (unsplit)": ("1", {}),
    }
    pinned_configs = {"2 pinned cores, two waves": "2", "2 pinned cores, one wave": "1"}
    rates: dict[tuple[str, int], list[float]] = {(label, users): [] for label in configs for users in USERS}
    steps: dict[int, list[float]] = {1: [], 2: [], 4: []}

    with ExitStack() as stack:
        hosts: dict[str, Host] = {}
        ranges: dict[str, str] = {}
        for label, (stages, env) in configs.items():
            print(f"starting kafila host --stages {stages} ({label}) ...", flush=True)
            options = ("--stages", stages, "--threads", threads, "--context", "512", "--concurrency", "4")
            hosts[label] = host = stack.enter_context(running_host("--model", model, *options, env=env))
            through_api(host.base_url, 8, MESSAGES)  # warm-up, one sequence and four
            concurrent(host.base_url, 8, 4, MESSAGES)
            ranges[label] = stage_ranges(host)
        if os.cpu_count() and os.cpu_count() >= 2 and not args.no_pinned:  # type: ignore[operator]
            for label, waves in pinned_configs.items():
                print(f"starting a host and a member on cores 0 and 1 ({label}) ...", flush=True)
                hosts[label] = host = two_pinned_machines(stack, model, waves)
                through_api(host.base_url, 8, MESSAGES)
                concurrent(host.base_url, 8, 4, MESSAGES)
                ranges[label] = stage_ranges(host)
                rates.update({(label, users): [] for users in USERS})
        n_prompt = prompt_tokens(hosts["2 stages"])

        for round_ in range(args.rounds):
            for rows, ms in step_cost(model, args.threads, rounds=10).items():
                steps[rows].append(ms)
            order = list(hosts) if round_ % 2 == 0 else list(reversed(hosts))
            for label in order:
                for users in USERS if round_ % 2 == 0 else tuple(reversed(USERS)):
                    rates[label, users].append(concurrent(hosts[label].base_url, args.tokens, users, MESSAGES))
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)

    s = size.shape
    print(
        f"\n{size.label}: {size.n_blocks} blocks, n_embd {s.n_embd}, n_ff {s.n_ff}, {s.n_head} heads / "
        f"{s.n_head_kv} KV heads of {s.head_dim}, "
        f"{storage_of(s)}, "
        f"random weights; {weight_gb:.3f} GB file; "
        f"{args.threads} threads per stage; {args.tokens} tokens per user, a {n_prompt}-token prompt; "
        f"{args.rounds} rounds interleaved, medians\n"
    )
    cost = {rows: statistics.median(ms) for rows, ms in steps.items()}
    print("| sequences per step (unsplit, in-process) | ms per step | min | max | × one row | tokens/s | × one row |")
    print("|---|---|---|---|---|---|---|")
    for rows, ms in cost.items():
        print(
            f"| {rows} | {ms:.1f} | {min(steps[rows]):.1f} | {max(steps[rows]):.1f} | {ms / cost[1]:.2f}× "
            f"| {rows * 1e3 / ms:.1f} | {rows * cost[1] / ms:.2f}× |"
        )
    print(
        f"\none row reads the {weight_gb:.2f} GB of weights in {cost[1]:.1f} ms "
        f"({weight_gb / cost[1] * 1e3:.1f} GB/s effective); "
        f"4 rows cost {cost[4] / cost[1]:.2f}× one row, so 4 users can gain at most {4 * cost[1] / cost[4]:.2f}×\n"
    )
    print(
        "| configuration | stage blocks | 1 user tokens/s | min | max "
        "| 4 users tokens/s | min | max | 4 users / 1 user |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for label in hosts:
        one, four = rates[label, 1], rates[label, 4]
        ratios[label] = statistics.median(four) / statistics.median(one)
        print(
            f"| {label} | {ranges[label]} | {statistics.median(one):.1f} | {min(one):.1f} | {max(one):.1f} "
            f"| {statistics.median(four):.1f} | {min(four):.1f} | {max(four):.1f} | {ratios[label]:.2f}× |"
        )
    for label in [label for label in hosts if label.startswith("2 ")]:
        verdict = "met" if ratios[label] >= TARGET else "not met"
        print(
            f"target: 4 users at {TARGET:.0f}× one user's aggregate tokens/s, {label}: {verdict} ({ratios[label]:.2f}×)"
        )


if __name__ == "__main__":
    main()
