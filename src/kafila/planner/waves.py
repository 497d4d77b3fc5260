"""How many waves a ring keeps in flight for the rows running now, and how they split.

R sequences decode, each one row a token (its next row needs its last token, so a sequence
rides in one wave at a time); they go round in W waves of ⌈R/W⌉ or ⌊R/W⌋ rows. Stage k takes
a_k + r·p_k for a wave of r rows (a_k: a step's fixed cost; p_k: a row's, which at the head is
mostly its output row), the wire adds L one way round the ring, and the stages on one machine
share its cores (S_m: the stages on machine m). Every wave comes back once a period

    C(r) = Σ_k (a_k + r·p_k) + L                              a wave of r rows round the ring
    P(W) = max( C(⌈R/W⌉), max_m [ Σ_{k∈S_m} (W·a_k + R·p_k) + [m = host]·W·o ] )

no shorter than its own trip, nor than a machine's work for all W waves; each sequence gets a
token a period, so the time per token is P(W)/R. o is the serving host's own work a wave beyond
its stage's timer (embedding, sampling, framing, its event loop's QUIC and hand-offs, the API),
on its machine: it overlaps the other machines' compute, so it is not in the trip, and no timer
measures it; a period observed at W waves where neither the trip nor another machine's work
explains it shows it, o = (observed − the host machine's stages' work) / W (`host_work_ms`).
Where every stage is on one machine, the trip never leaves it: L is its own cores' work (the
hops' framing and event loops), W·L more of it, so one wave (P(1) = C(R) ≤ P(W)) always wins
there. More waves shorten a wave's trip (fewer rows
at each stage) and keep more machines busy at once, but pay every a_k again for each: with the
fixed costs dominant one wave wins, with per-row compute dominant one wave per machine, and with
a long wire (the stages idle most of a trip) more. The W of least P, from 1 to R, is chosen;
where it saves less than MIN_GAIN of the current count's period, the count stays (the figures are
measured, not exact, and a count that flips on noise reorders the waves for nothing).

The same figures price drafts in flight (`idle_behind_ms`): a wave a sequence sends behind its
own still out takes, of its rows' time, only what the machines do not idle while the waves
ahead travel, C(r₀) − max_m (each machine's work for every wave out); across homes that is most
of a trip wherever the stages run, on loopback nothing.

A greedy request's token and drafts go one row a decode at every stage, and each stage passes a
row on as soon as it has decoded it (`engines.rows_as_decoded`), so a wave of r such rows is r
decodes of one row at each stage (d_k = a_k + p_k each), its rows one behind the other round the
ring: the first comes back after Σ_k d_k + L, each next one as the busiest machine frees,

    C₁(r) = Σ_k d_k + L + (r − 1) · max_m Σ_{k∈S_m} d_k        r rows one a decode round the ring

(on one machine, r · Σ_k d_k + L: one stage after another, as without passing rows on).

Pure: the engine loop gives it the stages' measured decodes (`StageReport.decode_ms_by_rows`,
fitted to a_k + r·p_k: `StageCost.fit`), the ring's measured trip and the periods it observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kafila.planner.stage_cost import StageCost

MIN_GAIN = 0.05  # a new wave count must save this much of the current one's period


@dataclass(frozen=True)
class WaveCosts:
    """What the host knows of its ring for choosing waves: each stage's price, the machine each
    runs on (stages sharing one share its cores), and the wire's time one way round."""

    stages: tuple[StageCost, ...]
    machines: tuple[int, ...]  # one per stage: stages with the same number share a machine
    ring_ms: float
    host_machine: int | None = None  # the serving host's machine, where it runs a stage
    host_ms: float = 0.0  # o: the host's own work a wave there, beyond its stage's (`host_work_ms`)
    # Priced from the stages' decodes of one row alone (`one_row_costs`): they price only waves
    # that go one row a decode (`idle_behind_ms`' row_by_row), not a decode of several rows.
    one_row: bool = False

    def __post_init__(self) -> None:
        if not self.stages or len(self.machines) != len(self.stages):
            raise ValueError("a ring has at least one stage, and each stage a machine")
        if not (self.ring_ms >= 0 and math.isfinite(self.ring_ms)):
            raise ValueError(f"the ring's trip is finite and never negative, not {self.ring_ms}")
        if not (self.host_ms >= 0 and math.isfinite(self.host_ms)):
            raise ValueError(f"the host's work a wave is finite and never negative, not {self.host_ms}")

    def trip_ms(self, rows: int, row_by_row: bool = False) -> float:
        """C(r): one wave of `rows` round the ring; `row_by_row`, C₁(r): one row a decode at each
        stage, each row passed on as decoded, so the rows overlap across machines (the module's
        formula)."""
        if not row_by_row:
            return sum(stage.batch_ms(rows) for stage in self.stages) + self.ring_ms
        one_row = dict.fromkeys(self.machines, 0.0)  # each machine's decodes of one row
        for stage, machine in zip(self.stages, self.machines, strict=True):
            one_row[machine] += stage.batch_ms(1)
        return sum(one_row.values()) + self.ring_ms + (rows - 1) * max(one_row.values())

    def period_ms(self, rows: int, waves: int) -> float:
        """P(W): how often each of `waves` waves, `rows` rows in all, comes back."""
        if rows < 1 or not 1 <= waves <= rows:
            raise ValueError(f"{rows} rows cannot ride in {waves} waves")
        return max(self.trip_ms(math.ceil(rows / waves)), *self._busy_ms(rows, waves).values())

    def _busy_ms(self, rows: int, waves: int) -> dict[int, float]:
        """Each machine's work for `waves` waves of `rows` rows in all."""
        one_machine = len(set(self.machines)) == 1  # the trip never leaves it: its hops are its own work
        busy = {machine: waves * self.ring_ms if one_machine else 0.0 for machine in self.machines}
        for stage, machine in zip(self.stages, self.machines, strict=True):
            busy[machine] += waves * stage.step_ms + rows * stage.row_ms
        if self.host_machine in busy:
            busy[self.host_machine] += waves * self.host_ms
        return busy

    def host_work_ms(self, rows: int, waves: int, observed_ms: float) -> float | None:
        """o as a period observed at `waves` waves of `rows` rows shows it: where neither the
        wave's trip nor another machine's work explains the period (both short of it by
        MIN_GAIN), the host's machine set it, o = (observed − its stages' work) / W; else None
        (o is then hidden under the trip or another machine's compute, and not seen)."""
        if self.host_machine is None:
            return None
        busy = WaveCosts(self.stages, self.machines, self.ring_ms)._busy_ms(rows, waves)
        others = [ms for machine, ms in busy.items() if machine != self.host_machine]
        explained = max([self.trip_ms(math.ceil(rows / waves)), *others])  # others: none on one machine
        if observed_ms <= (1 + MIN_GAIN) * explained:
            return None
        return max(0.0, (observed_ms - busy.get(self.host_machine, 0.0)) / waves)


def idle_behind_ms(costs: WaveCosts, rows_out: Sequence[int], row_by_row: bool = False) -> float | None:
    """What a wave sent behind a sequence's waves out (drafts in flight) may take of the ring
    without delaying them: while the oldest of them (`rows_out`, oldest first, each a wave's rows)
    travels, C(rows_out[0]), the busiest machine works its stages' part of every wave out (and,
    at the serving host's, o a wave); the rest of the trip that machine idles, at least 0. A
    greedy request's waves go one row a decode at every stage (`row_by_row`): a wave of r rows
    is r decodes of one there in each machine's work, and its trip C₁(r) (its rows passed on as
    decoded, one behind the other), so across machines the ring idles about
    Σ_k d_k − max_m Σ_{k∈S_m} d_k + L while one wave travels, whatever its rows. The
    wire's time counts as idle, on one machine too: a PING round's work at each hop is a small
    frame's, next to a decode's, so a ring of one box at 40 ms a hop idles ~60 of ~85 ms, and on
    loopback (0 ms) about nothing. None with no wave out, or on a ring of one stage, where a wave
    behind only waits at that stage for the one ahead (nothing travels while it computes), and
    where the costs know only the stages' decodes of one row (`WaveCosts.one_row`) and the waves
    do not go one row a decode."""
    if any(rows < 1 for rows in rows_out):
        raise ValueError(f"a wave out has a row at least, not {list(rows_out)}")
    if not rows_out or len(costs.stages) < 2 or (costs.one_row and not row_by_row):
        return None
    price = StageCost.row_by_row_ms if row_by_row else StageCost.batch_ms
    work = dict.fromkeys(costs.machines, 0.0)
    for stage, machine in zip(costs.stages, costs.machines, strict=True):
        work[machine] += sum(price(stage, rows) for rows in rows_out)
    if costs.host_machine in work:
        work[costs.host_machine] += len(rows_out) * costs.host_ms
    return max(0.0, costs.trip_ms(rows_out[0], row_by_row) - max(work.values()))


def decode_waves(rows: int, costs: WaveCosts | None, current: int) -> int:
    """W for `rows` sequences decoding (see the module's formula): `current` where costs are
    unknown (None) or no count saves MIN_GAIN of its period, at most `rows`, at least 1."""
    if rows <= 1:
        return 1
    current = max(1, min(current, rows))
    if costs is None:
        return current
    periods = {waves: costs.period_ms(rows, waves) for waves in range(1, rows + 1)}
    best = min(periods, key=lambda waves: (periods[waves], waves))
    return best if periods[best] < (1 - MIN_GAIN) * periods[current] else current


def wave_costs_from(
    stage_points: Sequence[Sequence[tuple[int, float]]], machines: Sequence[int], ring_ms: float | None
) -> WaveCosts | None:
    """WaveCosts from each stage's measured decodes (rows, median ms); None until every stage has
    measured decodes of two row counts, or without the ring's trip."""
    if not stage_points or ring_ms is None or len(machines) != len(stage_points):
        return None
    fitted = [StageCost.fit(points) for points in stage_points]
    if any(stage is None for stage in fitted):
        return None
    return WaveCosts(tuple(s for s in fitted if s is not None), tuple(machines), ring_ms)


def one_row_costs(
    stage_points: Sequence[Sequence[tuple[int, float]]], machines: Sequence[int], ring_ms: float | None
) -> WaveCosts | None:
    """WaveCosts for waves that go one row a decode at every stage (`WaveCosts.one_row`): each
    stage's measured decode of one row is all their trip and work take (`trip_ms`' C₁), so these
    price a greedy request's drafts in flight where the stages have measured no other row count,
    as where a greedy request alone drafts (its drafted rows go one a decode: `wave_costs_from`
    then has no line to fit). None until every stage has measured a decode of one row, or without
    the ring's trip."""
    if not stage_points or ring_ms is None or len(machines) != len(stage_points):
        return None
    alone = [next((ms for rows, ms in points if rows == 1), None) for points in stage_points]
    if any(ms is None for ms in alone):
        return None
    return WaveCosts(
        tuple(StageCost(ms, 0.0) for ms in alone if ms is not None), tuple(machines), ring_ms, one_row=True
    )
