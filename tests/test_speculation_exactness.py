"""Where a rejected draft may leave a trace on real llama.cpp: not in the cut of a windowed cache.
A draft decoded after its row and cut back leaves the next logits bit for bit as without it, on
gemma2's tiny model with rows falling out of its window; what moves them is the draft sharing its
row's decode (docs/architecture.md, "Exactness")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
from test_split_correctness import N_BLOCKS, PROMPT
from tiny_models import write_tiny_model

from kafila.runtime.engine.stage import Vocabulary
from kafila.runtime.llama.model import ContextSettings, LlamaModel

SETTINGS = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=1, n_threads=2)
STEPS = 40


def greedy_rows(model: LlamaModel, prompt: list[int], reject_each: bool) -> list[npt.NDArray[np.float32]]:
    """Each greedy row's logits, STEPS rows past the prompt; with `reject_each`, after each row a
    wrong draft decoded on its own and cut back, as a stage cuts a rejected one."""
    model.forget(0)
    for start in range(0, len(prompt), SETTINGS.n_batch):
        chunk = prompt[start : start + SETTINGS.n_batch]
        outputs = [start + i == len(prompt) - 1 for i in range(len(chunk))]
        model.decode([0] * len(chunk), range(start, start + len(chunk)), outputs, tokens=chunk)
    token = int(np.argmax(model.logits(len(chunk) - 1)))
    rows = []
    for position in range(len(prompt), len(prompt) + STEPS):
        model.decode([0], [position], [True], tokens=[token])
        rows.append(model.logits(0))
        if reject_each:
            model.decode([0], [position + 1], [False], tokens=[(token + 1) % model.n_vocab])
            model.forget(0, position + 1)
        token = int(np.argmax(rows[-1]))
    return rows


def test_a_cut_back_draft_leaves_a_windowed_cache_as_without_it(tmp_path: Path) -> None:
    """gemma2's tiny model (every other block windowed) on Kafila's context settings, llama.cpp's
    full-size window cache among them: 40 rows past a prompt, each followed by a rejected draft
    in a decode of its own, cut back, give the same logits bit for bit as rows without drafts,
    while the window drops rows more than twice over."""
    path = write_tiny_model(tmp_path / "gemma2.gguf", "gemma2", N_BLOCKS["gemma2"])
    with LlamaModel(path, SETTINGS) as model:
        prompt = Vocabulary(model).tokenize(PROMPT)
        window = model.sliding_window
        assert 0 < 2 * window < len(prompt) + STEPS
        plain = greedy_rows(model, prompt, reject_each=False)
        cut = greedy_rows(model, prompt, reject_each=True)
    for step, (a, b) in enumerate(zip(plain, cut, strict=True)):
        assert np.array_equal(a, b), (step, float(np.abs(a - b).max()))
