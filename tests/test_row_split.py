"""A stage's rows decoded together or one decode each, as each has cost it (runtime/engine/row_split.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from kafila.runtime.engine.row_split import RECHECK_EVERY, RowSplit
from kafila.runtime.engine.stage import HeadStage, StepInput
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings

SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_seq_max=4, n_threads=1)


def measured(alone_s: float, together: dict[int, float]) -> RowSplit:
    split = RowSplit()
    split.record(1, alone_s, one_by_one=False)
    for rows, seconds in together.items():
        split.record(rows, seconds, one_by_one=False)
    return split


def test_rows_go_together_until_both_ways_are_measured() -> None:
    assert not RowSplit().one_by_one(2)
    assert not measured(0.012, {}).one_by_one(2)  # two rows together never timed
    assert not RowSplit(together={}).one_by_one(1)


def test_one_by_one_where_that_many_single_decodes_cost_less() -> None:
    """gemma-3-270m's head on one CPU thread: 12 ms a row alone, 35 for two together, 42 for four."""
    split = measured(0.012, {2: 0.035, 4: 0.042})
    assert split.one_by_one(2)  # 24 ms < 35
    assert not split.one_by_one(4)  # 48 ms > 42
    assert not measured(0.012, {2: 0.020}).one_by_one(2)  # a batch that pays stays together


def test_a_split_size_goes_together_again_every_recheck() -> None:
    """Waves run one by one say nothing of the cost together, which the load may have changed:
    every RECHECK_EVERY-th goes together and is timed again."""
    split = measured(0.012, {2: 0.035})
    for _ in range(RECHECK_EVERY - 1):
        assert split.one_by_one(2)
        split.record(2, 0.024, one_by_one=True)
    assert not split.one_by_one(2)
    split.record(2, 0.020, one_by_one=False)  # together is now cheaper: it stays so
    split.record(2, 0.020, one_by_one=False)
    assert not split.one_by_one(2)


def test_a_split_wave_counts_as_single_row_decodes() -> None:
    split = measured(0.012, {2: 0.035})
    split.record(2, 0.030, one_by_one=True)  # 15 ms each
    assert list(split.together[1]) == [0.012, 0.015]
    assert list(split.together[2]) == [0.035]


@pytest.fixture(scope="module")
def head_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("row_split")
    model = write_tiny_model(tmp / "tiny.gguf", "llama", n_blocks=3)
    return cached_slices(model, [2, 1], tmp / "stages")[-1].path


def test_a_head_decodes_a_wave_one_row_at_a_time_where_that_costs_less(head_file: Path) -> None:
    """Real llama.cpp: with two rows together measured dearer than two alone, a wave of two goes
    as two decodes, whose logits are each sequence's decoded alone; each sequence's next rows
    follow on."""
    head, reference = HeadStage(head_file, SETTINGS), HeadStage(head_file, SETTINGS)
    try:
        rng = np.random.default_rng(3)
        prompts = [rng.standard_normal((5, head.hidden)).astype(np.float32) for _ in range(2)]
        for stage in (head, reference):
            stage.forward([StepInput(s, 0, prompts[s]) for s in range(2)])
        head.row_split = measured(0.001, {2: 1.0})
        for position in (5, 6):
            rows = [rng.standard_normal((1, head.hidden)).astype(np.float32) for _ in range(2)]
            split = head.forward([StepInput(s, position, rows[s]) for s in range(2)], decode=True)
            alone = [reference.forward([StepInput(s, position, rows[s])], decode=True)[0] for s in range(2)]
            for got, want in zip(split, alone, strict=True):
                assert got is not None and want is not None
                np.testing.assert_array_equal(got, want)
        assert head.row_split.split_since[2] == 2
        assert [head.model.next_position(s) for s in range(2)] == [7, 7]
    finally:
        head.close()
        reference.close()
