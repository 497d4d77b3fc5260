"""Waves on a real ring: several steps out at once, landing in order, each exactly what it would
be on its own; a sequence forgotten while its rows are out is dropped everywhere, and its slot
serves a new request from scratch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.pipeline import EngineStep, RingEngine, SequenceFailed, open_engine

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
        assert engine.stage_report()  # nothing left out: a stage report goes round cleanly
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
        assert engine.stage_report()
    finally:
        engine.close()
