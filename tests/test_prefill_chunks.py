"""The chunk length of pipelined prefill (planner/prefill.py): short enough that the stages
overlap, long enough that each chunk's fixed costs and the ring's trip do not dominate; a prompt
too short to gain is not split."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafila.planner.prefill import (
    MIN_CHUNK_ROWS,
    MIN_GAIN,
    PrefillCosts,
    costs_from,
    first_token_ms,
    prefill_chunk_rows,
)
from kafila.planner.stage_cost import StageCost

BATCH = 512


def ring(step_ms: float, row_ms: float, ring_ms: float, stages: int = 3) -> PrefillCosts:
    return PrefillCosts(tuple(StageCost(step_ms, row_ms) for _ in range(stages)), ring_ms)


def test_the_formula_by_hand() -> None:
    """Three stages of 2 + 0.5·c ms, 60 ms of wire: 1,000 rows in chunks of 250 (four), three out at once."""
    costs = ring(2.0, 0.5, 60.0)
    trip = 3 * (2 + 0.5 * 250) + 60  # 441
    assert first_token_ms(1000, 250, costs, 3) == pytest.approx(trip + 3 * max(2 + 0.5 * 250, trip / 3))
    assert first_token_ms(1000, 250, costs, 1) == pytest.approx(4 * trip)  # one at a time: four whole trips
    assert first_token_ms(1000, 300, costs, 3) == first_token_ms(1000, 250, costs, 3)  # four chunks, made even


def test_unknown_costs_or_one_chunk_out_leave_the_prompt_whole_up_to_a_step() -> None:
    costs = ring(2.0, 0.5, 60.0)
    assert prefill_chunk_rows(2000, None, 3, BATCH) == 500  # four even chunks: a step holds no more than 512
    assert prefill_chunk_rows(300, None, 3, BATCH) == 300
    assert prefill_chunk_rows(2000, costs, 1, BATCH) == 500  # one at a time: splitting only adds steps


def test_a_long_prompt_on_three_stages_goes_in_chunks_that_overlap_them() -> None:
    """2,000 rows, three stages of 0.5 ms a row and 2 ms a step, 60 ms of wire: the chosen chunks
    are far shorter than a step, and the prompt's first token comes near the limit (the slowest
    stage's whole prompt and one chunk's trip), well under one step-long chunk after another."""
    costs = ring(2.0, 0.5, 60.0)
    chunk = prefill_chunk_rows(2000, costs, 3, BATCH)
    assert MIN_CHUNK_ROWS <= chunk < 250
    pipelined = first_token_ms(2000, chunk, costs, 3)
    limit = 2000 * 0.5 + costs.trip_ms(chunk)
    assert limit <= pipelined <= 1.1 * limit
    assert pipelined < 0.5 * first_token_ms(2000, BATCH, costs, 1)


def test_a_prompt_too_short_to_gain_is_not_split() -> None:
    """Where a step's fixed cost outweighs what overlapping the stages saves, 600 rows go in the
    two chunks a step of 512 needs; and a prompt under two MIN_CHUNK_ROWS is never split."""
    assert prefill_chunk_rows(600, ring(200.0, 0.3, 60.0), 3, BATCH) == 300
    assert prefill_chunk_rows(600, ring(2.0, 0.3, 60.0), 3, BATCH) < 300  # where it does not, split
    assert prefill_chunk_rows(2 * MIN_CHUNK_ROWS - 1, ring(0.0, 1.0, 0.0), 3, BATCH) == 2 * MIN_CHUNK_ROWS - 1


def test_costlier_steps_and_a_slower_trip_make_chunks_longer() -> None:
    cheap, costly = ring(1.0, 0.5, 60.0), ring(30.0, 0.5, 60.0)
    assert prefill_chunk_rows(2000, costly, 3, BATCH) > prefill_chunk_rows(2000, cheap, 3, BATCH)
    near, far = ring(1.0, 0.5, 10.0), ring(1.0, 0.5, 600.0)
    assert prefill_chunk_rows(2000, far, 2, BATCH) > prefill_chunk_rows(2000, near, 2, BATCH)


def test_the_slowest_stage_sets_the_pace() -> None:
    """One stage twice the others' time a row: the limit is its time for the whole prompt."""
    costs = PrefillCosts((StageCost(2, 0.25), StageCost(2, 1.0), StageCost(2, 0.25)), 60.0)
    chunk = prefill_chunk_rows(2000, costs, 3, BATCH)
    assert first_token_ms(2000, chunk, costs, 3) <= 1.15 * (2000 * 1.0 + costs.trip_ms(chunk))


@given(
    prompt=st.integers(1, 5000),
    batch=st.integers(1, 1024),
    out=st.integers(1, 8),
    step_ms=st.lists(st.floats(0, 50), min_size=1, max_size=6),
    per_row=st.floats(0, 5),
    ring_ms=st.floats(0, 1000),
)
def test_the_choice_is_the_least_first_token_time_of_any_chunk_length(
    prompt: int, batch: int, out: int, step_ms: list[float], per_row: float, ring_ms: float
) -> None:
    """Against a brute force over every chunk length a step allows (down to MIN_CHUNK_ROWS): never
    longer than a step nor shorter than MIN_CHUNK_ROWS, never worse than the least by more than
    MIN_GAIN of the unsplit time, and never worse than leaving the prompt whole."""
    costs = PrefillCosts(tuple(StageCost(step, per_row) for step in step_ms), ring_ms)
    chunk = prefill_chunk_rows(prompt, costs, out, batch)
    even = math.ceil(prompt / math.ceil(prompt / batch))  # the unsplit prompt's chunks, as even as a step allows
    floor = min(even, MIN_CHUNK_ROWS)
    assert floor <= chunk <= even
    unsplit = first_token_ms(prompt, min(prompt, batch), costs, out)
    lengths = [n for n in range(floor, even + 1) if math.ceil(prompt / math.ceil(prompt / n)) >= floor]  # made even
    best = min(first_token_ms(prompt, rows, costs, out) for rows in lengths)
    chosen = first_token_ms(prompt, chunk, costs, out)
    assert chosen <= unsplit + 1e-9 * unsplit
    assert chosen <= best + MIN_GAIN * unsplit + 1e-9 * unsplit
    if chunk < even:
        assert chosen <= (1 - MIN_GAIN) * unsplit + 1e-9 * unsplit  # split only where it gains


def test_costs_come_from_every_stages_measured_figures_or_not_at_all() -> None:
    assert costs_from([(5.0, 0.4), (4.0, 0.3)], 60.0) == PrefillCosts((StageCost(5.0, 0.4), StageCost(4.0, 0.3)), 60.0)
    assert costs_from([(None, 0.4)], 0.5) == PrefillCosts((StageCost(0.0, 0.4),), 0.5)
    assert costs_from([(5.0, 0.4), (4.0, None)], 60.0) is None  # a stage that has prefilled nothing yet
    assert costs_from([], 60.0) is None and costs_from([(5.0, 0.4)], None) is None


def test_bad_figures_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        PrefillCosts((), 1.0)
    with pytest.raises(ValueError, match="trip"):
        PrefillCosts((StageCost(1, 1),), math.nan)
    with pytest.raises(ValueError, match="at least one"):
        prefill_chunk_rows(0, None, 2, BATCH)
    with pytest.raises(ValueError, match="at least one"):
        first_token_ms(10, 0, ring(1, 1, 1), 2)
