"""A client that hangs up while its ring is broken is not served on the next ring: not while the
broken loop still holds its request, nor once the session has taken it to wait for the new ring.
A client that stays, its answer begun, gets the rest on the new ring, as an unbroken run would
write it. The real API server, engine loops and llama.cpp; the ring is a real local ring whose
stage process is stopped (SIGSTOP) while the requests come in, then killed (SIGKILL), as a member
dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
from serving_checks import engine_served, unsplit_greedy
from tiny_models import write_tiny_model
from waiting import until

from kafila.runtime.engine.engines import RingEngine
from kafila.runtime.engine.local_ring import LocalRing, open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.engine_loop import EngineLoop

PROMPT = "the quick brown fox"
SETTINGS = ContextSettings(n_ctx=256 * 4, n_batch=64, n_seq_max=4, n_threads=1)
CONTEXT = 256
TOKENS = 200  # long enough that the first stream is mid-answer when its ring stalls


def test_a_client_that_hangs_up_while_its_ring_is_broken_is_not_carried_to_the_next(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    ring_engine = open_engine(model, [1, 1], SETTINGS, cache_dir=tmp_path / "stages")  # block 0 in its own process
    assert isinstance(ring_engine, RingEngine) and isinstance(ring_engine.ring, LocalRing)
    (worker,) = ring_engine.ring.workers
    stage = worker.process
    with engine_served(ring_engine, 3, SETTINGS.n_batch, CONTEXT) as (base_url, serving):
        assert serving.ring is not None
        broken = serving.ring.loop
        assert broken is not None
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        asked = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        staying = iter(client.completions.create(**asked))  # type: ignore[call-overload]
        begun = next(staying).choices[0].text  # it has part of its answer when the ring stalls
        assert begun
        os.kill(stage.pid, signal.SIGSTOP)  # the ring stalls: every request is held by the loop
        early, late = (client.completions.create(**asked) for _ in range(2))  # type: ignore[call-overload]
        until(lambda: broken.running + broken.queued == 3, "the stalled loop holds all three requests")
        assert broken.error is None
        os.kill(stage.pid, signal.SIGKILL)  # the member dies
        until(lambda: broken.error is not None, "the ring broke")
        assert stage.wait(timeout=30) == -signal.SIGKILL
        assert "blocks 0-0" in (broken.error or "") and "SIGKILL" in (broken.error or ""), broken.error

        early.close()  # while the broken loop holds it
        until(lambda: len(serving.gone) == 1, "the server saw the first client leave")
        held = broken.take_suspended()  # as the session does, to wait for the next ring
        assert len(held) == 2

        late.close()  # while the session holds it
        until(lambda: len(serving.gone) == 2, "the server saw the second client leave")
        wanted = serving.still_wanted(held)
        assert len(wanted) == 1 and not serving.gone

        engine = open_engine(model, [2], SETTINGS)
        loop = EngineLoop(engine, 3, SETTINGS.n_batch, CONTEXT)
        loop.start()
        try:
            loop.resume(wanted)
            serving.become_ready(engine, loop, "llama")
            text = begun + "".join(chunk.choices[0].text for chunk in staying if chunk.choices)
            assert text == unsplit_greedy(model, PROMPT, TOKENS)  # resumed where it stood, as if unbroken
            until(lambda: loop.stats.finished == 1 and loop.running == 0, "the new ring is idle")
        finally:
            loop.stop()
            engine.close()
