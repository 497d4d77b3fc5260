"""Pipelined prefill: a prompt's chunks ride in successive waves, a bounded number out at once,
each after the last in position order; decoding sequences keep their row in every wave. First
the batcher's plan on its own, then on real llama.cpp stages: every tiny family decodes the same
greedy tokens pipelined as not, with chunks of one prompt out round the ring together."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.request import Request, urlopen

import numpy as np
import numpy.typing as npt
import pytest
from serving_checks import engine_served
from test_scheduler import Argmax, answer, job
from test_speculation_models import REPEATING, SETTINGS
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.engine.engines import Engine, EngineStep, Launched, SequenceFailed
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.sampling import SamplingSettings, TokenSampler
from kafila.runtime.engine.speculation import Speculate
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import cached_slices
from kafila.serving.batcher import Batcher, Job, RequestFailed, TextDelta, Trim
from kafila.serving.engine_loop import prefill_chunks_in_flight

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


def test_off_by_default_a_prompt_is_in_one_wave_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFILA_PREFILL_CHUNKS", raising=False)
    assert prefill_chunks_in_flight() == 1
    monkeypatch.setenv("KAFILA_PREFILL_CHUNKS", "3")
    assert prefill_chunks_in_flight() == 3
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


def drive(engine: Engine, jobs: Sequence[Job], chunks: int, depth: int) -> tuple[list[list[int]], Batcher]:
    """Serve `jobs` as the engine loop does, with up to `depth` waves out round the ring; the
    tokens each request sampled, in the order they were admitted."""
    sampled: list[list[int]] = []
    batcher = Batcher(
        SETTINGS.n_seq_max, 8, 256, lambda s: Recording(engine.sampler(s), sampled), engine.piece, engine.is_end,
        engine.prefix_cut, Speculate.OFF, engine.speculation_refused, engine.every_row_whole, prefill_chunks=chunks,
    )  # fmt: skip
    for each in jobs:
        batcher.submit(each)
    out: deque[Launched] = deque()
    while not batcher.idle or batcher.trimming or out:
        for trim in batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        while len(out) < depth and (steps := batcher.plan(depth)):
            out.append(engine.launch(steps))
        if out:
            for event in batcher.advance(engine.land(out.popleft())):
                assert not isinstance(event, RequestFailed), event.message
    for slot in range(SETTINGS.n_seq_max):
        engine.forget(slot)
    return sampled, batcher


@pytest.fixture(params=SUPPORTED_TINY_ARCHS)
def ring(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path, Engine]]:
    arch = request.param
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    n, starts = N_BLOCKS[arch], read_manifest(model).stage_starts
    cut = starts[0] if starts else n // 2
    engine = open_engine(model, [cut, n - cut], SETTINGS, tmp_path / "stages")
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
    assert status["prefill"] == {"chunks": 2, "most_chunks_out": 2}, status["prefill"]
