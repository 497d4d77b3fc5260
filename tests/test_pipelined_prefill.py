"""Pipelined prefill: a prompt's chunks ride in successive waves, a bounded number out at once,
each after the last in position order; decoding sequences keep their row in every wave. First
the batcher's plan on its own, then on real llama.cpp stages: every tiny family decodes the same
greedy tokens pipelined as not, with chunks of one prompt out round the ring together."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from urllib.request import Request, urlopen

import numpy as np
import numpy.typing as npt
import pytest
from host_process import status_of, wait_ready
from serving_checks import engine_served
from test_scheduler import Argmax, answer, job
from test_session_network import session
from test_speculation_models import REPEATING, SETTINGS, Departing, cut_in_two
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, ModelShape, write_tiny_model

from kafila.planner.prefill import prefill_chunk_rows
from kafila.runtime.engine.engines import Engine, EngineStep, Launched, RingEngine, SequenceFailed
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.sampling import SamplingSettings, TokenSampler
from kafila.runtime.engine.speculation import NgramDrafter, Speculate
from kafila.runtime.engine.stage import WholeModel
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Batcher, Finished, Job, RequestFailed, TextDelta, Trim
from kafila.serving.engine_loop import REPORT_LATE_S, STATS_REFRESH_S, EngineLoop, prefill_chunks_in_flight

END = 0


def batcher(chunks: int, concurrency: int = 2, rows: int = 8) -> Batcher:
    return Batcher(
        concurrency, rows, 256, lambda _s: Argmax(), lambda t: f"<{t}>".encode(), lambda t: t == END,
        prefill_chunks=chunks,
    )  # fmt: skip


def chunks(steps: Sequence[EngineStep]) -> list[tuple[int, int, int, bool]]:
    """(slot, position, rows, asks for logits) of each prompt chunk of a wave."""
    return [(s.sequence_id, s.position, len(s.tokens), s.logits) for s in steps if not s.decode]


def test_a_long_prompt_is_out_in_successive_waves_up_to_the_bound_in_position_order() -> None:
    b = batcher(chunks=2)
    b.submit(job("a", 30, max_tokens=2))
    first, second = b.plan(waves=3), b.plan(waves=3)
    assert chunks(first) == [(0, 0, 8, False)] and chunks(second) == [(0, 8, 8, False)]
    assert b.plan(waves=3) == [] and b.most_chunks_out == 2  # bounded: two chunks out at once
    assert b.advance(answer(first)) == []
    third = b.plan(waves=3)
    assert chunks(third) == [(0, 16, 8, False)]
    b.advance(answer(second))
    fourth = b.plan(waves=3)
    assert chunks(fourth) == [(0, 24, 6, True)]  # the last chunk asks for the logits
    assert b.plan(waves=3) == []  # the whole prompt is out: its token must come back first
    assert b.advance(answer(third)) == []
    assert b.advance(answer(fourth)) == [TextDelta("a", "<5>")]
    (decode,) = b.plan(waves=3)
    assert decode.decode and decode.position == 30


def test_on_by_default_one_chunk_a_wave_in_flight_and_the_setting_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, as many chunks of a prompt as the engine keeps waves out (one per machine: off on
    one machine); KAFILA_PREFILL_CHUNKS=1 turns it off, and a value that is no whole number of at
    least 1 is refused naming it, by the engine loop and by the command line before anything starts."""
    monkeypatch.delenv("KAFILA_PREFILL_CHUNKS", raising=False)
    assert prefill_chunks_in_flight(3) == 3 and prefill_chunks_in_flight(1) == 1
    monkeypatch.setenv("KAFILA_PREFILL_CHUNKS", " 1 ")
    assert prefill_chunks_in_flight(3) == 1
    for bad in ("0", "two", "-2", "1.5"):
        monkeypatch.setenv("KAFILA_PREFILL_CHUNKS", bad)
        with pytest.raises(ValueError, match=f"KAFILA_PREFILL_CHUNKS='{re.escape(bad)}' is not a whole number"):
            prefill_chunks_in_flight(3)
    command = [sys.executable, "-m", "kafila", "status"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env={**os.environ})
    assert result.returncode == 1 and "KAFILA_PREFILL_CHUNKS='1.5' is not a whole number" in result.stderr
    assert "Traceback" not in result.stderr
    b = Batcher(2, 8, 256, lambda _s: Argmax(), lambda t: b"", lambda t: t == END)
    b.submit(job("a", 30))
    assert chunks(b.plan(waves=2)) == [(0, 0, 8, False)]
    assert b.plan(waves=2) == [] and b.most_chunks_out == 1
    with pytest.raises(ValueError, match="at least one chunk"):
        batcher(chunks=0)


def test_decoding_sequences_keep_their_row_in_every_wave() -> None:
    """A decoding request rides first; the pipelined prompt takes only the rows it leaves, and a
    prompt not yet out goes ahead of one already out."""
    b = batcher(chunks=3, concurrency=3, rows=8)
    b.submit(job("a", 2, max_tokens=20))
    b.advance(answer(b.plan(waves=2)))  # a has its first token: it decodes from now on
    b.submit(job("b", 40))
    decode = b.plan(waves=2)  # half the running requests a wave: a alone
    assert [(s.sequence_id, s.decode) for s in decode] == [(0, True)]
    first = b.plan(waves=2)
    assert chunks(first) == [(1, 0, 8, False)]
    b.advance(answer(decode))
    both = b.plan(waves=2)  # a's row first, b's second chunk in the 7 rows left
    assert [(s.sequence_id, s.decode, s.position, len(s.tokens)) for s in both] == [(0, True, 3, 1), (1, False, 8, 7)]
    b.submit(job("c", 5))
    third = b.plan(waves=2)  # c, not yet out, goes before b's third chunk
    assert chunks(third) == [(2, 0, 5, True), (1, 15, 3, False)]
    assert b.plan(waves=2) == [] and b.most_chunks_out == 3  # b's bound; a waits on its token


def test_a_chunk_a_stage_refused_fails_its_request_and_the_chunks_behind_it_land_unused() -> None:
    b = batcher(chunks=2, concurrency=1)
    b.submit(job("a", 30))
    first, second = b.plan(waves=2), b.plan(waves=2)
    (failed,) = b.advance([SequenceFailed(0, "the stage is out of memory")])
    assert isinstance(failed, RequestFailed) and failed.code == "stage_error"
    assert b.advance(answer(second)) == [] and b.idle
    b.submit(Job("b", list(range(1, 30)), 2, SamplingSettings()))
    assert b.plan(waves=2) == [] and b.take_trims() == [Trim(0, 0)]  # nothing of a's cache is trusted
    assert chunks(first) == chunks(b.plan(waves=2)) == [(0, 0, 8, False)]


def test_a_request_cancelled_mid_prompt_leaves_only_its_landed_rows_for_reuse() -> None:
    b = batcher(chunks=2, concurrency=1)
    b.submit(job("a", 30))
    first, second = b.plan(waves=2), b.plan(waves=2)
    b.advance(answer(first))
    assert b.cancel("a")
    b.submit(job("b", 30))
    assert b.plan(waves=2) == []
    assert b.take_trims() == [Trim(0, 8)]  # the rows of the chunk still out land after, and are cut off
    (reused,) = b.plan(waves=2)
    assert (reused.position, len(reused.tokens)) == (8, 8)
    assert b.advance(answer(second)) == []  # a's second chunk lands unused


# --- on real stages ----------------------------------------------------------------------------

GREEDY = SamplingSettings(top_k=1)
STEPS = 12


class Recording:
    """A request's own sampler, with every token it samples written down (its end token too)."""

    def __init__(self, sampler: TokenSampler, into: list[list[int]]) -> None:
        self.sampler, self.portable, self.sampled = sampler, sampler.portable, list[int]()
        into.append(self.sampled)

    def accept(self, tokens: Sequence[int]) -> None:
        self.sampler.accept(tokens)

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        token = self.sampler.sample(logits)
        self.sampled.append(token)
        return token

    def close(self) -> None:
        self.sampler.close()


def recording_batcher(
    engine: Engine, chunks: int, sampled: list[list[int]], speculate: Speculate = Speculate.OFF
) -> Batcher:
    """A batcher over `engine`, 8 rows a wave, whose samplers write down what they sample into `sampled`."""
    return Batcher(
        SETTINGS.n_seq_max, 8, 256, lambda s: Recording(engine.sampler(s), sampled), engine.piece, engine.is_end,
        engine.prefix_cut, speculate, engine.speculation_refused, engine.every_row_whole, prefill_chunks=chunks,
    )  # fmt: skip


def serve(
    engine: Engine,
    batcher: Batcher,
    depth: int,
    until: Callable[[Batcher], bool] = lambda b: False,
    planned: Callable[[Batcher], None] = lambda b: None,
) -> list[Finished]:
    """Serve what `batcher` holds as the engine loop does, with up to `depth` waves out round the
    ring, until it is idle (then every slot is forgotten) or `until` holds (then the waves still
    out are landed unused, as a ring lost under them would leave them); the requests finished.
    `planned` sees the batcher after each wave is planned."""
    finished: list[Finished] = []
    out: deque[Launched] = deque()
    while True:
        if until(batcher):
            for launched in out:
                engine.land(launched)
            return finished
        if batcher.idle and not batcher.trimming and not out:
            break
        for trim in batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        while len(out) < depth and (steps := batcher.plan(depth)):
            planned(batcher)
            out.append(engine.launch(steps))
        if out:
            for event in batcher.advance(engine.land(out.popleft())):
                assert not isinstance(event, RequestFailed), event.message
                if isinstance(event, Finished):
                    finished.append(event)
    for slot in range(SETTINGS.n_seq_max):
        engine.forget(slot)
    return finished


def drive(
    engine: Engine,
    jobs: Sequence[Job],
    chunks: int,
    depth: int,
    speculate: Speculate = Speculate.OFF,
    drafter: Callable[[Job], NgramDrafter] | None = None,
) -> tuple[list[list[int]], Batcher]:
    """Serve `jobs` together; the tokens each request sampled, in the order they were admitted.
    `drafter`: each request's drafter in place of the n-gram one."""
    sampled: list[list[int]] = []
    batcher = recording_batcher(engine, chunks, sampled, speculate)
    for each in jobs:
        batcher.submit(each)
    replaced: set[str] = set()

    def replace_drafters(batcher: Batcher) -> None:
        for request_id, sequence in batcher._active.items():
            if drafter is not None and request_id not in replaced:
                assert not sequence.generated  # admitted in this wave: nothing drafted yet
                sequence.drafter = drafter(sequence.job)
                replaced.add(request_id)

    serve(engine, batcher, depth, planned=replace_drafters)
    return sampled, batcher


@pytest.fixture(params=SUPPORTED_TINY_ARCHS)
def ring(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path, Engine]]:
    arch = request.param
    model, engine = cut_in_two(arch, tmp_path)
    try:
        yield arch, model, engine
    finally:
        engine.close()


def test_every_tiny_family_decodes_the_same_greedy_tokens_pipelined(ring: tuple[str, Path, Engine]) -> None:
    """Two requests with prompts of several 8-row chunks, two waves out round a two-stage ring:
    pipelined, chunks of one prompt are out together, and every token is greedy decoding's
    without a ring, as it is unpipelined."""
    arch, model, engine = ring
    jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
    assert all(len(each.prompt) > 16 for each in jobs), "prompts of three chunks at least"
    plain, off = drive(engine, jobs, chunks=1, depth=2)
    pipelined, on = drive(engine, jobs, chunks=2, depth=2)
    assert off.most_chunks_out == 1 and on.most_chunks_out == 2, arch
    assert pipelined == plain, arch
    expected = [
        greedy_unsplit(model, each.prompt, STEPS)[: len(tokens)] for each, tokens in zip(jobs, plain, strict=True)
    ]
    assert pipelined == expected, arch


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # full attention, and a sliding window
def test_chunks_pipeline_through_three_stages_with_the_head_on_the_ring(arch: str, tmp_path: Path) -> None:
    """Three stage processes, the head among them (as a member holds it): up to three chunks of
    one prompt out at once, the same greedy tokens as one chunk at a time."""
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    n = N_BLOCKS[arch]
    engine = local_ring_engine(cached_slices(model, [n - 2, 1, 1], tmp_path / "stages"), SETTINGS, model=model)
    try:
        jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        plain, _ = drive(engine, jobs, chunks=1, depth=3)
        pipelined, on = drive(engine, jobs, chunks=3, depth=3)
        assert on.most_chunks_out == 3 and pipelined == plain
    finally:
        engine.close()


def test_status_shows_chunks_of_one_prompt_out_together(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Through the engine loop and the API, as `kafila host` serves: with KAFILA_PREFILL_CHUNKS=2
    and two waves in flight, /status reports two chunks of one prompt seen out round the ring at
    once, and the answer is greedy decoding's."""
    monkeypatch.setenv("KAFILA_PREFILL_CHUNKS", "2")
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path / "stages")
    engine.depth = 2  # as on a ring of two machines
    prompt = engine.tokenize(PROMPT)
    expected = engine.detokenize(greedy_unsplit(model, prompt, 6))
    with engine_served(engine, 2, 8, 256) as (url, _serving):
        asked = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        request = Request(f"{url}/v1/completions", json.dumps(asked).encode(), {"Content-Type": "application/json"})
        with urlopen(request, timeout=60) as response:
            reply = json.load(response)
        with urlopen(f"{url}/status", timeout=10) as response:
            status = json.load(response)
    text, finish = reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]
    assert text == expected if finish == "length" else expected.startswith(text)
    assert (status["prefill"]["chunks"], status["prefill"]["most_chunks_out"]) == (2, 2), status["prefill"]


def test_the_stages_own_timers_show_two_stages_computing_one_prompt_at_once(tmp_path: Path) -> None:
    """One prompt of four chunks, nothing else in flight, on a two-stage ring (a stage process and
    the head here), each stage timing its own forwards. One chunk at a time, the stages take turns:
    their compute adds up to no more than the wall time. Pipelined, the time they computed exceeds
    the wall time: the stage process ran a chunk of the prompt while the head ran the one before."""
    shape = ModelShape(512, 8, 8, 64, 2048, tied_output=False)
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4, shape=shape)
    settings = ContextSettings(n_ctx=512, n_batch=64, n_seq_max=1, n_threads=1)
    engine = open_engine(model, [2, 2], settings, tmp_path / "stages")
    assert isinstance(engine, RingEngine) and engine.head is not None
    head = engine.head
    try:
        prompt = (engine.tokenize(PROMPT) * 16)[:256]

        def computed_and_wall(chunks: int) -> tuple[float, float]:
            ring_before = engine.stage_report().stages[0]
            head_before = head.timer.seconds
            batcher = Batcher(1, 64, 512, engine.sampler, engine.piece, engine.is_end, prefill_chunks=chunks)
            batcher.submit(Job("a", prompt, 1, GREEDY))
            out: deque[Launched] = deque()
            started = time.perf_counter()
            while not batcher.idle or out:
                while len(out) < 2 and (steps := batcher.plan(2)):
                    out.append(engine.launch(steps))
                batcher.advance(engine.land(out.popleft()))
            wall = time.perf_counter() - started
            engine.forget(0)
            ring_after = engine.stage_report().stages[0]
            assert ring_after.seconds is not None and ring_before.seconds is not None
            return (ring_after.seconds - ring_before.seconds) + (head.timer.seconds - head_before), wall

        computed, wall = computed_and_wall(chunks=1)
        assert computed <= wall
        computed, wall = computed_and_wall(chunks=2)
        assert computed > wall, f"the stages computed {computed:.3f} s in {wall:.3f} s"
    finally:
        engine.close()


def test_the_engine_loop_sizes_chunks_by_what_the_stages_measured(tmp_path: Path) -> None:
    """Before the stages have prefilled anything, a prompt goes in as few even chunks as a step
    allows; once their report (a PING round the ring) carries each stage's ms per prompt row and
    a step's cost, the loop prices the ring with them and the trip the PING took, and a long
    prompt's chunks are the cost model's length, each wave carrying one."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path / "stages")
    engine.depth = 2  # as on a ring of two machines
    prompt = (engine.tokenize(PROMPT) * 64)[:200]
    try:
        loop = EngineLoop(engine, 1, 64, 256)  # not started: its thread would take the waves planned here
        loop.batcher.submit(Job("first", prompt, 1, GREEDY))
        assert chunks(loop.batcher.plan(2)) == [(0, 0, 50, False)] and loop.batcher.last_chunk_rows == 50
        loop.batcher.cancel("first")
        drive(engine, [Job("measured", prompt, 2, GREEDY)], chunks=1, depth=2)  # the stages time a prompt
        loop._refresh_report()
        costs = loop.prefill_costs
        assert costs is not None and len(costs.stages) == 2 and loop.ring_ms is not None and loop.ring_ms > 0
        assert all(stage.row_ms > 0 and stage.step_ms > 0 for stage in costs.stages)
        assert costs.ring_ms == loop.ring_ms
        expected = prefill_chunk_rows(200, costs, 2, 64)
        loop.batcher.submit(Job("second", prompt[::-1], 1, GREEDY))
        assert loop.batcher.plan(2) == []  # admitted: its slot's cache is cut first
        for trim in loop.batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        assert chunks(loop.batcher.plan(2)) == [(0, 0, expected, False)]
        assert chunks(loop.batcher.plan(2)) == [(0, expected, expected, False)]
        assert loop.batcher.last_chunk_rows == expected
    finally:
        engine.close()


def test_the_stage_report_waits_while_a_prompt_is_pipelining(tmp_path: Path) -> None:
    """The report's PING needs the ring empty: while a prompt has chunks out and more to send, it
    waits (up to REPORT_LATE_S), so the pipeline is not drained every STATS_REFRESH_S; once the
    whole prompt is out it is due again."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path / "stages")
    engine.depth = 2
    try:
        loop = EngineLoop(engine, 1, 8, 256, prefill_chunks=2)  # not started: the test drives its waves
        loop._report_at = time.monotonic() - STATS_REFRESH_S
        assert loop._report_due()
        loop.batcher.submit(Job("a", (engine.tokenize(PROMPT) * 8)[:40], 1, GREEDY))
        out = deque([engine.launch(loop.batcher.plan(2))])
        assert loop.batcher.pipelining and not loop._report_due()  # 8 rows out, 32 to send
        loop._report_at = time.monotonic() - REPORT_LATE_S
        assert loop._report_due()  # not for ever
        loop._report_at = time.monotonic() - STATS_REFRESH_S
        while loop.batcher.pipelining:
            assert not loop._report_due()
            while len(out) < 2 and (steps := loop.batcher.plan(2)):
                out.append(engine.launch(steps))
            loop.batcher.advance(engine.land(out.popleft()))
        assert out and loop._report_due()  # the whole prompt is out: its last chunks land, then the PING
        while out:
            loop.batcher.advance(engine.land(out.popleft()))
    finally:
        engine.close()


def test_prefix_reuse_replay_and_drafts_hold_pipelined(tmp_path: Path) -> None:
    """With n-gram drafts on, pipelined prefill gives the tokens of one chunk at a time without
    drafts; a next turn that extends a finished request's prompt and answer reuses its slot's
    cache and prefills the rest in pipelined chunks; a request whose ring is lost with chunks of
    its replay out resumes, replays in pipelined chunks, and ends as it would have."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path / "stages")
    try:
        jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        plain, _ = drive(engine, jobs, chunks=1, depth=2)
        answers = {job.request_id: answer for job, answer in zip(jobs, plain, strict=True)}

        def departing(job: Job) -> NgramDrafter:  # greedy decoding's answer, every third draft wrong
            return Departing(job.prompt, answers[job.request_id], engine.n_vocab(), wrong=3)

        drafted, on = drive(engine, jobs, chunks=2, depth=2, speculate=Speculate.NGRAM, drafter=departing)
        assert drafted == plain and on.most_chunks_out == 2
        assert 0 < on.speculation.accepted < on.speculation.drafted  # drafts kept and cut

        first = jobs[0]
        turn = Job("turn", first.prompt + plain[0] + engine.tokenize(" and", add_special=False), STEPS, GREEDY)
        turns: dict[int, list[list[int]]] = {}
        cached: dict[int, int] = {}
        for chunks in (1, 2):
            sampled: list[list[int]] = []
            batcher = recording_batcher(engine, chunks, sampled)
            batcher.submit(first)
            assert len(serve(engine, batcher, 2, until=lambda b: b.idle)) == 1  # its slot keeps its cache
            batcher.submit(turn)
            (done,) = serve(engine, batcher, 2)
            turns[chunks], cached[chunks] = sampled, done.cached_tokens
        assert turns[2] == turns[1] and cached[2] == cached[1] >= len(first.prompt)

        sampled = []
        lost = recording_batcher(engine, 2, sampled)
        lost.submit(first)
        serve(engine, lost, 2, until=lambda b: b.running == 1 and len(b._active["0"].generated) == 5)
        kept, failed = lost.suspend_all("the ring broke")
        assert not failed
        for slot in range(SETTINGS.n_seq_max):  # a new ring: empty caches
            engine.forget(slot)
        resumed = recording_batcher(engine, 2, [])
        resumed.resume(kept[0])
        serve(engine, resumed, 2)
        assert sampled == [plain[0]] and resumed.most_chunks_out == 2  # the prompt and 5 tokens: three chunks
    finally:
        engine.close()


def test_a_three_member_session_over_quic_pipelines_a_long_prompt(tmp_path: Path) -> None:
    """A host and two members joined over QUIC, three waves in flight (as on three machines) and
    KAFILA_PREFILL_CHUNKS=3: a prompt of 1,100 rows is out round the ring in three waves at once,
    in as few even chunks as a step of 512 rows allows (the stages have measured no prompt yet, so
    the cost model has nothing to split it further by), and the greedy answer is the unsplit model's."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    whole = WholeModel(model, ContextSettings(n_ctx=2048, n_batch=512, n_seq_max=1, n_threads=1))
    try:
        prompt = (whole.vocabulary.tokenize(PROMPT) * 64)[:1100]
        logits = whole.forward_tokens(0, 0, prompt)
        expected: list[int] = []
        for _ in range(8):
            expected.append(int(np.argmax(logits)))
            logits = whole.forward_tokens(0, len(prompt) + len(expected) - 1, expected[-1:], decode=True)
        text = whole.vocabulary.detokenize(expected)
    finally:
        whole.close()
    env = {"KAFILA_PIPELINE_WAVES": "3", "KAFILA_PREFILL_CHUNKS": "3", "KAFILA_SESSION_IDLE_S": "1.5"}
    with session(tmp_path, model, 3, "--context", "1200", env=env) as (host, _joiners):
        wait_ready(host)
        asked = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        request = Request(
            f"{host.base_url}/v1/completions", json.dumps(asked).encode(), {"Content-Type": "application/json"}
        )
        with urlopen(request, timeout=120) as response:
            reply = json.load(response)
        status = status_of(host)
    assert status["pipeline_waves"] == 3 and len(status["members"]) == 3
    prefill = status["prefill"]
    assert (prefill["chunks"], prefill["most_chunks_out"], prefill["chunk_rows"]) == (3, 3, 367), prefill
    choice = reply["choices"][0]
    assert choice["text"] == text if choice["finish_reason"] == "length" else text.startswith(choice["text"])
