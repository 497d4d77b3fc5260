"""`kafila generate` with stages as separate processes: the real gemma-3-270m and tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import local_ring_engine
from kafila.runtime.engine.ring import StageFailed
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings

PROMPT = "The capital of France is"


def kafila(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )


def run_json(*args: str | Path, env: dict[str, str] | None = None) -> dict:
    result = kafila("generate", *args, "--json", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {**os.environ, "KAFILA_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def gemma_unsplit(gemma_path: Path, cache_env: dict[str, str]) -> dict:
    return run_json("--model", gemma_path, "--stages", "1", "--prompt", PROMPT, "--max-tokens", "32", env=cache_env)


def test_unsplit_gemma_writes_sense(gemma_unsplit: dict) -> None:
    assert len(gemma_unsplit["tokens"]) == 32
    assert "France" in gemma_unsplit["text"] or "Paris" in gemma_unsplit["text"]
    (stage,) = gemma_unsplit["stages"]
    assert stage["range"] == [0, 18] and stage["ms_per_token"] > 0
    # one sequence: every decode was of one row
    assert stage["steps_alone"] == 31 and stage["ms_per_token_alone"] > 0


@pytest.mark.parametrize("division", ["9,9", "6,6,6", "1,16,1"])
def test_gemma_split_across_processes_is_identical(
    gemma_path: Path, gemma_unsplit: dict, cache_env: dict[str, str], division: str
) -> None:
    counts = [int(c) for c in division.split(",")]
    split = run_json(
        "--model", gemma_path, "--division", division, "--prompt", PROMPT, "--max-tokens", "32", env=cache_env
    )
    assert split["tokens"] == gemma_unsplit["tokens"]
    assert split["text"] == gemma_unsplit["text"]
    bounds = [[sum(counts[:i]), sum(counts[: i + 1])] for i in range(len(counts))]
    assert [stage["range"] for stage in split["stages"]] == bounds
    assert all(stage["ms_per_token"] > 0 for stage in split["stages"])
    assert split["tokens_per_s"] > 0


def test_seeded_sampling_repeats_and_differs_from_greedy(gemma_path: Path, cache_env: dict[str, str]) -> None:
    args = ("--model", gemma_path, "--division", "9,9", "--prompt", PROMPT, "--max-tokens", "24")
    sampled = [run_json(*args, "--temperature", "1.2", "--seed", "7", env=cache_env) for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]
    other = run_json(*args, "--temperature", "1.2", "--seed", "8", env=cache_env)
    greedy = run_json(*args, env=cache_env)
    assert other["tokens"] != sampled[0]["tokens"] or greedy["tokens"] != sampled[0]["tokens"]


def test_planner_division_for_local_stages(tmp_path: Path, cache_env: dict[str, str]) -> None:
    model = write_tiny_model(tmp_path / "qwen3.gguf", "qwen3", n_blocks=5)
    out = run_json("--model", model, "--stages", "2", "--prompt", "hello world", "--max-tokens", "8", env=cache_env)
    assert len(out["division"]) == 2 and sum(out["division"]) == 5
    unsplit = run_json("--model", model, "--stages", "1", "--prompt", "hello world", "--max-tokens", "8", env=cache_env)
    assert out["tokens"] == unsplit["tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--division", "2,2"), "covers 4 blocks but the model has 5"),
        (("--division", "2,x"), "block counts separated by commas"),
        (("--division", "3,0,2"), "at least one block"),
        (("--stages", "3", "--division", "2,3"), "lists 2 stages but --stages is 3"),
        (("--stages", "9"), "9 stages for a model of 5 blocks"),
    ],
)
def test_bad_divisions_are_refused(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=5)
    result = kafila("generate", "--model", model, "--prompt", "hello", *args)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_generation_stops_where_the_context_ends(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """More tokens asked for than the context holds: they stop at its end, as a length finish,
    rather than failing once the cache is full; a prompt that fills it is refused up front."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=2)
    args = ("--model", model, "--stages", "1", "--context", "32")
    out = run_json(*args, "--prompt", "hello world", "--max-tokens", "1000", env=cache_env)
    assert out["finish_reason"] == "length" and out["prompt_tokens"] + len(out["tokens"]) == 32
    result = kafila("generate", *args, "--prompt", "hello " * 40)
    assert result.returncode == 1 and "the context holds 32" in result.stderr and "Traceback" not in result.stderr


def test_missing_and_broken_models(tmp_path: Path) -> None:
    missing = kafila("generate", "--model", tmp_path / "none.gguf", "--prompt", "hi")
    assert missing.returncode == 1 and "no model file" in missing.stderr
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 40)
    result = kafila("generate", "--model", broken, "--prompt", "hi", "--json")
    assert result.returncode == 1 and "error" in json.loads(result.stdout)


def test_a_stage_that_dies_is_reported_not_waited_on(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    stages = slice_model(model, [1, 1, 2], tmp_path / "stages")
    engine = local_ring_engine(stages, ContextSettings(n_ctx=128, n_batch=16, n_seq_max=1, n_threads=1))
    try:
        prompt = engine.tokenize("hello world")
        engine.step(0, 0, prompt, decode=False)
        victim = engine.ring.workers[1].process
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        started = time.monotonic()
        with pytest.raises(StageFailed, match="blocks 1-1"):
            engine.step(0, len(prompt), [5], decode=True)
        assert time.monotonic() - started < 10
    finally:
        engine.close()


def test_a_malformed_frame_is_answered_with_an_error(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    stages = slice_model(model, [2, 2], tmp_path / "stages")
    engine = local_ring_engine(stages, ContextSettings(n_ctx=128, n_batch=16, n_seq_max=1, n_threads=1))
    try:
        engine.ring._out.sendall(b"this is not a frame at all, not even close")
        with pytest.raises(StageFailed, match="bad magic"):
            engine.ring.receive(1)
    finally:
        engine.close()


def test_frames_of_the_wrong_width_are_refused(tmp_path: Path) -> None:
    import numpy as np

    from kafila.wire.frames import Frame, Kind

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    stages = slice_model(model, [2, 2], tmp_path / "stages")
    engine = local_ring_engine(stages, ContextSettings(n_ctx=128, n_batch=16, n_seq_max=1, n_threads=1))
    try:
        engine.ring.send([Frame.of_hidden(Kind.DECODE, 0, 0, np.zeros((1, 3), dtype=np.float32))])
        (refusal,) = engine.ring.receive(1)  # an error for that sequence alone: the stage serves on
        assert refusal.kind is Kind.ERROR and refusal.sequence_id == 0 and "hidden size 3" in refusal.text()
        assert len(engine.step(0, 0, engine.tokenize("hello"), decode=False)) == engine.n_vocab()
    finally:
        engine.close()
