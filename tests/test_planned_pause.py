"""A request that comes while the host replans by choice (taking in newcomers, rebalancing) waits
for the new ring instead of being turned away; a replan that fails, or a pause past its bound,
ends it with OpenAI's 503. The real API server, engine loop and llama.cpp, in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import openai
import pytest
from serving_checks import engine_served, unsplit_greedy
from tiny_models import write_tiny_model
from waiting import until

from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.engine_loop import EngineLoop
from kafila.session.availability import Availability

PROMPT = "the quick brown fox"
SETTINGS = ContextSettings(n_ctx=256 * 2, n_batch=64, n_seq_max=2, n_threads=1)


@dataclass
class Served:
    serving: Availability
    base_url: str
    engine: Engine
    loop: EngineLoop

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=60)

    def held(self) -> float:
        with urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith("kafila_requests_held_total")))

    def until_held(self, count: float = 1.0, timeout: float = 30.0) -> None:
        """Until the server counts `count` requests held for the replan (they wait, not turned away)."""
        until(lambda: self.held() >= count, "a request held for the replan", timeout)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pause") / "tiny.gguf", "llama", n_blocks=2)


@pytest.fixture
def served(model: Path) -> Iterator[Served]:
    engine = open_engine(model, [2], SETTINGS)
    with engine_served(engine, 2, SETTINGS.n_batch, 256) as (base_url, serving):
        assert serving.ring is not None
        yield Served(serving, base_url, engine, serving.ring.loop)


def in_background(served: Served) -> tuple[threading.Thread, dict[str, object]]:
    """A greedy completion sent from another thread; its text or its error lands in the dict."""
    outcome: dict[str, object] = {}

    def ask() -> None:
        try:
            reply = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
            outcome["text"] = reply.choices[0].text
        except openai.APIStatusError as error:
            outcome["error"] = error

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, outcome


def test_a_request_during_a_planned_replan_waits_and_is_served_by_the_new_ring(served: Served, model: Path) -> None:
    served.serving.become_unready(["the host to divide the blocks again"], paused=True)
    thread, outcome = in_background(served)
    served.until_held()
    assert thread.is_alive() and not outcome, outcome  # waiting, not turned away
    served.serving.become_ready(served.engine, served.loop, "llama")  # the replan is done
    thread.join(timeout=60)
    assert outcome.get("text") == unsplit_greedy(model, PROMPT, 8), outcome
    assert served.held() == 1.0


def test_a_planned_replan_that_fails_ends_the_waiting_request_with_its_reason(served: Served) -> None:
    served.serving.become_unready(["the host to replan, taking in newcomer"], paused=True)
    thread, outcome = in_background(served)
    served.until_held()
    assert thread.is_alive() and not outcome, outcome
    served.serving.become_unready([], failure="replanning failed: newcomer cannot hold its share")
    thread.join(timeout=60)
    error = outcome.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, outcome
    assert "cannot serve: replanning failed: newcomer cannot hold its share" in error.message


def test_a_pause_past_its_bound_turns_the_request_away_and_one_not_planned_at_once(served: Served) -> None:
    served.serving.pause_wait_s = 0.5
    served.serving.become_unready(["the host to divide the blocks again"], paused=True)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as waited:
        served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert waited.value.status_code == 503 and time.monotonic() - started >= 0.5
    assert "not ready yet: waiting for the host to divide the blocks again" in waited.value.message
    assert served.held() == 1.0
    served.serving.become_unready(["the host to replan with the members that are left"])  # a break: no wait
    with pytest.raises(openai.APIStatusError) as refused:
        served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert refused.value.status_code == 503 and "members that are left" in refused.value.message
    assert served.held() == 1.0


@contextmanager
def request_held_in_its_tokenizer(served: Served) -> Iterator[Callable[[], dict[str, object]]]:
    """A greedy request started and held inside the engine's tokenizer (long prompts are
    tokenized off the event loop, so the window is real). Calling what this yields lets it go on,
    with the tokenizer as it was, and returns its outcome."""
    entered, release = threading.Event(), threading.Event()
    tokenize = served.engine.tokenize

    def held_tokenize(text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        entered.set()
        release.wait(30)
        return tokenize(text, add_special, parse_special)

    served.engine.tokenize = held_tokenize  # type: ignore[method-assign]
    thread, outcome = in_background(served)
    assert entered.wait(30)

    def go_on() -> dict[str, object]:
        release.set()
        thread.join(timeout=60)
        return outcome

    try:
        yield go_on
    finally:
        served.engine.tokenize = tokenize  # type: ignore[method-assign]
        release.set()


@contextmanager
def new_loop(engine: Engine) -> Iterator[EngineLoop]:
    """The loop a replan starts over its new ring."""
    loop = EngineLoop(engine, concurrency=2, batch_rows=SETTINGS.n_batch, context_per_sequence=256)
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()


def test_a_request_that_took_the_engine_just_before_a_replan_stopped_it_runs_on_the_new_ring(
    served: Served, model: Path
) -> None:
    """The window between a request taking the engine and queueing its job: the host pauses,
    stops the old loop and serves from a new one meanwhile. The request runs on the new loop,
    not refused as if the host were shutting down."""
    with request_held_in_its_tokenizer(served) as go_on:
        served.serving.become_unready(["the host to divide the blocks again"], paused=True)
        served.loop.stop()  # as a planned replan stops the old ring's loop
        with new_loop(served.engine) as loop:
            served.serving.become_ready(served.engine, loop, "llama")
            outcome = go_on()
            assert outcome.get("text") == unsplit_greedy(model, PROMPT, 8), outcome
            assert loop.stats.finished == 1


def test_a_request_whose_engine_closes_under_its_tokenizer_is_tokenized_again_on_the_new_ring(
    served: Served, model: Path
) -> None:
    """The same window, wider: the replan closes the old engine while the request tokenizes on it
    (its tokenizer then raises StageFailed). The request tokenizes again on the new engine and
    runs on the new loop."""
    with request_held_in_its_tokenizer(served) as go_on:
        served.serving.become_unready(["the host to divide the blocks again"], paused=True)
        served.loop.stop()
        served.engine.close()
        new_engine = open_engine(model, [2], SETTINGS)
        try:
            with new_loop(new_engine) as loop:
                served.serving.become_ready(new_engine, loop, "llama")
                outcome = go_on()
                assert outcome.get("text") == unsplit_greedy(model, PROMPT, 8), outcome
                assert loop.stats.finished == 1
        finally:
            new_engine.close()


def test_the_official_clients_retries_wait_out_a_session_getting_ready_and_stop_where_it_cannot_serve(
    served: Served, model: Path
) -> None:
    """A 503 says `Retry-After` while the session gets ready or replans after a break, and the
    official client's default two retries, waiting that long, reach the ring once it is back (its
    own backoff alone would have given up after about 1.5 s). A session that cannot serve says
    `x-should-retry: false`, and the client gives up at once. The client's own answers are
    counted (an event hook on its HTTP client), and the ring comes back on the second refusal."""
    from kafila.api.errors import RETRY_AFTER_S

    answers: list[int] = []  # the status of each answer the client got, retries included

    def answered(response: Any) -> None:
        answers.append(response.status_code)
        if answers == [503, 503]:  # turned away twice: the ring comes back before the client's third try
            served.serving.become_ready(served.engine, served.loop, "llama")

    http = openai.DefaultHttpxClient(event_hooks={"response": [answered]})
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", timeout=60, http_client=http)
    served.serving.become_unready(["the host to replan with the members that are left"])
    with pytest.raises(openai.APIStatusError) as refused:
        client.with_options(max_retries=0).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == str(RETRY_AFTER_S)

    answers.clear()
    started = time.monotonic()
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)  # max_retries: 2
    assert reply.choices[0].text == unsplit_greedy(model, PROMPT, 8)
    assert answers == [503, 503, 200]
    assert time.monotonic() - started >= 2 * RETRY_AFTER_S - 0.1  # each retry waited as told

    served.serving.become_unready([], failure="the model does not fit: every member is too small")
    answers.clear()
    with pytest.raises(openai.APIStatusError) as final:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert final.value.status_code == 503 and final.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in final.value.response.headers
    assert answers == [503]  # no retry
