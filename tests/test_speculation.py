"""Speculative decoding's pure parts: n-gram drafts, the adaptive window, the fair share of a
wave's drafted rows, and the batcher verifying drafts against a scripted model whose cache is
checked row by row (what a stage refuses: a gap or a repeat), with and without drafts."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.planner.stage_cost import StageCost
from kafila.planner.waves import WaveCosts, idle_behind_ms, one_row_costs, wave_costs_from
from kafila.runtime.engine.draft_cost import DRAFT_WAVES_OUT
from kafila.runtime.engine.engines import EngineStep, EveryRowLogits, PrefixCut, StepResult
from kafila.runtime.engine.logprobs import HeadRow, token_logprob
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import (
    DRAFT_ROWS_PER_WAVE,
    FIRST_WINDOW,
    GUESSES_TO_WAKE,
    MAX_DRAFT,
    MISSES_TO_REST,
    DraftWindow,
    NgramDrafter,
    Speculate,
    SpeculationStats,
    draft_shares,
)
from kafila.runtime.engine.stage import StageTimer, _decodes, _outputs, _rows
from kafila.serving.batcher import Batcher, Finished, Job, RequestEvent, TextDelta
from kafila.wire.frames import MAX_TOP_LOGPROBS, ROW_BY_ROW_FLAG, DType, Frame, FrameDecoder, FrameError, Kind

# --- n-gram drafts -------------------------------------------------------------------------


def reference_draft(tokens: Sequence[int], limit: int, low: int, high: int) -> list[int]:
    """The brute-force reading of prompt lookup: the longest suffix (high..low tokens) that occurred
    before, at its latest earlier occurrence, and the tokens after it, the history repeating from
    there where they run past its end (position end + i holds what position start + i does)."""
    end = len(tokens)
    for n in range(min(high, end), low - 1, -1):
        suffix = list(tokens[end - n :])
        for start in range(end - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                text = list(tokens)
                for i in range(limit):
                    text.append(text[start + n + i])
                return text[end:]
    return []


@given(
    tokens=st.lists(st.integers(0, 5), max_size=60),
    limit=st.integers(0, 10),
    low=st.integers(1, 3),
    extra=st.integers(0, 2),
    split=st.integers(0, 60),
)
def test_a_draft_is_what_follows_the_latest_earlier_occurrence_of_the_longest_suffix(
    tokens: list[int], limit: int, low: int, extra: int, split: int
) -> None:
    drafter = NgramDrafter(tokens[:split], min_ngram=low, max_ngram=low + extra)
    drafter.extend(tokens[split:])  # built in two parts: as a prompt, then generated tokens
    assert len(drafter) == len(tokens)
    assert drafter.draft(limit) == reference_draft(tokens, limit, low, low + extra)


def test_a_copied_passage_is_drafted_from_the_prompt() -> None:
    prompt = [1, 10, 11, 12, 13, 14, 15, 2, 10, 11]
    drafter = NgramDrafter(prompt)
    assert drafter.draft(4) == [12, 13, 14, 15]
    drafter.extend([12, 99])  # the copy departs from the passage: nothing follows "12 99"
    assert drafter.draft(4) == []
    looping = NgramDrafter([7, 1, 2, 3, 1, 2, 3, 1, 2])  # a loop of three: drafted on past its last turn
    assert looping.draft(7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramDrafter([5, 8, 8, 8, 8]).draft(4) == [8, 8, 8, 8]
    with pytest.raises(ValueError):
        NgramDrafter(min_ngram=3, max_ngram=2)


# --- the window ------------------------------------------------------------------------------


def test_the_window_grows_on_accepts_shrinks_on_rejects_and_rests_where_drafts_do_not_pay() -> None:
    window = DraftWindow()
    assert window.allowed == FIRST_WINDOW
    window.landed(FIRST_WINDOW, FIRST_WINDOW)
    assert window.allowed == 2 * FIRST_WINDOW + 1
    while window.allowed < MAX_DRAFT:
        window.landed(window.allowed, window.allowed)
    window.landed(MAX_DRAFT, MAX_DRAFT)
    assert window.allowed == MAX_DRAFT  # never past the most a trip carries
    window.landed(MAX_DRAFT, 2)
    assert window.allowed == 3  # what was accepted, and one more
    for _ in range(MISSES_TO_REST):
        window.landed(window.allowed, 0)
    assert window.allowed == 0  # resting: no drafts
    trips = 0
    while window.allowed == 0:
        window.skip()
        trips += 1
    assert trips >= 1 and window.allowed == FIRST_WINDOW
    for _ in range(MISSES_TO_REST):
        window.landed(window.allowed, 0)
    again = 0
    while window.allowed == 0:
        window.skip()
        again += 1
    assert again == 2 * trips  # each rest twice as long as the last
    with pytest.raises(ValueError):
        window.landed(2, 3)


def test_a_rest_ends_early_once_free_guesses_land_in_a_row() -> None:
    """A resting window whose free guesses (`shadowed`) are the tokens that land GUESSES_TO_WAKE
    times in a row (text that turned to copying) drafts again at once; a right guess among wrong
    ones does not wake it, and drafts sent start the count again."""
    window = DraftWindow()
    for _ in range(2):  # two rests, the second twice as long as the first
        while window.allowed == 0:
            window.skip()
        for _ in range(MISSES_TO_REST):
            window.landed(window.allowed, 0)
    assert window.allowed == 0 and window.resting > GUESSES_TO_WAKE + 2
    for kept in (True, False):
        window.skip()
        window.shadowed(kept)
    assert window.allowed == 0  # one right, then one wrong: still resting
    for _ in range(GUESSES_TO_WAKE - 1):
        window.skip()
        window.shadowed(True)
        assert window.allowed == 0
    window.skip()
    assert window.resting > 0
    window.shadowed(True)
    assert window.allowed == FIRST_WINDOW and window.resting == 0
    window.landed(FIRST_WINDOW, 1)
    assert window.guessed == 0


def test_free_guesses_that_land_in_a_row_open_the_window_as_kept_drafts_would() -> None:
    """A window of one after a trip whose drafts were all missed (on loopback one draft does not
    pay, so none is sent): g right guesses in a row open it to 2g + 1, up to MAX_DRAFT; a wrong one stops the
    run without shrinking it; a trip whose drafts were all kept opens it to twice them and one."""
    window = DraftWindow()
    window.landed(FIRST_WINDOW, 0)
    assert window.allowed == 1
    opened = []
    for _ in range(4):
        window.skip()
        window.shadowed(True)
        opened.append(window.allowed)
    assert opened == [3, 5, MAX_DRAFT, MAX_DRAFT]
    window.shadowed(False)
    assert window.allowed == MAX_DRAFT and window.guessed == 0
    window.landed(3, 1)
    assert window.allowed == 2
    window.landed(1, 1)  # fewer than the window allowed, all kept
    assert window.allowed == 3


@given(st.lists(st.integers(0, MAX_DRAFT), max_size=8), st.integers(0, 20))
def test_drafted_rows_are_shared_fairly(wanted: list[int], rows: int) -> None:
    shares = draft_shares(wanted, rows)
    assert all(0 <= s <= w for s, w in zip(shares, wanted, strict=True))
    assert sum(shares) == min(rows, sum(wanted))
    for a, wa in zip(shares, wanted, strict=True):  # nobody wanting more is left below another's share - 1
        for b in shares:
            assert a >= min(wa, b - 1)


def test_stats_report_accepted_per_trip_and_the_mean_window() -> None:
    stats = SpeculationStats()
    assert stats.accepted_per_trip == 0.0 and stats.mean_window == 0.0
    stats.record(4, 4)
    stats.record(2, 0)
    stats.record(0, 0)  # a trip without drafts is not a speculative one
    assert (stats.drafted, stats.accepted, stats.trips) == (6, 4, 2)
    assert stats.accepted_per_trip == 2.0 and stats.mean_window == 3.0


# --- the batcher against a scripted model --------------------------------------------------

VOCAB = 12
END = 0


class Sample:
    """Greedy, or a seeded draw from a softmax: a sampler whose every draw depends on the row and its own state."""

    portable = True

    def __init__(self, seed: int | None) -> None:
        self._random = np.random.default_rng(seed) if seed is not None else None

    def accept(self, tokens: Sequence[int]) -> None:
        pass

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        if self._random is None:
            return int(np.argmax(logits))
        p = np.exp(logits - logits.max())
        return int(self._random.choice(VOCAB, p=p / p.sum()))

    def close(self) -> None:
        pass


class ScriptedModel:
    """A target model over a tiny vocabulary, with a cache per slot that refuses rows out of
    position order as a stage does; its logits after a token depend on the last two tokens."""

    def __init__(self, table: npt.NDArray[np.float32]) -> None:
        self.table = table
        self.cache: dict[int, list[int]] = {}
        self.rows = 0

    def logits(self, held: Sequence[int]) -> npt.NDArray[np.float32]:
        return self.table[held[-2] if len(held) > 1 else 0, held[-1]]

    def forget(self, slot: int, keep: int) -> None:
        self.cache[slot] = self.cache.get(slot, [])[:keep]

    def run(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        out: list[StepResult] = []
        for step in steps:
            held = self.cache.setdefault(step.sequence_id, [])
            assert step.position == len(held), f"rows at {step.position}; the cache holds {len(held)}"
            rows = []
            for token in step.tokens:
                held.append(token)
                rows.append(self.logits(held))
            self.rows += len(step.tokens)
            if step.every_row:
                out.append(EveryRowLogits(np.stack(rows)))
            else:
                out.append(rows[-1] if step.logits else None)
        return out


class Departing(NgramDrafter):
    """Drafts what greedy decoding writes next (`answer`), but with every `wrong`-th draft wrong
    (counted along the answer), so that trips keep some drafts and reject the rest."""

    def __init__(self, prompt: Sequence[int], answer: Sequence[int], n_vocab: int, wrong: int) -> None:
        self.prompt_length, self.answer, self.n_vocab, self.wrong = len(prompt), list(answer), n_vocab, wrong
        super().__init__(prompt)

    def draft(self, limit: int) -> list[int]:
        written = len(self) - self.prompt_length
        drafts = self.answer[written : written + limit]
        return [
            (t + 1) % self.n_vocab if (written + i) % self.wrong == self.wrong - 1 else t for i, t in enumerate(drafts)
        ]


# A ring priced as never idling while a wave travels (`idle_behind_ms` 0 whatever is out): a wave
# behind pays for all its rows' time, the most the cost rule can charge it.
NEVER_IDLE = WaveCosts((StageCost(0.0, 0.0),) * 2, (0, 1), 0.0)


def serve(
    model: ScriptedModel, jobs: Sequence[Job], speculate: Speculate, seed: int | None = None, rows: int = 16,
    waves: int = 1, drafter: Callable[[Job], NgramDrafter] | None = None, ring_costs: WaveCosts | None = None,
) -> tuple[dict[str, list[str]], Batcher]:  # fmt: skip
    """Run jobs to the end; the text of each, and the batcher (for its stats). `waves`: waves of
    one sequence's drafts out at once (drafts in flight), kept out as the engine loop keeps them:
    the scripted model runs each wave as it leaves and answers it as it lands, oldest first, the
    cuts taken between (as a CANCEL follows the rows out round a ring); each wave is timed as a
    trip of 100 ms and 1 ms a drafted row, so that the cost rule sends waves behind. `drafter`: a
    drafter for each admitted request in place of the n-gram one; `ring_costs`: the ring's stages
    and wire as the engine loop gives them (`Batcher.ring_costs`; None: not yet measured, so no
    wave goes behind)."""
    batcher = Batcher(
        2, rows, 64, lambda _s: Sample(seed), lambda t: f"<{t}>".encode(), lambda t: t == END,
        PrefixCut.ANYWHERE, speculate, draft_waves=waves,
    )  # fmt: skip
    batcher.ring_costs = ring_costs
    for job in jobs:
        batcher.submit(job)
    texts: dict[str, list[str]] = {job.request_id: [] for job in jobs}
    finished: set[str] = set()
    out: deque[tuple[list[EngineStep], list[StepResult]]] = deque()
    for _ in range(1000):
        for trim in batcher.take_trims():
            model.forget(trim.slot, trim.keep)
        for sequence in batcher._active.values():  # rejected rows, and stale waves' rows, leave no trace
            if sequence.generated and sequence.trimmed and not sequence.in_flight:
                assert model.cache.get(sequence.slot, []) == sequence.tokens_held()
        while not out or (batcher.drafting_ahead and len(out) < waves):  # as `EngineLoop._fill`
            steps = batcher.plan(ahead_only=bool(out))
            for sequence in batcher._active.values():
                if drafter is not None and not sequence.generated and not isinstance(sequence.drafter, Departing):
                    sequence.drafter = drafter(sequence.job)
            if not steps:
                break
            out.append((steps, model.run(steps)))
        if not out:
            if batcher.idle:
                break
            continue  # a request waits for its slot's cache to be cut
        steps, results = out.popleft()
        events: list[RequestEvent] = batcher.advance(results)
        if waves > 1 and all(step.decode for step in steps) and batcher.last_wave_plain:
            drafted = sum(len(step.tokens) - 1 for step in steps)
            batcher.trip_clock.record(drafted, 0.1 + 0.001 * drafted)
        for event in events:
            if isinstance(event, TextDelta):
                texts[event.request_id].append(event.text)
            elif isinstance(event, Finished):
                finished.add(event.request_id)
    assert finished == set(texts)
    return texts, batcher


CYCLE_PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4]


def copying_cycle() -> npt.NDArray[np.float32]:
    """Logits by the last two tokens of a model that copies the cycle 3..11 forever (CYCLE_PROMPT
    holds it once and starts it again): every draft of its n-gram lookup is kept."""
    loop = np.full((VOCAB, VOCAB, VOCAB), -5.0, dtype=np.float32)
    for b in range(VOCAB):
        loop[:, b, 3 if b == 11 else (b + 1 if b >= 3 else 3)] = 5.0
    return loop


def table_of(seed: int, peaked: bool) -> npt.NDArray[np.float32]:
    """Logits by the last two tokens; `peaked`: mostly one continuation (a model copying text)."""
    random = np.random.default_rng(seed)
    table = random.normal(size=(VOCAB, VOCAB, VOCAB)).astype(np.float32)
    if peaked:
        table[:, :, :] = table[0:1, :, :]  # the next token follows the last alone: loops that drafts catch
        table *= 4
    table[:, :, END] -= 3.0  # long enough answers
    return table


@settings(deadline=None, max_examples=40)
@given(
    table_seed=st.integers(0, 2**16),
    prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3),
    peaked=st.booleans(),
    sampled=st.booleans(),
    rows=st.integers(2, 16),
)
def test_drafts_change_nothing_but_the_trips(
    table_seed: int, prompts: list[list[int]], peaked: bool, sampled: bool, rows: int
) -> None:
    """Greedy or seeded, every request's text with drafts is the text without, and the cache never
    holds a row out of order (the scripted model asserts it): rejected rows were cut first."""
    table = table_of(table_seed, peaked)
    jobs = [Job(f"r{i}", prompt, 24, SamplingSettings()) for i, prompt in enumerate(prompts)]
    seed = table_seed if sampled else None
    plain, _ = serve(ScriptedModel(table), jobs, Speculate.OFF, seed, rows)
    drafted, batcher = serve(ScriptedModel(table), jobs, Speculate.NGRAM, seed, rows)
    assert drafted == plain
    stats = batcher.speculation
    assert 0 <= stats.accepted <= stats.drafted
    assert stats.mean_window <= MAX_DRAFT
    ahead, batcher = serve(
        ScriptedModel(table), jobs, Speculate.NGRAM, seed, rows, waves=DRAFT_WAVES_OUT, ring_costs=NEVER_IDLE
    )
    assert ahead == plain
    assert 0 <= batcher.speculation.waves_stale <= batcher.speculation.waves_behind


def test_a_copying_model_takes_fewer_trips_and_a_forced_reject_leaves_no_trace() -> None:
    prompt, loop = CYCLE_PROMPT, copying_cycle()
    job = Job("copy", prompt, 40, SamplingSettings())
    plain_model, drafted_model = ScriptedModel(loop), ScriptedModel(loop)
    plain, _ = serve(plain_model, [job], Speculate.OFF)
    drafted, batcher = serve(drafted_model, [job], Speculate.NGRAM)
    assert drafted == plain
    assert batcher.speculation.accepted_per_trip > 2  # several tokens per trip
    assert batcher.speculation.accepted == batcher.speculation.drafted  # a copy is all accepted

    # A model that departs from the prompt's pattern: the first drafts ("4 5" after "5 7 4 5 7")
    # are rejected; the scripted cache refuses the next rows unless the rejected ones were cut,
    # and afterwards holds only the prompt and the tokens fed back, in order.
    plus_two = np.full((VOCAB, VOCAB, VOCAB), -5.0, dtype=np.float32)
    for b in range(VOCAB):
        plus_two[:, b, (b + 2) % VOCAB or 1] = 5.0
    departing = Job("off", [5, 7, 4, 5], 12, SamplingSettings())
    model = ScriptedModel(plus_two)
    texts, batcher = serve(model, [departing], Speculate.NGRAM)
    again, _ = serve(ScriptedModel(plus_two), [departing], Speculate.OFF)
    assert texts == again
    assert batcher.speculation.drafted > batcher.speculation.accepted
    generated = [int(piece.strip("<>")) for piece in texts["off"]]
    assert generated[:2] == [7, 9]
    assert model.cache[0][: 4 + len(generated) - 1] == [5, 7, 4, 5, *generated[:-1]]


def test_waves_in_flight_carry_a_copy_and_a_reject_ahead_leaves_no_trace_of_them() -> None:
    """Drafts in flight: a copy goes in waves sent behind the sequence's own waves out, every one
    kept; where the text departs from the lookup, waves behind a reject are stale, cut with the
    rejected rows before the next wave (the scripted cache refuses its rows otherwise, and `serve`
    checks it holds only the accepted positions), and the text is decoding's without drafts."""
    prompt, loop = CYCLE_PROMPT, copying_cycle()
    job = Job("copy", prompt, 60, SamplingSettings())
    plain, _ = serve(ScriptedModel(loop), [job], Speculate.OFF)
    one, single = serve(ScriptedModel(loop), [job], Speculate.NGRAM)
    ahead, batcher = serve(ScriptedModel(loop), [job], Speculate.NGRAM, waves=DRAFT_WAVES_OUT, ring_costs=NEVER_IDLE)
    assert ahead == one == plain
    stats = batcher.speculation
    assert single.speculation.waves_behind == 0
    assert stats.waves_behind > 3 and stats.waves_stale == 0
    assert stats.accepted == stats.drafted

    answer = [int(piece.strip("<>")) for piece in plain["copy"]]  # drafts of it, every fifth wrong
    model = ScriptedModel(loop)
    ahead, batcher = serve(model, [job], Speculate.NGRAM, waves=DRAFT_WAVES_OUT, ring_costs=NEVER_IDLE,
                           drafter=lambda job: Departing(job.prompt, answer, VOCAB, wrong=5))  # fmt: skip
    assert ahead == plain
    stats = batcher.speculation
    assert stats.waves_behind > 0 and stats.waves_stale > 0 and stats.accepted < stats.drafted
    assert model.cache[0][: len(prompt) + len(answer) - 1] == [*prompt, *answer[:-1]]


def test_waves_behind_go_where_the_ring_is_measured_with_stages_to_overlap() -> None:
    """Drafts in flight as the engine loop prices them: none before the ring's stages are measured
    (no `ring_costs`), none on a ring of one stage (a wave behind only waits there for the one
    ahead), and on three stages of one box whose trip is mostly wire the copy's waves go behind,
    every one kept; the text is decoding's without drafts each time."""
    prompt, loop = CYCLE_PROMPT, copying_cycle()
    job = Job("copy", prompt, 60, SamplingSettings())
    plain, _ = serve(ScriptedModel(loop), [job], Speculate.OFF)
    one_stage = WaveCosts((StageCost(5.0, 1.0),), (0,), 60.0)
    box = WaveCosts((StageCost(5.0, 1.0),) * 3, (0, 0, 0), 60.0)
    for costs, behind in ((None, False), (one_stage, False), (box, True)):
        texts, batcher = serve(ScriptedModel(loop), [job], Speculate.NGRAM, waves=DRAFT_WAVES_OUT, ring_costs=costs)
        assert texts == plain
        stats = batcher.speculation
        assert (stats.waves_behind > 3) is behind and stats.waves_stale == 0, (costs, stats)


def test_no_drafts_past_max_tokens_or_where_speculation_is_off() -> None:
    loop = np.full((VOCAB, VOCAB, VOCAB), -5.0, dtype=np.float32)
    loop[:, :, 4] = 5.0  # always 4: a draft of 4s is always right
    model = ScriptedModel(loop)
    texts, batcher = serve(model, [Job("short", [4, 4, 4, 4], 3, SamplingSettings())], Speculate.NGRAM)
    assert "".join(texts["short"]) == "<4><4><4>"
    assert model.rows <= 4 + 3  # the prompt, then at most the tokens it may still write
    assert batcher.speculation.drafted == batcher.speculation.accepted == 1  # one draft: all max_tokens allowed
    off = Batcher(1, 8, 64, lambda _s: Sample(None), lambda t: b"", lambda t: False, PrefixCut.NOWHERE, Speculate.NGRAM)
    assert off.speculation_off is not None and "recurrent" in off.speculation_off
    refused: Callable[[], Batcher] = lambda: Batcher(  # noqa: E731
        1, 8, 64, lambda _s: Sample(None), lambda t: b"", lambda t: False, PrefixCut.ANYWHERE, Speculate.NGRAM, "why"
    )
    assert refused().speculation_off == "the engine cannot check drafts: why"
    assert DRAFT_ROWS_PER_WAVE >= 1


# --- how a stage groups a wave's steps into decodes ----------------------------------------


@dataclass(frozen=True)
class Rows:
    sequence_id: int
    position: int
    states: npt.NDArray[np.float32]


@settings(max_examples=200)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    limit=st.integers(MAX_DRAFT + 1, 32),
    outputs=st.integers(MAX_DRAFT + 1, 20),
    marks=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_a_step_whose_rows_all_want_logits_sits_in_one_decode_and_others_fill_decodes(
    lengths: list[int], limit: int, outputs: int, marks: list[bool]
) -> None:
    """Every row goes into exactly one decode, in order; no decode exceeds the batch or the head's
    rows of logits; a step whose rows all want logits sits in one decode whole, and any other
    step, however short, goes on into the next decode only where its decode is full (rows or
    logits): a windowed cache's keeper lets a cut back into the first part find its cells."""
    every_row = [mark and n <= MAX_DRAFT + 1 for mark, n in zip(marks, lengths, strict=False)]
    steps = [Rows(i, 100 * i, np.zeros((n, 1), dtype=np.float32)) for i, n in enumerate(lengths)]
    decodes = _decodes(steps, limit, max_ends=outputs, every_row=every_row)
    seen: dict[int, list[int]] = {}
    wanted_in: list[int] = []
    for decode in decodes:
        assert sum(piece.states.shape[0] for piece in decode) <= limit
        wanted = sum(piece.states.shape[0] if every_row[piece.step] else piece.ends_step for piece in decode)
        assert wanted <= outputs
        wanted_in.append(wanted)
        for piece in decode:
            seen.setdefault(piece.step, []).extend(range(piece.position, piece.position + piece.states.shape[0]))
    assert seen == {i: list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)}
    for index in range(len(lengths)):
        holding = [i for i, d in enumerate(decodes) if any(piece.step == index for piece in d)]
        if every_row[index]:
            assert len(holding) == 1, index
        for i in holding[:-1]:
            assert sum(piece.states.shape[0] for piece in decodes[i]) == limit or wanted_in[i] == outputs, (index, i)


@settings(max_examples=200)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    limit=st.integers(MAX_DRAFT + 1, 32),
    outputs=st.integers(1, 20),
    marks=st.lists(st.sampled_from(["plain", "every row", "row by row"]), min_size=8, max_size=8),
)
def test_a_greedy_token_and_its_drafts_go_one_row_a_decode_and_their_logits_are_gathered_in_order(
    lengths: list[int], limit: int, outputs: int, marks: list[str]
) -> None:
    """A step marked row by row (a greedy request's token and drafts) never has two rows in one
    decode; its row i goes in the decode after its row i - 1, beside row i of the others so
    marked (one row a sequence, as a wave without drafts goes), so k + 1 rows cost k + 1 decodes
    however many sequences draft. Every row still goes into exactly one decode, within the batch
    and the head's rows of logits, and the rows that ask for logits, gathered across decodes,
    are each every-row step's rows in order and each other step's last."""
    marked = [mark for mark, n in zip(marks, lengths, strict=False)]
    every_row = [mark != "plain" and n <= min(MAX_DRAFT + 1, outputs) for mark, n in zip(marked, lengths, strict=True)]
    row_by_row = [mark == "row by row" and wants for mark, wants in zip(marked, every_row, strict=True)]
    steps = [Rows(i, 100 * i, np.zeros((n, 1), dtype=np.float32)) for i, n in enumerate(lengths)]
    decodes = _decodes(steps, limit, max_ends=outputs, every_row=every_row, row_by_row=row_by_row)
    seen: dict[int, list[int]] = {}
    gathered: dict[int, list[int]] = {}
    for decode in decodes:
        assert sum(piece.states.shape[0] for piece in decode) <= limit
        flags, owners = _outputs(decode, None, every_row)
        assert sum(flags) <= outputs and [row for row, _ in owners] == [i for i, f in enumerate(flags) if f]
        _, positions, _ = _rows(decode)
        for row, step in owners:
            gathered.setdefault(step, []).append(positions[row])
        for piece in decode:
            seen.setdefault(piece.step, []).extend(range(piece.position, piece.position + piece.states.shape[0]))
        split = [piece.step for piece in decode if row_by_row[piece.step]]
        assert len(split) == len(set(split)) and all(p.states.shape[0] == 1 for p in decode if row_by_row[p.step])
    assert seen == {i: list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)}
    wanted = {
        i: list(range(100 * i, 100 * i + n)) if every_row[i] else [100 * i + n - 1] for i, n in enumerate(lengths)
    }
    assert gathered == wanted
    longest = max((n for n, split in zip(lengths, row_by_row, strict=True) if split), default=0)
    holding = [d for d in decodes if any(row_by_row[piece.step] for piece in d)]
    if sum(row_by_row) <= min(limit, outputs):  # each round fits one decode
        assert len(holding) == longest


def test_a_step_one_row_a_decode_must_be_its_sequence_s_only_step_in_the_batch() -> None:
    steps = [Rows(3, 10, np.zeros((3, 1), dtype=np.float32)), Rows(3, 13, np.zeros((2, 1), dtype=np.float32))]
    with pytest.raises(ValueError, match="another step of its sequence"):
        _decodes(steps, 16, row_by_row=[True, False])
    assert len(_decodes(steps, 16, row_by_row=[False, False])) == 1


def test_a_stage_counts_a_forward_one_row_a_decode_as_decodes_of_one_row() -> None:
    """A greedy token and four drafts at a stage: five decodes of a row, priced as such
    (`decode_ms_by_rows`, the time of a row alone), not one decode of five."""
    timer = StageTimer()
    timer.add_forward(0.02, True, [(1, 0.004)] * 5, [True])
    assert timer.decode_ms_by_rows == [(1, pytest.approx(4.0))] and timer.ms_per_token_alone == pytest.approx(4.0)
    assert timer.decode_rows == 5 and timer.rows == 5 and timer.prefill_ms_per_token is None


def test_a_greedy_wave_behind_is_priced_one_row_a_decode_its_rows_passed_on_as_decoded() -> None:
    """Drafts in flight behind a greedy wave of five rows out: at each stage five decodes of a row
    (5 · (a + p)), not one of five (a + 5p); each stage passes a row on as decoded, so on machines
    apart the rows overlap (the first row's trip, then one row at the busiest machine a row), and
    on one machine they go one stage after another."""
    stages = (StageCost(5.0, 1.0), StageCost(5.0, 1.0), StageCost(8.0, 4.0))  # 6, 6, 12 ms a row
    box = WaveCosts(stages, (0, 0, 0), 60.0)
    assert box.trip_ms(5, row_by_row=True) == pytest.approx(5 * 24.0 + 60.0)
    assert idle_behind_ms(box, [5]) == pytest.approx(60.0)  # a + 5p at each stage: 48 ms of work
    assert idle_behind_ms(box, [5], row_by_row=True) == pytest.approx(60.0)  # its trip grows as its work
    apart = WaveCosts(stages, (0, 1, 2), 30.0)
    assert apart.trip_ms(5, row_by_row=True) == pytest.approx(24.0 + 30.0 + 4 * 12.0)
    assert apart.trip_ms(1, row_by_row=True) == pytest.approx(apart.trip_ms(1))
    assert idle_behind_ms(apart, [5], row_by_row=True) == pytest.approx(24.0 - 12.0 + 30.0)
    two = WaveCosts(stages, (0, 0, 1), 0.0)  # the first two share a machine: 12 ms a row there too
    assert two.trip_ms(5, row_by_row=True) == pytest.approx(24.0 + 4 * 12.0)


def test_a_greedy_request_s_waves_behind_are_priced_from_one_row_decodes_alone() -> None:
    """A greedy request drafting alone makes its stages decode one row at a time and nothing else,
    so no stage ever times a second row count and the fitted costs never come (`wave_costs_from`
    None: its drafts in flight never went, 0 waves behind in the 40 ms edit, docs/benchmarks.md).
    One row's decodes are all its waves' trip and work need: `one_row_costs` prices them as the
    fitted line's a + p would, and prices no wave of several rows in one decode."""
    points = [[(1, 6.0)], [(1, 6.0)], [(1, 12.0)]]
    assert wave_costs_from(points, (0, 1, 2), 30.0) is None
    costs = one_row_costs(points, (0, 1, 2), 30.0)
    assert costs is not None and costs.one_row
    fitted = WaveCosts((StageCost(5.0, 1.0), StageCost(5.0, 1.0), StageCost(8.0, 4.0)), (0, 1, 2), 30.0)
    for rows_out in ([1], [5], [3, 2]):
        assert idle_behind_ms(costs, rows_out, row_by_row=True) == pytest.approx(
            idle_behind_ms(fitted, rows_out, row_by_row=True)
        )
        assert idle_behind_ms(costs, rows_out) is None  # a sampled request's rows: one decode of several
    assert one_row_costs([[(1, 6.0)], [(2, 9.0)]], (0, 1), 30.0) is None  # a stage with no decode of one row
    assert one_row_costs(points, (0, 1, 2), None) is None
    job = Job("copy", CYCLE_PROMPT, 60, SamplingSettings())  # greedy
    plain, _ = serve(ScriptedModel(copying_cycle()), [job], Speculate.OFF)
    box = one_row_costs([[(1, 5.0)]] * 3, (0, 0, 0), 60.0)
    texts, batcher = serve(
        ScriptedModel(copying_cycle()), [job], Speculate.NGRAM, waves=DRAFT_WAVES_OUT, ring_costs=box
    )
    assert texts == plain and batcher.speculation.waves_behind > 3 and batcher.speculation.waves_stale == 0


def test_a_verify_frame_says_whether_it_goes_one_row_a_decode_and_no_other_kind_may() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    for row_by_row in (False, True):
        sent = Frame.of_hidden(Kind.VERIFY, 5, 40, rows, top=1, logprobs=2, row_by_row=row_by_row)
        (back,) = FrameDecoder().feed(sent.encode())
        assert back == sent and back.row_by_row is row_by_row and back.logprobs == 2
    with pytest.raises(ValueError, match="only VERIFY"):
        Frame.of_hidden(Kind.DECODE, 5, 40, rows, row_by_row=True)
    decode = Frame.of_hidden(Kind.DECODE, 5, 40, rows)
    header = bytearray(decode.encode())
    header[5] |= ROW_BY_ROW_FLAG  # the flags byte
    with pytest.raises(FrameError, match="only VERIFY frames carry it"):
        FrameDecoder().feed(bytes(header))
    header[5] = 0x20  # a bit no frame carries
    with pytest.raises(FrameError, match="frame flags"):
        FrameDecoder().feed(bytes(header))


# --- a head on a member's answer to a token and its drafts -----------------------------------


@given(
    rows=st.integers(1, MAX_DRAFT + 1),
    vocabulary=st.integers(2, 64),
    top=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_a_rows_frame_carries_each_rows_largest_logits(rows: int, vocabulary: int, top: int, seed: int) -> None:
    top = min(top, vocabulary)
    logits = np.random.default_rng(seed).normal(size=(rows, vocabulary)).astype(np.float32)
    frame = Frame.of_rows(7, 30, logits, top)
    (back,) = FrameDecoder().feed(frame.encode())
    assert (back.kind, back.sequence_id, back.position, back.n_tokens, back.top) == (Kind.ROWS, 7, 30, rows, top)
    matrix = back.rows()
    assert matrix.shape == (rows, vocabulary)
    for row, sent in zip(matrix, logits, strict=True):
        kept = np.isfinite(row)
        assert kept.sum() == top and int(row.argmax()) == int(sent.argmax())  # greedy picks as from the whole row
        assert np.array_equal(row[kept], sent[kept]) and np.all(sent[~kept] <= row[kept].min())


def test_a_rows_frame_from_a_member_is_checked() -> None:
    good = Frame.of_rows(1, 0, np.arange(12, dtype=np.float32).reshape(3, 4), 2)
    with pytest.raises(FrameError):  # a length that does not hold rows x top entries
        FrameDecoder().feed(replace(good, payload=good.payload[:-8]).encode())
    outside = bytearray(good.payload)
    outside[0:4] = np.int32(9).tobytes()  # a token past the vocabulary of 4
    with pytest.raises(FrameError):
        Frame(Kind.ROWS, 1, 0, 3, 4, DType.I32, bytes(outside), 2).rows()
    with pytest.raises(FrameError, match="too short"):  # log probabilities asked, but no trailer
        FrameDecoder().feed(replace(good, logprobs=2).encode())
    with pytest.raises(FrameError):  # a top past the vocabulary
        FrameDecoder().feed(Frame(Kind.ROWS, 1, 0, 1, 4, DType.I32, bytes(8 * 5), 5).encode())
    with pytest.raises(ValueError):
        Frame.of_rows(1, 0, np.zeros((2, 4), dtype=np.float32), 0)


@given(
    rows=st.integers(1, MAX_DRAFT + 1),
    vocabulary=st.integers(2, 64),
    top=st.integers(1, 8),
    alternatives=st.integers(0, MAX_TOP_LOGPROBS),
    seed=st.integers(0, 2**16),
)
def test_a_rows_frame_carries_each_rows_log_probabilities_as_the_whole_row_gives_them(
    rows: int, vocabulary: int, top: int, alternatives: int, seed: int
) -> None:
    """A head on a member's ROWS frame for a request that asks for log probabilities: the host
    reports from it, for the token each row gives, what it reports from the whole rows."""
    top, alternatives = min(top, vocabulary), min(alternatives, vocabulary)
    logits = (np.random.default_rng(seed).normal(size=(rows, vocabulary)) * 4).astype(np.float32)
    frame = Frame.of_rows(7, 30, logits, top).with_logprobs(logits, alternatives)
    (back,) = FrameDecoder().feed(frame.encode())
    assert back.logprobs == alternatives and np.array_equal(back.rows(), Frame.of_rows(7, 30, logits, top).rows())
    trailer = back.rows_logprobs()
    assert trailer is not None
    for sent, kept, lse, ids, values in zip(logits, back.rows(), *trailer, strict=True):
        token = int(kept.argmax())  # the greedy token, as from the whole row
        head = HeadRow(kept, float(lse), ids, values)
        here, there = (token_logprob(r, token, alternatives, lambda t: b"") for r in (sent, head))
        assert there.logprob == pytest.approx(here.logprob, abs=1e-5)
        assert [a.token for a in there.top] == [a.token for a in here.top]
        assert [a.logprob for a in there.top] == pytest.approx([a.logprob for a in here.top], abs=1e-5)


def test_a_rows_frames_log_probabilities_from_a_member_are_checked() -> None:
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    good = Frame.of_rows(1, 0, logits, 2).with_logprobs(logits, 2)
    assert FrameDecoder().feed(good.encode())[0].rows_logprobs() is not None
    rows_part = 8 * 3 * 2  # the rows' top entries come first, then the trailer: 3 log-sum-exps, ids, logits
    for payload in (good.payload[:-4], good.payload + bytes(4)):  # a length that does not hold the trailer
        with pytest.raises(FrameError):
            FrameDecoder().feed(replace(good, payload=payload).encode())
    nan = bytearray(good.payload)
    nan[rows_part + 4 : rows_part + 8] = np.float32(np.nan).tobytes()  # the second row's log-sum-exp
    with pytest.raises(FrameError, match="not finite"):
        FrameDecoder().feed(replace(good, payload=bytes(nan)).encode())[0].rows_logprobs()
    twice = bytearray(good.payload)
    twice[rows_part + 12 : rows_part + 16] = twice[rows_part + 16 : rows_part + 20]  # row 0 names one token twice
    with pytest.raises(FrameError, match="twice"):
        FrameDecoder().feed(replace(good, payload=bytes(twice)).encode())[0].rows_logprobs()
    with pytest.raises(ValueError):  # logits that are not the frame's rows
        Frame.of_rows(1, 0, logits, 2).with_logprobs(logits[:2], 2)


@settings(deadline=None, max_examples=30)
@given(break_after=st.integers(1, 12), waves=st.integers(1, 2), sampled=st.booleans())
def test_a_ring_lost_mid_speculation_leaves_requests_that_finish_as_without_drafts(
    break_after: int, waves: int, sampled: bool
) -> None:
    """The ring breaks after some waves, with drafts out and rejected rows not yet cut: the
    requests go on on a new ring (empty caches, `suspend_all` then `resume`), drafting again, and
    end with the text decoding without drafts gives."""
    loop = np.full((VOCAB, VOCAB, VOCAB), -5.0, dtype=np.float32)
    for a in range(VOCAB):
        for b in range(VOCAB):
            loop[a, b, (b + 1) % VOCAB or 3] = 5.0 if a % 2 else 4.0  # copies, with some departures
            loop[a, b, (b + 5) % VOCAB or 4] = 4.5
    jobs = [Job("a", [3, 4, 5, 6, 3, 4], 30, SamplingSettings()), Job("b", [7, 8, 9, 7, 8], 30, SamplingSettings())]
    seed = 5 if sampled else None
    plain, _ = serve(ScriptedModel(loop), jobs, Speculate.OFF, seed)

    def batcher() -> Batcher:
        return Batcher(
            2, 16, 64, lambda _s: Sample(seed), lambda t: f"<{t}>".encode(), lambda t: t == END,
            PrefixCut.ANYWHERE, Speculate.NGRAM,
        )  # fmt: skip

    first, model = batcher(), ScriptedModel(loop)
    for job in jobs:
        first.submit(job)
    texts: dict[str, str] = {job.request_id: "" for job in jobs}
    launched: list[list[EngineStep]] = []
    for _ in range(break_after):
        for trim in first.take_trims():
            model.forget(trim.slot, trim.keep)
        while len(launched) < waves and (steps := first.plan(waves)):
            launched.append(steps)
        if not launched:
            break
        for event in first.advance(model.run(launched.pop(0))):
            if isinstance(event, TextDelta):
                texts[event.request_id] += event.text
    kept, failed = first.suspend_all("the ring broke")
    assert not failed  # every sampler here is the host's
    second, fresh = batcher(), ScriptedModel(loop)
    for suspended in reversed(kept):
        second.resume(suspended)
    while not second.idle or second.trimming:
        for trim in second.take_trims():
            fresh.forget(trim.slot, trim.keep)
        steps = second.plan()
        if steps:
            for event in second.advance(fresh.run(steps)):
                if isinstance(event, TextDelta):
                    texts[event.request_id] += event.text
    assert texts == {name: "".join(parts) for name, parts in plain.items()}
    assert first.speculation.drafted + second.speculation.drafted > 0
