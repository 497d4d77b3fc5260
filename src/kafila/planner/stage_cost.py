"""A stage's price for a step: a fixed part and a part a row, a + r·p, the one linear rule that
pipelined prefill's chunks (`prefill.py`) and the waves in flight (`waves.py`) price a ring by."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class StageCost:
    """One stage's price for a step of r rows: step_ms + r · row_ms."""

    step_ms: float  # a: what every step costs, whatever its rows
    row_ms: float  # p: what each of its rows adds

    def __post_init__(self) -> None:
        if not (self.step_ms >= 0 and self.row_ms >= 0 and math.isfinite(self.step_ms + self.row_ms)):
            raise ValueError(f"a stage's costs are finite and never negative, not {self}")

    def batch_ms(self, rows: int) -> float:
        """One step of `rows` rows together: a prompt's chunk, a wave's decode."""
        return self.step_ms + rows * self.row_ms

    def row_by_row_ms(self, rows: int) -> float:
        """`rows` steps of one row each: a greedy request's token and drafts, which every stage
        decodes one row a decode (`stage._decodes`)."""
        return rows * (self.step_ms + self.row_ms)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> StageCost | None:
        """The line through (rows, ms) steps: the Theil–Sen line (the median slope between row
        counts, the median intercept), which one count measured in a busy moment moves little;
        each never below 0. None where fewer than two row counts were measured."""
        if len({rows for rows, _ in points}) < 2:
            return None
        slopes = [(b_ms - a_ms) / (b - a) for (a, a_ms), (b, b_ms) in combinations(points, 2) if a != b]
        row_ms = max(0.0, statistics.median(slopes))
        step_ms = max(0.0, statistics.median(ms - rows * row_ms for rows, ms in points))
        return cls(step_ms, row_ms)
