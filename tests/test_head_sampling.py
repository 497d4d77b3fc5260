"""A head on a member samples the requests that need the whole row of logits itself.

Such a request (top_k 0 with a temperature, or a penalty that raises logits) would otherwise
send the host its whole row every token: 1 MiB for a 262k vocabulary. The host starts the
request's sampler on the head with a SAMPLER frame (settings, seed and prompt), and the head
answers each step with the chosen token alone. These tests run the real ring (worker processes,
llama.cpp) and check that the tokens are exactly those the host's own sampler draws from the
whole row, and that a start that cannot be honoured fails its request alone, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from kafila.runtime.engine.engines import EngineStep
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.sampling import Sampler, SamplerStart, SamplingSettings, TokenChosenOnHead
from kafila.runtime.engine.stage import HeadStage
from kafila.runtime.engine.worker import handle_frames
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.wire.frames import SAMPLE_ON_HEAD, Frame, FrameDecoder, FrameError, Kind

SETTINGS = ContextSettings(n_ctx=4 * 64, n_batch=64, n_seq_max=4, n_threads=1)
PROMPTS = ["the quick brown fox", "hello world", "a model of the world", "write in small letters"]
STEPS = 12
# Each needs the whole row: a plain draw at a temperature; a greedy pick after a penalty that
# raises logits; a draw with penalties, top_p and a low temperature; and a draw held to a grammar
# (structured output), whose sampler needs the model's vocabulary, on the member that holds the head.
WHOLE_ROW = [
    SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, seed=7),
    SamplingSettings(temperature=0.0, presence_penalty=-1.5, seed=1),
    SamplingSettings(temperature=0.6, top_k=0, top_p=0.9, frequency_penalty=0.5, presence_penalty=-0.5, seed=42),
    SamplingSettings(temperature=1.0, seed=5, grammar="root ::= [a-z ]+"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("head_sampling") / "tiny.gguf", "llama", n_blocks=4)


def sampled_here(model: Path, prompt: list[int], settings: SamplingSettings) -> list[int]:
    """The reference: the unsplit model, and the host's sampler on the whole row."""
    engine = open_engine(model, [4], SETTINGS)
    sampler = Sampler(settings, engine.n_vocab(), engine.llama_model.vocab)
    try:
        sampler.accept(prompt)
        out = [sampler.sample(engine.step(0, 0, prompt, decode=False))]
        for _ in range(STEPS - 1):
            out.append(sampler.sample(engine.step(0, len(prompt) + len(out) - 1, out[-1:], decode=True)))
        return out
    finally:
        sampler.close()
        engine.close()


def test_settings_that_need_the_whole_row_are_the_ones_sampled_on_the_head() -> None:
    assert all(s.needs_whole_row for s in WHOLE_ROW)
    assert not SamplingSettings(temperature=0.0).needs_whole_row  # greedy: the argmax alone
    assert not SamplingSettings(temperature=1.0, top_k=40, frequency_penalty=1.0).needs_whole_row  # top k + window
    assert SamplingSettings(temperature=1.0, top_k=40, repeat_last_n=70000, repeat_penalty=1.1).top_logits == 0
    assert max(SamplingSettings(temperature=1.0, top_k=k).top_logits for k in (65533, 65534, 65535)) < SAMPLE_ON_HEAD


def test_a_head_on_the_ring_samples_as_the_host_would(model: Path, tmp_path: Path) -> None:
    """Three requests at once, each started on the head and sampled there, in waves beside a
    greedy one: every token equals what the host's sampler draws from the whole row, and only
    the chosen token comes back."""
    remote = local_ring_engine(cached_slices(model, [2, 1, 1], tmp_path), SETTINGS, model=model)
    try:
        prompts = [remote.tokenize(p) for p in PROMPTS]
        expected = [sampled_here(model, p, s) for p, s in zip(prompts, WHOLE_ROW, strict=True)]
        samplers = [remote.sampler(s) for s in WHOLE_ROW]
        assert all(isinstance(s, TokenChosenOnHead) for s in samplers)
        assert isinstance(remote.sampler(SamplingSettings(temperature=0.7, top_k=5)), Sampler)
        outs: list[list[int]] = [[] for _ in WHOLE_ROW]
        for _ in range(STEPS):
            waves = []
            for s, (prompt, settings) in enumerate(zip(prompts, WHOLE_ROW, strict=True)):
                if not outs[s]:
                    start = SamplerStart(settings=settings, prompt=prompt)
                    step = EngineStep(s, 0, prompt, decode=False, top=settings.top_logits, sampler=start)
                else:
                    step = EngineStep(s, len(prompt) + len(outs[s]) - 1, outs[s][-1:], decode=True, top=0)
                waves.append(remote.launch([step]))  # one wave per request, all out at once
            for s, wave in enumerate(waves):
                (row,) = remote.land(wave)
                assert isinstance(row, np.ndarray) and np.isfinite(row).sum() == 1  # the chosen token alone
                outs[s].append(samplers[s].sample(row))
        assert outs == expected
        assert set(remote.detokenize(outs[3])) <= set("abcdefghijklmnopqrstuvwxyz ")  # the grammar held
        # A slot forgotten and reused by a greedy request: the head no longer samples it.
        remote.forget(0)
        (row,) = remote.step_many([EngineStep(0, 0, prompts[1], decode=False, top=1)])
        assert isinstance(row, np.ndarray) and np.isfinite(row).sum() == 1
    finally:
        remote.close()


def test_a_start_the_head_cannot_honour_fails_its_request_alone(model: Path, tmp_path: Path) -> None:
    """On the head itself (the code a member runs): a malformed start, a prompt outside the
    vocabulary and a row asked to be sampled with no start are each refused on their sequence,
    with the reason, while a good start on another sequence is sampled; nothing answers a start."""
    head_file = cached_slices(model, [3, 1], tmp_path)[-1]
    head = HeadStage(head_file.path, SETTINGS)
    try:
        prompt = [1, 5, 9, 4]
        states = np.zeros((len(prompt), head.hidden), np.float32)
        good = SamplerStart(settings=WHOLE_ROW[0], prompt=prompt)
        outside = SamplerStart(settings=WHOLE_ROW[0], prompt=[head.model.n_vocab + 3])
        frames = [
            Frame(Kind.SAMPLER, 0, payload=good.payload()),
            Frame(Kind.SAMPLER, 1, payload=b'{"settings": {"temperature": "hot"}, "prompt": []}'),
            Frame(Kind.SAMPLER, 2, payload=outside.payload()),
            *(Frame.of_hidden(Kind.PREFILL, s, 0, states, top=SAMPLE_ON_HEAD) for s in range(4)),
        ]
        out = handle_frames(head, frames)
        assert [(f.kind, f.sequence_id) for f in out] == [(Kind.LOGITS, 0)] + [(Kind.ERROR, s) for s in (1, 2, 3)]
        assert np.isfinite(out[0].logits()).sum() == 1
        assert "its sampler could not start" in out[1].text() and "temperature" in out[1].text()
        assert "outside this model" in out[2].text()
        assert "no sampler was started" in out[3].text()
        head.forget(0)  # a CANCEL stops the sampler with the sequence
        (after,) = handle_frames(head, [Frame.of_hidden(Kind.PREFILL, 0, 0, states, top=SAMPLE_ON_HEAD)])
        assert after.kind is Kind.ERROR and "no sampler was started" in after.text()
    finally:
        head.close()


def test_sampler_frames_are_checked_at_the_boundary() -> None:
    start = SamplerStart(settings=WHOLE_ROW[2], prompt=[3, 1, 4])
    frame = Frame(Kind.SAMPLER, 5, payload=start.payload())
    (decoded,) = FrameDecoder().feed(frame.encode())
    assert decoded == frame and SamplerStart.from_payload(decoded.payload) == start
    choice = Frame.of_choice(5, 9, 17, 2.5, 100)
    (back,) = FrameDecoder().feed(choice.encode())
    row = back.logits()
    assert row.shape == (100,) and int(np.argmax(row)) == 17 and row[17] == 2.5 and np.isfinite(row).sum() == 1
    bad_headers = [
        Frame(Kind.SAMPLER, 5, n_tokens=1, payload=b"{}"),  # a start carries no tensor
        Frame(Kind.SAMPLER, 5, payload=b"x" * ((1 << 23) + 1)),  # too large to be a start
    ]
    for bad in bad_headers:
        with pytest.raises(FrameError):
            FrameDecoder().feed(bad.encode())
    for payload in (b"", b"[]", b'{"settings": {}, "prompt": [-1]}', b'{"settings": {}, "prompt": [], "x": 1}'):
        with pytest.raises(ValueError):
            SamplerStart.from_payload(payload)
