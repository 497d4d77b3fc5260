"""Speculative decoding on real llama.cpp: every tiny family decodes the same text with n-gram
drafts as without, on a local ring of two stages with the head on the host; a forced reject
leaves no trace in the stages' caches; a grammar-held request still validates."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from test_speculation import NEVER_IDLE, Departing
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.engine.draft_cost import DRAFT_WAVES_OUT, TripCost
from kafila.runtime.engine.draft_model import DraftModel
from kafila.runtime.engine.engines import (
    Engine,
    EngineStep,
    Launched,
    PrefixCut,
    RingEngine,
    UnsplitEngine,
    prefix_cut_of,
)
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import NgramDrafter, Speculate
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Batcher, Finished, Job, RequestFailed, TextDelta
from kafila.serving.engine_loop import EngineLoop
from kafila.serving.handle import ServingHandle

SETTINGS = ContextSettings(n_ctx=512, n_batch=16, n_seq_max=2, n_threads=2)
GREEDY = SamplingSettings(top_k=1)
STEPS = 24
REPEATING = "one two three four five six one two three four five six one two three"


def drive(
    engine: Engine,
    jobs: Sequence[Job],
    speculate: Speculate,
    after_each_wave: Callable[[Batcher], None] = lambda _b: None,
    drafter: Callable[[Job], NgramDrafter] | None = None,
    logprobs: dict[str, list[TokenLogprob]] | None = None,
    draft_model: DraftModel | None = None,
    waves: int = 1,
) -> tuple[dict[str, str], Batcher]:
    """Serve `jobs` on `engine` as the engine loop does, one wave at a time; each request's text
    (and into `logprobs`, each one's log probabilities). `drafter`: a drafter for each admitted
    request in place of the n-gram one; `draft_model`: what `Speculate.DRAFT` drafts with;
    `waves`: waves of one sequence's drafts out at once (drafts in flight), launched and landed
    as the engine loop does, each timed for the cost rule as a trip of 100 ms and 1 ms a drafted
    row, on a ring priced as never idling (`NEVER_IDLE`), so that it sends waves behind."""
    batcher = Batcher(
        SETTINGS.n_seq_max, 16, 256, engine.sampler, engine.piece, engine.is_end, engine.prefix_cut,
        speculate, engine.speculation_refused, engine.every_row_whole,
        make_drafter=draft_model.drafter if draft_model is not None else None,
        draft_together=draft_model.draft_many if draft_model is not None else None, draft_waves=waves,
    )  # fmt: skip
    batcher.ring_costs = NEVER_IDLE
    for job in jobs:
        batcher.submit(job)
    texts = {job.request_id: "" for job in jobs}
    finished: set[str] = set()
    replaced: set[str] = set()
    out: deque[tuple[list[EngineStep], Launched]] = deque()
    while not batcher.idle or batcher.trimming or out:
        for trim in batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        after_each_wave(batcher)
        while not out or (batcher.drafting_ahead and len(out) < waves):  # as `EngineLoop._fill`
            steps = batcher.plan(ahead_only=bool(out))
            if drafter is not None:
                for request_id, sequence in batcher._active.items():
                    if request_id not in replaced:
                        assert not sequence.generated  # admitted in this wave: its history is its prompt
                        sequence.drafter = drafter(sequence.job)
                        replaced.add(request_id)
            if not steps:
                break
            out.append((steps, engine.launch(steps)))
        if not out:
            continue
        steps, launched = out.popleft()
        events = batcher.advance(engine.land(launched))
        if waves > 1 and all(step.decode for step in steps) and batcher.last_wave_plain:
            drafted = sum(len(step.tokens) - 1 for step in steps)
            batcher.trip_clock.record(drafted, 0.1 + 0.001 * drafted)
        for event in events:
            assert not isinstance(event, RequestFailed), event.message
            if isinstance(event, TextDelta):
                texts[event.request_id] += event.text
                if logprobs is not None:
                    logprobs.setdefault(event.request_id, []).extend(event.logprobs)
            elif isinstance(event, Finished):
                finished.add(event.request_id)
    assert finished == set(texts)
    for slot in range(SETTINGS.n_seq_max):  # the next run starts from empty caches
        engine.forget(slot)
    return texts, batcher


def halves(arch: str, model: Path) -> list[int]:
    """Two stages' block counts for a tiny model: cut where the family allows, else in the middle."""
    n, starts = N_BLOCKS[arch], read_manifest(model).stage_starts
    cut = starts[0] if starts else n // 2
    return [cut, n - cut]


def cut_in_two(arch: str, directory: Path) -> tuple[Path, Engine]:
    """The family's tiny model, and a ring of it in two stages (block stage in its own process)."""
    model = write_tiny_model(directory / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    return model, open_engine(model, halves(arch, model), SETTINGS, directory / "stages")


@pytest.fixture(params=SUPPORTED_TINY_ARCHS)
def ring(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    arch = request.param
    _, engine = cut_in_two(arch, tmp_path)
    try:
        yield arch, engine
    finally:
        engine.close()


def test_every_tiny_family_decodes_the_same_text_with_drafts(ring: tuple[str, Engine], tmp_path: Path) -> None:
    """Two requests at once, with and without drafts on the same ring: the same text. With n-gram
    drafts (which a random tiny model seldom repeats), and with drafts of greedy decoding's answer
    of which every third is wrong, so that trips keep some and have the rest cut: wherever the
    family's cache can be cut, both kinds of trip happened."""
    arch, engine = ring
    model = tmp_path / f"{arch}.gguf"
    jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
    plain, off = drive(engine, jobs, Speculate.OFF)
    assert off.speculation.drafted == 0
    drafted, on = drive(engine, jobs, Speculate.NGRAM)
    assert drafted == plain, arch
    answers = {job.request_id: greedy_unsplit(model, job.prompt, STEPS) for job in jobs}

    def departing(job: Job) -> NgramDrafter:
        return Departing(job.prompt, answers[job.request_id], engine.n_vocab(), wrong=3)

    drafted, on = drive(engine, jobs, Speculate.NGRAM, drafter=departing)
    assert drafted == plain, arch
    if engine.prefix_cut is PrefixCut.NOWHERE or engine.speculation_refused is not None:  # qwen3next, gpt-oss
        assert on.speculation_off is not None and on.speculation.drafted == 0
    else:
        assert on.speculation_off is None, arch
        assert 0 < on.speculation.accepted < on.speculation.drafted, arch

    drafted, on = drive(engine, jobs, Speculate.NGRAM, drafter=departing, waves=DRAFT_WAVES_OUT)
    assert drafted == plain, arch  # drafts in flight: waves behind the sequence's own, made stale by rejects
    stats = on.speculation
    if on.speculation_off is None:  # windowed caches too: their stages keep the cells a cut back needs
        assert stats.waves_stale > 0, arch
    else:
        assert stats.waves_behind == 0, arch


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # full attention, and a sliding window
def test_a_forced_reject_leaves_no_trace(arch: str, tmp_path: Path) -> None:
    """Rejected drafts on every trip that drafts two: the text is greedy decoding's, and before
    each wave the head's cache of the sequence ends exactly where its next row goes (the block stage, in its own
    process, would refuse that row otherwise)."""
    model, engine = cut_in_two(arch, tmp_path)
    assert isinstance(engine, RingEngine) and engine.head is not None
    head = engine.head
    try:
        prompt = engine.tokenize(PROMPT)
        answer = greedy_unsplit(model, prompt, STEPS)
        job = Job("forced", prompt, STEPS, GREEDY)
        checked: list[int] = []

        def cache_ends_where_the_next_row_goes(batcher: Batcher) -> None:
            for sequence in batcher._active.values():
                if sequence.trimmed and not sequence.in_flight and sequence.generated:
                    assert head.model.next_position(sequence.slot) == sequence.position
                    checked.append(sequence.position)

        def departing(job: Job) -> NgramDrafter:
            return Departing(job.prompt, answer, engine.n_vocab(), wrong=2)

        ends = next((i for i, t in enumerate(answer) if engine.is_end(t)), len(answer))
        for waves in (1, DRAFT_WAVES_OUT):  # and with drafts in flight
            checked.clear()
            texts, batcher = drive(
                engine, [job], Speculate.NGRAM, cache_ends_where_the_next_row_goes, departing, waves=waves
            )
            assert texts["forced"] == engine.detokenize(answer[:ends])
            stats = batcher.speculation
            assert stats.trips > 2 and 0 < stats.accepted < stats.drafted  # one kept, the rest cut, each trip
            assert len(checked) > 2
            assert (stats.waves_stale > 0) is (waves > 1)  # a windowed cache too keeps what a cut back needs
    finally:
        engine.close()


def test_a_grammar_held_request_validates_with_drafts(tmp_path: Path) -> None:
    """A JSON grammar on the whole model with drafts on: the text parses, and equals the text without."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=N_BLOCKS["llama"])
    engine = UnsplitEngine(model, SETTINGS)
    try:
        grammar = 'root ::= "{\\"a\\": [" item ("," item)? ("," item)? ("," item)? "]}"\nitem ::= [0-9]'
        held = SamplingSettings(top_k=1, grammar=grammar)
        job = Job("json", engine.tokenize(REPEATING), 40, held)
        plain, _ = drive(engine, [job], Speculate.OFF)
        drafted, batcher = drive(engine, [job], Speculate.NGRAM)
        assert drafted == plain
        assert batcher.speculation_off is None
        assert isinstance(json.loads(drafted["json"])["a"], list)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # full attention, and a sliding window
def test_seeds_penalties_and_log_probabilities_hold_with_drafts(arch: str, tmp_path: Path) -> None:
    """A seeded draw, a repeat penalty and log probabilities, on a local ring, with drafts of the
    answer of which every third is wrong, one wave of them out and waves behind it: the same
    tokens, text and log probabilities as without. The sampler draws each row in turn as it would
    each trip's, so a kept draft is one it drew."""
    _, engine = cut_in_two(arch, tmp_path)
    try:
        prompt = engine.tokenize(REPEATING)
        kinds = {
            "seeded": SamplingSettings(temperature=0.9, top_k=40, top_p=0.95, seed=11),
            "penalised": SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, repeat_penalty=1.5),
        }
        jobs = [Job(name, prompt, STEPS, settings, logprobs=2) for name, settings in kinds.items()]
        plain_logprobs: dict[str, list[TokenLogprob]] = {}
        plain, _ = drive(engine, jobs, Speculate.OFF, logprobs=plain_logprobs)
        answers = {name: [entry.token for entry in entries] for name, entries in plain_logprobs.items()}

        def departing(job: Job) -> NgramDrafter:
            return Departing(job.prompt, answers[job.request_id], engine.n_vocab(), wrong=3)

        for waves in (1, DRAFT_WAVES_OUT):
            drafted_logprobs: dict[str, list[TokenLogprob]] = {}
            drafted, batcher = drive(
                engine, jobs, Speculate.NGRAM, drafter=departing, logprobs=drafted_logprobs, waves=waves
            )
            assert drafted == plain, waves
            assert 0 < batcher.speculation.accepted < batcher.speculation.drafted
            assert (batcher.speculation.waves_stale > 0) is (waves > 1)
            for name in kinds:
                one, other = plain_logprobs[name], drafted_logprobs[name]
                assert [e.token for e in one] == [e.token for e in other], (name, waves)
                assert [e.logprob for e in one] == pytest.approx([e.logprob for e in other], abs=1e-3), (name, waves)
                assert [[a.token for a in e.top] for e in one] == [[a.token for a in e.top] for e in other], name
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_head_on_a_member_checks_drafts_with_each_rows_largest_logits(arch: str, tmp_path: Path) -> None:
    """The head in a stage process, as on a member: a token and its drafts go round as a VERIFY
    frame and come back as ROWS (each row's largest logits), and greedy decoding with drafts (every
    third wrong) writes what it writes without. A request that asks for log probabilities drafts
    too, its ROWS carrying each row's log-sum-exp and largest entries: the same tokens and log
    probabilities as without drafts. One whose sampler needs whole rows drafts nothing there."""
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    stages = cached_slices(model, halves(arch, model), tmp_path / "stages")
    engine = local_ring_engine(stages, SETTINGS, prefix_cut_of(model), model=model)
    try:
        assert engine.head is None and engine.speculation_refused is None and not engine.every_row_whole
        jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        plain, _ = drive(engine, jobs, Speculate.OFF)
        answers = {job.request_id: greedy_unsplit(model, job.prompt, STEPS) for job in jobs}

        def departing(job: Job) -> NgramDrafter:
            return Departing(job.prompt, answers.get(job.request_id, []), engine.n_vocab(), wrong=3)

        drafted, batcher = drive(engine, jobs, Speculate.NGRAM, drafter=departing)
        assert drafted == plain
        assert 0 < batcher.speculation.accepted < batcher.speculation.drafted
        asking = [Job(job.request_id, job.prompt, STEPS, GREEDY, logprobs=3) for job in jobs]
        plain_logprobs: dict[str, list[TokenLogprob]] = {}
        drafted_logprobs: dict[str, list[TokenLogprob]] = {}
        for job in asking:  # alone: decoded as the same rows with drafts as without
            plain, _ = drive(engine, [job], Speculate.OFF, logprobs=plain_logprobs)
            drafted, batcher = drive(engine, [job], Speculate.NGRAM, drafter=departing, logprobs=drafted_logprobs)
            assert drafted == plain
            assert 0 < batcher.speculation.accepted < batcher.speculation.drafted
            one, other = plain_logprobs[job.request_id], drafted_logprobs[job.request_id]
            assert [e.token for e in one] == [e.token for e in other] and len(one) > 1
            assert [e.logprob for e in one] == pytest.approx([e.logprob for e in other], abs=1e-5)
            assert [[a.token for a in e.top] for e in one] == [[a.token for a in e.top] for e in other]
            alternatives = [[a.logprob for e in entries for a in e.top] for entries in (one, other)]
            assert alternatives[0] == pytest.approx(alternatives[1], abs=1e-5) and len(alternatives[0]) > len(one)
        whole_row = SamplingSettings(temperature=0.8, top_k=0, seed=3)  # sampled on the head itself
        _, batcher = drive(engine, [Job("0", jobs[0].prompt, 8, whole_row)], Speculate.NGRAM, drafter=departing)
        assert batcher.speculation.drafted == 0
    finally:
        engine.close()


def test_a_request_that_stops_among_its_drafts_leaves_a_slot_the_next_request_reuses(tmp_path: Path) -> None:
    """A stop string met in the middle of a trip's drafts ends the request with rows past what it
    kept still in the slot's cache; the next request, which extends the first's prompt and answer,
    reuses the kept rows only and decodes what a fresh cache decodes."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=N_BLOCKS["llama"])
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path / "stages")
    try:
        prompt = engine.tokenize(PROMPT)
        answer = greedy_unsplit(model, prompt, STEPS)
        text = engine.detokenize(answer)
        start = len(engine.detokenize(answer[:10]))  # past the tenth token: the next request reuses eight
        stop = next(text[i : i + 2] for i in range(start, len(text) - 2) if "\ufffd" not in text[i : i + 2])
        batcher = Batcher(
            1, 16, 256, engine.sampler, engine.piece, engine.is_end, engine.prefix_cut, Speculate.NGRAM,
            engine.speculation_refused, engine.every_row_whole,
        )  # fmt: skip

        def serve(job: Job) -> tuple[str, Finished]:
            batcher.submit(job)
            out, finished = "", None
            while not batcher.idle or batcher.trimming:
                for trim in batcher.take_trims():
                    engine.forget(trim.slot, trim.keep)
                steps = batcher.plan()
                for sequence in batcher._active.values():
                    if not isinstance(sequence.drafter, Departing):  # drafts of the whole answer, all right
                        sequence.drafter = Departing(sequence.job.prompt, answer, engine.n_vocab(), wrong=STEPS + 1)
                if steps:
                    for event in batcher.advance(engine.step_many(steps)):
                        assert not isinstance(event, RequestFailed), event.message
                        if isinstance(event, TextDelta):
                            out += event.text
                        elif isinstance(event, Finished):
                            finished = event
            assert finished is not None
            return out, finished

        first, ended = serve(Job("first", prompt, STEPS, GREEDY, stop=(stop,)))
        assert ended.reason == "stop" and first == text[: text.find(stop)]
        assert isinstance(engine, RingEngine) and engine.head is not None
        # The stop came within a trip's drafts: the slot still holds rows past the tokens kept.
        assert engine.head.model.next_position(0) > len(prompt) + ended.completion_tokens
        second_prompt = prompt + answer[:8]
        second, reused = serve(Job("second", second_prompt, 8, GREEDY))
        assert reused.cached_tokens == len(second_prompt) - 1  # all but the last, whose logits it needs
        expected = greedy_unsplit(model, second_prompt, 8)
        ends = next((i for i, t in enumerate(expected) if engine.is_end(t)), len(expected))
        assert second == engine.detokenize(expected[:ends])
    finally:
        engine.close()


def test_the_status_shows_the_cost_rule_once_the_waves_have_measured_it(tmp_path: Path) -> None:
    """/status's trip, fixed and row costs: None until the waves price them, then each as the
    cost rule holds it, to a hundredth of a millisecond."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=N_BLOCKS["llama"])
    engine = UnsplitEngine(model, SETTINGS)
    try:
        handle = ServingHandle.of(engine, EngineLoop(engine, 1, 16, 256), "llama")  # not started: nothing runs
        status = handle.speculation
        assert (status.trip_ms, status.fixed_ms, status.row_ms) == (None, None, None)
        handle.loop.batcher.trip_clock.cost = TripCost(trip_ms=60.126, row_ms=1.454, fixed_ms=3.789)
        status = handle.speculation
        assert (status.trip_ms, status.fixed_ms, status.row_ms) == (60.13, 3.79, 1.45)
    finally:
        engine.close()
