"""Prefix reuse on real llama.cpp: a request whose prompt begins with what a slot's cache holds
prefills only the rest, and decodes exactly what a full prefill decodes."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import numpy.typing as npt
import openai
import pytest
from openai.types import Completion
from serving_checks import engine_served, unsplit_greedy
from test_split_correctness import N_BLOCKS, PROMPT, greedy_unsplit
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.runtime.engine.engines import Engine, PrefixCut, prefix_cut, prefix_cut_of
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.stage import Vocabulary
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.serving.batcher import Finished, Job, RequestEvent, RequestFailed, TextDelta
from kafila.serving.engine_loop import EngineLoop

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
        events: queue.Queue[RequestEvent] = queue.Queue()
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
                assert not isinstance(event, RequestFailed), event.message

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()


def fresh_answer(model: Path, blocks: int, prompt: list[int]) -> str:
    """The greedy answer to `prompt` of the whole model (`blocks` long) on a cache that held nothing."""
    fresh = Served(open_engine(model, [blocks], SETTINGS))
    try:
        text, finished = fresh.ask(prompt)
    finally:
        fresh.close()
    assert finished.cached_tokens == 0
    return text


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
    assert text == fresh_answer(model, n, second), arch


def test_the_header_says_where_a_cache_may_be_cut_as_the_loaded_model_does(family: tuple[str, Path]) -> None:
    """A ring's host decides from the whole model's header (`prefix_cut_of`), an unsplit engine
    from the model llama.cpp loaded: for every family both come to the same answer. A windowed
    cache is cut anywhere only because its keeper holds every cell of its window."""
    arch, model = family
    loaded = LlamaModel(model, SETTINGS)
    try:
        truth = prefix_cut(not loaded.holds_positions)
        windowed, kept = loaded.sliding_window > 0, loaded.keeps_window_cells
    finally:
        loaded.close()
    assert prefix_cut_of(model) is truth, arch
    assert kept == (windowed and truth is PrefixCut.ANYWHERE), arch


WINDOWED_FAMILIES = ("gemma3", "gemma2", "gpt-oss")  # windows of 16, 16 and 8 positions


@pytest.mark.parametrize("arch", [*WINDOWED_FAMILIES, "llama"])
def test_a_history_edited_in_the_middle_resumes_from_the_edit(arch: str, tmp_path: Path) -> None:
    """An agent resends its history with an earlier part rewritten: on a ring of two stages the
    slot's cache is cut at the edit, well before the end of what it holds and behind positions
    that left a sliding window long ago, and the answer is the one a fresh cache gives."""
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    n, starts = N_BLOCKS[arch], read_manifest(model).stage_starts
    split = [starts[0], n - starts[0]] if starts else [n // 2, n - n // 2]
    # one slot: the edited history must go where the long one is, not to a fresh slot
    served = Served(open_engine(model, split, SETTINGS, tmp_path / "stages"), 1)
    try:
        first = served.engine.tokenize(PROMPT)
        answer = greedy_unsplit(model, first, 40)
        served.ask(first, max_tokens=len(answer))
        held = len(first) + len(answer) - 1  # the last answer token is never fed back
        edit = held // 2 + 1  # where a cut still keeps half the cache
        window = int(FastGGUFReader(model).scalar(f"{arch}.attention.sliding_window", 0))
        assert held - edit >= window, arch  # the rows before the edit had left the window
        history = first + answer
        edited = history[:edit] + served.engine.tokenize(" hello kafila", add_special=False) + history[edit + 2 :]
        text, finished = served.ask(edited)
        assert finished.cached_tokens == edit, arch
    finally:
        served.close()
    assert text == fresh_answer(model, n, edited), arch


def _decode_in_chunks(model: LlamaModel, sequence: int, start: int, tokens: list[int]) -> npt.NDArray[np.float32]:
    """Decode `tokens` from `start` on, 16 rows a decode; the last row's logits."""
    for at in range(0, len(tokens), 16):
        part = tokens[at : at + 16]
        positions = range(start + at, start + at + len(part))
        model.decode([sequence] * len(part), positions, [False] * (len(part) - 1) + [True], tokens=part)
    return model.logits(len(part) - 1)


def _edited_rows(
    model: LlamaModel, history: list[int], edit: list[int], at: int, answered: bool
) -> npt.NDArray[np.float32]:
    """The logits of an edit's last row, decoded after cutting sequence 0's history at `at`. Another
    sequence's short request came first and has ended, so its freed cells are where the next
    decode looks first; `answered`: sequence 0 then decoded an answer a token at a time, whose
    rows, past those freed cells, find the history's earliest ones out of its window."""
    _decode_in_chunks(model, 1, 0, history[:2])
    _decode_in_chunks(model, 0, 0, history)
    model.forget(1)
    if answered:
        for i in range(model.sliding_window // 2):
            model.decode([0], [len(history) + i], [True], tokens=[history[i]])
    model.forget(0, at)
    logits = _decode_in_chunks(model, 0, at, edit)
    model.forget(0)
    return logits


@pytest.mark.parametrize("arch", WINDOWED_FAMILIES)
def test_a_windowed_cache_cut_far_back_reads_the_window_as_it_was(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A history three windows long, cut just past half a window and an edit decoded there: the
    edit's logits are the same, bit for bit, whether or not the sequence decoded an answer in
    between, whose rows llama.cpp would give cells of the history's first positions (and then
    drop the positions before them) if a keeper did not hold them. Without keepers they differ."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, N_BLOCKS[arch])
    settings = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=2, n_threads=2)

    def edited_both_ways() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        with LlamaModel(path, settings) as model:
            window = model.sliding_window
            tokens = Vocabulary(model).tokenize(PROMPT) * 8
            history, edit, at = tokens[: 3 * window], tokens[3 * window : 3 * window + window // 2], window // 2 + 2
            return _edited_rows(model, history, edit, at, False), _edited_rows(model, history, edit, at, True)

    quiet, answered = edited_both_ways()
    assert np.array_equal(quiet, answered), float(np.abs(quiet - answered).max())
    monkeypatch.setattr(LlamaModel, "_window_cells_kept", lambda self: False)
    quiet, answered = edited_both_ways()
    assert not np.array_equal(quiet, answered), arch  # the case is one where llama.cpp takes the cells


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)


def served_ring(model: Path, tmp_path: Path, concurrency: int) -> contextlib.AbstractContextManager[tuple[str, object]]:
    """The model cut in two behind the real API, as `kafila host --stages 2` serves it."""
    settings = ContextSettings(n_ctx=512 * concurrency, n_batch=64, n_seq_max=concurrency, n_threads=2)
    return engine_served(open_engine(model, [2, 2], settings, tmp_path / "stages"), concurrency, 64, 512)


def metric(base_url: str, name: str) -> float:
    with urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")))


def test_a_chat_through_the_api_reuses_every_earlier_turn_and_says_so(tiny_llama: Path, tmp_path: Path) -> None:
    """Three turns of one chat with the official client: from the second on, the rows of the turns
    before are reused, `usage` and `/metrics` say how many, and the last answer is the one a fresh
    ring gives the same messages."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "you are the kafila model of the world"}]
    usages = []
    with served_ring(tiny_llama, tmp_path, 2) as (base_url, _):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        for question in ("hello world", "and the block", "is it the model"):
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            usages.append(reply.usage)
        last = messages[-1]["content"]
        cached = [u.prompt_tokens_details.cached_tokens for u in usages]  # type: ignore[union-attr]
        prompts = [u.prompt_tokens for u in usages]  # type: ignore[union-attr]
        assert cached[0] == 0
        for turn in (1, 2):  # at least the turn before's prompt, less a token or two where it joins the answer
            assert prompts[turn - 1] - 2 <= cached[turn] < prompts[turn], (cached, prompts)
        assert metric(base_url, "kafila_prompt_tokens_cached_total") == sum(cached)
        assert metric(base_url, "kafila_prompt_tokens_computed_total") == sum(prompts) - sum(cached)
    with served_ring(tiny_llama, tmp_path / "fresh", 2) as (base_url, _):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        again = client.chat.completions.create(model="tiny", messages=messages[:-1], max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.choices[0].message.content == last


SYSTEM = "the kafila model is in a block of the world and the world is in the model of a block. "


def test_four_users_sharing_a_system_prompt_each_reuse_it_and_get_their_own_answer(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Four users at once, three rounds, one system prompt: once every slot has served it, each
    request reuses it, and each answer is its own prompt's."""
    with served_ring(tiny_llama, tmp_path, 4) as (base_url, _):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        warm = client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=1)
        assert warm.usage is not None
        shared = warm.usage.prompt_tokens

        def ask(prompt: str) -> Completion:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)

        for round_ in range(3):
            prompts = [f"{SYSTEM}{question}" for question in ("hello", "a world", "the block", "is it")]
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, prompts))
            if round_ == 2:
                cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]  # type: ignore[union-attr]
                assert all(n >= shared - 2 for n in cached), (cached, shared)
        # Batched rows take other kernels than one alone, reused or not, and a greedy run of the
        # random tiny model may break a near-tie the other way after a token or two, as other
        # requests' cells move its own (serving_checks.check_concurrent_streams): each answer starts
        # as its prompt's alone (its first token's text, less a character it splits).
        for prompt, reply in zip(prompts, replies, strict=True):
            assert reply.choices[0].text.startswith(unsplit_greedy(tiny_llama, prompt, 1).rstrip("\ufffd")), prompt


def test_more_conversations_than_slots_evict_caches_and_every_answer_stays_right(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Three conversations on two slots: the one that comes back often keeps its cache, one that
    waits while the others take both slots finds its own evicted, and every answer is exactly
    what a fresh cache gives."""
    histories = {"a": "hello world", "b": "the kafila model", "c": "a block of the world"}
    cached: dict[str, list[int]] = {name: [] for name in histories}
    with served_ring(tiny_llama, tmp_path, 2) as (base_url, _):
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        for name in "abacab":
            history = histories[name]
            reply = client.completions.create(model="tiny", prompt=history, max_tokens=6, temperature=0)
            assert reply.choices[0].text == unsplit_greedy(tiny_llama, history, 6), history
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached[name].append(reply.usage.prompt_tokens_details.cached_tokens or 0)
            histories[name] = history + reply.choices[0].text + " and"
    assert all(n > 1 for n in cached["a"][1:]), cached  # more than the BOS every prompt starts with
    assert cached["b"][1] <= 1, cached  # c took b's slot, the least recently used
