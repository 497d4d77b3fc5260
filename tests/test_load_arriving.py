"""A stage file whose tensor bytes still arrive is loaded up to its tensors' data at once, and its
tensors only once every byte is in (`runtime.gguf.arriving`, `LlamaModel`): real llama.cpp and
gemma-3-270m, whose tensor data is zeros until the test writes it. Repacked (its Q4_K weights
copied into llama.cpp's interleaved layout as it loads: loaded without the wait, this reads the
zeros, its logits off by ~100) and not (read through the mapping as decodes need them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from waiting import until

from kafila.runtime.gguf.arriving import arrival_at, arrival_of, arriving
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.llama.model import ContextSettings, LlamaModel

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]


def last_logits(model: LlamaModel) -> npt.NDArray[np.float32]:
    model.decode([0] * len(TOKENS), list(range(len(TOKENS))), [False] * (len(TOKENS) - 1) + [True], tokens=TOKENS)
    return model.logits(len(TOKENS) - 1).copy()


def laid_out(model: Path, out: Path) -> tuple[Path, int]:
    """A copy of `model` as a fetch lays it out: the header, metadata and tensor table in place, the
    file at its full size, its tensor data zeros. Returns it and where its tensor data begins."""
    shutil.copy(model, out)
    start = FastGGUFReader(model).data_offset
    with out.open("r+b") as file:
        file.seek(start)
        file.write(bytes(model.stat().st_size - start))
    return out, start


class Loading:
    """A LlamaModel loading in a thread of its own."""

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        self.model: LlamaModel | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._load, args=(path, settings))
        self.thread.start()

    def _load(self, path: Path, settings: ContextSettings) -> None:
        try:
            self.model = LlamaModel(path, settings)
        except Exception as error:
            self.error = error

    def result(self) -> LlamaModel:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the load never ended"
        if self.error is not None:
            raise self.error
        assert self.model is not None
        return self.model


@pytest.mark.parametrize("repack", [True, False])
def test_a_load_begun_before_the_tensors_arrive_reads_them_once_they_have(
    tmp_path: Path, gemma_path: Path, repack: bool
) -> None:
    source = gemma_path
    settings = ContextSettings(n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1, repack=repack)
    with LlamaModel(source, settings) as whole:
        expected = last_logits(whole)
    path, start = laid_out(source, tmp_path / "stage.partial")
    fd = os.open(path, os.O_RDWR)
    try:
        with arriving(fd) as arrival:
            assert arrival_of(path) is arrival
            loading = Loading(path, settings)
            until(lambda: arrival.waiting == 1, "the load waits for the tensors' bytes")
            assert loading.thread.is_alive()
            os.pwrite(fd, source.read_bytes()[start:], start)  # the bytes land while it waits
            arrival.settle(True)
            with loading.result() as model:
                assert np.array_equal(last_logits(model), expected)  # bit for bit: nothing read before
        assert arrival_of(path) is None  # arrived: loads of it no longer wait
    finally:
        os.close(fd)


def test_a_load_of_bytes_that_never_all_arrive_fails_saying_so(tmp_path: Path, gemma_path: Path) -> None:
    path, _ = laid_out(gemma_path, tmp_path / "stage.partial")
    fd = os.open(path, os.O_RDWR)
    try:
        with arriving(fd) as arrival:
            loading = Loading(path, ContextSettings(n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1))
            until(lambda: arrival.waiting == 1, "the load waits for the tensors' bytes")
            arrival.settle(False)  # the fetch failed
            with pytest.raises(RuntimeError, match="never all came"):
                loading.result()
    finally:
        os.close(fd)


def test_an_arrival_left_unsettled_settles_incomplete_and_is_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "stage.partial"
    path.write_bytes(b"GGUF")
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(KeyError), arriving(fd) as arrival:
            raise KeyError("a fetch that failed")
        assert arrival.settled and not arrival.wait(0)
        assert arrival_of(path) is None
        with arriving(fd) as arrival:
            arrival.settle(True)
            arrival.settle(False)  # said once
        assert arrival.wait(0)
    finally:
        os.close(fd)
    assert arrival_of(tmp_path / "absent") is None


def test_a_wait_for_a_file_to_begin_arriving_wakes_as_another_thread_registers_it(tmp_path: Path) -> None:
    # The fetch registers its file in a thread of its own; the deployment awaits it in the event
    # loop, woken by the registration, not by looking again a while later.
    path, other = tmp_path / "stage.partial", tmp_path / "other.partial"
    path.write_bytes(b"GGUF")
    other.write_bytes(b"GGUF")

    async def scenario() -> None:
        until_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with contextlib.ExitStack() as fetches:
            fd, other_fd = os.open(path, os.O_RDWR), os.open(other, os.O_RDWR)
            fetches.callback(os.close, fd)
            fetches.callback(os.close, other_fd)
            waiter = asyncio.create_task(arrival_at(path, until_done))
            await asyncio.sleep(0)  # it looks, finds nothing arriving, and waits
            await asyncio.to_thread(fetches.enter_context, arriving(other_fd))
            await asyncio.sleep(0)
            assert not waiter.done()  # another file's arrival: it looks again, and waits on
            arrival = await asyncio.to_thread(fetches.enter_context, arriving(fd))
            await asyncio.sleep(0)  # one turn of the loop: a wait that looked every so often would still sleep
            assert waiter.done() and waiter.result() is arrival
            assert await arrival_at(path, until_done) is arrival  # arriving now: at once

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_wait_for_a_file_to_begin_arriving_ends_with_none_once_its_bound_is_done(tmp_path: Path) -> None:
    async def scenario() -> None:
        share: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(arrival_at(tmp_path / "never.partial", share))
        await asyncio.sleep(0)
        assert not waiter.done()
        share.set_result(None)  # this host's share got, the file never arriving here
        assert await waiter is None

    asyncio.run(asyncio.wait_for(scenario(), 10))
