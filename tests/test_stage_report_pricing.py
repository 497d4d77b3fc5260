"""Whatever stage reports the contract admits, the host's pricing of them stays finite and never
raises: a member's report is read off the wire, and a rule that raised on it would end every
request on the ring (the engine loop breaks the ring on what it cannot explain)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kafila.contracts import MAX_REPORTED_MS, StageReport
from kafila.planner.prefill import costs_from, prefill_chunk_rows
from kafila.planner.waves import decode_waves, wave_costs_from

reported_ms = st.floats(min_value=0.0, max_value=MAX_REPORTED_MS, allow_nan=False)
reports = st.builds(
    StageReport,
    range=st.just((0, 1)),
    ms_per_token_alone=st.none() | reported_ms,
    prefill_ms_per_token=st.none() | reported_ms,
    decode_ms_by_rows=st.lists(st.tuples(st.integers(1, 64), reported_ms), max_size=6, unique_by=lambda p: p[0]).map(
        sorted
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(reports, min_size=1, max_size=6),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    st.integers(1, 8),
    st.integers(1, 64),
    st.integers(1, 8),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
)
def test_any_admitted_report_prices_without_raising(
    report: list[StageReport], trip_ms: float, in_flight: int, rows: int, waves: int, observed_ms: float
) -> None:
    costs = costs_from([(r.ms_per_token_alone, r.prefill_ms_per_token) for r in report], trip_ms)
    chunk = prefill_chunk_rows(2_000, costs, in_flight, 512)
    assert 1 <= chunk <= 512
    machines = tuple(range(len(report)))
    priced = wave_costs_from([r.decode_ms_by_rows for r in report], machines, trip_ms)
    assert 1 <= decode_waves(rows, priced, min(waves, rows)) <= max(1, rows)
    if priced is not None:
        assert math.isfinite(priced.period_ms(rows, min(waves, rows)))
        host = priced.host_work_ms(rows, min(waves, rows), observed_ms)
        assert host is None or math.isfinite(host)


def test_a_time_past_what_a_stage_can_measure_is_no_report() -> None:
    """A day a token is no measurement; 1e308 ms a token, priced, overflowed the chunk's cost."""
    with pytest.raises(ValidationError):
        StageReport(range=(0, 1), ms_per_token_alone=1e308, prefill_ms_per_token=1e308)
    with pytest.raises(ValidationError):
        StageReport(range=(0, 1), decode_ms_by_rows=[(1, MAX_REPORTED_MS * 2)])
