"""A ring that breaks while the engine loop launches its next wave: the tokens the wave before it
made have been drawn, and go with their request to the next ring, so their text must reach the
client first. The engine loop launches the next wave before it delivers a landed wave's text
(the delivery then overlaps the trip); a break in between (the host, seeing a member's link go
down, suspends the loop while the launch waits on it) must not drop that text. Real llama.cpp,
a real engine loop; the launch is held, as a send to a stopped member is."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from serving_checks import unsplit_greedy
from tiny_models import write_tiny_model
from waiting import until

from kafila.runtime.engine.engines import Engine, EngineStep, Launched, UnsplitEngine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.batcher import Finished, Job, RequestEvent, TextDelta
from kafila.serving.engine_loop import EngineLoop

PROMPT = "the quick brown fox"
TOKENS = 60
SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1)


class HeldLaunch:
    """The real engine, but its `held`-th launch waits until released: a wave that cannot leave."""

    def __init__(self, engine: Engine, held: int) -> None:
        self.engine, self.held, self.launches = engine, held, 0
        self.waiting, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def launch(self, steps: Sequence[EngineStep]) -> Launched:
        self.launches += 1
        if self.launches == self.held:
            self.waiting.set()
            self.release.wait(60)
        return self.engine.launch(steps)


def test_the_text_of_tokens_made_before_a_break_reaches_the_client_once(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    engine = UnsplitEngine(model, SETTINGS)
    held = HeldLaunch(engine, held=8)  # a decode wave's launch, after the one before it landed
    text: list[str] = []
    ended: list[RequestEvent] = []

    def sink(event: RequestEvent) -> None:
        if isinstance(event, TextDelta):
            text.append(event.text)
        else:
            ended.append(event)

    broken = EngineLoop(held, 1, SETTINGS.n_batch, 256)  # type: ignore[arg-type]
    broken.start()
    broken.submit(Job("a", engine.tokenize(PROMPT), TOKENS, SamplingSettings()), sink)
    assert held.waiting.wait(60), "the loop never launched its held wave"
    halting = threading.Thread(target=broken.halt)  # as the host retires a ring whose member went
    halting.start()
    broken.suspend("a member's link went down")
    (left,) = broken.take_suspended()
    assert left[0].generated  # it had made tokens, which the next ring replays
    held.release.set()
    halting.join(timeout=60)
    assert not halting.is_alive()
    engine.forget(0)  # the next ring's caches start empty

    again = EngineLoop(engine, 1, SETTINGS.n_batch, 256)
    again.start()
    try:
        again.resume([left])
        until(lambda: bool(ended), "the request ends on the next loop")
    finally:
        again.stop()
        engine.close()
    assert isinstance(ended[0], Finished), ended
    assert "".join(text) == unsplit_greedy(model, PROMPT, TOKENS)
