"""Where a rejected draft may leave a trace on real llama.cpp: not in the ring's handling of drafts
nor in the cut of a windowed cache. A ring's logits for drafted waves, cuts and all, are what
llama.cpp gives the whole model for the same decodes and cuts, bit for bit; a draft decoded after
its row and cut back leaves the next logits as without it, on gemma2's tiny model with rows
falling out of its window. What moves them is a draft sharing its row's decode (docs/architecture.md,
"Exactness")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from test_speculation_models import GREEDY, REPEATING, SETTINGS, STEPS, Departing, cut_in_two, drive
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.engine.engines import (
    Engine,
    EngineStep,
    EveryRowLogits,
    Launched,
    RingEngine,
    StepResult,
    UnsplitEngine,
)
from kafila.runtime.engine.speculation import NgramDrafter, Speculate
from kafila.runtime.engine.stage import BlockStage, FloatRows, StepInput, Vocabulary, _decodes
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.serving.batcher import Job

WINDOWED = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=1, n_threads=2)
ROWS_PAST_THE_WINDOW = 40


class Recording:
    """An engine that keeps, in the order it sent them, every wave it launched with what came back
    for it, and every cut."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.log: list[Wave | tuple[int, int]] = []
        self._out: dict[int, Wave] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def launch(self, steps: Sequence[EngineStep]) -> Launched:
        launched = self.engine.launch(steps)
        self._out[id(launched)] = wave = Wave(list(steps))
        self.log.append(wave)
        return launched

    def land(self, launched: Launched) -> list[StepResult]:
        results = self.engine.land(launched)
        self._out.pop(id(launched)).results = results
        return results

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        self.engine.forget(sequence_id, keep)
        self.log.append((sequence_id, keep))


@dataclass
class Wave:
    steps: list[EngineStep]
    results: list[StepResult] | None = None


def as_matrix(result: StepResult) -> npt.NDArray[np.float32] | None:
    if isinstance(result, EveryRowLogits):
        return result.rows
    assert result is None or isinstance(result, np.ndarray), result
    return result


# Not gpt-oss (Family.speculation_refused) nor qwen3next (a recurrent state): they draft nothing.
DRAFTING = [arch for arch in SUPPORTED_TINY_ARCHS if arch not in ("gpt-oss", "qwen3next")]


@pytest.mark.parametrize("arch", DRAFTING)
def test_a_ring_s_drafted_waves_give_llama_cpp_s_logits_for_the_same_decodes(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests at once on a two-stage ring (the block stage in its own process), with drafts
    of greedy decoding's answer of which every third is wrong: every logit the ring returned, for
    every row of every wave, equals what the whole model on one llama.cpp context gives for the
    same decodes and cuts, bit for bit (greedy: each drafted step one row a decode at both
    stages), so no cut, position or row is mixed up."""
    model, ring = cut_in_two(arch, tmp_path)
    assert isinstance(ring, RingEngine) and ring.head is not None
    # The head times decodes of single rows together against one by one and takes the cheaper
    # (row_split), which the replay below cannot know: here they always go together.
    monkeypatch.setattr(ring.head.row_split, "one_by_one", lambda rows: False)
    recording = Recording(ring)
    try:
        jobs = [Job(f"{i}", ring.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        answers = {job.request_id: greedy_unsplit(model, job.prompt, STEPS) for job in jobs}

        def departing(job: Job) -> NgramDrafter:
            return Departing(job.prompt, answers[job.request_id], ring.n_vocab(), wrong=3)

        _, batcher = drive(recording, jobs, Speculate.NGRAM, drafter=departing)  # type: ignore[arg-type]
        assert 0 < batcher.speculation.accepted < batcher.speculation.drafted, arch  # kept and cut
    finally:
        ring.close()
    whole = UnsplitEngine(model, SETTINGS)  # the ring's own settings
    try:
        rows = 0
        for entry in recording.log:
            if not isinstance(entry, Wave):
                whole.forget(*entry)
                continue
            assert entry.results is not None  # every wave launched landed
            for step, got, alone in zip(entry.steps, entry.results, whole.step_many(entry.steps), strict=True):
                a, b = as_matrix(got), as_matrix(alone)
                assert (a is None) == (b is None), (arch, step)
                if a is not None and b is not None:
                    assert np.array_equal(a, b), (arch, step.sequence_id, step.position, float(np.abs(a - b).max()))
                    rows += 1 if a.ndim == 1 else len(a)
        assert rows > 2 * STEPS, arch
    finally:
        whole.close()


def greedy_rows(model: LlamaModel, prompt: list[int], reject_each: bool) -> list[npt.NDArray[np.float32]]:
    """Each greedy row's logits, ROWS_PAST_THE_WINDOW rows past the prompt; with `reject_each`, after each row a
    wrong draft decoded on its own and cut back, as a stage cuts a rejected one."""
    model.forget(0)
    for start in range(0, len(prompt), WINDOWED.n_batch):
        chunk = prompt[start : start + WINDOWED.n_batch]
        outputs = [start + i == len(prompt) - 1 for i in range(len(chunk))]
        model.decode([0] * len(chunk), range(start, start + len(chunk)), outputs, tokens=chunk)
    token = int(np.argmax(model.logits(len(chunk) - 1)))
    rows = []
    for position in range(len(prompt), len(prompt) + ROWS_PAST_THE_WINDOW):
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
    with LlamaModel(path, WINDOWED) as model:
        prompt = Vocabulary(model).tokenize(PROMPT)
        window = model.sliding_window
        assert 0 < 2 * window < len(prompt) + ROWS_PAST_THE_WINDOW
        plain = greedy_rows(model, prompt, reject_each=False)
        cut = greedy_rows(model, prompt, reject_each=True)
    for step, (a, b) in enumerate(zip(plain, cut, strict=True)):
        assert np.array_equal(a, b), (step, float(np.abs(a - b).max()))


def rows_after_a_cut_back(model: LlamaModel, tokens: list[int], behind: bool) -> npt.NDArray[np.float32]:
    """The logits of the row a cut back leaves next, on a window of `w` positions: another sequence's
    row first, then the sequence's w - 2 rows, a wave of its next token and 7 drafts, the other
    sequence's slot freed (its cell is where the next decode looks first), with `behind` a wave
    of 4 rows behind the drafts, then a reject of every draft."""
    start = model.sliding_window - 2
    model.decode([1], [0], [False], tokens=tokens[:1])
    model.decode([0] * start, range(start), [False] * start, tokens=tokens[:start])
    model.decode([0] * 8, range(start, start + 8), [True] * 8, tokens=tokens[start : start + 8])
    model.forget(1)
    if behind:
        model.decode([0] * 4, range(start + 8, start + 12), [True] * 4, tokens=tokens[start + 8 : start + 12])
    model.forget(0, start + 1)
    model.decode([0], [start + 1], [True], tokens=tokens[start + 1 : start + 2])
    logits = model.logits(0)
    model.forget(0)
    return logits


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt-oss"])  # windows of 16, 16 and 8 positions
def test_a_wave_behind_drafts_leaves_a_windowed_cache_the_cells_a_cut_back_needs(arch: str, tmp_path: Path) -> None:
    """llama.cpp's window cache gives a decode any cell whose position has left the window of its
    sequence's last position: with drafts out, that last position is a draft, so a wave decoded
    behind them (drafts in flight, or another sequence's rows on a ring of several waves) could
    take cells of positions a reject then needs again. Here the wave behind finds those cells
    first (only the freed slot's cell is empty before them): the row after the cut reads the same
    logits, bit for bit, as without that wave, because every cell also belongs to a keeper."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, N_BLOCKS[arch])
    with LlamaModel(path, ContextSettings(n_ctx=256, n_batch=16, n_seq_max=2, n_threads=2)) as model:
        assert model.sliding_window > 0 and model.keeps_window_cells
        tokens = (Vocabulary(model).tokenize(PROMPT) * 2)[: model.sliding_window + 10]
        without = rows_after_a_cut_back(model, tokens, behind=False)
        with_wave_behind = rows_after_a_cut_back(model, tokens, behind=True)
    assert np.array_equal(without, with_wave_behind), float(np.abs(without - with_wave_behind).max())


def test_a_token_and_its_drafts_split_between_two_decodes_are_cut_back_as_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a block stage a step of a token and its 7 drafts may straddle two decodes
    (`stage._decodes`): here another sequence's 4 rows fill half the first, which takes a freed
    slot's 8 cells, and the second then finds first the cells of the sequence's oldest positions,
    which have left the window (16) of the drafts before it. A cut back to the token reads the
    row after it bit for bit as a stage that never saw the drafts, because those cells also belong
    to a keeper (`LlamaModel.keeps_window_cells`); without keepers it does not."""
    gemma = write_tiny_model(tmp_path / "gemma.gguf", "gemma3", n_blocks=6)
    first, _ = slice_model(gemma, [3, 3], tmp_path / "stages")
    settings = ContextSettings(n_ctx=256, n_batch=8, n_seq_max=3, n_threads=2)

    def row_after_the_cut(drafts: int) -> FloatRows:
        stage = BlockStage(first.path, settings)
        rows = np.random.default_rng(11).standard_normal((35, stage.hidden)).astype(np.float32) * 0.01
        try:
            assert stage.model.sliding_window == 16
            stage.forward([StepInput(1, 0, rows[:8])])
            stage.forward([StepInput(0, 0, rows[8:22])])
            stage.forget(1)
            wave = [StepInput(2, 0, rows[22:26]), StepInput(0, 14, rows[26 : 27 + drafts])]
            split = _decodes(wave, settings.n_batch)
            assert sum(any(piece.sequence_id == 0 for piece in decode) for decode in split) == 1 + (drafts == 7)
            stage.forward(wave)
            stage.forget(0, 15)
            (row,) = stage.forward([StepInput(0, 15, rows[34:35])])
            return row
        finally:
            stage.close()

    alone = row_after_the_cut(0)
    assert np.array_equal(row_after_the_cut(7), alone)
    monkeypatch.setattr(LlamaModel, "_window_cells_kept", lambda self: False)
    assert np.array_equal(row_after_the_cut(0), alone)
    assert not np.array_equal(row_after_the_cut(7), alone)  # the case is one where llama.cpp takes the cells
