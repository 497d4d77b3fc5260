"""A fault in one sequence fails only that sequence's request; the ring and the others go on.

Real parts throughout: tiny models the tests write, real llama.cpp stages, real worker processes
and sockets, and the real HTTP server under uvicorn with the official `openai` client. The
faults are real ones a stage meets: rows at a position their sequence's cache has not reached,
and a prompt longer than a stage's KV cache can hold (a stage given less context than the
host planned for), which llama.cpp itself refuses part-way through a batch.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import openai
import pytest
from serving_checks import engine_served, unsplit_greedy
from tiny_models import write_tiny_model
from waiting import until

from kafila.runtime.engine.engines import EngineStep, RingEngine, SequenceFailed
from kafila.runtime.engine.local_ring import LocalRing, local_ring_engine
from kafila.runtime.engine.stage import BatchFailed, BlockStage, FloatRows, StepInput, run_isolating
from kafila.runtime.engine.worker import handle_frames
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.serving.engine_loop import REFUSALS_TO_BREAK, EngineLoop
from kafila.wire.frames import Frame, Kind

SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_seq_max=4, n_threads=1)
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("faults") / "tiny.gguf", "llama", n_blocks=4)


def greedy(engine: RingEngine, sequence: int, prompt: list[int], logits: np.ndarray, steps: int) -> list[int]:
    """Continue a sequence whose prompt is in the cache (`logits` after it) for `steps` greedy tokens."""
    out = [int(np.argmax(logits))]
    for _ in range(steps - 1):
        (row,) = engine.step_many([EngineStep(sequence, len(prompt) + len(out) - 1, out[-1:], decode=True)])
        assert isinstance(row, np.ndarray)
        out.append(int(np.argmax(row)))
    return out


def test_a_frame_out_of_position_fails_its_sequence_alone_in_a_local_ring(model: Path, tmp_path: Path) -> None:
    """Three stages in worker processes: stage 0 refuses sequence 1's rows (its cache has no
    position 5), the stage after it passes the ERROR on, and sequence 0 of the same batch gets
    exactly the logits it gets alone, then decodes on as it does alone."""
    stages = slice_model(model, [1, 1, 2], tmp_path / "stages")
    engine = local_ring_engine(stages, SETTINGS)
    try:
        prompt = engine.tokenize(PROMPT)
        (alone,) = engine.step_many([EngineStep(0, 0, prompt, decode=False)])
        assert isinstance(alone, np.ndarray)
        expected = greedy(engine, 0, prompt, alone, 6)
        engine.forget(0)

        ok, failed = engine.step_many([EngineStep(0, 0, prompt, decode=False), EngineStep(1, 5, [7, 8], decode=False)])
        assert isinstance(failed, SequenceFailed) and failed.sequence_id == 1
        assert "blocks 0-0" in failed.message and "position 5" in failed.message, failed.message
        assert isinstance(ok, np.ndarray) and np.array_equal(ok, alone)
        assert greedy(engine, 0, prompt, ok, 6) == expected  # its cache on every stage is whole

        engine.forget(1)  # the failed slot is dropped round the ring and serves the next request
        (again,) = engine.step_many([EngineStep(1, 0, prompt, decode=False)])
        assert isinstance(again, np.ndarray) and np.array_equal(again, alone)

        # an ERROR frame from upstream is passed on unchanged by every stage, and not run
        error = Frame(Kind.ERROR, 2, payload=b"refused upstream")
        engine.ring.send([error])
        assert engine.ring.receive(1) == [error]
        assert [s.range for s in engine.ring.stats()] == [(0, 1), (1, 2)]  # the ring is whole
    finally:
        engine.close()


def test_a_failed_batch_leaves_every_cache_as_it_was(model: Path, tmp_path: Path) -> None:
    """A batch that llama.cpp refuses part-way (a prompt larger than the stage's KV cache, after
    some of its decodes went in) is taken out of the cache again: the sequence batched with it
    is run alone and gives, then and afterwards, what a stage that never saw the failure gives."""
    first, _ = slice_model(model, [2, 2], tmp_path / "stages")
    stage, reference = BlockStage(first.path, SETTINGS), BlockStage(first.path, SETTINGS)
    rng = np.random.default_rng(7)
    short = rng.standard_normal((10, stage.hidden)).astype(np.float32)
    long = rng.standard_normal((300, stage.hidden)).astype(np.float32)  # the cache holds 256 rows
    try:
        stage.forward([StepInput(0, 0, short)])
        reference.forward([StepInput(0, 0, short)])
        row = rng.standard_normal((1, stage.hidden)).astype(np.float32)
        with pytest.raises(BatchFailed, match="no room"):
            stage.forward([StepInput(0, 10, row), StepInput(1, 0, long)])
        assert (stage.model.next_position(0), stage.model.next_position(1)) == (10, 0)

        frames = [Frame.of_hidden(Kind.DECODE, 0, 10, row), Frame.of_hidden(Kind.PREFILL, 1, 0, long)]
        served, refused = handle_frames(stage, frames)
        assert refused.kind is Kind.ERROR and refused.sequence_id == 1 and "no room" in refused.text()
        assert served.kind is Kind.DECODE and served.sequence_id == 0
        (want,) = reference.forward([StepInput(0, 10, row)])
        assert np.array_equal(served.hidden_states(), want)
        for position in range(11, 14):
            row = rng.standard_normal((1, stage.hidden)).astype(np.float32)
            (got,), (want,) = (
                stage.forward([StepInput(0, position, row)]),
                reference.forward([StepInput(0, position, row)]),
            )
            assert np.array_equal(got, want)
        assert stage.model.next_position(1) == 0
        (got,), (want,) = stage.forward([StepInput(1, 0, short)]), reference.forward([StepInput(1, 0, short)])
        assert np.array_equal(got, want)  # the failed sequence's slot starts afresh
    finally:
        stage.close()
        reference.close()


@contextlib.contextmanager
def a_windowed_batch_failed(tmp_path: Path) -> Iterator[tuple[BlockStage, BlockStage, FloatRows, list[Frame]]]:
    """A stage of gemma3's tiny model (a window of 16 positions) decoding 16 rows at a time, and a
    reference stage: sequence 1's 32 rows, sequence 0's first 20 after them, sequence 1 dropped
    (its cells, the first 32, are free, and a decode looks there first). Then the stage alone runs
    a batch of sequence 0's next 48 rows, whose third decode finds the cells of its first 20
    positions once they have left its window, and 300 rows of sequence 2, which its 256-row cache
    refuses in a later decode. Yields both stages, sequence 0's 48 rows and the batch's replies
    (`handle_frames`)."""
    gemma = write_tiny_model(tmp_path / "gemma.gguf", "gemma3", n_blocks=6)
    first, _ = slice_model(gemma, [3, 3], tmp_path / "stages")
    settings = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=4, n_threads=1)
    stage, reference = BlockStage(first.path, settings), BlockStage(first.path, settings)
    rows = np.random.default_rng(3).standard_normal((400, stage.hidden)).astype(np.float32) * 0.01
    try:
        assert stage.model.sliding_window == 16
        for each in (stage, reference):
            each.forward([StepInput(1, 0, rows[:32])])
            each.forward([StepInput(0, 0, rows[32:52])])
            each.forget(1)
        frames = [Frame.of_hidden(Kind.PREFILL, 0, 20, rows[52:100]), Frame.of_hidden(Kind.PREFILL, 2, 0, rows[100:])]
        yield stage, reference, rows[52:100], handle_frames(stage, frames)
    finally:
        stage.close()
        reference.close()


def test_a_windowed_sequence_of_a_failed_batch_is_retried_alone_as_its_keeper_kept_its_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window's cache gives a later decode of a forward the cells of positions that left the
    window of the sequence's new last position, and drops those positions, which a retry from
    where it started needs again; the keeper (`LlamaModel.keeps_window_cells`) holds every cell,
    so a windowed sequence of a failed batch is retried alone and gives, then and afterwards, bit
    for bit what a stage that never saw the failure gives. Without keepers the batch leaves the
    sequence none of its positions, so there it is spoiled: refused with the batch's reason."""
    with a_windowed_batch_failed(tmp_path) as (stage, reference, rows, (served, refused)):
        assert stage.model.keeps_window_cells
        assert refused.kind is Kind.ERROR and refused.sequence_id == 2 and "no room" in refused.text()
        assert served.kind is Kind.PREFILL and served.sequence_id == 0
        assert np.array_equal(served.hidden_states(), reference.forward([StepInput(0, 20, rows)])[0])
        (got,), (want,) = (stage.forward([StepInput(0, 68, rows[:8])]), reference.forward([StepInput(0, 68, rows[:8])]))
        assert np.array_equal(got, want)

    monkeypatch.setattr(LlamaModel, "_window_cells_kept", lambda self: False)
    (tmp_path / "without").mkdir()
    with a_windowed_batch_failed(tmp_path / "without") as (stage, reference, rows, replies):
        assert not stage.model.keeps_window_cells
        for refused, sequence in zip(replies, (0, 2), strict=True):
            assert refused.kind is Kind.ERROR and refused.sequence_id == sequence and "no room" in refused.text()
        # the batch's third decode took the cells of all 20 positions and llama.cpp dropped them
        assert stage.model.next_position(0) == 0


def test_a_recurrent_state_a_failed_batch_advanced_is_refused_not_retried(tmp_path: Path) -> None:
    """qwen3next's delta-net blocks keep one state per sequence, not one row per position, so a
    failed forward cannot take back a decode that completed: the sequence it advanced is refused
    with the batch's reason, and starts afresh once forgotten; the one that failed is retried
    alone (and fails alone); a sequence's first rows, undone, leave its slot empty."""
    hybrid = write_tiny_model(tmp_path / "qwen3next.gguf", "qwen3next", n_blocks=8)
    first, _ = slice_model(hybrid, [4, 4], tmp_path / "stages")
    stage, reference = BlockStage(first.path, SETTINGS), BlockStage(first.path, SETTINGS)
    rng = np.random.default_rng(5)
    short = rng.standard_normal((10, stage.hidden)).astype(np.float32)
    long = rng.standard_normal((300, stage.hidden)).astype(np.float32)  # the cache holds 256 rows
    row = rng.standard_normal((1, stage.hidden)).astype(np.float32)
    try:
        assert stage.model.keeps_recurrent_state
        stage.forward([StepInput(0, 0, short)])
        frames = [Frame.of_hidden(Kind.DECODE, 0, 10, row), Frame.of_hidden(Kind.PREFILL, 1, 0, long)]
        advanced, failed = handle_frames(stage, frames)
        for refused, sequence in ((advanced, 0), (failed, 1)):
            assert refused.kind is Kind.ERROR and refused.sequence_id == sequence and "no room" in refused.text()
        assert stage.model.next_position(1) == 0
        stage.forget(0)
        (got,), (want,) = stage.forward([StepInput(0, 0, short)]), reference.forward([StepInput(0, 0, short)])
        assert np.array_equal(got, want)
    finally:
        stage.close()
        reference.close()


def test_a_sequence_id_without_a_slot_is_refused_not_fatal(model: Path, tmp_path: Path) -> None:
    """llama.cpp aborts the process on a cache call for a sequence id out of its range; a stage
    refuses such a frame as that sequence's error, and a CANCEL for it is a no-op."""
    first, _ = slice_model(model, [2, 2], tmp_path / "stages")
    stage = BlockStage(first.path, SETTINGS)
    rows = np.ones((1, stage.hidden), dtype=np.float32)
    try:
        frames = [
            Frame.of_hidden(Kind.PREFILL, 0, 0, rows),
            Frame.of_hidden(Kind.PREFILL, (1 << 32) - 1, 0, rows),  # -1 to llama.cpp: every sequence
            Frame(Kind.CANCEL, 1 << 40),
        ]
        served, refused, cancel = handle_frames(stage, frames)
        assert served.kind is Kind.PREFILL and refused.kind is Kind.ERROR and "slots" in refused.text()
        assert cancel.kind is Kind.CANCEL and stage.model.next_position(0) == 1
    finally:
        stage.close()


@dataclass
class InProcessHost:
    base_url: str
    loop: EngineLoop
    engine: RingEngine


@pytest.fixture
def small_stage_host(model: Path, tmp_path: Path) -> Iterator[InProcessHost]:
    """The real API server, engine loop and local ring, but with the stage process given a 256-row
    KV cache while the host plans 512 tokens a request: a long prompt overflows that stage."""
    stages = slice_model(model, [2, 2], tmp_path / "stages")
    head = ContextSettings(n_ctx=512 * 4, n_batch=512, n_seq_max=4, n_threads=1)
    engine = RingEngine(stages, head, ring=LocalRing(stages[:-1], SETTINGS))
    with engine_served(engine, 4, head.n_batch, 512) as (base_url, serving):
        assert serving.ring is not None
        yield InProcessHost(base_url, serving.ring.loop, engine)


def test_one_request_a_stage_cannot_hold_fails_alone_and_the_server_serves_on(
    small_stage_host: InProcessHost, model: Path
) -> None:
    """Three streams are generating when a fourth request's prompt, too long for the stage's KV
    cache, joins their batch: that request gets an OpenAI-shaped error naming the stage and the
    reason, the three finish with their own text, and the server stays ready."""
    host = small_stage_host
    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = ("the quick brown fox", "a b c d", "hello world")
    long_prompt = "hello world " * 150
    assert 256 < len(host.engine.tokenize(long_prompt)) < 400
    results: dict[str, str] = {}
    failures: dict[str, BaseException] = {}
    streaming = threading.Barrier(len(prompts) + 1)

    def short(prompt: str) -> None:
        try:
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stream=True)
            chunks = iter(stream)
            parts = [next(chunks).choices[0].text]
            streaming.wait(timeout=60)
            parts += [c.choices[0].text for c in chunks if c.choices]
            results[prompt] = "".join(parts)
        except BaseException as error:  # reported below, not lost in the thread
            failures[prompt] = error
            streaming.abort()

    def too_long() -> None:
        try:
            client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8, temperature=0)
        except BaseException as error:
            failures["long"] = error

    threads = [threading.Thread(target=short, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    streaming.wait(timeout=60)
    # Hold the stage while the long request queues, so that it surely joins the three streams'
    # next step (each has at most a few of its 60 tokens by now).
    ring = host.engine.ring
    assert isinstance(ring, LocalRing)
    stage = ring.workers[0].process
    stage.send_signal(signal.SIGSTOP)
    try:
        long_thread = threading.Thread(target=too_long)
        long_thread.start()
        # The long request is queued behind the held step, or already admitted to the batch if
        # the loop was between steps when the stage stopped: either way it runs with the three.
        deadline = time.monotonic() + 30
        while host.loop.queued + host.loop.running < len(prompts) + 1:
            assert time.monotonic() < deadline, (host.loop.queued, host.loop.running)
            time.sleep(0.01)
    finally:
        stage.send_signal(signal.SIGCONT)
    for thread in [*threads, long_thread]:
        thread.join(timeout=120)

    refused = failures.pop("long")
    assert not failures and set(results) == set(prompts), failures
    for prompt, text in results.items():  # batched kernels may break a late near-tie: compare the start
        assert text.startswith(unsplit_greedy(model, prompt, 3)), prompt
    assert isinstance(refused, openai.InternalServerError) and refused.code == "stage_error"
    assert "blocks 0-1" in str(refused) and "no room" in str(refused), str(refused)

    stream = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=8, temperature=0, stream=True)
    with pytest.raises(openai.APIError, match="blocks 0-1") as refused_stream:
        list(stream)  # streamed: an error event, then the end of the stream
    assert "no room" in str(refused_stream.value)

    assert host.loop.error is None  # a fault of one request does not mark the ring broken
    with urlopen(f"{host.base_url}/health", timeout=10) as response:
        assert response.status == 200
    after = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert after.choices[0].text == unsplit_greedy(model, PROMPT, 8)
    with urlopen(f"{host.base_url}/status", timeout=10) as response:
        requests = json.loads(response.read())["requests"]
    assert requests == {"finished": len(prompts) + 1, "failed": 2}


def test_only_a_spoiled_sequence_is_not_retried() -> None:
    """`run_isolating`: a failed batch is retried item by item, except the sequences the failure
    says it could not restore, which are refused with its reason."""
    runs: list[list[int]] = []

    def run(items: Sequence[int]) -> list[str]:
        runs.append(list(items))
        if len(items) > 1:
            raise BatchFailed("the batch failed", spoiled=frozenset({1}))
        if items[0] == 2:
            raise ValueError("two is refused")
        return [f"ran {items[0]}"]

    out = run_isolating([0, 1, 2, 3], run, lambda item, error: f"refused {item}: {error}", lambda item: item)
    assert out == ["ran 0", "refused 1: the batch failed", "refused 2: two is refused", "ran 3"]
    assert runs == [[0, 1, 2, 3], [0], [2], [3]]


def test_a_stage_that_refuses_request_after_request_marks_the_ring_broken(small_stage_host: InProcessHost) -> None:
    """One refusal is that request's; eight in a row with nothing served between is a broken stage,
    and the loop says so (the host's watcher then replans). The request that made the eighth waits,
    held for the next ring, and fails with the reason the host gives when none comes."""
    client = openai.OpenAI(base_url=f"{small_stage_host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    loop = small_stage_host.loop
    too_long = "hello world " * 150
    for _ in range(REFUSALS_TO_BREAK - 1):
        with pytest.raises(openai.InternalServerError, match="no room"):
            client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
    assert loop.error is None
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)  # one served: the count starts again
    for _ in range(REFUSALS_TO_BREAK - 1):
        with pytest.raises(openai.InternalServerError, match="no room"):
            client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
    assert loop.error is None
    held: list[BaseException] = []

    def eighth() -> None:
        try:
            client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
        except BaseException as error:
            held.append(error)

    thread = threading.Thread(target=eighth)
    thread.start()
    until(lambda: loop.error is not None, "eight refusals in a row breaking the loop", timeout=60)
    assert "8 requests' rows in a row" in loop.error
    assert thread.is_alive()  # held for the next ring, not failed
    loop.stop("no ring came back")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(held) == 1 and isinstance(held[0], openai.APIError) and "no ring came back" in str(held[0]), held
