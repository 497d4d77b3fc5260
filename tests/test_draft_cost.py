"""The cost rule of speculative decoding: a sequence drafts only as many tokens as pay on this
ring, by its accept rate against the measured trip and drafted row. Pure: the rule, the clock
and the accept rate alone, then the batcher against a scripted model on a simulated ring whose
waves take a trip plus a cost per drafted row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_speculation import VOCAB, Sample, ScriptedModel, table_of

from kafila.runtime.engine.draft_cost import (
    CLOCK_WAVES,
    STALE_DECAY,
    AcceptRate,
    TripClock,
    best_window,
    expected_tokens,
)
from kafila.runtime.engine.engines import PrefixCut
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import MAX_DRAFT, DraftWindow, Speculate
from kafila.serving.batcher import Batcher, Job, TextDelta


def test_a_trip_brings_its_token_then_each_draft_while_all_before_it_were_kept() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize(
    ("rate", "trip_ms", "row_ms", "drafts"),
    [
        (0.29, 100.0, 30.0, 0),  # one draft pays where rate × trip > row: 29 < 30
        (0.31, 100.0, 30.0, 1),
        (1.0, 100.0, 99.0, MAX_DRAFT),  # every draft kept: all allowed, where a row costs less than a trip
        (1.0, 100.0, 100.0, 0),  # ... and none where it costs as much
        (0.9, 150.0, 10.0, MAX_DRAFT),  # across homes a fair rate pays the whole window
        (0.5, 45.0, 31.0, 0),  # on a loaded loopback only copying text does
    ],
)
def test_drafts_pay_where_the_accept_rate_times_the_trip_exceeds_a_rows_cost(
    rate: float, trip_ms: float, row_ms: float, drafts: int
) -> None:
    assert best_window(rate, trip_ms, row_ms, MAX_DRAFT) == drafts


@settings(deadline=None, max_examples=200)
@given(
    rate=st.floats(0.0, 1.0),
    trip_ms=st.floats(1.0, 500.0),
    row_ms=st.floats(0.0, 200.0),
    limit=st.integers(0, MAX_DRAFT),
    sharing=st.integers(1, 4),
)
def test_the_window_chosen_is_never_slower_than_none_and_moves_the_right_way(
    rate: float, trip_ms: float, row_ms: float, limit: int, sharing: int
) -> None:
    """Its tokens a millisecond are at least no drafts' (so a sequence whose rate is known never
    loses by drafting), it stays within the limit, and it never grows with a dearer row, a
    shorter trip, a lower accept rate or more sequences sharing the wave."""
    chosen = best_window(rate, trip_ms, row_ms, limit, sharing)
    assert 0 <= chosen <= limit
    assert expected_tokens(rate, chosen) / (trip_ms + chosen * row_ms * sharing) >= (1 - 1e-9) / trip_ms
    assert best_window(rate, trip_ms, row_ms * 1.5 + 1, limit, sharing) <= chosen
    assert best_window(rate, trip_ms / 2, row_ms, limit, sharing) <= chosen
    assert best_window(rate * 0.8, trip_ms, row_ms, limit, sharing) <= chosen
    assert best_window(rate, trip_ms, row_ms, limit, sharing + 1) <= chosen


def test_bad_figures_are_refused() -> None:
    for rate, trip_ms, row_ms, sharing in (
        (1.5, 10.0, 1.0, 1),
        (0.5, 0.0, 1.0, 1),
        (0.5, 10.0, -1.0, 1),
        (0.5, 10.0, 1.0, 0),
    ):
        with pytest.raises(ValueError):
            best_window(rate, trip_ms, row_ms, 4, sharing)
    with pytest.raises(ValueError):
        TripClock().record(-1, 0.1)
    with pytest.raises(ValueError):
        AcceptRate().landed(2, 3)


def test_the_clock_finds_the_trip_and_the_row_and_shrugs_off_delayed_waves() -> None:
    clock = TripClock()
    clock.record(0, 0.100)
    clock.record(0, 0.102)
    assert clock.cost is None  # every wave drafted as much: no row cost to see
    for drafted in (2, 4, 8, 1, 0, 8, 3):
        clock.record(drafted, (100 + 25 * drafted) / 1e3)
    clock.record(0, 2.0)  # a wave the operating system held up
    assert clock.cost is not None
    assert clock.cost.trip_ms == pytest.approx(100, abs=3) and clock.cost.row_ms == pytest.approx(25, abs=2)
    row_ms, stale = clock.cost.row_ms, 0
    for seconds in [0.1] * CLOCK_WAVES + [0.25] * CLOCK_WAVES:  # drafts stopped; then the ring got slower
        clock.record(0, seconds)
        stale += not any(rows for rows, _ in clock.waves)  # a row's cost stays while recent waves drafted,
        assert clock.cost.row_ms == pytest.approx(row_ms * STALE_DECAY**stale)  # then is trusted less
        assert clock.cost.stale == (stale > 0)
    assert clock.cost.trip_ms == pytest.approx(250)  # the trip follows
    assert best_window(0.9, clock.cost.trip_ms, clock.cost.row_ms, MAX_DRAFT) > best_window(0.9, 100, 25, MAX_DRAFT)
    clock.record(3, 0.325)  # drafts again: the row is measured afresh, and the stale line no longer shrinks
    clock.record(3, 0.325)
    clock.record(2, 0.3)
    assert clock.cost.row_ms == pytest.approx(25, abs=1) and not clock.cost.stale


# A head whose batched products tile rows by four, as gemma-3-270m's CPU head measured (CPU ms of
# one decode with every row's logits: 19 for 1 row, 46 for 2, 61 for 4, 96 for 5, 94 for 8, 125 for 9).
HEAD_MS = {1: 19.3, 2: 46.0, 3: 58.7, 4: 61.3, 5: 96.2, 6: 104.2, 7: 113.3, 8: 94.1, 9: 125.1}


def tiled_ms(drafts: int) -> float:
    """What `drafts` drafted rows add to such a head's trip."""
    return HEAD_MS[drafts + 1] - HEAD_MS[1]


def test_a_count_of_rows_the_waves_show_is_priced_as_they_show_it() -> None:
    """Eight rows batch better than five: the clock prices each count it has seen three times by
    what those waves took, the others by the fitted line, and keeps the counts once drafts stop."""
    clock = TripClock()
    for _ in range(3):
        for drafted in (0, 1, 3, 4, 7):
            clock.record(drafted, (40 + tiled_ms(drafted)) / 1e3)
    cost = clock.cost
    assert cost is not None and cost.trip_ms == pytest.approx(40)
    for drafted in (1, 3, 4, 7):
        assert cost.drafted_ms(drafted) == pytest.approx(tiled_ms(drafted))
    assert cost.drafted_ms(7) < cost.drafted_ms(4)
    assert cost.drafted_ms(5) == pytest.approx(5 * cost.row_ms)  # never seen: the line
    for _ in range(CLOCK_WAVES - 1):  # drafts stopped: what each count cost stays while recent waves drafted
        clock.record(0, 0.04)
    assert clock.cost is not None and clock.cost.drafted_ms(7) == pytest.approx(tiled_ms(7))
    clock.record(0, 0.04)  # none of the recent waves did: trusted less, as the line is
    assert clock.cost.drafted_ms(7) == pytest.approx(tiled_ms(7) * STALE_DECAY)
    # Copying text on loopback: the window of 8 rows, which a line through 1..7 would price at 7 rows' worth
    assert best_window(0.95, 40.0, cost.row_ms, MAX_DRAFT, drafted_ms=cost.drafted_ms) == 7
    assert best_window(0.95, 40.0, cost.row_ms, 4, drafted_ms=cost.drafted_ms) == 3  # 5 rows cost more than they bring
    # and a rate at which one draft pays on the line does not pay for the dear second row
    assert best_window(0.6, 40.0, 15.0, 1) == 1
    assert best_window(0.6, 40.0, 15.0, 1, drafted_ms=tiled_ms) == 0


def test_the_accept_rate_starts_hopeful_follows_recent_trips_and_forgets_while_idle() -> None:
    rate = AcceptRate()
    assert rate.rate == 1.0  # a first draft is tried wherever a kept one pays
    for _ in range(6):
        rate.landed(4, 4)
    assert rate.rate == 1.0
    rate.landed(4, 0)
    assert 0.7 < rate.rate < 1.0
    for _ in range(10):
        rate.landed(2, 0)
    low = rate.rate
    assert low < 0.4
    for _ in range(100):
        rate.landed(0, 0)  # trips without drafts: tried again, some time later
    assert rate.rate > low + 0.25
    window = DraftWindow()
    window.landed(4, 1)
    window.skip()
    assert window.accept.kept < 1.0 and window.accept.missed < 1.0
    guesses = AcceptRate()  # guesses checked for free, one a trip: free text's lucky one stays below a row's worth
    for trip in range(40):
        guesses.guessed(trip % 12 == 0)
    assert guesses.rate < 0.25
    for _ in range(12):  # ... and text that turns to copying is seen within a dozen trips
        guesses.guessed(True)
    assert guesses.rate > 0.5


# --- the rule in the batcher, on a simulated ring -------------------------------------------

CYCLE = np.full((VOCAB, VOCAB, VOCAB), -9.0, dtype=np.float32)
for _b in range(VOCAB):  # a model that copies the cycle 3..11 forever
    CYCLE[:, _b, 3 if _b == 11 or _b < 3 else _b + 1] = 9.0


def simulate(
    table: np.ndarray,
    jobs: Sequence[Job],
    speculate: Speculate,
    seed: int | None,
    trip_ms: float,
    row_ms: float,
    batcher: Batcher | None = None,
    drafted_ms: Callable[[int], float] | None = None,
) -> tuple[dict[str, str], float, Batcher]:
    """Serve `jobs` as the engine loop does (on `batcher`, else a new one), timing each wave as a
    ring whose trip takes `trip_ms` and each drafted row `row_ms` more (or its drafted rows
    `drafted_ms`(rows) more): their texts, the time taken and the batcher."""
    batcher = batcher or Batcher(
        2, 16, 256, lambda _s: Sample(seed), lambda t: f"<{t}>".encode(), lambda t: t == 0,
        PrefixCut.ANYWHERE, speculate,
    )  # fmt: skip
    model = ScriptedModel(table)
    for job in jobs:
        batcher.submit(job)
    texts = {job.request_id: "" for job in jobs}
    elapsed = 0.0
    while not batcher.idle or batcher.trimming:
        for trim in batcher.take_trims():
            model.forget(trim.slot, trim.keep)
        steps = batcher.plan()
        if not steps:
            continue
        drafted = sum(len(step.tokens) - 1 for step in steps if step.decode)
        seconds = (trip_ms + (row_ms * drafted if drafted_ms is None else drafted_ms(drafted))) / 1e3
        elapsed += seconds
        for event in batcher.advance(model.run(steps)):
            if isinstance(event, TextDelta):
                texts[event.request_id] += event.text
        if all(step.decode for step in steps):
            batcher.trip_clock.record(drafted, seconds)
    return texts, elapsed, batcher


@settings(deadline=None, max_examples=25)
@given(
    table_seed=st.integers(0, 2**16), ring=st.sampled_from([(45.0, 31.0), (105.0, 31.0), (20.0, 25.0), (300.0, 30.0)])
)
def test_free_text_never_loses_more_than_five_percent_to_drafts(table_seed: int, ring: tuple[float, float]) -> None:
    """Sampled free text, whose drafts are mostly missed: with the rule, at loopback's trip or
    across homes, drafting never costs more than 5% of the time decoding without it takes, on a
    ring whose costs an earlier request measured (as a host's first requests measure its ring).
    (A sequence's first draft is tried on hope: an answer of a few tokens may lose that row.)"""
    trip_ms, row_ms = ring
    table = table_of(table_seed, peaked=False)
    jobs = [Job("chat", [3, 4, 5, 3, 4, 6, 7, 3, 4], 200, SamplingSettings())]
    plain, plain_s, _ = simulate(table, jobs, Speculate.OFF, table_seed, trip_ms, row_ms)
    assume(plain_s * 1e3 >= 40 * trip_ms)  # an answer of 40 tokens or more: one probe's row is a few % of it
    _, _, measured = simulate(CYCLE, [Job("warm", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3], 60, SamplingSettings())],
                              Speculate.NGRAM, table_seed, trip_ms, row_ms)  # fmt: skip
    assert measured.trip_clock.cost is not None
    drafted, drafted_s, batcher = simulate(table, jobs, Speculate.NGRAM, table_seed, trip_ms, row_ms, measured)
    assert drafted == plain
    assert plain_s / drafted_s >= 0.95, (plain_s, drafted_s, batcher.speculation)


def test_a_copy_drafts_its_whole_window_and_text_that_departs_stops_drafting_where_rows_are_dear() -> None:
    copy = [Job("copy", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], 120, SamplingSettings())]
    plain, plain_s, _ = simulate(CYCLE, copy, Speculate.OFF, None, 45.0, 31.0)
    drafted, drafted_s, batcher = simulate(CYCLE, copy, Speculate.NGRAM, None, 45.0, 31.0)
    assert drafted == plain
    cost = batcher.trip_clock.cost
    assert cost is not None and (cost.trip_ms, cost.row_ms) == (pytest.approx(45.0), pytest.approx(31.0))
    # 8 tokens a trip of 45 + 7 × 31 ms against one a 45 ms trip: 1.37×, a loopback whose rows are dear
    assert batcher.speculation.mean_window > MAX_DRAFT - 2 and plain_s / drafted_s > 1.3
    # Sampled text on that ring: after a few misses it drafts nothing, and is never tried every trip again.
    _, _, batcher = simulate(table_of(7, peaked=False), [Job("chat", [3, 4, 5, 3, 4], 200, SamplingSettings())],
                             Speculate.NGRAM, 7, 45.0, 31.0)  # fmt: skip
    assert batcher.speculation.trips < 40, batcher.speculation


@pytest.mark.parametrize("trip_ms", [32.0, 97.0])
def test_on_a_head_that_tiles_rows_a_copy_rides_trips_of_eight_rows_and_free_text_does_not_lose(trip_ms: float) -> None:
    """Rows priced as the head measured them (`HEAD_MS`): on loopback's trip (32 ms) and at 40 ms
    a hop (97 ms), a copy sends 7 drafts a trip (the 8 rows that batch best), and sampled free
    text still keeps within 5% of decoding without drafts."""
    copy = [Job("copy", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], 120, SamplingSettings())]
    plain, plain_s, _ = simulate(CYCLE, copy, Speculate.OFF, None, trip_ms, 0.0)
    drafted, drafted_s, batcher = simulate(CYCLE, copy, Speculate.NGRAM, None, trip_ms, 0.0, drafted_ms=tiled_ms)
    assert drafted == plain
    assert batcher.speculation.mean_window > MAX_DRAFT - 1
    assert plain_s / drafted_s > 0.9 * 8 * trip_ms / (trip_ms + tiled_ms(7))  # near every trip 8 tokens
    chat = [Job("chat", [3, 4, 5, 3, 4, 6, 7, 3, 4], 200, SamplingSettings())]
    warm = [Job("warm", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3], 60, SamplingSettings())]
    for seed in range(5):
        table = table_of(seed, peaked=False)
        plain, plain_s, _ = simulate(table, chat, Speculate.OFF, seed, trip_ms, 0.0)
        _, _, measured = simulate(CYCLE, warm, Speculate.NGRAM, seed, trip_ms, 0.0, drafted_ms=tiled_ms)
        drafted, drafted_s, _ = simulate(table, chat, Speculate.NGRAM, seed, trip_ms, 0.0, measured, tiled_ms)
        assert drafted == plain
        assert plain_s / drafted_s >= 0.95, (seed, plain_s, drafted_s)


# A model whose answer first departs from its prompt's n-grams (each draft from them is missed)
# and then falls into a loop of four tokens, as gemma-3-270m's greedy answers do.
DEPARTS = [5, 6, 7, 8, 9, 10, 11]
DEPARTS_TEXT = [5, 6, 3, 7, 8, 3, 9, 10, 3] + [4, 1, 2, 11] * 60
DEPARTS_THEN_LOOPS = np.full((VOCAB, VOCAB, VOCAB), -9.0, dtype=np.float32)
for _a, _b, _c in zip(DEPARTS[-2:] + DEPARTS_TEXT, DEPARTS[-1:] + DEPARTS_TEXT, DEPARTS_TEXT, strict=False):
    DEPARTS_THEN_LOOPS[_a, _b, _c] = 9.0


def test_a_sequence_whose_drafts_stopped_paying_drafts_again_once_its_guesses_land() -> None:
    """On loopback's trip, the first drafts are missed and the rule stops drafting; the n-gram
    guesses it goes on making for free, checked against each token, show the loop, and it drafts
    the loop (on past its last turn) 7 tokens a trip: twice the tokens a millisecond of no drafts."""
    job = [Job("loops", DEPARTS, 200, SamplingSettings())]
    plain, plain_s, _ = simulate(DEPARTS_THEN_LOOPS, job, Speculate.OFF, None, 32.0, 0.0)
    assert plain["loops"].startswith("".join(f"<{t}>" for t in DEPARTS_TEXT[:20]))
    warm = [Job("warm", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3], 60, SamplingSettings())]
    _, _, measured = simulate(CYCLE, warm, Speculate.NGRAM, None, 32.0, 0.0, drafted_ms=tiled_ms)
    drafted, drafted_s, batcher = simulate(
        DEPARTS_THEN_LOOPS, job, Speculate.NGRAM, None, 32.0, 0.0, measured, tiled_ms
    )
    assert drafted == plain
    assert plain_s / drafted_s > 1.8, (plain_s, drafted_s, batcher.speculation)


def test_a_row_measured_dear_in_a_moment_of_load_does_not_keep_drafts_off_for_good() -> None:
    """The lab's case: at 0 ms a hop under load a drafted row measured 175 ms against a 28 ms trip,
    and drafts stopped; at 40 ms a hop the trip is 97 ms and rows cost what the head measured. The
    old measure, unconfirmed while nothing drafts, is trusted less each wave, a copy's guesses
    land, and its first drafted wave prices the rows afresh: it drafts its window again."""
    warm = [Job("warm", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3], 60, SamplingSettings())]
    _, _, loaded = simulate(CYCLE, warm, Speculate.NGRAM, None, 28.0, 175.0)
    assert loaded.trip_clock.cost is not None and loaded.trip_clock.cost.row_ms > 3 * 28.0  # a row dearer than 3 trips
    copy = [Job("copy", [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], 200, SamplingSettings())]
    plain, plain_s, _ = simulate(CYCLE, copy, Speculate.OFF, None, 97.0, 0.0)
    drafted, drafted_s, batcher = simulate(CYCLE, copy, Speculate.NGRAM, None, 97.0, 0.0, loaded, tiled_ms)
    assert drafted == plain
    cost = batcher.trip_clock.cost
    assert cost is not None and cost.drafted_ms(7) == pytest.approx(tiled_ms(7))
    assert plain_s / drafted_s > 2.5, (plain_s, drafted_s, batcher.speculation)
