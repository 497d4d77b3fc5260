"""The continuous-batching policy, on its own: what each step carries, and when requests end."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from kafila.runtime.engine.engines import EngineStep, PrefixCut, SequenceFailed
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.batcher import Batcher, Finished, FinishReason, Job, RequestFailed, TextDelta, Trim
from kafila.serving.engine_loop import LoopStats

VOCAB = 16
END = 0


class Argmax:
    portable = True

    def accept(self, tokens: Sequence[int]) -> None:
        pass

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        return int(np.argmax(logits))

    def close(self) -> None:
        pass


def batcher(concurrency: int = 2, rows: int = 8, context: int = 64) -> Batcher:
    return Batcher(concurrency, rows, context, lambda _s: Argmax(), lambda t: f"<{t}>".encode(), lambda t: t == END)


def job(name: str, prompt: int, max_tokens: int = 10, stop: tuple[str, ...] = ()) -> Job:
    return Job(name, list(range(1, prompt + 1)), max_tokens, SamplingSettings(), stop)


def one_hot(token: int) -> npt.NDArray[np.float32]:
    row = np.zeros(VOCAB, dtype=np.float32)
    row[token] = 1.0
    return row


def answer(steps: Sequence[EngineStep], token: int = 5) -> list[npt.NDArray[np.float32] | None]:
    return [one_hot(token) if s.logits else None for s in steps]


def test_prompts_share_the_step_budget_and_extra_requests_queue() -> None:
    b = batcher(concurrency=2, rows=8)
    for name, length in (("a", 5), ("b", 10), ("c", 3)):
        b.submit(job(name, length))
    steps = b.plan()
    assert [(s.sequence_id, s.position, len(s.tokens), s.decode, s.logits) for s in steps] == [
        (0, 0, 5, False, True),  # a: its whole prompt, in slot 0
        (1, 0, 3, False, False),  # b: the first 3 of 10 rows, with no output row
    ]
    assert b.queued == 1 and b.running == 2
    events = b.advance(answer(steps))
    assert events == [TextDelta("a", "<5>")]
    steps = b.plan()
    # a decodes one row; b's prompt continues with the 7 rows left of the budget.
    assert [(len(s.tokens), s.decode, s.position) for s in steps] == [(1, True, 5), (7, False, 3)]


def test_a_slot_is_reused_only_after_the_engine_cut_its_cache() -> None:
    b = batcher(concurrency=1, rows=8)
    b.submit(job("a", 2, max_tokens=1))
    b.submit(Job("b", [7, 8], 10, SamplingSettings()))
    steps = b.plan()
    assert b.advance(answer(steps)) == [TextDelta("a", "<5>"), Finished("a", FinishReason.LENGTH, 2, 1)]
    assert b.plan() == []  # b waits: slot 0 still holds a's cache
    assert b.take_trims() == [Trim(0, 0)]  # nothing in common: all of it goes
    (step,) = b.plan()
    assert step.sequence_id == 0 and step.tokens == [7, 8] and step.position == 0


def run_to_the_end(b: Batcher, token: int = 5) -> list[Finished]:
    """Plan and land waves, cutting caches as asked, until every request has ended."""
    finished: list[Finished] = []
    while not b.idle:
        b.take_trims()
        steps = b.plan()
        finished += [e for e in b.advance(answer(steps, token)) if isinstance(e, Finished)]
    return finished


def test_a_request_takes_the_slot_holding_most_of_its_prompt_and_prefills_only_the_rest() -> None:
    """A chat's second turn resends the first turn and its answer: those rows are in the cache
    of the slot that served it, so only what is new is computed."""
    b = batcher(concurrency=2, rows=16)
    b.submit(Job("first", [1, 2, 3, 4], 3, SamplingSettings()))
    b.submit(Job("other", [9, 9, 9], 3, SamplingSettings()))
    b.take_trims()
    slots = {s.tokens[0]: s.sequence_id for s in b.plan()}
    b.advance([one_hot(5), one_hot(6)])
    assert [f.cached_tokens for f in run_to_the_end(b)] == [0, 0]
    # "first" fed 1 2 3 4, then 5 and 5 back (the third 5 was never fed): 6 rows held in its slot
    b.submit(Job("second", [1, 2, 3, 4, 5, 5, 10, 11], 2, SamplingSettings()))
    assert b.plan() == [] and b.take_trims() == [Trim(slots[1], 6)]
    (step,) = b.plan()
    assert step.sequence_id == slots[1] and step.position == 6 and step.tokens == [10, 11]
    b.advance([one_hot(5)])
    assert run_to_the_end(b) == [Finished("second", FinishReason.LENGTH, 8, 2, cached_tokens=6)]


def test_a_prompt_sharing_only_its_first_token_starts_afresh() -> None:
    """A BOS alone is not worth its rounding (`MIN_REUSED`): the slot is cut to nothing, and the
    whole prompt is computed as in a fresh cache; two tokens in common are kept."""
    b = batcher(concurrency=1, rows=16)
    b.submit(Job("first", [1, 2, 3, 4], 2, SamplingSettings()))
    b.take_trims()
    b.plan()
    b.advance([one_hot(5)])
    run_to_the_end(b)
    b.submit(Job("bos only", [1, 7, 8], 2, SamplingSettings()))
    assert b.plan() == [] and b.take_trims() == [Trim(0, 0)]
    (step,) = b.plan()
    assert step.position == 0 and step.tokens == [1, 7, 8]
    b.advance([one_hot(5)])
    run_to_the_end(b)
    b.submit(Job("two shared", [1, 7, 9], 2, SamplingSettings()))
    assert b.plan() == [] and b.take_trims() == [Trim(0, 2)]


def test_the_same_prompt_again_recomputes_only_its_last_token() -> None:
    b = batcher(concurrency=1)
    for name in ("a", "b"):
        b.submit(job(name, 5, max_tokens=2))
    finished = run_to_the_end(b)
    assert [f.cached_tokens for f in finished] == [0, 4]  # the last token's logits are needed anew


def test_a_cache_is_cut_anywhere_in_what_it_holds_and_a_recurrent_state_never() -> None:
    """A prefix far short of what a slot holds (an edit early in a history) is resumed where the
    cache holds positions, a sliding window's included; a recurrent state cannot be cut at all."""
    for cut, expected in ((PrefixCut.ANYWHERE, 2), (PrefixCut.NOWHERE, 0)):
        b = batcher(concurrency=1)
        b.prefix_cut = cut
        b.submit(job("a", 6, max_tokens=1))
        b.submit(Job("b", [1, 2, 9, 9], 1, SamplingSettings()))  # shares 2 of the 6 rows held
        assert [f.cached_tokens for f in run_to_the_end(b)] == [0, expected], cut
        b.submit(Job("c", [1, 2, 9, 9, 4], 1, SamplingSettings()))  # extends what b left: 4 rows
        reused = 0 if cut is PrefixCut.NOWHERE else 4
        assert [f.cached_tokens for f in run_to_the_end(b)] == [reused], cut


def test_among_equal_slots_the_least_recently_used_cache_is_the_one_dropped() -> None:
    b = batcher(concurrency=2)
    b.submit(Job("old", [1, 1, 1], 1, SamplingSettings()))
    run_to_the_end(b)
    b.submit(Job("new", [2, 2, 2], 1, SamplingSettings()))
    run_to_the_end(b)  # took the never-used slot
    b.submit(Job("third", [3, 3], 1, SamplingSettings()))  # shares nothing: evicts "old"
    run_to_the_end(b)
    b.submit(Job("new again", [2, 2, 2, 4], 1, SamplingSettings()))
    assert run_to_the_end(b)[0].cached_tokens == 3  # "new"'s cache survived


def test_an_end_token_stops_and_a_stop_string_cuts_the_text() -> None:
    b = batcher()
    b.submit(job("a", 2))
    b.submit(job("b", 2, stop=("<7>",)))
    steps = b.plan()
    events = b.advance([one_hot(END), one_hot(7)])
    assert Finished("a", FinishReason.STOP, 2, 0) in events
    assert Finished("b", FinishReason.STOP, 2, 1, stop="<7>") in events  # which stop string ended it
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert len(steps) == 2 and b.idle


def test_a_full_context_ends_generation_with_length() -> None:
    b = batcher(concurrency=1, rows=8, context=6)
    b.submit(job("a", 4, max_tokens=100))
    finished = []
    for _ in range(10):
        steps = b.plan()
        if not steps:
            break
        for step in steps:
            assert step.position + len(step.tokens) <= 6
        finished += [e for e in b.advance(answer(steps)) if isinstance(e, Finished)]
    assert finished == [Finished("a", FinishReason.LENGTH, 4, 3)]


def test_cancelled_requests_leave_the_queue_or_free_their_slot() -> None:
    b = batcher(concurrency=1)
    b.submit(job("a", 2))
    b.submit(job("b", 2))
    steps = b.plan()
    assert b.cancel("b") and b.cancel("a") and not b.cancel("a")
    assert b.advance(answer(steps)) == []  # a was cancelled while its step ran
    assert b.idle and not b.trimming


def test_a_broken_engine_fails_every_request() -> None:
    b = batcher(concurrency=1)
    b.submit(job("a", 2))
    b.submit(job("b", 2))
    b.plan()
    assert b.fail_all("ring broke") == [RequestFailed("a", "ring broke"), RequestFailed("b", "ring broke")]
    assert b.idle


def test_a_sequence_a_stage_refused_fails_alone_and_frees_its_slot() -> None:
    b = batcher(concurrency=2)
    b.submit(job("a", 2))
    b.submit(job("b", 2))
    b.submit(job("c", 2))
    steps = b.plan()
    refused = SequenceFailed(steps[1].sequence_id, "the stage holding blocks 0-1 refused sequence 0: no room")
    events = b.advance([one_hot(5), refused])
    assert events == [
        TextDelta("a", "<5>"),
        RequestFailed(
            "b", "this request failed: the stage holding blocks 0-1 refused sequence 0: no room", "stage_error"
        ),
    ]
    assert b.running == 1 and b.queued == 1
    assert [s.decode for s in b.plan()] == [True]  # a decodes on; c waits for b's slot to be cut
    assert b.take_trims() == [Trim(steps[1].sequence_id, 0)]  # c shares b's prompt, but not a failed cache
    b.advance([one_hot(5)])
    assert [(s.decode, s.position) for s in b.plan()] == [(True, 3), (False, 0)]


def test_prompts_the_context_cannot_hold_are_refused() -> None:
    b = batcher(context=4)
    with pytest.raises(ValueError, match="context holds 4"):
        b.submit(job("a", 4))
    with pytest.raises(ValueError, match="empty"):
        b.submit(Job("b", [], 1, SamplingSettings()))


def test_running_requests_split_into_waves_that_land_in_order() -> None:
    b = batcher(concurrency=4, rows=16)
    for name in "abcd":
        b.submit(job(name, 2, max_tokens=3))
    first = b.plan(waves=2)
    second = b.plan(waves=2)
    assert [s.sequence_id for s in first] != [s.sequence_id for s in second]
    assert len(first) == len(second) == 2 and b.in_flight == 2
    assert b.plan(waves=2) == []  # every sequence is out in a wave
    events = b.advance(answer(first))  # the oldest wave lands first
    assert {e.request_id for e in events} == {"a", "b"} and b.in_flight == 1
    again = b.plan(waves=2)  # a and b go round again while c and d are still out
    assert {s.sequence_id for s in again} == {s.sequence_id for s in first} and all(s.decode for s in again)
    assert {e.request_id for e in b.advance(answer(second))} == {"c", "d"}
    assert {e.request_id for e in b.advance(answer(again))} == {"a", "b"}
    with pytest.raises(ValueError):
        b.advance(answer(again))  # nothing is out any more


def test_a_request_cancelled_while_its_wave_is_out_gives_up_its_slot_when_the_wave_lands() -> None:
    b = batcher(concurrency=2, rows=8)
    b.submit(job("a", 2))
    b.submit(job("b", 2))
    b.take_trims()
    wave = b.plan()
    assert b.cancel("a")
    b.submit(job("c", 2))
    assert b.plan() == [] and b.take_trims() == [Trim(wave[0].sequence_id, 0)]  # a's rows never landed
    (reused,) = b.plan()  # b is still out; c takes a's slot: the engine orders it after a's rows and their cut
    assert reused.sequence_id == wave[0].sequence_id and reused.position == 0
    assert [e.request_id for e in b.advance(answer(wave))] == ["b"]  # a's row lands unused


def test_the_rate_window_forgets_old_steps_without_being_read() -> None:
    """A server nobody polls for /status keeps only the last 10 s of steps, not every step."""
    stats = LoopStats()
    for step in range(10_000):  # 100 steps a second for 100 s, never read
        stats.record_step(step / 100, 2)
    assert 1000 <= len(stats.recent_tokens) <= 1001  # the last 10 s, give or take a rounded end
    assert stats.tokens_per_s(100.0) == pytest.approx(200.0)  # steps from t=90.00 on: 2,000 tokens in 10 s
    assert stats.tokens_per_s(200.0) == 0.0 and not stats.recent_tokens


class ChosenElsewhere(Argmax):
    portable = False  # a head on a member sampled it


def test_a_request_the_ring_lost_goes_on_on_the_next_ring_where_it_stopped() -> None:
    """Suspended mid-answer, a request goes to the new ring ahead of those that came after it,
    prefills its prompt and the tokens it had drawn, and draws on with its own sampler: its text
    and counts run on as if nothing had happened."""
    old = batcher(concurrency=2, rows=16)
    old.submit(job("a", 3, max_tokens=4))
    old.submit(job("b", 40, max_tokens=4))  # still prefilling after two steps of 16 rows
    first = old.plan()
    assert [e for e in old.advance(answer(first, 5)) if isinstance(e, TextDelta)] == [TextDelta("a", "<5>")]
    old.advance(answer(old.plan(), 6))  # a has drawn 5 then 6, whose row has not gone round
    old.submit(job("c", 2))
    kept, failed = old.suspend_all("the model ring failed: member-1 is gone")
    assert failed == [] and [s.job.request_id for s in kept] == ["a", "b", "c"] and old.idle
    assert kept[0].generated == [5, 6] and kept[1].sampler is None  # b drew nothing: it starts afresh

    new = batcher(concurrency=2, rows=16)
    new.submit(job("d", 2))  # came after the break: waits behind the resumed ones
    for suspended in reversed(kept):
        new.resume(suspended)
    steps = new.plan()
    assert [(s.position, s.tokens, s.logits) for s in steps] == [
        (0, [1, 2, 3, 5, 6], True),  # a: its prompt and what it drew, the last row asking for the next
        (0, list(range(1, 12)), False),  # b: from its first token again
    ]
    events = new.advance(answer(steps, 7))
    assert events == [TextDelta("a", "<7>")]
    (decode, _) = new.plan()
    assert (decode.position, decode.tokens, decode.decode) == (5, [7], True)
    events = new.advance([one_hot(8), None])
    assert [e for e in events if isinstance(e, Finished)] == [Finished("a", FinishReason.LENGTH, 3, 4)]


def test_a_request_whose_sampler_ran_on_the_lost_ring_ends_with_why() -> None:
    b = Batcher(2, 8, 64, lambda _s: ChosenElsewhere(), lambda t: f"<{t}>".encode(), lambda t: t == END)
    b.submit(job("a", 2))
    b.advance(answer(b.plan()))
    kept, failed = b.suspend_all("the model ring failed")
    assert kept == [] and len(failed) == 1 and "sampler ran on the member that holds the head" in failed[0].message
