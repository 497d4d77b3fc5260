"""A greedy token and its drafts go round the ring a frame a row, and every stage passes each row
on as soon as it has decoded it (issue 37): the pure cores that split, group and gather them, then
real llama.cpp stages in worker processes and over a real QUIC link."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from linked_routers import FAST, linked_routers
from tiny_models import write_tiny_model
from waiting import until_async

from kafila.runtime.engine.engines import (
    EngineStep,
    EveryRowLogits,
    RingEngine,
    SequenceFailed,
    StepResult,
    landing_rounds,
    rows_as_decoded,
)
from kafila.runtime.engine.local_ring import LocalRing, local_ring_engine
from kafila.runtime.engine.stage import BlockStage, HeadStage
from kafila.runtime.engine.worker import as_decoded, handle_frames
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings
from kafila.session.member import _serve_feed, serve_stage
from kafila.session.quic_ring import QuicRing
from kafila.session.router import FrameFeed
from kafila.wire.frames import Frame, Kind

HIDDEN = 4
SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_seq_max=4, n_threads=1)
PROMPT = "the quick brown fox"


def verify(sequence: int, position: int, rows: int, row_by_row: bool = True) -> Frame:
    states = np.arange(rows * HIDDEN, dtype=np.float32).reshape(rows, HIDDEN) + 100 * sequence + position
    return Frame.of_hidden(Kind.VERIFY, sequence, position, states, top=2, logprobs=1, row_by_row=row_by_row)


def decode(sequence: int, position: int) -> Frame:
    return Frame.of_hidden(Kind.DECODE, sequence, position, np.zeros((1, HIDDEN), dtype=np.float32))


def test_a_step_decoded_one_row_a_decode_goes_a_frame_a_row_and_others_whole() -> None:
    frame = verify(3, 40, 4)
    parts = rows_as_decoded(frame)
    assert [(p.kind, p.sequence_id, p.position, p.n_tokens) for p in parts] == [
        (Kind.VERIFY, 3, 40 + i, 1) for i in range(4)
    ]
    assert all(p.row_by_row and p.top == 2 and p.logprobs == 1 and p.hidden == HIDDEN for p in parts)
    assert np.array_equal(np.concatenate([p.hidden_states() for p in parts]), frame.hidden_states())
    sampled = verify(3, 40, 4, row_by_row=False)  # a sampled request's rows go together, one decode
    assert rows_as_decoded(sampled) == (sampled,)
    assert rows_as_decoded(verify(3, 40, 1)) == (verify(3, 40, 1),)
    assert rows_as_decoded(decode(1, 9)) == (decode(1, 9),)


def test_landing_rounds_take_each_step_whole_but_the_rows_after_a_split_step_s_first() -> None:
    assert landing_rounds([1, 3, 1, 2]) == [[(0, 0), (1, 0), (2, 0), (3, 0)], [(1, 1), (3, 1)], [(1, 2)]]
    assert landing_rounds([1, 1]) == [[(0, 0), (1, 0)]]
    assert landing_rounds([]) == []
    with pytest.raises(ValueError, match="one frame at least"):
        landing_rounds([2, 0])


def test_a_step_one_row_a_decode_must_ask_for_every_row() -> None:
    """The engines all trust `row_by_row` to come with `every_row` (a token and its drafts): a step
    that asks for one row's logits cannot be split (UnsplitEngine and a head here ran it unchecked)."""
    with pytest.raises(ValueError, match="every_row"):
        EngineStep(1, 5, [7, 8], decode=True, row_by_row=True)
    assert EngineStep(1, 5, [7, 8], decode=True, every_row=True, row_by_row=True).row_by_row


def test_a_burst_s_rows_go_in_rounds_with_its_other_frames_in_the_first() -> None:
    """Two greedy steps sent a frame a row and a plain decode: round i holds each step's row i,
    round 0 the decode too, so each row goes on as soon as its round is decoded."""
    a, b = rows_as_decoded(verify(1, 10, 3)), rows_as_decoded(verify(2, 20, 2))
    plain = decode(3, 5)
    pieces = as_decoded([*a, *b, plain])
    assert pieces == [[a[0], b[0], plain], [a[1], b[1]], [a[2]]]


def test_a_frame_that_is_not_hidden_states_closes_the_rounds_and_keeps_its_place() -> None:
    """A CANCEL of sequence 1 after its rows comes after every round that holds them (the host
    takes a sequence's answers in the order they left), and so does a PING or an ERROR passed on."""
    a = rows_as_decoded(verify(1, 10, 3))
    cancel, ping = Frame(Kind.CANCEL, 1, position=11), Frame(Kind.PING, 9, payload=b"{}")
    after = rows_as_decoded(verify(2, 0, 2))
    assert as_decoded([*a, cancel, *after, ping]) == [[a[0]], [a[1]], [a[2]], [cancel], [after[0]], [after[1]], [ping]]


def test_a_sequence_s_next_step_follows_its_rows_in_order() -> None:
    """A wave behind a greedy step (drafts in flight) continues its rows' rounds; a plain frame of a
    sequence with rows open, or a greedy row behind a plain frame of its sequence, closes them."""
    first, behind = rows_as_decoded(verify(1, 10, 2)), rows_as_decoded(verify(1, 12, 2))
    assert as_decoded([*first, *behind]) == [[first[0]], [first[1]], [behind[0]], [behind[1]]]
    plain = decode(1, 12)
    assert as_decoded([*first, plain]) == [[first[0]], [first[1]], [plain]]
    ahead = decode(1, 9)
    assert as_decoded([ahead, *first]) == [[ahead], [first[0]], [first[1]]]


frames_of_bursts = st.lists(
    st.tuples(st.sampled_from(["rows", "decode", "cancel", "ping"]), st.integers(0, 3), st.integers(1, 4)), max_size=12
)


@given(frames_of_bursts)
def test_as_decoded_keeps_every_frame_once_and_each_sequence_s_order(burst: list[tuple[str, int, int]]) -> None:
    """Whatever a burst holds: every frame is in one piece, each sequence's frames keep their
    order across the pieces, no piece holds two rows of a sequence or mixes its kinds, and a frame
    that is not hidden states is a piece alone."""
    position: dict[int, int] = {}
    frames: list[Frame] = []
    for what, sequence, rows in burst:
        start = position.get(sequence, 0)
        if what == "rows":
            frames += rows_as_decoded(verify(sequence, start, rows))
            position[sequence] = start + rows
        elif what == "decode":
            frames.append(decode(sequence, start))
            position[sequence] = start + 1
        else:
            frames.append(Frame(Kind.CANCEL, sequence) if what == "cancel" else Frame(Kind.PING, sequence))
    pieces = as_decoded(frames)
    flat = [frame for piece in pieces for frame in piece]
    assert sorted(map(id, flat)) == sorted(map(id, frames))
    for sequence in {frame.sequence_id for frame in frames}:
        assert [f for f in flat if f.sequence_id == sequence] == [f for f in frames if f.sequence_id == sequence]
    for piece in pieces:
        split = [frame.sequence_id for frame in piece if frame.row_by_row]
        assert len(split) == len(set(split))  # one row of a sequence a decode
        assert not set(split) & {frame.sequence_id for frame in piece if not frame.row_by_row}
        if any(frame.kind in (Kind.CANCEL, Kind.PING) for frame in piece):
            assert len(piece) == 1


# --- real stages ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("rows") / "tiny.gguf", "llama", n_blocks=4)


def test_a_member_passes_row_0_on_before_it_decodes_row_1(model: Path, tmp_path: Path) -> None:
    """A member's stage thread (`_serve_feed`) given a greedy step's four rows at once hands each
    row's answer to its loop while its cache holds that row and none after it; the rows it passes
    on are exactly those the step gives as one frame (one row a decode either way)."""
    first, _ = slice_model(model, [2, 2], tmp_path / "stages")
    stage, whole = BlockStage(first.path, SETTINGS), BlockStage(first.path, SETTINGS)
    try:
        prompt = np.random.default_rng(1).normal(size=(5, stage.hidden)).astype(np.float32)
        step = Frame.of_hidden(Kind.VERIFY, 0, 5, prompt[:4] + 1, top=1, row_by_row=True)
        for each in (stage, whole):
            handle_frames(each, [Frame.of_hidden(Kind.PREFILL, 0, 0, prompt)])
        feed = FrameFeed()
        for frame in rows_as_decoded(step):
            feed.put(frame)
        feed.put(None)
        answered: list[tuple[list[int], list[Frame], int]] = []

        def answer(taken: list[Frame], out: list[Frame]) -> None:
            answered.append(([f.position for f in taken], out, stage.model.next_position(0)))

        _serve_feed(stage, feed, answer, lambda: False)
        assert [(taken, held) for taken, _, held in answered] == [([5], 6), ([6], 7), ([7], 8), ([8], 9)]
        passed_on = np.concatenate([out[0].hidden_states() for _, out, _ in answered])
        (as_one,) = handle_frames(whole, [step])
        assert all(len(out) == 1 and out[0].row_by_row for _, out, _ in answered)
        assert np.array_equal(passed_on, as_one.hidden_states())
    finally:
        stage.close()
        whole.close()


def test_a_stage_that_refuses_a_middle_row_fails_that_sequence_alone(model: Path, tmp_path: Path) -> None:
    """Worker processes whose stage holds 256 rows, the head here holding more: a greedy step of
    eight rows after 250 rows in the stage's cache fits its first rows and not its last, so the
    stage answers the rows that fit, then refuses a row (no room) and the rows after it (out of
    position). The host fails that sequence with the stage's reason, the other sequence of the
    wave gets its row, and once the failed one is forgotten its slot serves afresh."""
    stages = slice_model(model, [2, 2], tmp_path / "stages")
    head = ContextSettings(n_ctx=512 * 4, n_batch=512, n_seq_max=4, n_threads=1)
    engine = RingEngine(stages, head, ring=LocalRing(stages[:-1], SETTINGS))
    try:
        short = engine.tokenize(PROMPT)
        long = [3 + i % 40 for i in range(250 - len(short))]
        (fresh,) = engine.step_many([EngineStep(1, 0, short, decode=False)])
        (_,) = engine.step_many([EngineStep(0, 0, long, decode=False)])
        other = EngineStep(1, len(short), [5], decode=True)
        greedy = EngineStep(0, len(long), [5, 6, 7, 8, 9, 10, 11, 12], decode=True, every_row=True, row_by_row=True)
        row, failed = engine.step_many([other, greedy])
        assert isinstance(row, np.ndarray) and row.shape == (engine.n_vocab(),)
        assert isinstance(failed, SequenceFailed) and not failed.cancelled
        assert "blocks 0-1" in failed.message and "room" in failed.message, failed.message
        engine.forget(0)
        (again,) = engine.step_many([EngineStep(0, 0, short, decode=False)])
        assert isinstance(again, np.ndarray) and np.array_equal(again, fresh)
        (on,) = engine.step_many([EngineStep(1, len(short) + 1, [6], decode=True)])
        assert isinstance(on, np.ndarray)
    finally:
        engine.close()


def test_a_request_forgotten_while_its_rows_are_out_lands_cancelled_and_its_slot_is_clean(
    model: Path, tmp_path: Path
) -> None:
    """A greedy step's rows go out a frame a row, then the sequence is forgotten (its CANCEL after
    them, as when a request stops among its drafts with a wave behind): the wave lands with that
    step cancelled and the other sequence answered, and the slot then gives what a fresh one does."""
    stages = slice_model(model, [1, 1, 2], tmp_path / "stages")
    engine = local_ring_engine(stages, SETTINGS)
    try:
        prompt = engine.tokenize(PROMPT)
        (fresh,) = engine.step_many([EngineStep(0, 0, prompt, decode=False)])
        engine.step_many([EngineStep(1, 0, prompt, decode=False)])
        steps = [
            EngineStep(0, len(prompt), [5, 6, 7, 8], decode=True, every_row=True, row_by_row=True),
            EngineStep(1, len(prompt), [5, 6, 7], decode=True, every_row=True, row_by_row=True),
        ]
        launched = engine.launch(steps)
        assert [len(frames) for frames in launched.frames] == [4, 3]
        engine.forget(0)
        cancelled, answered = engine.land(launched)
        assert isinstance(cancelled, SequenceFailed) and cancelled.cancelled
        assert isinstance(answered, EveryRowLogits) and answered.rows.shape == (3, engine.n_vocab())
        (again,) = engine.step_many([EngineStep(0, 0, prompt, decode=False)])
        assert isinstance(again, np.ndarray) and np.array_equal(again, fresh)
    finally:
        engine.close()


def test_a_head_on_a_member_over_quic_answers_a_greedy_step_row_by_row_as_without_drafts(
    model: Path, tmp_path: Path
) -> None:
    """The whole model on a member (its head answers with each row's largest logit) over a real
    QUIC link bound to the least it may hold: a greedy step of a token and seven drafts goes as
    eight frames, each answered as decoded, and its rows are exactly the rows the same tokens
    give decoded one a wave without drafts; every frame the member took is released."""
    (whole,) = slice_model(model, [4], tmp_path / "stages")

    async def scenario() -> tuple[list[StepResult], list[StepResult]]:
        host, member, demuxes = await linked_routers(FAST.model_copy(update={"max_held_bytes": 1 << 16}))
        stage = HeadStage(whole.path, SETTINGS)
        executor = ThreadPoolExecutor(1)
        serving = asyncio.create_task(serve_stage(stage, member.activation, member.activation, executor))
        ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
        engine = RingEngine([whole], SETTINGS, ring=ring, model=model)

        def drive() -> tuple[list[StepResult], list[StepResult]]:
            prompt = engine.tokenize(PROMPT)
            engine.step_many([EngineStep(s, 0, prompt, decode=False, top=1) for s in (0, 1)])
            tokens = [5, 9, 2, 7, 5, 9, 2, 7]
            plain = [
                engine.step_many([EngineStep(0, len(prompt) + i, [t], decode=True, top=1)])[0]
                for i, t in enumerate(tokens)
            ]
            drafted = engine.step_many(
                [EngineStep(1, len(prompt), tokens, decode=True, top=1, every_row=True, row_by_row=True)]
            )
            return plain, drafted

        try:
            plain, drafted = await asyncio.to_thread(drive)
            await until_async(lambda: member.link.held_bytes == 0, "the member's frames released", 10)
            return plain, drafted
        finally:
            await asyncio.to_thread(engine.close)
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            executor.shutdown()
            stage.close()
            for demux in demuxes:
                demux.close()

    plain, (drafted,) = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert isinstance(drafted, EveryRowLogits) and drafted.rows.shape[0] == 8
    for row, alone in zip(drafted.rows, plain, strict=True):
        assert isinstance(alone, np.ndarray)
        assert int(row.argmax()) == int(alone.argmax()) and row.max() == alone.max()
