"""A client that hangs up while its ring is broken is not served on the next ring: not while the
broken loop still holds its request, nor once the session has taken it to wait for the new ring.
A client that stays gets its answer on the new ring, as an unbroken run would write it. The real
API server, engine loops and llama.cpp in this process; only the ring's break is staged."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import openai
from serving_checks import engine_served, unsplit_greedy
from tiny_models import write_tiny_model
from waiting import until

from kafila.runtime.engine.engines import Engine, Launched, StepResult
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.ring import StageFailed
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.engine_loop import EngineLoop

PROMPT = "the quick brown fox"
SETTINGS = ContextSettings(n_ctx=256 * 4, n_batch=64, n_seq_max=4, n_threads=1)
CONTEXT = 256


class BreakingRing:
    """The real engine, whose ring waits for `go` and then breaks after `lands` landings, as a
    ring does when a member dies."""

    def __init__(self, engine: Engine, lands: int) -> None:
        self._engine = engine
        self.go = threading.Event()
        self.lands = lands

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def land(self, launched: Launched) -> list[StepResult]:
        self.go.wait(timeout=60)
        if self.lands <= 0:
            raise StageFailed("member-1 is gone")
        self.lands -= 1
        return self._engine.land(launched)


def test_a_client_that_hangs_up_while_its_ring_is_broken_is_not_carried_to_the_next(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    ring = BreakingRing(open_engine(model, [2], SETTINGS), lands=3)
    with engine_served(ring, 3, SETTINGS.n_batch, CONTEXT) as (base_url, serving):  # type: ignore[arg-type]
        assert serving.ring is not None
        broken = serving.ring.loop
        assert broken is not None
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        asked = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        early, late, staying = (client.completions.create(**asked) for _ in range(3))  # type: ignore[call-overload]
        ring.go.set()
        until(lambda: broken.error is not None, "the ring broke")

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
            text = "".join(chunk.choices[0].text for chunk in staying if chunk.choices)
            assert text == unsplit_greedy(model, PROMPT, 40)
            until(lambda: loop.stats.finished == 1 and loop.running == 0, "the new ring is idle")
        finally:
            loop.stop()
            engine.close()
