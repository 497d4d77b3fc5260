"""Drive a split ring and the unsplit model side by side on real llama.cpp, for `agreement`.

Each stage has its own `ContextSettings`, so one ring can mix a CPU stage with a GPU one
(`gpu_layers`) or flash attention on with off. The unsplit model runs with a graph callback that
copies out the residual after each block where the ring is cut (`l_out-<block>`, the node a
`BlockStage` sends), without stopping the graph.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFReader

from kafila.runtime.engine.agreement import (
    AgreementReport,
    CutError,
    Tolerance,
    first_divergence,
    relative_errors,
    spread,
    top_token_agreement,
)
from kafila.runtime.engine.stage import BlockStage, HeadStage, StepInput
from kafila.runtime.llama.loading import GGMLBase
from kafila.runtime.llama.model import ContextSettings, LlamaModel

FloatRows = npt.NDArray[np.float32]


@dataclass
class _Run:
    """What one side produced over a run: the tokens it was fed or chose, the logits after each
    step, and per cut the hidden states of every position in order."""

    tokens: list[int]
    logits: list[FloatRows]
    states: list[list[FloatRows]]

    def stacked_states(self) -> list[FloatRows]:
        return [np.concatenate(rows) for rows in self.states]


class UnsplitReference:
    """The whole model on token ids, copying out the residual after each block in `after_blocks`."""

    def __init__(self, path: str | os.PathLike[str], settings: ContextSettings, after_blocks: Sequence[int]) -> None:
        self._ggml = GGMLBase.load()
        self._targets = {f"l_out-{block}".encode(): index for index, block in enumerate(after_blocks)}
        self._captured: list[list[FloatRows]] = [[] for _ in after_blocks]
        settings = replace(settings, max_outputs=settings.n_seq_max)  # a row of logits a sequence: no drafts here
        self.model = LlamaModel(path, settings, eval_callback=self._on_tensor)
        self.after_blocks = tuple(after_blocks)

    def _on_tensor(self, tensor: int, ask: bool, _user: object) -> bool:
        index = self._targets.get(self._ggml.get_name(tensor))
        if index is None:
            return not ask
        if ask:
            return True
        nbytes = self._ggml.nbytes(tensor)
        rows = np.empty(nbytes // 4, dtype=np.float32)
        self._ggml.tensor_get(tensor, rows.ctypes.data, 0, nbytes)
        self._captured[index].append(rows.reshape(-1, self.model.n_embd))
        return True  # go on: the graph's later blocks and the logits are wanted too

    def step(self, position: int, tokens: Sequence[int]) -> tuple[FloatRows, list[FloatRows]]:
        """Logits after the last token, and per cut the residual rows of these tokens."""
        for captured in self._captured:
            captured.clear()
        limit = self.model.settings.n_batch
        chunk: list[int] = []
        for start in range(0, len(tokens), limit):
            chunk = list(tokens[start : start + limit])
            last = start + len(chunk) == len(tokens)
            outputs = [False] * (len(chunk) - 1) + [last]
            positions = list(range(position + start, position + start + len(chunk)))
            self.model.decode([0] * len(chunk), positions, outputs, tokens=chunk)
        states = [np.concatenate(captured) for captured in self._captured]
        for block, rows in zip(self.after_blocks, states, strict=True):
            if rows.shape[0] != len(tokens):
                raise RuntimeError(f"the unsplit model's residual after block {block} was not captured whole")
        return self.model.logits(len(chunk) - 1), states

    def close(self) -> None:
        self.model.close()


class SplitRing:
    """Stage files run in order in this process, each with its own settings; the last is the head."""

    def __init__(self, stages: Sequence[tuple[Path, ContextSettings]]) -> None:
        if len(stages) < 2:
            raise ValueError("a ring has at least two stages")
        self.blocks: list[BlockStage] = []
        try:
            for path, settings in stages[:-1]:
                self.blocks.append(BlockStage(path, settings))
            self.head = HeadStage(stages[-1][0], stages[-1][1])
        except Exception:
            self.close()
            raise

    @property
    def after_blocks(self) -> list[int]:
        return [stage.first_block + stage.n_layers - 1 for stage in self.blocks]

    def step(self, position: int, tokens: Sequence[int]) -> tuple[FloatRows, list[FloatRows]]:
        """Logits after the last token, and the hidden states each block stage sent on."""
        states = self.head.embed(list(tokens))
        sent = []
        for stage in self.blocks:
            states = stage.forward([StepInput(0, position, states)])[0]
            sent.append(states)
        logits = self.head.forward([StepInput(0, position, states)])[0]
        assert logits is not None
        return logits, sent

    def forget(self) -> None:
        for stage in self.blocks:
            stage.forget(0)
        self.head.forget(0)

    def close(self) -> None:
        for stage in self.blocks:
            stage.close()
        if hasattr(self, "head"):
            self.head.close()


def _run(side: UnsplitReference | SplitRing, prompt: Sequence[int], steps: int, fed: Sequence[int] = ()) -> _Run:
    """The prompt, then one token a step: `fed`'s while it lasts (teacher-forced), else the side's
    own greedy choice; `steps` tokens in all, and the logits and cut states of every step."""
    run = _Run(tokens=[], logits=[], states=[[] for _ in side.after_blocks])
    tokens, position = list(prompt), 0
    while True:
        logits, states = side.step(position, tokens)
        run.logits.append(logits)
        for kept, rows in zip(run.states, states, strict=True):
            kept.append(rows)
        position += len(tokens)
        index = len(run.tokens)
        run.tokens.append(fed[index] if index < len(fed) else int(np.argmax(logits)))
        if len(run.tokens) == steps:
            return run
        tokens = run.tokens[-1:]


def compare_ring(
    whole: Path,
    whole_settings: ContextSettings,
    stages: Sequence[tuple[Path, ContextSettings]],
    prompt: Sequence[int],
    steps: int,
    tolerance: Tolerance | None = None,
) -> AgreementReport:
    """The ring of `stages` (cut from `whole`) against `whole` over `steps` greedy tokens after `prompt`.

    The unsplit model generates greedily, capturing its residual at the ring's cuts; the ring is
    then fed the same tokens (teacher-forced) and compared position by position; last, the ring
    generates freely from a clean cache and where its tokens part from the unsplit ones is noted.
    Of `tolerance`, only the near-tie margin is used here; `AgreementReport.problems` judges."""
    if steps < 1:
        raise ValueError("compare at least one generated token")
    margin = (tolerance or Tolerance()).near_tie_margin
    ring = SplitRing(stages)
    try:
        reference = UnsplitReference(whole, whole_settings, ring.after_blocks)
        try:
            expected = _run(reference, prompt, steps)
        finally:
            reference.close()
        got = _run(ring, prompt, steps, fed=expected.tokens)
        ring.forget()
        free = _run(ring, prompt, steps)
        after_blocks = ring.after_blocks
    finally:
        ring.close()
    cuts = tuple(
        CutError(block, spread(relative_errors(ring_rows, unsplit_rows)))
        for block, ring_rows, unsplit_rows in zip(
            after_blocks, got.stacked_states(), expected.stacked_states(), strict=True
        )
    )
    ring_logits, unsplit_logits = np.stack(got.logits), np.stack(expected.logits)
    return AgreementReport(
        cuts=cuts,
        logits=spread(relative_errors(ring_logits, unsplit_logits)),
        top_tokens=top_token_agreement(ring_logits, unsplit_logits, margin),
        free_run_tokens=steps,
        free_run_divergence=first_divergence(free.tokens, expected.tokens),
    )


def perturbed_copy(path: Path, tensor: str, factor: float, out: Path) -> Path:
    """A copy of a stage file with one float32 tensor scaled by `factor`: the negative control that
    shows the check fails a ring whose weights are wrong by a little."""
    shutil.copyfile(path, out)
    reader = GGUFReader(out, "r+")
    found = next((t for t in reader.tensors if t.name == tensor), None)
    if found is None or found.tensor_type != GGMLQuantizationType.F32:
        raise ValueError(f"{path} has no float32 tensor {tensor}")
    found.data[...] = found.data * np.float32(factor)
    reader.data.flush()
    return out
