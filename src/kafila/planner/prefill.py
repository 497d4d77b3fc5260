"""How long a prompt's chunks are when they ride the ring in successive waves (pipelined prefill).

A prompt of N rows goes in m chunks of c = ⌈N/m⌉ rows. Stage k takes a_k + c·p_k for a chunk
(a_k: a step's fixed cost, what a step of one row takes there; p_k: its time per prompt row), and
the wire adds L one way round the ring. With at most B chunks out at once:

    C(c) = Σ_k (a_k + c·p_k) + L                     one chunk round the ring
    T(m) = C(c) + (m − 1) · max(max_k (a_k + c·p_k), C(c) / B)

the first chunk's whole trip, then each later one a period behind: the slowest stage's time for a
chunk, or, where B chunks out cannot fill the ring, a trip shared by B. Small chunks overlap the
stages (the second term shrinks with c); each chunk pays every a_k again and a period never drops
below C/B, so chunks too small lose what overlap gains. With B = 1, T(m) = m·C(c): one chunk at
a time, where splitting only adds steps. The chunk count of least T, between ⌈N/batch⌉ (no chunk
exceeds a step's rows) and ⌊N/MIN_CHUNK_ROWS⌋, is chosen; where it saves less than MIN_GAIN of
the fewest chunks' time, the prompt is not split further.

The model sees stages, not links: a chunk's bytes on a slow link are part of the measured stage
times only where a stage waits for them. Pure: the engine loop gives it the stages' measured
figures (`StageReport`) and the ring's measured trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kafila.planner.stage_cost import StageCost

# Below this a chunk costs more a row than the linear price says: llama.cpp's CPU kernels lose
# their batch's efficiency. gemma-3-270m whole, one thread, 1,000 rows here: in chunks of 500,
# 10.5 s; of 128, 11.0; of 64, 12.0; of 35, 14.3-16.1 (a 2,000-token prompt in 35-row chunks
# over the NAT lab measured twice the stages' ms a row of 500-row chunks, and lost its overlap).
MIN_CHUNK_ROWS = 128
MAX_CHUNKS = 64  # chunk counts tried for one prompt: T(m) flattens long before
MIN_GAIN = 0.05  # a split must save this much of the unsplit time: the figures are measured, not exact


@dataclass(frozen=True)
class PrefillCosts:
    """What the host knows of its ring for a prompt: each stage's prices and the wire's time one way round."""

    stages: tuple[StageCost, ...]
    ring_ms: float

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a ring has at least one stage")
        if not (self.ring_ms >= 0 and math.isfinite(self.ring_ms)):
            raise ValueError(f"the ring's trip is finite and never negative, not {self.ring_ms}")

    def trip_ms(self, rows: int) -> float:
        """C(c): one chunk of `rows` round the ring."""
        return sum(stage.batch_ms(rows) for stage in self.stages) + self.ring_ms

    def slowest_ms(self, rows: int) -> float:
        return max(stage.batch_ms(rows) for stage in self.stages)


def first_token_ms(prompt_rows: int, chunk_rows: int, costs: PrefillCosts, chunks_in_flight: int) -> float:
    """T: when the prompt's last chunk is back, in chunks of `chunk_rows`, `chunks_in_flight` out at once."""
    if prompt_rows < 1 or chunk_rows < 1 or chunks_in_flight < 1:
        raise ValueError("a prompt, its chunks and the chunks out at once are at least one each")
    chunks = math.ceil(prompt_rows / chunk_rows)
    rows = math.ceil(prompt_rows / chunks)  # chunks as even as their count allows
    trip = costs.trip_ms(rows)
    return trip + (chunks - 1) * max(costs.slowest_ms(rows), trip / chunks_in_flight)


def prefill_chunk_rows(prompt_rows: int, costs: PrefillCosts | None, chunks_in_flight: int, batch_rows: int) -> int:
    """The chunk length for a prompt of `prompt_rows` (see the module's formula): at most `batch_rows`,
    and the prompt's whole length, up to `batch_rows`, where costs are unknown (None), only one
    chunk may be out, or a split gains less than MIN_GAIN."""
    if prompt_rows < 1 or batch_rows < 1 or chunks_in_flight < 1:
        raise ValueError("a prompt, a step's rows and the chunks out at once are at least one each")
    fewest = math.ceil(prompt_rows / batch_rows)
    unsplit = math.ceil(prompt_rows / fewest)
    if costs is None or chunks_in_flight == 1:
        return unsplit
    most = max(fewest, min(prompt_rows // MIN_CHUNK_ROWS, fewest + MAX_CHUNKS - 1))  # chunks of MIN_CHUNK_ROWS at least
    times = {
        m: first_token_ms(prompt_rows, math.ceil(prompt_rows / m), costs, chunks_in_flight)
        for m in range(fewest, most + 1)
    }
    best = min(times, key=lambda m: (times[m], m))
    if times[best] > (1 - MIN_GAIN) * times[fewest]:
        return unsplit
    return math.ceil(prompt_rows / best)


def costs_from(stage_ms: Sequence[tuple[float | None, float | None]], ring_ms: float | None) -> PrefillCosts | None:
    """PrefillCosts from each stage's (ms a step of one row, ms per prompt row) as measured; None
    until every stage has measured a prompt's rows (a step of one row unmeasured counts as free)."""
    if not stage_ms or ring_ms is None or any(per_row is None for _, per_row in stage_ms):
        return None
    stages = tuple(StageCost(step or 0.0, per_row or 0.0) for step, per_row in stage_ms)
    return PrefillCosts(stages, ring_ms)
