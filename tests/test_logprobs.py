"""Log probabilities on /v1/completions and /v1/chat/completions, through the official client.

A tiny model is served unsplit, as a two-stage ring with the head on the host, and as a ring
whose head is on a member (a worker process that sends the host its top entries or the token it
drew, with the row's log-sum-exp and top alternatives). Every value must be the log-softmax of
the unsplit model's logits for the same tokens, the alternatives sorted and holding the chosen
token wherever it is among them; bad values get a 400.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import openai
import pytest
from serving_checks import engine_served
from tiny_models import write_tiny_model

from kafila.api.openai_replies import TextOffsets
from kafila.api.schemas import ChatRequest
from kafila.runtime.engine.engines import Engine, RingEngine, prefix_cut_of
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.logprobs import HeadRow, token_logprob
from kafila.runtime.engine.sampling import Sampler, SamplingSettings, TokenChosenOnHead
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.session.availability import Availability
from kafila.wire.frames import (
    LOGPROBS_FLAG,
    NO_LOGPROBS,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
    top_ids,
)

CONTEXT = 128
SETTINGS = ContextSettings(n_ctx=2 * CONTEXT, n_batch=64, n_seq_max=2, n_threads=1)
TOLERANCE = 2e-3  # a split ring sums in another order than the unsplit model
TOKENS = 6
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
# Greedy (a head on a member sends the top entry), a top-k draw (its top 40) and a draw from the
# whole row (a head on a member draws it itself and sends the chosen token).
CHAT_SAMPLING = [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 5, "extra_body": {"top_k": 40}},
    {"temperature": 1.0, "seed": 11, "top_p": 1.0},
]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("logprobs") / "tiny.gguf", "llama", n_blocks=4)


@pytest.fixture(scope="module")
def whole(model: Path) -> Iterator[Engine]:
    """The reference: the unsplit model in this process."""
    engine = open_engine(model, [4], SETTINGS)
    yield engine
    engine.close()


@dataclass
class Served:
    client: openai.OpenAI
    serving: Availability
    engine: Engine


@pytest.fixture(scope="module", params=["unsplit", "ring", "head on a member"])
def served(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    stages = tmp_path_factory.mktemp("stages")
    if request.param == "unsplit":
        engine = open_engine(model, [4], SETTINGS)
    elif request.param == "ring":
        engine = open_engine(model, [2, 2], SETTINGS, stages)
    else:
        engine = local_ring_engine(cached_slices(model, [2, 2], stages), SETTINGS, prefix_cut_of(model), model=model)
    with engine_served(engine, 2, SETTINGS.n_batch, CONTEXT) as (url, serving):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield Served(client, serving, engine)


def log_softmax(row: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """numpy's own log-softmax of a row, in float64: nothing of the code under test."""
    values = row.astype(np.float64)
    return values - np.logaddexp.reduce(values)


@dataclass(frozen=True)
class Expected:
    token: int
    piece: bytes
    row: npt.NDArray[np.float64]  # the log-softmax of the unsplit model's logits at its position


def reference(whole: Engine, prompt: list[int], settings: SamplingSettings) -> list[Expected]:
    """The tokens the host's sampler draws from the unsplit model's rows, each with its row's log-softmax."""
    sampler = Sampler(settings, whole.n_vocab())
    out: list[Expected] = []
    whole.forget(0)
    try:
        sampler.accept(prompt)
        row = whole.step(0, 0, prompt, decode=False)
        for i in range(TOKENS):
            token = sampler.sample(row)
            if whole.is_end(token):
                break
            out.append(Expected(token, whole.piece(token), log_softmax(row)))
            row = whole.step(0, len(prompt) + i, [token], decode=True)
        return out
    finally:
        sampler.close()
        whole.forget(0)


def check_token(piece: bytes, logprob: float, top: list[tuple[bytes, float]], expected: Expected, k: int) -> None:
    """One token's values against the unsplit model's log-softmax: the chosen one's, then the top
    k in order (compared by value, so that a near-tie may list either token first)."""
    assert piece == expected.piece
    assert math.isclose(logprob, float(expected.row[expected.token]), abs_tol=TOLERANCE)
    values = [v for _, v in top]
    assert len(top) == k and values == sorted(values, reverse=True)
    assert np.allclose(values, np.sort(expected.row)[::-1][:k], atol=TOLERANCE)
    if k and logprob > values[-1] + TOLERANCE:  # among the top k: listed, with the same value
        assert any(p == piece and math.isclose(v, logprob, abs_tol=1e-6) for p, v in top)


def as_text(piece: bytes) -> str:
    """A token as OpenAI writes it: its text, or `bytes:` and its bytes where it is part of a character."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def check_completion(logprobs: object, expected: list[Expected], text: str) -> None:
    assert logprobs is not None
    tokens, values, tops, offsets = (
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset,  # type: ignore[attr-defined]
    )  # fmt: skip
    assert len(tokens) == len(values) == len(tops) == len(offsets) == len(expected) > 0
    for token, value, top, want in zip(tokens, values, tops, expected, strict=True):
        assert token == as_text(want.piece)
        assert math.isclose(value, float(want.row[want.token]), abs_tol=TOLERANCE)
        best = np.sort(want.row)[::-1][:5]
        listed = list(top.values())  # keyed by text: two tokens that read alike are listed once
        assert 0 < len(listed) <= 5 and listed == sorted(listed, reverse=True)
        assert math.isclose(listed[0], best[0], abs_tol=TOLERANCE)
        assert all(np.min(np.abs(best - v)) < TOLERANCE for v in listed)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets, strict=True):
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token)


def test_completions_report_the_models_log_probabilities(served: Served, whole: Engine) -> None:
    prompt = "the quick brown fox"
    expected = reference(whole, served.engine.tokenize(prompt, True, False), SamplingSettings())
    asked = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 5}
    reply = served.client.completions.create(**asked)  # type: ignore[call-overload]
    check_completion(reply.choices[0].logprobs, expected, reply.choices[0].text)

    chunks = [c for c in served.client.completions.create(**asked, stream=True) if c.choices]  # type: ignore[call-overload]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices[0].finish_reason)
    assert [t for s in streamed for t in s.tokens] == reply.choices[0].logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == reply.choices[0].logprobs.text_offset
    values = [v for s in streamed for v in s.token_logprobs]
    assert np.allclose(values, reply.choices[0].logprobs.token_logprobs, atol=1e-6)

    only_chosen = served.client.completions.create(**{**asked, "logprobs": 0})  # type: ignore[call-overload]
    assert only_chosen.choices[0].logprobs.top_logprobs == [{}] * len(expected)


@pytest.mark.parametrize("sampling", CHAT_SAMPLING, ids=["greedy", "top-k draw", "whole-row draw"])
def test_chat_reports_the_models_log_probabilities_streamed_or_not(
    served: Served, whole: Engine, sampling: dict[str, object]
) -> None:
    assert served.serving.ring.template is not None
    rendered = served.serving.ring.template.render(MESSAGES)
    prompt = served.engine.tokenize(rendered.text, not rendered.starts_with_bos, True)
    body = {k: v for k, v in sampling.items() if k != "extra_body"} | dict(sampling.get("extra_body", {}))  # type: ignore[call-overload]
    settings = ChatRequest.model_validate({"model": "tiny", "messages": MESSAGES, **body}).sampling()
    expected = reference(whole, prompt, settings)
    if isinstance(served.engine, RingEngine) and served.engine.head is None and settings.needs_whole_row:
        assert isinstance(served.engine.sampler(settings), TokenChosenOnHead)  # drawn on the member
    for k, stream in ((20, False), (3, True)):
        asked = {"model": "tiny", "messages": MESSAGES, "max_tokens": TOKENS, "logprobs": True, "top_logprobs": k}
        if stream:
            chunks = served.client.chat.completions.create(**asked, **sampling, stream=True)  # type: ignore[call-overload]
            content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        else:
            reply = served.client.chat.completions.create(**asked, **sampling)  # type: ignore[call-overload]
            assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
            content = reply.choices[0].logprobs.content
        assert len(content) == len(expected) > 0
        for item, want in zip(content, expected, strict=True):
            assert bytes(item.bytes or []) == want.piece and item.token == as_text(want.piece)
            top = [(bytes(a.bytes or []), a.logprob) for a in item.top_logprobs]
            check_token(want.piece, item.logprob, top, want, k)


def test_log_probabilities_out_of_range_or_without_logprobs_are_refused(served: Served) -> None:
    client = served.client
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="a", max_tokens=1, logprobs=6)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="a", max_tokens=1, logprobs=-1)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="a", max_tokens=1, extra_body={"logprobs": True})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=False, top_logprobs=2)  # type: ignore[arg-type]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


# --- the pure parts ---------------------------------------------------------------------------


def test_a_head_rows_summary_gives_the_values_the_whole_row_gives() -> None:
    """What a head on a member sends (the chosen token alone, the log-sum-exp, the top k) yields
    the same log probabilities as the whole row on the host."""
    rng = np.random.default_rng(3)
    row = rng.standard_normal(500).astype(np.float32) * 4
    row[[7, 9]] = row.max() + 1.0  # a tie at the top: the lower id first
    piece = str.encode
    for token in (7, int(np.argmin(row)), 123):
        chosen = np.full_like(row, -np.inf)
        chosen[token] = row[token]
        sent = FrameDecoder().feed(Frame.of_choice(1, 2, token, row[token], 500).with_logprobs(row, 4).encode())[0]
        trailer = sent.logprob_trailer()
        assert trailer is not None and sent.logprobs == 4
        from_head = token_logprob(HeadRow(sent.logits(), *trailer), token, 4, lambda t: piece(str(t)))
        here = token_logprob(row, token, 4, lambda t: piece(str(t)))
        assert [a.token for a in here.top] == [7, 9, *top_ids(row, 4)[2:].tolist()]
        assert [a.token for a in from_head.top] == [a.token for a in here.top]
        assert math.isclose(from_head.logprob, here.logprob, abs_tol=1e-5)
        assert np.allclose([a.logprob for a in from_head.top], [a.logprob for a in here.top], atol=1e-5)
        assert math.isclose(here.logprob, float(log_softmax(row)[token]), abs_tol=1e-6)


def test_logprob_flags_and_trailers_are_checked_on_receipt() -> None:
    row = np.arange(50, dtype=np.float32)
    good = Frame.of_logits(1, 0, row, top=3).with_logprobs(row, 2)
    decoded = FrameDecoder().feed(good.encode())[0]
    assert decoded.logprobs == 2 and np.array_equal(decoded.logits()[[47, 48, 49]], [47, 48, 49])
    hidden = Frame.of_hidden(Kind.DECODE, 1, 0, np.zeros((1, 4)), logprobs=20)
    assert FrameDecoder().feed(hidden.encode())[0].logprobs == 20
    assert FrameDecoder().feed(Frame.of_hidden(Kind.DECODE, 1, 0, np.zeros((1, 4))).encode())[0].logprobs == NO_LOGPROBS
    with pytest.raises(ValueError, match="logprobs 21"):
        Frame.of_hidden(Kind.DECODE, 1, 0, np.zeros((1, 4)), logprobs=21)

    def refused(frame: Frame, flags: int) -> None:
        data = bytearray(frame.encode())
        data[5] = flags  # the header's flags byte: after magic, version, kind and dtype
        with pytest.raises(FrameError):
            FrameDecoder().feed(bytes(data))

    refused(hidden, LOGPROBS_FLAG | 21)  # more than 20 alternatives
    refused(hidden, 0x01)  # a flag this protocol does not define
    refused(Frame(Kind.CANCEL, 1), LOGPROBS_FLAG | 1)  # on a frame that carries no row
    refused(Frame.of_logits(1, 0, row, top=3), LOGPROBS_FLAG | 20)  # no trailer that long
    bad_id = bytearray(good.payload)
    bad_id[-4 * 2 - 4 * 2 : -4 * 2 - 4] = np.int32(50).tobytes()  # an alternative outside the vocabulary
    with pytest.raises(FrameError, match="outside"):
        FrameDecoder().feed(Frame(Kind.LOGITS, 1, 0, 3, 50, good.dtype, bytes(bad_id), logprobs=2).encode())[
            0
        ].logprob_trailer()
    too_likely = bytearray(good.payload)
    too_likely[-4 * 2 :] = np.array([1e6, 1e6], dtype=np.float32).tobytes()
    with pytest.raises(FrameError, match="exceed"):
        Frame(Kind.LOGITS, 1, 0, 3, 50, good.dtype, bytes(too_likely), logprobs=2).logprob_trailer()


def test_text_offsets_point_at_each_tokens_text_whatever_bytes_came_before() -> None:
    """A stray byte turns into a replacement character only once the next byte shows it is no
    character: a whole token after it still points at its own text."""
    offsets = TextOffsets()
    pieces = [b"\xf4", b"\xf4", b"P", b"ab", "é".encode()[:1], "é".encode()[1:], b"c"]
    text = b"".join(pieces).decode("utf-8", errors="replace")
    found = [offsets.next(p) for p in pieces]
    assert text == "\ufffd\ufffdPabéc"
    assert found == [0, 1, 2, 3, 5, 5, 6]
