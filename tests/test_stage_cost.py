"""A stage's price for a step, step_ms + r·row_ms (planner/stage_cost.py): the one rule that prices
pipelined prefill's chunks and the waves in flight."""

from __future__ import annotations

import math

import pytest

from kafila.planner.stage_cost import StageCost


def test_a_step_of_rows_together_pays_the_fixed_part_once_and_one_row_at_a_time_once_a_row() -> None:
    stage = StageCost(5.0, 1.5)
    assert stage.batch_ms(4) == 5.0 + 4 * 1.5
    assert stage.row_by_row_ms(4) == 4 * (5.0 + 1.5)
    assert stage.batch_ms(1) == stage.row_by_row_ms(1) == 6.5


BAD = [(-1.0, 0.5), (1.0, -0.5), (1.0, math.inf), (math.inf, 1.0), (math.nan, 1.0), (1.0, math.nan)]


@pytest.mark.parametrize(("step_ms", "row_ms"), BAD)
def test_bad_figures_are_refused(step_ms: float, row_ms: float) -> None:
    with pytest.raises(ValueError, match="finite and never negative"):
        StageCost(step_ms, row_ms)
