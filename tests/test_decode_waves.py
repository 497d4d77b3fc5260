"""How many waves a ring keeps in flight (planner/waves.py): the count of least period for the
rows running now, from what the stages' decodes cost (a fixed part and a part a row) and the
ring's trip; and what a stage reports for it (its recent decodes' times by size)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import write_tiny_model

from kafila.contracts import MAX_REPORTED_ROW_COUNTS, StageReport
from kafila.planner.stage_cost import StageCost
from kafila.planner.waves import (
    MIN_GAIN,
    WaveCosts,
    decode_waves,
    idle_behind_ms,
    wave_costs_from,
)
from kafila.runtime.engine.stage import RECENT_SIZED_STEPS, BlockStage, StageTimer
from kafila.runtime.engine.worker import handle_frames
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings
from kafila.wire.frames import Frame, Kind


def ring(stages: list[tuple[float, float]], ring_ms: float, machines: list[int] | None = None) -> WaveCosts:
    machines = list(range(len(stages))) if machines is None else machines
    return WaveCosts(tuple(StageCost(a, p) for a, p in stages), tuple(machines), ring_ms)


def simulated_period_ms(costs: WaveCosts, rows: int, waves: int, cycles: int = 60) -> float:
    """The period of `waves` equal waves going round stages that are machines of their own, each
    stage taking waves first come first served, by the departure recurrence of a closed tandem
    line: wave n (n-th overall) leaves stage k at max(it left stage k-1, stage k's previous wave
    left) + its time there, and comes back to stage 0 the ring's trip after its last stage."""
    size = rows // waves
    times = [stage.batch_ms(size) for stage in costs.stages]
    left: list[list[float]] = []  # per job: when it left each stage
    for n in range(waves * cycles):
        arrives = left[n - waves][-1] + costs.ring_ms if n >= waves else 0.0
        done = []
        for k, took in enumerate(times):
            ready = arrives if k == 0 else done[-1]
            free = left[n - 1][k] if n >= 1 else 0.0
            done.append(max(ready, free) + took)
        left.append(done)
    last, earlier = left[-1][-1], left[-1 - waves * 10][-1]
    return (last - earlier) / 10


def test_the_period_by_hand() -> None:
    """Two stages (20 + 5·r and 2 + 3·r ms), 1 ms of wire, 4 rows: one wave waits its own trip;
    two waves wait for the head, which now takes its fixed 20 ms twice a period."""
    costs = ring([(20, 5), (2, 3)], 1.0)
    assert costs.period_ms(4, 1) == pytest.approx(20 + 20 + 2 + 12 + 1)
    assert costs.period_ms(4, 2) == pytest.approx(max(20 + 10 + 2 + 6 + 1, 2 * 20 + 4 * 5))
    assert costs.period_ms(3, 2) == pytest.approx(max(20 + 10 + 2 + 6 + 1, 40 + 15, 4 + 9))  # the bigger wave's trip
    with pytest.raises(ValueError, match="cannot ride"):
        costs.period_ms(2, 3)


@given(
    st.lists(st.tuples(st.floats(0, 50), st.floats(0, 20)), min_size=2, max_size=5),
    st.floats(0, 200),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_the_period_is_what_waves_round_a_ring_of_machines_take(
    stages: list[tuple[float, float]], ring_ms: float, waves: int, size: int
) -> None:
    """On stages that are machines of their own, P(W) for W equal waves is the steady period of
    the waves simulated stage by stage."""
    costs = ring(stages, ring_ms)
    rows = waves * size
    assert costs.period_ms(rows, waves) == pytest.approx(simulated_period_ms(costs, rows, waves), rel=1e-6, abs=1e-6)


def test_a_fixed_cost_a_wave_that_dominates_keeps_one_wave() -> None:
    """The head's step costs 30 ms whatever its rows, a row 1 ms: every extra wave pays 30 ms more there."""
    costs = ring([(3, 1), (30, 1)], 1.0)
    assert decode_waves(4, costs, current=2) == 1
    same_machine = ring([(5, 4), (5, 4)], 1.0, machines=[0, 0])  # two stages sharing one machine's cores
    assert decode_waves(4, same_machine, current=2) == 1


def test_on_one_machine_the_trip_is_its_own_work_and_one_wave_wins() -> None:
    """Stages on one machine behind a long trip: a ring of machines would hide the trip under more
    waves, but on one the trip's hops are that machine's own work, which waves only add to."""
    assert decode_waves(4, ring([(0.1, 0.2)] * 3, 5.0), current=1) == 4
    local = ring([(0.1, 0.2)] * 3, 5.0, machines=[0, 0, 0])
    assert local.period_ms(4, 1) == pytest.approx(0.3 + 4 * 0.6 + 5.0)
    assert local.period_ms(4, 2) == pytest.approx(2 * (0.3 + 5.0) + 4 * 0.6)
    assert decode_waves(4, local, current=2) == 1


def test_compute_a_row_that_dominates_keeps_one_wave_a_stage() -> None:
    """Three equal stages, each a machine, 1 ms fixed and 5 ms a row, a wire of no time: one wave
    per stage keeps all three busy; more only pay the fixed cost again."""
    costs = ring([(1, 5)] * 3, 0.0)
    assert decode_waves(6, costs, current=1) == 3
    assert decode_waves(6, costs, current=6) == 3
    assert decode_waves(12, costs, current=1) == 3


def test_a_long_trip_keeps_more_waves_than_stages() -> None:
    """The same stages behind 100 ms of wire: they idle most of a trip, so each sequence in a wave
    of its own shortens every wave's trip by what the rows would cost it."""
    costs = ring([(1, 5)] * 3, 100.0)
    assert decode_waves(6, costs, current=3) == 6
    assert decode_waves(4, ring([(20, 30), (2, 10)], 200.0), current=2) == 4  # 262 ms a period against 302


def test_unknown_costs_one_row_and_small_gains_keep_the_current_count() -> None:
    costs = ring([(1, 5)] * 3, 0.0)
    assert decode_waves(6, None, current=2) == 2
    assert decode_waves(1, costs, current=3) == 1
    assert decode_waves(2, None, current=3) == 2  # never more waves than rows
    nearly = ring([(0.2, 5), (0.2, 5)], 0.0)  # 4 rows: one wave 40.4 ms, two 20.4, four 20.8
    assert decode_waves(4, nearly, current=4) == 4  # within MIN_GAIN of the best: stays
    assert decode_waves(4, nearly, current=1) == 2  # half the period: moves


@given(
    st.lists(st.tuples(st.floats(0, 50), st.floats(0, 20)), min_size=1, max_size=4),
    st.floats(0, 200),
    st.integers(1, 8),
    st.integers(1, 8),
)
def test_the_count_chosen_is_the_least_period_or_close_to_it(
    stages: list[tuple[float, float]], ring_ms: float, rows: int, current: int
) -> None:
    costs = ring(stages, ring_ms)
    chosen = decode_waves(rows, costs, current)
    best = min(costs.period_ms(rows, w) for w in range(1, rows + 1))
    assert 1 <= chosen <= rows
    assert costs.period_ms(rows, chosen) <= best / (1 - MIN_GAIN) + 1e-9


def test_a_stage_line_is_fitted_through_its_decodes_a_busy_moment_aside() -> None:
    assert StageCost.fit([(1, 25.0), (2, 30.0), (4, 40.0)]) == StageCost(20.0, 5.0)
    fitted = StageCost.fit([(1, 25.0), (2, 30.0), (3, 35.0), (4, 90.0), (6, 50.0)])  # 4 rows measured under load
    assert fitted is not None and fitted.row_ms == pytest.approx(5.0) and fitted.step_ms == pytest.approx(20.0)
    assert StageCost.fit([(2, 30.0), (2, 31.0)]) is None  # one size alone: no line
    assert StageCost.fit([(1, 30.0), (4, 20.0)]) == StageCost(25.0, 0.0)  # never a negative row
    assert wave_costs_from([[(1, 25.0), (2, 30.0)], [(1, 9.0)]], [0, 1], 2.0) is None  # one stage has one size
    assert wave_costs_from([[(1, 25.0), (2, 30.0)]], [0], None) is None  # no trip measured
    costs = wave_costs_from([[(1, 25.0), (2, 30.0)], [(1, 9.0), (3, 13.0)]], [0, 1], 2.0)
    assert costs == ring([(20, 5), (7, 2)], 2.0)


def test_a_stage_reports_its_recent_decodes_by_size() -> None:
    """Each size its own window, so a size the load no longer makes keeps its figure; prompts
    apart; the least recently seen sizes leave beyond the report's bound; the report survives the wire."""
    timer = StageTimer()
    for _ in range(3):
        timer.add(0.010, 1, decode=True)
    timer.add(0.050, 1, decode=True)  # one slow decode does not move the median
    for seconds in (0.020, 0.022, 0.018):
        timer.add(seconds, 4, decode=True)
    timer.add(1.0, 300, decode=False)  # a prompt's chunk: not a decode
    assert timer.decode_ms_by_rows == [(1, pytest.approx(10.0)), (4, pytest.approx(20.0))]
    for _ in range(RECENT_SIZED_STEPS):
        timer.add(0.030, 4, decode=True)
    assert timer.decode_ms_by_rows[1] == (4, pytest.approx(30.0))  # only the recent ones
    for rows in range(2, MAX_REPORTED_ROW_COUNTS + 2):
        timer.add(0.001 * rows, rows, decode=True)
    sizes = [rows for rows, _ in timer.decode_ms_by_rows]
    assert len(sizes) == MAX_REPORTED_ROW_COUNTS and 1 not in sizes  # size 1, seen longest ago, left
    report = timer.report((0, 4))
    assert StageReport.model_validate(report.wire()) == report


def test_the_hosts_own_work_a_wave_is_read_from_a_period_its_machine_set() -> None:
    """The demo's ring as measured on this box (member 7.1 + 3.0·r ms, head 2.0 + 10.9·r, 1.8 ms
    of wire): two waves of two rows were priced at 47.6 ms a period but came back every 83 ms, one
    wave of four every 67. The excess, the host's own work a wave beside its head (framing, its
    event loop, the API) on the head's machine, makes one wave the faster, as measured."""
    costs = WaveCosts((StageCost(7.1, 3.0), StageCost(2.0, 10.9)), (0, 1), 1.8, host_machine=1)
    assert costs.period_ms(4, 2) == pytest.approx(47.6) and decode_waves(4, costs, current=2) == 2
    seen = costs.host_work_ms(4, 2, observed_ms=83.0)
    assert seen == pytest.approx((83.0 - (2 * 2.0 + 4 * 10.9)) / 2)
    priced = WaveCosts(costs.stages, costs.machines, costs.ring_ms, host_machine=1, host_ms=seen)
    assert priced.period_ms(4, 2) == pytest.approx(83.0)
    assert priced.period_ms(4, 1) == pytest.approx(costs.trip_ms(4))  # one wave hides it under the member's compute
    assert decode_waves(4, priced, current=2) == 1
    assert costs.host_work_ms(4, 1, observed_ms=costs.trip_ms(4) * 1.02) is None  # the trip set it: o unseen
    assert costs.host_work_ms(4, 2, observed_ms=40.0) is None  # faster than priced: nothing beyond
    member_bound = WaveCosts((StageCost(40, 10), StageCost(2, 1)), (0, 1), 1.0, host_machine=1)
    assert member_bound.host_work_ms(4, 2, observed_ms=121.0) is None  # the member's 120 ms explain it
    assert WaveCosts(costs.stages, costs.machines, 1.8).host_work_ms(4, 2, 83.0) is None  # no host stage
    # Every stage on the host's machine (a ring left with the host alone, a local ring): no other
    # machine's work to compare with, only the trip.
    alone = WaveCosts(costs.stages, (1, 1), 1.8, host_machine=1)
    assert alone.host_work_ms(4, 2, observed_ms=200.0) is not None


def test_a_wave_behind_may_take_what_the_ring_idles_while_the_waves_ahead_travel() -> None:
    """Drafts in flight: three stages on one box (the NAT lab's), a drafted wave of five rows out.
    At 40 ms a hop (60 ms of wire one way round) the box works 48 ms of a 108 ms trip and idles
    60, whatever its stages share; a second wave out (three rows) leaves 24; on loopback (2 ms of
    wire) it idles 2, and with the host's own work a wave on it none. On machines of their own
    with no wire, each idles the others' stages: 20 beside the head's 28."""
    stages = [(5.0, 1.0), (5.0, 1.0), (8.0, 4.0)]
    box = ring(stages, 60.0, machines=[0, 0, 0])
    assert box.trip_ms(5) == pytest.approx(108.0)
    assert idle_behind_ms(box, [5]) == pytest.approx(60.0)
    assert idle_behind_ms(box, [5, 3]) == pytest.approx(108.0 - 48.0 - 36.0)
    loopback = ring(stages, 2.0, machines=[0, 0, 0])
    assert idle_behind_ms(loopback, [5]) == pytest.approx(2.0)
    busy_host = WaveCosts(loopback.stages, loopback.machines, 2.0, host_machine=0, host_ms=3.0)
    assert idle_behind_ms(busy_host, [5]) == 0.0
    apart = ring(stages, 0.0)
    assert idle_behind_ms(apart, [5]) == pytest.approx(48.0 - 28.0)
    host_at_head = WaveCosts(apart.stages, apart.machines, 0.0, host_machine=2, host_ms=10.0)
    assert idle_behind_ms(host_at_head, [5]) == pytest.approx(10.0)
    # One stage: a wave behind only waits there for the one ahead; nothing out: nothing to hide behind.
    assert idle_behind_ms(ring([(5.0, 1.0)], 60.0), [5]) is None
    assert idle_behind_ms(box, []) is None
    with pytest.raises(ValueError):
        idle_behind_ms(box, [5, 0])


@given(
    stages=st.lists(st.tuples(st.floats(0, 50), st.floats(0, 20)), min_size=2, max_size=4),
    machines=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    ring_ms=st.floats(0, 300),
    rows_out=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    more=st.integers(1, 9),
)
def test_the_idle_behind_waves_out_is_never_negative_and_shrinks_with_each_wave_more(
    stages: list[tuple[float, float]], machines: list[int], ring_ms: float, rows_out: list[int], more: int
) -> None:
    costs = ring(stages, ring_ms, machines[: len(stages)])
    idle = idle_behind_ms(costs, rows_out)
    assert idle is not None and 0.0 <= idle <= costs.trip_ms(rows_out[0])
    behind = idle_behind_ms(costs, [*rows_out, more])
    assert behind is not None and behind <= idle


def test_a_block_stage_times_a_token_and_its_drafts_as_a_decode_of_their_rows(tmp_path: Path) -> None:
    """A VERIFY frame (a token and its drafts, one sequence) is a decode of its rows at a block
    stage, as at the head: the stage reports its size among the decodes, which price the waves and
    drafts in flight, and not among a prompt's rows."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    first, _ = slice_model(model, [2, 2], tmp_path / "stages")
    stage = BlockStage(first.path, ContextSettings(n_ctx=64, n_batch=32, n_seq_max=2, n_threads=1))
    rows = np.random.default_rng(3).standard_normal((5, stage.hidden)).astype(np.float32)
    try:
        handle_frames(stage, [Frame.of_hidden(Kind.PREFILL, 0, 0, rows[:3])])
        handle_frames(stage, [Frame.of_hidden(Kind.DECODE, 0, 3, rows[3:4])])
        (answer,) = handle_frames(stage, [Frame.of_hidden(Kind.VERIFY, 0, 4, rows[:4])])
        assert answer.kind is Kind.VERIFY and answer.hidden_states().shape == (4, stage.hidden)
        assert [size for size, _ in stage.timer.decode_ms_by_rows] == [1, 4]
        assert stage.timer.decode_rows == 5 and stage.timer.rows - stage.timer.decode_rows == 3
    finally:
        stage.close()
