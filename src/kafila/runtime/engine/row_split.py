"""Whether a stage decodes a wave's rows together or one decode a row, from what each has cost it.

Batching rows is what a stage is for, but not every kernel gains from it: on one CPU thread,
gemma-3-270m's head (one block and the 262,144-row output, Q8_0) decodes one row in 12 ms, two
rows together in 35, three in 40 and four in 42 (llama.cpp's matrix product for two to four
columns is slower a column than its product with one). Two rows as two decodes of one take 24.
So the stage times both: a decode of r rows together, and a decode of one row, and where r
decodes of one cost less than the last decodes of r together, it runs them one by one. Every
RECHECK_EVERY-th wave of r rows still goes together, so a figure the load has changed since is
measured again. Until both are measured, rows go together (as llama.cpp would take them).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

RECENT_DECODES = 16  # each size's window of decodes together: its median decides
RECHECK_EVERY = 64  # of the waves of r rows run one by one, this one goes together again


@dataclass
class RowSplit:
    """A stage's record of its decodes by rows, and the choice it gives for the next one."""

    together: dict[int, deque[float]] = field(default_factory=dict)  # rows → recent seconds of one decode
    split_since: dict[int, int] = field(default_factory=dict)  # rows → waves run one by one since the last together

    def one_by_one(self, rows: int) -> bool:
        """Whether a decode of `rows` rows (one a sequence) runs as `rows` decodes of one row."""
        if rows < 2 or self.split_since.get(rows, 0) + 1 >= RECHECK_EVERY:
            return False
        alone, together = self.together.get(1), self.together.get(rows)
        if not alone or not together:
            return False
        return rows * statistics.median(alone) < statistics.median(together)

    def record(self, rows: int, seconds: float, one_by_one: bool) -> None:
        """A decode of `rows` rows took `seconds`, together or one by one (then it counts as
        `rows` decodes of one row, each its share of the time)."""
        if one_by_one:
            self.split_since[rows] = self.split_since.get(rows, 0) + 1
            self._add(1, seconds / rows)
            return
        self.split_since.pop(rows, None)
        self._add(rows, seconds)

    def _add(self, rows: int, seconds: float) -> None:
        self.together.setdefault(rows, deque(maxlen=RECENT_DECODES)).append(seconds)
