"""Waves on a real ring: several steps out at once, landing in order, each exactly what it would
be on its own; a sequence forgotten while its rows are out is dropped everywhere, and its slot
serves a new request from scratch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from kafila.contracts import StageReport
from kafila.runtime.engine.engines import EngineStep, RingEngine, SequenceFailed
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.engine_loop import EngineLoop
from kafila.wire.frames import Frame

SETTINGS = ContextSettings(n_ctx=4 * 64, n_batch=64, n_seq_max=4, n_threads=1)
PROMPTS = ["the quick brown fox", "hello world", "a model of the world", "kafila"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("waves") / "tiny.gguf", "llama", n_blocks=4)


def greedy_alone(model: Path, prompt: str, steps: int) -> list[int]:
    engine = open_engine(model, [4], SETTINGS)
    try:
        tokens = engine.tokenize(prompt)
        logits = engine.step(0, 0, tokens, decode=False)
        out = [int(np.argmax(logits))]
        for _ in range(steps - 1):
            logits = engine.step(0, len(tokens) + len(out) - 1, out[-1:], decode=True)
            out.append(int(np.argmax(logits)))
        return out
    finally:
        engine.close()


def test_waves_in_flight_together_generate_what_each_sequence_does_alone(model: Path, tmp_path: Path) -> None:
    engine = open_engine(model, [2, 1, 1], SETTINGS, tmp_path)
    assert isinstance(engine, RingEngine) and engine.depth == 1  # local stages share this machine's cores
    try:
        prompts = [engine.tokenize(p) for p in PROMPTS]
        outs: list[list[int]] = [[] for _ in PROMPTS]
        waves = [[0, 1], [2], [3]]  # three waves out at once, one per stage

        def step(sequence: int) -> EngineStep:
            if not outs[sequence]:
                return EngineStep(sequence, 0, prompts[sequence], decode=False)
            return EngineStep(sequence, len(prompts[sequence]) + len(outs[sequence]) - 1, outs[sequence][-1:], True)

        for _ in range(6):
            launched = [engine.launch([step(s) for s in wave]) for wave in waves]
            for wave, out in zip(waves, launched, strict=True):
                for sequence, logits in zip(wave, engine.land(out), strict=True):
                    assert isinstance(logits, np.ndarray)
                    outs[sequence].append(int(np.argmax(logits)))
        assert outs == [greedy_alone(model, p, 6) for p in PROMPTS]
        assert engine.stage_report().stages  # nothing left out: a stage report goes round cleanly
    finally:
        engine.close()


def test_a_sequence_forgotten_while_its_rows_are_out_starts_clean_in_its_slot(model: Path, tmp_path: Path) -> None:
    engine = open_engine(model, [2, 2], SETTINGS, tmp_path)
    try:
        first, second = (engine.tokenize(p) for p in PROMPTS[:2])
        stale = engine.launch([EngineStep(0, 0, first, decode=False)])
        engine.forget(0)  # the request ended while its prompt was in the ring
        fresh = engine.launch([EngineStep(0, 0, second, decode=False)])
        (dropped,) = engine.land(stale)
        assert isinstance(dropped, SequenceFailed)
        (logits,) = engine.land(fresh)
        assert isinstance(logits, np.ndarray)
        token = int(np.argmax(logits))
        (after,) = engine.step_many([EngineStep(0, len(second), [token], decode=True)])
        assert isinstance(after, np.ndarray)
        assert [token, int(np.argmax(after))] == greedy_alone(model, PROMPTS[1], 2)
        engine.forget(0)
        assert engine.stage_report().stages
    finally:
        engine.close()


def test_a_head_on_the_ring_gives_the_logits_the_head_here_does(model: Path, tmp_path: Path) -> None:
    """The head as a ring stage of its own (a worker answering with LOGITS frames), this engine
    holding only the vocabulary and embedding from the whole file: the same logits, waves,
    forgetting and stage report as with the head here."""
    from kafila.runtime.gguf.slicer import cached_slices

    stages = cached_slices(model, [2, 1, 1], tmp_path)
    remote = local_ring_engine(stages, SETTINGS, model=model)
    try:
        whole = open_engine(model, [4], SETTINGS)
        assert remote.head is None and remote.n_vocab() == whole.n_vocab()
        assert remote.tokenize(PROMPTS[0]) == whole.tokenize(PROMPTS[0]) and remote.is_end(2) == whole.is_end(2)
        assert remote.chat_template() == whole.chat_template()
        whole.close()
        prompts = [remote.tokenize(p) for p in PROMPTS[:2]]
        outs: list[list[int]] = [[], []]
        for _ in range(5):
            steps = [  # sequence 0 asks for its argmax alone (a greedy request), 1 for the whole row
                EngineStep(s, 0, prompts[s], decode=False, top=1 - s)
                if not outs[s]
                else EngineStep(s, len(prompts[s]) + len(outs[s]) - 1, outs[s][-1:], decode=True, top=1 - s)
                for s in (0, 1)
            ]
            launched = [remote.launch([step]) for step in steps]  # two waves out at once
            for sequence, wave in enumerate(launched):
                (logits,) = remote.land(wave)
                assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
                assert np.isfinite(logits).sum() == (1 if sequence == 0 else remote.n_vocab())
                outs[sequence].append(int(np.argmax(logits)))
        assert outs == [greedy_alone(model, p, 5) for p in PROMPTS[:2]]
        (unwanted,) = remote.step_many([EngineStep(2, 0, prompts[0], decode=False, logits=False)])
        assert unwanted is None
        remote.forget(2)
        remote.forget(0)
        report = remote.stage_report().stages
        assert [stage.range for stage in report] == [(0, 2), (2, 3), (3, 4)]  # the head's own among them
        assert all(stage.ms_per_token is not None for stage in report)
        stale = remote.launch([EngineStep(1, 99, [1], decode=True)])  # a gap: the stages refuse it
        (failed,) = remote.land(stale)
        assert isinstance(failed, SequenceFailed) and "position 99" in failed.message
    finally:
        remote.close()


def test_a_ring_that_answers_hidden_states_with_logits_is_broken_not_misread(model: Path, tmp_path: Path) -> None:
    """A member that sends the head here a LOGITS frame where hidden states belong (a peer
    speaking out of turn) fails the ring with what it sent, never reaching the head's forward."""
    from kafila.runtime.engine.ring import StageFailed
    from kafila.runtime.gguf.slicer import cached_slices
    from kafila.wire.frames import Frame

    class SpeaksOutOfTurn:
        def __init__(self) -> None:
            self.sent: list[Frame] = []

        def send(self, frames: list[Frame]) -> None:
            self.sent += frames

        def receive(self, count: int) -> list[Frame]:
            answers = [Frame.of_logits(f.sequence_id, f.position, np.zeros(8, np.float32)) for f in self.sent[:count]]
            del self.sent[:count]
            return answers

        def stats(self) -> list[dict[str, object]]:
            return []

        def close(self) -> None:
            pass

    stages = cached_slices(model, [2, 2], tmp_path)
    engine = RingEngine(stages, SETTINGS, ring=SpeaksOutOfTurn())
    try:
        with pytest.raises(StageFailed, match="LOGITS frame"):
            engine.step_many([EngineStep(0, 0, [1], decode=True)])
    finally:
        engine.close()


class SlowWire:
    """A ring whose every round (a wave's frames, a CANCEL's, a stage report's PING) takes TRIP_S."""

    TRIP_S = 0.2

    def __init__(self) -> None:
        self.sent: list[Frame] = []

    def send(self, frames: Sequence[Frame]) -> None:
        self.sent += frames

    def receive(self, count: int) -> list[Frame]:
        time.sleep(self.TRIP_S)  # the wire's trip: the frames come back unchanged, a CANCEL as itself
        answers, self.sent = self.sent[:count], self.sent[count:]
        return answers

    def stats(self) -> list[StageReport]:
        time.sleep(self.TRIP_S)
        return []

    def close(self) -> None:
        pass


def test_the_ring_trip_is_the_pings_alone_after_a_cancel(model: Path, tmp_path: Path) -> None:
    """A stage report asked for just after a CANCEL left (a rejected draft's cut, a reused slot's)
    times its PING alone: the engine takes the CANCEL's own trip round the ring first, not counted
    as the wire's (it read two trips, 130 for 65 ms, in bench_wan at 40 ms a hop), and the engine
    loop prices and shows the trip the report carries."""
    engine = RingEngine(cached_slices(model, [2, 2], tmp_path), SETTINGS, ring=SlowWire())
    try:
        engine.forget(0, keep=3)  # its answer is still out when the report is asked for
        report = engine.stage_report()
        assert 1e3 * SlowWire.TRIP_S <= report.trip_ms < 1.5e3 * SlowWire.TRIP_S, report.trip_ms
        assert engine.ring.sent == []  # the CANCEL came round too
        loop = EngineLoop(engine, 1, 16, 64)  # not started: the test asks for the report itself
        engine.forget(0, keep=2)
        loop._refresh_report()
        assert loop.ring_ms is not None
        assert 1e3 * SlowWire.TRIP_S <= loop.ring_ms < 1.5e3 * SlowWire.TRIP_S, loop.ring_ms
    finally:
        engine.close()


def test_closing_an_engine_waits_out_a_tokenization_and_refuses_later_ones(model: Path) -> None:
    """The server tokenizes long prompts on worker threads while the host may close the engine to
    replan: close waits until no thread is inside the vocabulary, and a tokenization after it is
    refused with StageFailed rather than reading freed memory."""
    import threading

    from kafila.runtime.engine.ring import StageFailed

    engine = open_engine(model, [4], SETTINGS)
    closed = threading.Event()
    with engine._readers.reading():  # a tokenization in flight on another thread, held open
        assert engine.tokenize("hello world")  # others still read meanwhile
        closing = threading.Thread(target=lambda: (engine.close(), closed.set()))
        closing.start()
        assert not closed.wait(0.3)  # close waits for the reader to leave
    closing.join(timeout=10)
    assert closed.is_set()
    with pytest.raises(StageFailed, match="closed"):
        engine.tokenize("hello world")


def test_the_stage_report_stays_current_while_the_ring_is_never_idle(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under steady load (more requests queued than run, two waves out) the loop still lets the
    ring empty now and then to ask the stages for their times, so /status measures the load and
    not the last idle moment; the requests still run to their last token."""
    import threading

    from kafila.runtime.engine.sampling import SamplingSettings
    from kafila.serving import engine_loop as service
    from kafila.serving.batcher import Finished, Job, TextDelta

    monkeypatch.setattr(service, "STATS_REFRESH_S", 0.02)
    monkeypatch.setenv("KAFILA_PIPELINE_WAVES", "2")  # two waves out throughout, unpriced
    settings = ContextSettings(n_ctx=4 * 512, n_batch=64, n_seq_max=4, n_threads=1)
    engine = open_engine(model, [2, 2], settings, tmp_path)
    assert isinstance(engine, RingEngine)
    engine.depth = 2
    loop = service.EngineLoop(engine, concurrency=4, batch_rows=64, context_per_sequence=512)
    texts: dict[str, list[str]] = {}
    lengths: list[int] = []
    done = threading.Semaphore(0)

    def sink(event: service.Event) -> None:
        if isinstance(event, TextDelta):
            texts.setdefault(event.request_id, []).append(event.text)
        elif isinstance(event, Finished):
            lengths.append(event.completion_tokens)
            done.release()
        else:
            raise AssertionError(event)

    loop.start()
    try:
        prompt = engine.tokenize(PROMPTS[0])
        for n in range(8):
            loop.submit(Job(f"r{n}", prompt, 400, SamplingSettings(top_k=1)), sink)
        rows_seen_busy: set[int] = set()
        deadline = time.monotonic() + 300
        while loop.running or loop.queued:
            assert time.monotonic() < deadline, f"8 requests of 400 tokens still running after 300 s: {lengths}"
            report = loop.stage_report
            if report and loop.running:
                rows_seen_busy.add(report[0].rows or 0)
            time.sleep(0.01)
        for _ in range(8):
            assert done.acquire(timeout=120)
        assert len(rows_seen_busy - {0}) >= 3, rows_seen_busy  # the report moved while requests ran
        assert sorted(lengths) == [400] * 8
        start = engine.detokenize(greedy_alone(model, PROMPTS[0], 3))  # batches may break a later near-tie
        assert all("".join(parts).startswith(start) for parts in texts.values())
    finally:
        loop.stop()
        engine.close()


def test_the_next_wave_leaves_before_the_last_ones_tokens_reach_the_api(model: Path, tmp_path: Path) -> None:
    """After landing a wave the loop launches the next before it hands the landed tokens to their
    requests, so their delivery overlaps the ring's trip rather than delaying the next token."""
    import threading

    from kafila.runtime.engine.sampling import SamplingSettings
    from kafila.serving import engine_loop as service
    from kafila.serving.batcher import Finished, Job, TextDelta

    engine = open_engine(model, [2, 2], SETTINGS, tmp_path)
    assert isinstance(engine, RingEngine)
    log: list[str] = []
    launch, land = engine.launch, engine.land

    def logged_launch(steps: list[EngineStep]) -> object:
        log.append("launch")
        return launch(steps)

    def logged_land(launched: object) -> object:
        log.append("land")
        return land(launched)  # type: ignore[arg-type]

    engine.launch, engine.land = logged_launch, logged_land  # type: ignore[method-assign,assignment]
    loop = service.EngineLoop(engine, concurrency=1, batch_rows=64, context_per_sequence=64)
    done = threading.Event()

    def sink(event: service.Event) -> None:
        if isinstance(event, TextDelta):
            log.append("delta")
        elif isinstance(event, Finished):
            done.set()

    loop.start()
    try:
        loop.submit(Job("r", engine.tokenize(PROMPTS[0]), 12, SamplingSettings(top_k=1)), sink)
        assert done.wait(timeout=120)
    finally:
        loop.stop()
        engine.close()
    last_land = len(log) - 1 - log[::-1].index("land")
    assert "delta" in log[:last_land], log  # text was delivered while the request still ran
    for at, entry in enumerate(log[:last_land]):
        if entry == "land":  # the request goes on: its next wave leaves before anything is delivered
            assert log[at + 1] == "launch", log


@pytest.mark.parametrize("override", [None, "2"])
def test_the_waves_in_flight_follow_what_the_stages_report_waves_cost(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str | None
) -> None:
    """As the stage report refreshes, the loop prices the waves in flight from each stage's
    decodes by size (planner/waves.py; these local stages count as three machines) and splits the
    running requests by the count it chooses, first one wave of them all so that every stage
    times the widest decode, the requests running to their last token as before;
    KAFILA_PIPELINE_WAVES fixes the count, and nothing is priced."""
    import threading

    from kafila.planner.waves import wave_costs_from
    from kafila.runtime.engine.sampling import SamplingSettings
    from kafila.serving import engine_loop as service
    from kafila.serving.batcher import Finished, Job, TextDelta

    if override is None:
        monkeypatch.delenv("KAFILA_PIPELINE_WAVES", raising=False)
    else:
        monkeypatch.setenv("KAFILA_PIPELINE_WAVES", override)
    monkeypatch.setattr(service, "STATS_REFRESH_S", 0.002)  # a report between most waves: priced often
    settings = ContextSettings(n_ctx=4 * 128, n_batch=64, n_seq_max=4, n_threads=1)
    engine = open_engine(model, [2, 1, 1], settings, tmp_path)
    assert isinstance(engine, RingEngine)
    engine.depth, engine.stage_machines = 2, (0, 1, 2)  # as three machines: two waves until priced
    loop = service.EngineLoop(engine, concurrency=4, batch_rows=64, context_per_sequence=128)
    texts: dict[str, list[str]] = {}
    lengths: dict[str, int] = {}
    done = threading.Semaphore(0)

    def sink(event: service.Event) -> None:
        if isinstance(event, TextDelta):
            texts.setdefault(event.request_id, []).append(event.text)
        elif isinstance(event, Finished):
            lengths[event.request_id] = event.completion_tokens
            done.release()

    costs_seen: list[object] = []  # held, so that each priced object's id is its own
    loop.start()
    try:
        prompt = engine.tokenize(PROMPTS[3])  # short: four in one step stay a small batch (as alone)
        for n, tokens in enumerate((20, 40, 60, 80)):  # ending one by one: waves of every size
            loop.submit(Job(f"r{n}", prompt, tokens, SamplingSettings(top_k=1)), sink)
        for _ in range(4):
            assert done.acquire(timeout=120)
            costs_seen.append(loop.wave_costs)
        start = engine.detokenize(greedy_alone(model, PROMPTS[3], 3))  # batches may break a later near-tie
    finally:
        loop.stop()
        engine.close()
    assert lengths == {"r0": 20, "r1": 40, "r2": 60, "r3": 80}
    assert all("".join(parts).startswith(start) for parts in texts.values())
    report = loop.stage_report  # the last, the loop stopped: what the last count was priced by
    if override is not None:
        assert loop.wave_costs is None and loop.decode_waves == 2
        return
    assert loop.wave_costs is not None and loop.wave_costs.machines == (0, 1, 2)
    fitted = wave_costs_from([s.decode_ms_by_rows for s in report], (0, 1, 2), loop.ring_ms)
    assert fitted is not None and loop.wave_costs.stages == fitted.stages and loop.wave_costs.ring_ms == fitted.ring_ms
    assert loop.wave_costs.host_machine == 2  # the head's, here
    assert all(len(stage.decode_ms_by_rows) >= 2 for stage in report)
    assert all(max(rows for rows, _ in stage.decode_ms_by_rows) == 4 for stage in report), report  # all four at once
    assert 1 <= loop.decode_waves <= 4
    # priced again as the report refreshed (a new pricing each time, equal where the medians held)
    assert len({id(costs) for costs in costs_seen if costs is not None}) >= 2
