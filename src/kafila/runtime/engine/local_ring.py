"""A ring of stages on this machine: the head in this process, every other stage in its own.

This is the whole data path of a session without the network: the head embeds tokens, the
frames go round local sockets through each block stage and come back to the head, which turns
them into logits. A session's ring over QUIC links (`session.quic_ring.QuicRing`) takes the place
of `LocalRing` behind the same `RingTransport`. `open_engine` picks the engine for a division of
the model on this machine; `generate` runs one prompt through any engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kafila.contracts import CountProgress, StageReport
from kafila.runtime.engine.engines import Engine, PrefixCut, RingEngine, UnsplitEngine, prefix_cut_of
from kafila.runtime.engine.ring import StageFailed, check_ring_error, ring_stats
from kafila.runtime.engine.sampling import (
    Sampler,
    SamplingSettings,
)
from kafila.runtime.gguf.slicer import StageFile, cached_slices
from kafila.runtime.llama.cpu_safety import died_by_signal, signal_of
from kafila.runtime.llama.loading import repack_choice, shares_cores_env, system_info
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.process_log import last_lines
from kafila.wire.frames import Frame, FrameDecoder

RING_TIMEOUT_S = 300.0
WORKER_EXIT_GRACE_S = 3.0  # how long a broken ring waits for the stage that broke it to be reaped


@dataclass
class _Worker:
    process: subprocess.Popen[str]
    stderr: IO[str]
    stage: StageFile

    def failure(self) -> str:
        """What became of this stage's process, in words: a death by a signal is explained
        (`cpu_safety`), with the last lines of its log."""
        tail = last_lines(self.stderr)
        code = self.process.poll()
        who = f"the stage process holding blocks {self.stage.first_block}-{self.stage.end_block - 1}"
        if signal_of(code) is not None:
            assert code is not None
            return died_by_signal(who, code, system_info(), repack_choice(), tail)
        state = f"exited with status {code}" if code is not None else "stopped answering"
        return f"{who} {state}: " + (" | ".join(tail) or "it printed nothing")


class LocalRing:
    """Stages as worker processes joined in a ring by loopback sockets (a head file among them
    answers with logits: the head on a member, without the network)."""

    def __init__(self, stages: Sequence[StageFile], settings: ContextSettings) -> None:
        self.workers: list[_Worker] = []
        self._decoder = FrameDecoder()
        self._pending: list[Frame] = []
        self._buffer = bytearray(1 << 20)  # reused across receives
        listener = socket.create_server(("127.0.0.1", 0))
        try:
            for stage in stages:
                stderr = tempfile.TemporaryFile("w+")
                command = [
                    sys.executable, "-m", "kafila.runtime.engine.worker", "--model", str(stage.path),
                    "--n-ctx", str(settings.n_ctx), "--n-batch", str(settings.n_batch),
                    "--n-seq", str(settings.n_seq_max), "--threads", str(settings.n_threads),
                    *(["--head"] if stage.is_head else []),
                ]  # fmt: skip
                process = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                    env={**os.environ, **shares_cores_env()},  # local stages take turns on these cores
                )  # fmt: skip
                self.workers.append(_Worker(process, stderr, stage))
            ports = [self._ready_port(worker) for worker in self.workers]
            nexts = [*ports[1:], listener.getsockname()[1]]
            for worker, port in zip(self.workers, nexts, strict=True):
                assert worker.process.stdin is not None
                worker.process.stdin.write(f"NEXT {port}\n")
                worker.process.stdin.flush()
            self._out = socket.create_connection(("127.0.0.1", ports[0]), timeout=RING_TIMEOUT_S)
            listener.settimeout(RING_TIMEOUT_S)
            self._in, _ = listener.accept()
            self._in.settimeout(RING_TIMEOUT_S)
            for connection in (self._in, self._out):
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    @staticmethod
    def _ready_port(worker: _Worker) -> int:
        assert worker.process.stdout is not None
        line = worker.process.stdout.readline().split()
        if len(line) != 2 or line[0] != "READY":
            raise StageFailed(worker.failure())
        return int(line[1])

    def send(self, frames: Sequence[Frame]) -> None:
        try:
            self._out.sendall(b"".join(frame.encode() for frame in frames))
        except OSError as error:
            raise StageFailed(self._dead_worker_report(error)) from error

    def receive(self, count: int) -> list[Frame]:
        """The next `count` frames to come back round the ring, a stage's ERROR for one sequence among them."""
        while len(self._pending) < count:
            try:
                received = self._in.recv_into(self._buffer)
            except OSError as error:
                raise StageFailed(self._dead_worker_report(error)) from error
            if not received:
                raise StageFailed(self._dead_worker_report(None))
            for frame in self._decoder.feed(memoryview(self._buffer)[:received]):
                self._pending.append(check_ring_error(frame))
        frames, self._pending = self._pending[:count], self._pending[count:]
        return frames

    def _dead_worker_report(self, error: OSError | None) -> str:
        """Which stage broke the ring, and how. Its socket closes as it dies, a moment before it can
        be reaped (a crash first writes its traceback), so a dying stage is given that moment."""
        deadline = time.monotonic() + WORKER_EXIT_GRACE_S
        while True:
            for worker in self.workers:
                if worker.process.poll() is not None:
                    return worker.failure()
            if time.monotonic() >= deadline:
                return f"the ring broke: {error or 'connection closed'}"
            time.sleep(0.02)

    def stats(self) -> list[StageReport]:
        return ring_stats(self)

    def close(self) -> None:
        for connection in (getattr(self, "_out", None), getattr(self, "_in", None)):
            if connection is not None:
                connection.close()
        for worker in self.workers:
            if worker.process.stdin is not None and not worker.process.stdin.closed:
                worker.process.stdin.close()
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.stderr.close()


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    text: str
    tokens_per_s: float | None
    stages: list[StageReport]
    prompt_tokens: int
    finish_reason: str  # "length" or "stop"


def generate(
    engine: Engine,
    prompt: str,
    max_tokens: int,
    sampling: SamplingSettings,
    sequence_id: int = 0,
    context: int | None = None,
) -> Generation:
    """Prefill the prompt, then decode up to `max_tokens` tokens or to an end-of-generation token;
    with `context` (the engine's tokens per sequence), no further than the context holds."""
    prompt_tokens = engine.tokenize(prompt)
    if not prompt_tokens:
        raise ValueError("the prompt is empty after tokenization")
    if context is not None:
        if len(prompt_tokens) >= context:
            raise ValueError(f"the prompt has {len(prompt_tokens)} tokens; the context holds {context}")
        max_tokens = min(max_tokens, context - len(prompt_tokens))
    sampler = Sampler(sampling, engine.n_vocab())
    sampler.accept(prompt_tokens)
    try:
        logits = engine.step(sequence_id, 0, prompt_tokens, decode=False)
        tokens: list[int] = []
        finish = "length"
        started = time.perf_counter()
        while len(tokens) < max_tokens:
            token = sampler.sample(logits)
            if engine.is_end(token):
                finish = "stop"
                break
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
            logits = engine.step(sequence_id, len(prompt_tokens) + len(tokens) - 1, [token], decode=True)
        elapsed = time.perf_counter() - started
    finally:
        sampler.close()
    engine.forget(sequence_id)
    rate = (len(tokens) - 1) / elapsed if len(tokens) > 1 and elapsed > 0 else None
    return Generation(tokens, engine.detokenize(tokens), rate, engine.stage_report().stages, len(prompt_tokens), finish)


def open_engine(
    model: Path,
    counts: Sequence[int],
    settings: ContextSettings,
    cache_dir: Path | None = None,
    progress: CountProgress | None = None,
) -> Engine:
    """An engine over the model cut as `counts` (chain order, head last); one count runs it unsplit.
    `progress` hears the cutting, where the stage files are not cached yet."""
    if len(counts) == 1:
        return UnsplitEngine(model, settings)
    directory = cache_dir or Path(os.environ.get("KAFILA_CACHE", Path.home() / ".cache" / "kafila")) / "stages"
    return local_ring_engine(cached_slices(model, counts, directory, progress), settings, prefix_cut_of(model))


def local_ring_engine(
    stages: Sequence[StageFile],
    settings: ContextSettings,
    prefix_cut: PrefixCut = PrefixCut.NOWHERE,
    model: Path | None = None,
) -> RingEngine:
    """A `RingEngine` whose other stages run as local processes: the head here, or, with `model`
    (the whole model's file), on the ring too, as a member would hold it."""
    ring = LocalRing(stages if model is not None else stages[:-1], settings)
    try:
        return RingEngine(stages, settings, ring=ring, model=model, prefix_cut=prefix_cut)
    except BaseException:
        ring.close()
        raise
