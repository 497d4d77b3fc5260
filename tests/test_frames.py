"""The activation frame codec: round trips, streaming, and every kind of malformed input."""

from __future__ import annotations

import struct

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.wire.frames import (
    CONTROL_SEQUENCE_BASE,
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    DType,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
    is_control_sequence,
    largest,
    top_ids,
)


def test_hidden_states_round_trip_in_f32_and_f16() -> None:
    states = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for dtype in (DType.F32, DType.F16):
        frame = Frame.of_hidden(Kind.PREFILL, 7, 12, states, dtype)
        (decoded,) = FrameDecoder().feed(frame.encode())
        assert (decoded.kind, decoded.sequence_id, decoded.position, decoded.n_tokens, decoded.hidden) == (
            Kind.PREFILL, 7, 12, 3, 64,
        )  # fmt: skip
        expected = states if dtype is DType.F32 else states.astype(np.float16).astype(np.float32)
        assert np.array_equal(decoded.hidden_states(), expected)


def test_header_is_32_bytes_little_endian() -> None:
    frame = Frame.of_tokens(5, 9, [1, 2, 3])
    raw = frame.encode()
    assert HEADER_SIZE == 32 and raw[:2] == b"KF" and raw[2] == 1 and raw[3] == Kind.RESULT
    assert struct.unpack_from("<Q", raw, 8)[0] == 5 and struct.unpack_from("<I", raw, 16)[0] == 9
    assert FrameDecoder().feed(raw)[0].tokens() == [1, 2, 3]


def test_frames_arrive_in_any_pieces() -> None:
    frames = [Frame.of_hidden(Kind.DECODE, i, i, np.full((1, 8), i, dtype=np.float32)) for i in range(5)] + [
        Frame(Kind.CANCEL, 3),
        Frame(Kind.PING, 0, payload=b'{"stages": []}'),
    ]
    stream = b"".join(f.encode() for f in frames)
    decoder = FrameDecoder()
    received = []
    for i in range(0, len(stream), 7):
        received += decoder.feed(stream[i : i + 7])
    assert received == frames and decoder.pending_bytes == 0


def _header(**fields: int | bytes) -> bytes:
    values = {
        "magic": b"KF",
        "version": 1,
        "kind": 2,
        "dtype": 1,
        "seq": 0,
        "pos": 0,
        "n": 1,
        "hidden": 4,
        "length": 16,
    }
    values.update(fields)  # type: ignore[arg-type]
    v = values
    return HEADER.pack(
        v["magic"], v["version"], v["kind"], v["dtype"], 0, 0, v["seq"], v["pos"], v["n"], v["hidden"], v["length"]
    )


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (_header(magic=b"XX"), "bad magic"),
        (_header(version=9), "version 9"),
        (_header(kind=42), "42"),
        (_header(dtype=9), "9"),
        (_header(length=MAX_PAYLOAD + 1), "exceeds"),
        (_header(n=1 << 20), "exceeds the limits"),
        (_header(length=15), "does not hold 1 x 4"),
        (_header(dtype=3), "f32 or f16"),
        (_header(n=0, length=0), "at least one token"),
        (_header(kind=3, dtype=3, n=2, length=4), "2 token ids"),
        (_header(kind=8, n=2, hidden=4, length=32), "one f32 row"),
        (_header(kind=8, dtype=2, hidden=4, length=8), "one f32 row"),
        (_header(kind=8, hidden=4, length=12), "4 f32 logits"),
        (_header(kind=8, hidden=(1 << 21) + 1, length=4 * ((1 << 21) + 1)), "exceeds the limits"),
        (_header(kind=2, hidden=(1 << 16) + 1, length=4 * ((1 << 16) + 1)), "exceeds the limits"),
    ],
)
def test_malformed_headers_are_refused_before_the_payload(header: bytes, message: str) -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match=message):
        decoder.feed(header)  # no payload sent: the header alone must be judged
    with pytest.raises(FrameError):
        decoder.feed(Frame(Kind.PING, 0).encode())  # a broken stream stays broken


def test_a_logits_row_of_a_large_vocabulary_round_trips_exactly() -> None:
    """A head on a member sends the host a row per step: wider than any hidden state (gemma's
    vocabulary has 262,144 entries), and in f32, so a greedy pick cannot change on the way."""
    row = np.random.default_rng(1).standard_normal(262_144).astype(np.float32)
    frame = Frame.of_logits(9, 40, row)
    (decoded,) = FrameDecoder().feed(frame.encode())
    assert (decoded.kind, decoded.sequence_id, decoded.position, decoded.n_tokens, decoded.hidden) == (
        Kind.LOGITS, 9, 40, 1, 262_144,
    )  # fmt: skip
    assert np.array_equal(decoded.logits(), row) and decoded.logits().flags.writeable


def test_asking_the_wrong_thing_of_a_frame() -> None:
    with pytest.raises(FrameError):
        Frame(Kind.DECODE, 0).logits()
    with pytest.raises(FrameError):
        Frame(Kind.PING, 0).hidden_states()
    with pytest.raises(FrameError):
        Frame(Kind.CANCEL, 0).tokens()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 64))
def test_random_bytes_never_crash_the_decoder(data: bytes, chunk: int) -> None:
    decoder = FrameDecoder()
    try:
        for i in range(0, len(data), chunk):
            for frame in decoder.feed(data[i : i + chunk]):
                assert frame.kind in Kind
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(1, 16), st.integers(1, 16), st.data())
def test_truncated_valid_frames_wait_for_the_rest(seq: int, pos: int, n: int, hidden: int, data: st.DataObject) -> None:
    frame = Frame.of_hidden(Kind.PREFILL, seq, pos, np.ones((n, hidden), dtype=np.float32))
    raw = frame.encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    decoder = FrameDecoder()
    assert decoder.feed(raw[:cut]) == []
    assert decoder.feed(raw[cut:]) == [frame]


def test_file_chunks_round_trip_only_in_the_control_range() -> None:
    frame = Frame(Kind.FILE, CONTROL_SEQUENCE_BASE + 3, 41, payload=b"\x00\xffraw bytes")
    (decoded,) = FrameDecoder().feed(frame.encode())
    assert decoded == frame and is_control_sequence(decoded.sequence_id)
    with pytest.raises(FrameError, match="outside the control range"):
        FrameDecoder().feed(Frame(Kind.FILE, 7, payload=b"x").encode())  # a request slot's sequence
    with pytest.raises(FrameError, match="raw bytes"):
        FrameDecoder().feed(_header(kind=Kind.FILE, seq=CONTROL_SEQUENCE_BASE))  # a tensor header


def test_the_top_logits_of_a_row_are_all_a_sampler_keeping_that_many_needs() -> None:
    """A head on a member sends the host only the entries its sampler can pick from: the argmax
    for greedy, the top k for top-k sampling. The row rebuilt from them is -inf elsewhere, and
    llama.cpp's chain draws exactly what it draws from the whole row."""
    from kafila.runtime.engine.sampling import Sampler, SamplingSettings

    rng = np.random.default_rng(3)
    row = rng.standard_normal(5000).astype(np.float32)
    row[[7, 4000]] = row.max() + 1  # a tie for the largest: the lowest index wins, as np.argmax picks
    greedy = FrameDecoder().feed(Frame.of_logits(2, 11, row, top=1).encode())[0]
    assert (greedy.dtype, greedy.n_tokens, len(greedy.payload)) == (DType.I32, 1, 8)
    assert int(np.argmax(greedy.logits())) == int(np.argmax(row)) == 7
    sampled = SamplingSettings(temperature=0.9, top_k=40, top_p=0.9, seed=5)
    assert sampled.top_logits == 40 and SamplingSettings().top_logits == 1
    assert SamplingSettings(temperature=0.9, presence_penalty=0.5).top_logits == 40 + 64  # and the penalised
    assert SamplingSettings(temperature=0.0, repeat_penalty=1.2, repeat_last_n=16).top_logits == 1 + 16
    assert SamplingSettings(temperature=0.9, frequency_penalty=-0.5).top_logits == 0  # raises some: every entry
    assert SamplingSettings(temperature=0.9, top_k=0).top_logits == 0
    frames = [Frame.of_logits(2, 11 + i, rng.standard_normal(5000), top=40) for i in range(30)]
    sparse = [FrameDecoder().feed(f.encode())[0].logits() for f in frames]
    assert all(np.isfinite(r).sum() == 40 for r in sparse)
    dense = [np.where(np.isfinite(r), r, rng.standard_normal(5000) - 100).astype(np.float32) for r in sparse]
    whole, kept = Sampler(sampled, 5000), Sampler(sampled, 5000)
    assert [whole.sample(r) for r in dense] == [kept.sample(r) for r in sparse]
    whole.close()
    kept.close()
    assert Frame.of_logits(0, 0, row, top=5000).dtype is DType.F32  # all of them: the plain row


def test_top_travels_on_hidden_frames_only_and_a_top_k_frame_is_checked() -> None:
    frame = Frame.of_hidden(Kind.DECODE, 1, 2, np.ones((1, 4), dtype=np.float32), top=40)
    assert FrameDecoder().feed(frame.encode())[0].top == 40
    with pytest.raises(ValueError):
        Frame.of_hidden(Kind.DECODE, 1, 2, np.ones((1, 4), dtype=np.float32), top=1 << 16)
    cancel = bytearray(Frame(Kind.CANCEL, 3).encode())
    struct.pack_into("<H", cancel, 6, 5)
    with pytest.raises(FrameError, match="only prefill and decode"):
        FrameDecoder().feed(bytes(cancel))
    with pytest.raises(FrameError, match="top 3 of 4"):
        FrameDecoder().feed(_header(kind=8, dtype=3, n=3, hidden=4, length=20))
    outside = Frame(Kind.LOGITS, 0, 0, 1, 4, DType.I32, np.array([9], np.int32).tobytes() + b"\0\0\0\0")
    with pytest.raises(FrameError, match="outside"):
        FrameDecoder().feed(outside.encode())[0].logits()


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.9, "top_k": 20, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repeat_last_n": 32},
        {"temperature": 0.0, "repeat_penalty": 3.0, "presence_penalty": 2.0, "repeat_last_n": 32},
    ],
)
def test_with_penalties_the_top_k_plus_the_window_give_the_draws_the_whole_row_does(settings: dict) -> None:
    """The history is drawn from the very tokens at the top, so the penalties push some of them out
    of the k kept and let lower ones in: those must have come across too."""
    from kafila.runtime.engine.sampling import Sampler, SamplingSettings

    sampling = SamplingSettings(**settings, seed=9)
    rng = np.random.default_rng(4)
    base = rng.standard_normal(4000).astype(np.float32) * 3
    history = rng.choice(np.argsort(base)[-40:], size=100).tolist()
    whole, kept = Sampler(sampling, 4000), Sampler(sampling, 4000)
    whole.accept(history)
    kept.accept(history)
    draws: list[tuple[int, int]] = []
    for _ in range(40):
        row = base + rng.standard_normal(4000).astype(np.float32) * 0.1
        sparse = FrameDecoder().feed(Frame.of_logits(0, 0, row, top=sampling.top_logits).encode())[0].logits()
        draws.append((whole.sample(row), kept.sample(sparse)))
    whole.close()
    kept.close()
    assert all(a == b for a, b in draws), draws
    assert len({a for a, _ in draws} - set(np.argsort(base)[-1:].tolist())) > 0  # penalties moved the choice


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 5000),
    top=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
    levels=st.sampled_from([None, 3, 50]),  # None: distinct values; else few, so ties at the edge abound
)
def test_largest_finds_a_rows_top_values_as_argpartition_does(
    size: int, top: int, seed: int, levels: int | None
) -> None:
    """`largest` searches only the blocks whose maxima lead; what it returns is still `top` distinct
    ids whose values are the row's `top` largest (a row shorter than `top` is not asked for)."""
    top = min(top, size)
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(size) if levels is None else rng.integers(0, levels, size)).astype(np.float32)
    ids = largest(row, top)
    assert len(set(ids.tolist())) == top
    assert np.array_equal(np.sort(row[ids]), np.sort(np.partition(row, size - top)[size - top :]))


def whole_row_top_ids(row: npt.NDArray[np.floating], k: int) -> npt.NDArray[np.intp]:
    """The k largest as `top_ids` gave them before it searched blocks: np.argpartition over the
    whole row (which picks among ties at the edge), then largest first, lowest index first."""
    k = min(k, row.shape[0])
    part = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    return part[np.lexsort((part, -row[part]))]


@settings(max_examples=400, deadline=None)
@given(
    size=st.integers(1, 3000),
    k=st.integers(1, 21),
    seed=st.integers(0, 2**32 - 1),
    levels=st.sampled_from([None, 2, 3, 50]),  # None: distinct values; else few, so ties at the edge abound
    odd=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0]), max_size=4),
    wide=st.booleans(),
)
def test_top_ids_are_the_ids_the_whole_rows_partition_gave(
    size: int, k: int, seed: int, levels: int | None, odd: list[float], wide: bool
) -> None:
    """A request's log probability alternatives, largest first: the same ids, in the same order,
    as partitioning the whole row gave, ties at the edge (broken as it broke them), NaN, infinities
    and signed zeros included, in float32 and float64 rows, across the 512-value blocks."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(size) if levels is None else rng.integers(0, levels, size)).astype(np.float32)
    row[rng.integers(0, size, len(odd))] = odd
    row = row.astype(np.float64) if wide else row
    assert np.array_equal(top_ids(row, k), whole_row_top_ids(row, k)), (size, k, odd)


def test_top_ids_of_a_262k_row_are_the_whole_rows_with_and_without_ties() -> None:
    rng = np.random.default_rng(3)
    distinct = rng.standard_normal(262_144).astype(np.float32)
    tied, inside = distinct.copy(), distinct.copy()
    tied[np.argsort(distinct)[-25:]] = distinct.max()  # 25 ids tie for the largest: 20 are asked for
    inside[np.argsort(distinct)[-10:]] = distinct.max()  # 10 tie, within the 20 asked for
    for row in (distinct, tied, inside):
        for k in (1, 5, 20):
            assert np.array_equal(top_ids(row, k), whole_row_top_ids(row, k)), k
    assert top_ids(inside, 20)[:10].tolist() == sorted(np.argsort(distinct)[-10:].tolist())  # lowest index first
    assert top_ids(tied, 0).size == 0 and top_ids(distinct, 20).tolist() == np.argsort(-distinct)[:20].tolist()


def test_a_heads_answer_of_a_262k_row_keeps_its_largest_logits() -> None:
    row = np.random.default_rng(1).standard_normal(262_144).astype(np.float32)
    (decoded,) = FrameDecoder().feed(Frame.of_logits(3, 8, row, top=40).encode())
    kept = decoded.logits()
    assert np.array_equal(np.sort(kept[np.isfinite(kept)]), np.sort(row)[-40:])
