"""Checks shared by the serving tests, on whatever host they run against."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai

from kafila.api.server import ApiConfig, create_app
from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import Sampler, SamplingSettings
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.engine_loop import EngineLoop
from kafila.session.availability import Availability

PROMPTS = ("the quick brown fox", "a b c d", "hello world", "jumps over the lazy dog")


def unsplit_greedy(model: Path, prompt: str, tokens: int) -> str:
    """The model's greedy continuation in one process, unsplit: what every split must give."""
    return unsplit_text(model, prompt, tokens, SamplingSettings())


# Each reference computed once per test process: the same model file (by path, size and time
# written), prompt, length and sampling always give the same text.
_UNSPLIT_TEXTS: dict[tuple[str, int, int, str, int, str], str] = {}


def unsplit_text(model: Path, prompt: str, tokens: int, sampling: SamplingSettings) -> str:
    """The model's continuation in one process, unsplit, drawn by the host's own sampler."""
    written = model.stat()
    key = (str(model.resolve()), written.st_size, written.st_mtime_ns, prompt, tokens, sampling.model_dump_json())
    if key not in _UNSPLIT_TEXTS:
        engine = open_engine(
            model, [read_manifest(model).n_blocks], ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1)
        )
        try:
            _UNSPLIT_TEXTS[key] = generate(engine, prompt, tokens, sampling).text
        finally:
            engine.close()
    return _UNSPLIT_TEXTS[key]


NEAR_TIE = 1e-3  # of the row's spread: a margin batched rows' rounding can overturn, no wrong history


def unsplit_margin_where_parted(model: Path, prompt: str, text: str) -> float | None:
    """Where a served greedy `text` parts from the unsplit model's, the unsplit row's margin there
    (its best logit less the runner-up, over the row's standard deviation); None where it does not
    part. A replayed history is prefilled in batches where the reference decoded it row by row, so
    a near-tie may go the other way; a wrong history or cache parts at a clear margin."""
    engine = open_engine(
        model, [read_manifest(model).n_blocks], ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1)
    )
    try:
        prompt_tokens = engine.tokenize(prompt)
        row, tokens = engine.step(0, 0, prompt_tokens, decode=False), []
        while len(prompt_tokens) + len(tokens) < 255:
            token = int(np.argmax(row))
            ended = engine.is_end(token)
            written = engine.detokenize(tokens if ended else [*tokens, token])
            if ended and written == text:
                return None
            if ended or not text.startswith(written.rstrip("\ufffd")):
                top = np.sort(row.astype(np.float64))
                return float((top[-1] - top[-2]) / top.std())
            if written == text:
                return None
            tokens.append(token)
            row = engine.step(0, len(prompt_tokens) + len(tokens) - 1, [token], decode=True)
        return None
    finally:
        engine.close()


def unsplit_logprobs(model: Path, prompt: str, tokens: int, sampling: SamplingSettings) -> list[float]:
    """The log probability (log-softmax of the unsplit model's row) of each token the host's
    sampler draws, up to an end-of-generation token: what a split or a head elsewhere must report."""
    engine = open_engine(
        model, [read_manifest(model).n_blocks], ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1)
    )
    sampler = Sampler(sampling, engine.n_vocab())
    try:
        prompt_tokens = engine.tokenize(prompt)
        sampler.accept(prompt_tokens)
        row, out = engine.step(0, 0, prompt_tokens, decode=False), []
        for i in range(tokens):
            token = sampler.sample(row)
            if engine.is_end(token):
                break
            values = row.astype(np.float64)
            peak = values.max()
            out.append(float(values[token] - peak - np.log(np.exp(values - peak).sum())))
            row = engine.step(0, len(prompt_tokens) + i, [token], decode=True)
        return out
    finally:
        sampler.close()
        engine.close()


def check_concurrent_streams(client: openai.OpenAI, model: str, alone: Callable[[str, int], str]) -> None:
    """Four streams batched together each finish, each with its own prompt's continuation.

    Batched decodes take other kernels than one-row ones, so after some tokens a greedy run in
    a batch may break a near-tie the other way (llama.cpp's own server does the same); what must
    hold is that no stream gets another's tokens: each starts as its prompt alone does
    (`alone(prompt, n)`: the first n greedy tokens' text).
    """
    results: dict[str, tuple[str, str | None, int]] = {}
    errors: list[BaseException] = []

    def run(prompt: str) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = list(stream)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
            results[prompt] = (text, finish, usage.completion_tokens if usage else -1)
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == len(PROMPTS), errors
    # The first token's text (less a character it may split). Which cells a stream's rows land in
    # changes how its attention rounds, and caches that other requests left in the shared cache
    # move them: enough to break a near-tie of the random tiny model after a token or two.
    starts = {prompt: alone(prompt, 1).rstrip("\ufffd") for prompt in PROMPTS}
    # And no stream follows another prompt's continuation further than its own: a stream that got
    # another's rows would match that one's text, not part from its own after a near-tie.
    continuations = {prompt: alone(prompt, 16) for prompt in PROMPTS}
    for prompt, (text, finish, tokens) in results.items():
        assert finish == "length" and tokens == 16, prompt
        assert text.startswith(starts[prompt]), prompt
        own = _shared_start(text, continuations[prompt])
        for other in PROMPTS:
            if other != prompt:
                assert _shared_start(text, continuations[other]) <= own, (prompt, text, other)


def _shared_start(a: str, b: str) -> int:
    """How many characters two texts begin with in common, leaving out the replacement characters
    of bytes that are no text alone: a stream decodes them piece by piece, and many a tiny model's
    continuations start with some."""
    a, b = a.replace("\ufffd", ""), b.replace("\ufffd", "")
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@contextmanager
def serving_in_thread(serving: Availability, context: int, config: ApiConfig | None = None) -> Iterator[str]:
    """The real API app on uvicorn, on a free loopback port, in a thread with its own event loop;
    yields its base URL. The caller owns the engine behind `serving`."""
    import uvicorn

    app = create_app(serving, config or ApiConfig(model_id="tiny", context_per_sequence=context))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextmanager
def engine_served(
    engine: Engine, concurrency: int, batch_rows: int, context: int, config: ApiConfig | None = None
) -> Iterator[tuple[str, Availability]]:
    """`engine` behind its engine loop and the real API app, as `kafila host` serves it; yields
    the base URL and the `Availability` the API reads. `config`: the API's (a model id, a key),
    else "tiny" with no key. The loop stops and the engine closes at the end."""
    loop = EngineLoop(engine, concurrency=concurrency, batch_rows=batch_rows, context_per_sequence=context)
    loop.start()
    serving = Availability()
    serving.become_ready(engine, loop, "llama")
    try:
        with serving_in_thread(serving, context, config) as base_url:
            yield base_url, serving
    finally:
        loop.stop()
        engine.close()
