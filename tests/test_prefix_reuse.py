"""Prefix reuse on real llama.cpp: a request whose prompt begins with what a slot's cache holds
prefills only the rest, and decodes exactly what a full prefill decodes."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.engine_loop import EngineLoop
from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.manifest import read_manifest
from kafila.runtime.pipeline import Engine, PrefixCut, open_engine, prefix_cut_of
from kafila.runtime.sampling import SamplingSettings
from kafila.runtime.scheduler import Event, Failed, Finished, Job, TextDelta

SETTINGS = ContextSettings(n_ctx=512, n_batch=16, n_seq_max=2, n_threads=2)
GREEDY = SamplingSettings(top_k=1)
STEPS = 12


class Served:
    """An engine behind its loop, answering one request at a time."""

    def __init__(self, engine: Engine, concurrency: int = 2) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine, concurrency=concurrency, batch_rows=16, context_per_sequence=256)
        self.loop.start()
        self._count = 0

    def ask(self, prompt: list[int], max_tokens: int = STEPS) -> tuple[str, Finished]:
        events: queue.Queue[Event] = queue.Queue()
        self._count += 1
        self.loop.submit(Job(f"r{self._count}", prompt, max_tokens, GREEDY), events.put)
        text: list[str] = []
        while True:
            event = events.get(timeout=120)
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, Finished):
                return "".join(text), event
            else:
                assert not isinstance(event, Failed), event.message

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()


@pytest.fixture(params=SUPPORTED_TINY_ARCHS)
def family(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    arch = request.param
    yield arch, write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])


def test_a_second_turn_prefills_only_what_is_new_and_decodes_what_a_full_prefill_does(
    family: tuple[str, Path], tmp_path: Path
) -> None:
    """Turn two resends turn one and its answer, then something new: on a ring of two stages it
    reuses every row turn one left, and its greedy answer is the one a fresh cache gives."""
    arch, model = family
    n, starts = N_BLOCKS[arch], read_manifest(model).stage_starts
    cut = starts[0] if starts else n // 2  # where the family may be cut
    served = Served(open_engine(model, [cut, n - cut], SETTINGS, tmp_path / "stages"))
    try:
        first = served.engine.tokenize(PROMPT)
        answer = greedy_unsplit(model, first, STEPS)
        _, one = served.ask(first)
        assert one.cached_tokens == 0
        second = first + answer + served.engine.tokenize(" the world and a model", add_special=False)
        text, two = served.ask(second)
        # every row turn one fed: its prompt and its answer but the last token, never fed back;
        # nothing of a recurrent state, which holds no positions to cut at
        recurrent = prefix_cut_of(model) is PrefixCut.NOWHERE
        assert two.cached_tokens == (0 if recurrent else len(first) + STEPS - 1), arch
        assert recurrent == (arch == "qwen3next")
        assert two.prompt_tokens == len(second)
    finally:
        served.close()
    fresh = Served(open_engine(model, [n], SETTINGS))
    try:
        expected, full = fresh.ask(second)
    finally:
        fresh.close()
    assert full.cached_tokens == 0 and text == expected, arch


def test_a_windowed_cache_is_not_cut_far_from_its_end_and_still_decodes_right(tmp_path: Path) -> None:
    """gemma3's sliding-window layers forget what falls out of their window: a prompt sharing only
    the start of a long cached sequence starts afresh, where a model without a window reuses it."""
    gemma = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", n_blocks=6)
    llama = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    assert prefix_cut_of(gemma) is PrefixCut.AT_END and prefix_cut_of(llama) is PrefixCut.ANYWHERE
    for model, reused in ((gemma, False), (llama, True)):
        served = Served(open_engine(model, [2, 2] if model == llama else [3, 3], SETTINGS, tmp_path / "stages"))
        try:
            first = served.engine.tokenize(PROMPT)
            served.ask(first, max_tokens=24)  # well past the window of 16
            branch = first[:10] + served.engine.tokenize(" hello kafila", add_special=False)
            text, finished = served.ask(branch)
            assert finished.cached_tokens == (10 if reused else 0), model
        finally:
            served.close()
        fresh = Served(open_engine(model, [2, 2] if model == llama else [3, 3], SETTINGS, tmp_path / "fresh"))
        try:
            assert fresh.ask(branch)[0] == text
        finally:
            fresh.close()
