"""Stage files over real QUIC links on loopback: full, resumed, cached, corrupted and malformed transfers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from disks import small_disk
from pydantic import ValidationError
from test_link import WAIT, pair, run, shut
from waiting import until_async

from kafila.network.link import Link, LinkError
from kafila.network.transfer import (
    CHUNK_SIZE,
    Abort,
    Ack,
    End,
    HashMismatch,
    Offer,
    ReceiverCore,
    Request,
    SenderCore,
    TransferChannel,
    TransferError,
    TransferProtocolError,
    TransferRejected,
    Verdict,
    chunk_frame,
    message_frame,
    parse_message,
    receive_stage_file,
    route,
    send_stage_file,
    transfer_sequence,
)
from kafila.wire.control import CONTROL_SEQUENCE, Assign
from kafila.wire.frames import CONTROL_SEQUENCE_BASE, DType, Frame, Kind

SIZE = 20 * CHUNK_SIZE + 12345  # a short last chunk


def random_file(path: Path, size: int, seed: int = 0) -> tuple[Path, str]:
    data = np.random.default_rng(seed).bytes(size)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


class Progress:
    """Records progress calls and checks they only ever go up."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        assert not self.calls or done >= self.calls[-1][0]
        self.calls.append((done, total))


async def links() -> tuple[Any, Any, Link, Link]:
    a, b, link_a, link_b = await pair()
    assert isinstance(link_a, Link) and isinstance(link_b, Link)
    return a, b, link_a, link_b


async def transfer(
    sender: Link, receiver: Link, path: Path, sha: str, cache: Path, stage: int = 0, **receive: Any
) -> tuple[Any, Any, Progress, Progress]:
    """Both sides at once; their results, or the exceptions they raised."""
    sent, got = Progress(), Progress()
    results = await asyncio.wait_for(
        asyncio.gather(
            send_stage_file(sender, path, sha, stage, sent),
            receive_stage_file(receiver, cache, got, **receive),
            return_exceptions=True,
        ),
        WAIT * 4,
    )
    return results[0], results[1], sent, got


def test_a_full_transfer_arrives_verified_with_progress_on_both_sides(tmp_path: Path) -> None:
    async def go() -> None:
        a, b, link_a, link_b = await links()
        path, sha = random_file(tmp_path / "stage-0.gguf", SIZE)
        cache = tmp_path / "cache"
        sent, received, sent_progress, got_progress = await transfer(link_a, link_b, path, sha, cache)
        assert sent == SIZE
        assert received == cache / f"{sha}.gguf" and received.read_bytes() == path.read_bytes()
        assert list(cache.iterdir()) == [received]  # no partial file left behind
        for progress in (sent_progress, got_progress):
            assert progress.calls[0] == (0, SIZE) and progress.calls[-1] == (SIZE, SIZE)
            assert len(progress.calls) > 10  # it moved along the way, not only at the end
        await shut(link_a, link_b, a, b)

    run(go)


def test_a_transfer_cut_off_midway_resumes_and_sends_only_the_rest(tmp_path: Path) -> None:
    async def go() -> None:
        path, sha = random_file(tmp_path / "stage-1.gguf", SIZE, seed=1)
        cache = tmp_path / "cache"
        a, b, link_a, link_b = await links()
        cut = Progress()
        closing: list[asyncio.Task[None]] = []

        def cut_at_a_third(done: int, total: int) -> None:
            cut(done, total)
            if done >= total // 3 and not closing:
                closing.append(asyncio.ensure_future(link_b.close("cut off for the test")))

        sent, received = await asyncio.wait_for(
            asyncio.gather(
                send_stage_file(link_a, path, sha, 1),
                receive_stage_file(link_b, cache, cut_at_a_third),
                return_exceptions=True,
            ),
            WAIT * 4,
        )
        assert isinstance(sent, LinkError) and isinstance(received, LinkError), (sent, received)
        await shut(link_a, link_b, a, b)
        partial = cache / f"{sha}.partial"
        have = partial.stat().st_size
        assert SIZE // 3 <= have < SIZE and have % CHUNK_SIZE == 0
        assert not (cache / f"{sha}.gguf").exists()

        a, b, link_a, link_b = await links()  # a new link, as after a reconnect
        sent, received, sent_progress, got_progress = await transfer(link_a, link_b, path, sha, cache, stage=1)
        assert sent == SIZE - have  # only the rest travelled
        assert received.read_bytes() == path.read_bytes() and not partial.exists()
        assert sent_progress.calls[0] == (have, SIZE) and got_progress.calls[0] == (have, SIZE)
        assert sent_progress.calls[-1] == got_progress.calls[-1] == (SIZE, SIZE)
        await shut(link_a, link_b, a, b)

    run(go)


def test_a_new_offer_that_overtakes_the_abort_of_the_last_ends_it_and_is_received_next(tmp_path: Path) -> None:
    """A host that stops a member's transfer and, replanning, offers its new stage at once: each
    transfer has its own stream, so the new offer can arrive before the old one's abort. The
    member's transfer under way ends, and its next receive takes that offer (it was read as a
    stray frame and lost, and the host waited on a member waiting for an offer)."""

    async def go() -> None:
        a, b, link_a, link_b = await links()
        path, sha = random_file(tmp_path / "stage-2.gguf", 3 * CHUNK_SIZE + 7, seed=2)
        cache = tmp_path / "cache"
        first, second = transfer_sequence(300), transfer_sequence(301)
        receiving = asyncio.ensure_future(receive_stage_file(link_b, cache))
        await link_a.send(offer(sequence=first))
        assert parse_message(await asyncio.wait_for(link_a.receive(), WAIT)) == Request(0)
        # The abandoned transfer's abort is still on its way; the next offer comes first.
        sending = asyncio.ensure_future(send_stage_file(link_a, path, sha, 2, sequence_id=second))
        with pytest.raises(TransferRejected, match="offered another file"):
            await asyncio.wait_for(receiving, WAIT)
        received = await asyncio.wait_for(receive_stage_file(link_b, cache), WAIT)
        assert received.read_bytes() == path.read_bytes()
        assert await asyncio.wait_for(sending, WAIT) == path.stat().st_size
        await shut(link_a, link_b, a, b)

    run(go)


@pytest.mark.parametrize("shared", [False, True], ids=["link", "channel"])
def test_a_receiver_told_its_transfer_passes_over_an_earlier_offer_the_sender_stopped(
    tmp_path: Path, shared: bool
) -> None:
    """A member that failed its part before it read the host's offer (a neighbour had left) finds
    that offer, and its abort once the host stopped it, still queued when the next plan's offer
    comes. Told the sequence of the transfer it was assigned, it passes over the old one and
    receives the new; it took the old offer, read its abort as the sender giving up, and failed,
    while the host waited on the new transfer (test_session_network's steady-load test)."""

    async def go() -> None:
        a, b, link_a, link_b = await links()
        path, sha = random_file(tmp_path / "stage-0.gguf", 3 * CHUNK_SIZE + 7, seed=3)
        cache = tmp_path / "cache"
        stopped, assigned = transfer_sequence(310), transfer_sequence(311)
        channel, routing = (TransferChannel(), None) if shared else (None, None)
        stale = [offer(sha=hashlib.sha256(b"stage-1").hexdigest(), sequence=stopped)]
        stale.append(message_frame(stopped, Abort("the sender was stopped")))
        for frame in stale:
            await link_a.send(frame)
        stale_bytes = sum(f.wire_bytes for f in stale)
        await until_async(lambda: link_b.held_bytes >= stale_bytes, lambda: "the stopped transfer's frames here", WAIT)
        if channel is not None:
            routing = asyncio.ensure_future(route(link_b, channel, lambda _frame: None))
        sending = asyncio.ensure_future(send_stage_file(link_a, path, sha, 0, sequence_id=assigned))
        received = await asyncio.wait_for(
            receive_stage_file(link_b, cache, channel=channel, sequence_id=assigned), WAIT
        )
        assert received.read_bytes() == path.read_bytes()
        assert await asyncio.wait_for(sending, WAIT) == path.stat().st_size
        if routing is not None:
            routing.cancel()
        await shut(link_a, link_b, a, b)

    run(go)


def test_a_cached_file_is_not_sent_and_a_wrong_sized_one_is_replaced(tmp_path: Path) -> None:
    async def go() -> None:
        a, b, link_a, link_b = await links()
        path, sha = random_file(tmp_path / "stage-2.gguf", 3 * CHUNK_SIZE + 7, seed=2)
        cache = tmp_path / "cache"
        cache.mkdir()
        shutil.copy(path, cache / f"{sha}.gguf")  # as the slicer leaves it on a member with --model
        sent, received, sent_progress, got_progress = await transfer(link_a, link_b, path, sha, cache)
        assert sent == 0 and received == cache / f"{sha}.gguf"
        assert sent_progress.calls[-1] == got_progress.calls[-1] == (path.stat().st_size,) * 2

        (cache / f"{sha}.gguf").write_bytes(b"truncated")  # not the right size: not trusted
        sent, received, _, _ = await transfer(link_a, link_b, path, sha, cache)
        assert sent == path.stat().st_size and received.read_bytes() == path.read_bytes()
        await shut(link_a, link_b, a, b)

    run(go)


def test_a_disk_too_small_for_the_file_is_refused_on_both_sides_with_the_space_it_needs(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "64k") as disk:

        async def go() -> None:
            a, b, link_a, link_b = await links()
            path, sha = random_file(tmp_path / "stage-2.gguf", SIZE, seed=2)
            sent, received, _, _ = await transfer(link_a, link_b, path, sha, disk / "cache")
            assert isinstance(received, TransferError), received
            assert f"in {disk / 'cache'}:" in str(received) and "free some space" in str(received), received
            assert isinstance(sent, TransferRejected) and "not enough disk space" in str(sent), sent
            assert list((disk / "cache").iterdir()) == []  # no partial file
            await shut(link_a, link_b, a, b)

        run(go)


def test_a_corrupted_file_is_detected_and_its_partial_discarded(tmp_path: Path) -> None:
    async def go() -> None:
        a, b, link_a, link_b = await links()
        path, sha = random_file(tmp_path / "stage-3.gguf", 5 * CHUNK_SIZE + 99, seed=3)
        good = path.read_bytes()
        flipped = bytearray(good)
        flipped[3 * CHUNK_SIZE + 5] ^= 0x01  # one bit, in the fourth chunk, after the hash was taken
        path.write_bytes(flipped)
        cache = tmp_path / "cache"
        sent, received, _, _ = await transfer(link_a, link_b, path, sha, cache)
        assert isinstance(received, HashMismatch) and sha in str(received) and "discarded" in str(received)
        assert isinstance(sent, TransferRejected) and "sha256" in str(sent)
        assert list(cache.iterdir()) == []  # neither the partial nor a final file

        path.write_bytes(good)  # the link is still good for the real thing
        sent, received, _, _ = await transfer(link_a, link_b, path, sha, cache)
        assert sent == len(good) and received.read_bytes() == good
        await shut(link_a, link_b, a, b)

    run(go)


def offer(
    sha: str = "ab" * 32, size: int = 2 * CHUNK_SIZE + 10, sequence: int = transfer_sequence(0), **fields: Any
) -> Frame:
    return message_frame(sequence, Offer(sha, size, 0, "x.gguf", **fields))


def ping(body: Any, sequence: int = transfer_sequence(0)) -> Frame:
    return Frame(Kind.PING, sequence, dtype=DType.NONE, payload=json.dumps(body).encode())


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([chunk_frame(transfer_sequence(0), 0, b"x" * 10)], "began with a FILE chunk, not an offer"),
        ([Frame(Kind.PING, transfer_sequence(0), payload=b"{oops")], "not JSON"),
        ([ping({"transfer": "offer", "version": 1, "sha256": "../../etc/passwd"})], "'sha256' must be 64"),
        ([ping({"transfer": "hello"})], "unknown transfer message 'hello'"),
        ([ping([1, 2])], "not an object"),
        ([ping({"transfer": "request", "have": 0})], "began with a request message"),
        ([offer(size=-1)], "'size' must be an integer"),
        ([offer(chunk=3)], "'chunk' must be an integer"),
        ([offer(window=1 << 30)], "'window' must be an integer"),
        ([Frame(Kind.CANCEL, transfer_sequence(0))], "a CANCEL frame where a transfer message"),
    ],
)
def test_the_receiver_refuses_a_malformed_offer_with_a_clear_error(frames: list[Frame], message: str) -> None:
    core = ReceiverCore(transfer_sequence(0))
    with pytest.raises(TransferProtocolError, match=message):
        for frame in frames:
            core.handle_offer(frame)


def receiving(size: int = 3 * CHUNK_SIZE + 10, have: int = 0, window: int = 8 * CHUNK_SIZE) -> ReceiverCore:
    core = ReceiverCore(transfer_sequence(0))
    core.handle_offer(offer(size=size, window=window))
    core.request_frame(have)
    return core


def chunk(index: int, length: int = CHUNK_SIZE, sequence: int = transfer_sequence(0)) -> Frame:
    return chunk_frame(sequence, index, bytes(length))


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([chunk(0), chunk(0)], "duplicate chunk 0"),
        ([chunk(1)], "out-of-order chunk 1: chunk 0 comes next"),
        ([chunk(0, CHUNK_SIZE + 1)], "oversized chunk 0"),
        ([chunk(0, 100)], "chunk 0 holds 100 bytes; it should hold 1048576"),
        ([chunk(0), chunk(1), chunk(2), chunk(3, 11)], "chunk 3 holds 11 bytes; it should hold 10"),
        ([chunk(9)], "chunk 9 starts at byte 9437184, past the announced 3145738 bytes"),
        ([chunk(2**32 - 1)], "past the announced"),
        ([message_frame(transfer_sequence(0), End())], "end after 0 of the 3145738 bytes"),
        ([message_frame(transfer_sequence(0), Ack(5))], "a ack message during the transfer"),
        ([offer()], "a offer message during the transfer"),
    ],
)
def test_chunks_out_of_place_are_protocol_errors(frames: list[Frame], message: str) -> None:
    core = receiving()
    with pytest.raises(TransferProtocolError, match=message):
        for frame in frames:
            core.handle(frame)


def test_a_sender_that_overruns_its_window_is_refused() -> None:
    core = receiving(size=10 * CHUNK_SIZE, window=2 * CHUNK_SIZE)
    core.handle(chunk(0))
    core.handle(chunk(1))  # no ack sent yet: two chunks fill the window
    with pytest.raises(TransferProtocolError, match="overran its 2097152-byte window"):
        core.handle(chunk(2))
    core = receiving(size=10 * CHUNK_SIZE, window=2 * CHUNK_SIZE)
    for index in range(10):
        core.handle(chunk(index))
        core.ack_frame()
    assert core.handle(message_frame(transfer_sequence(0), End())) == Verdict(
        False,
        f"sha256 of the {10 * CHUNK_SIZE} bytes received is {hashlib.sha256(bytes(10 * CHUNK_SIZE)).hexdigest()}, "
        f"not {'ab' * 32}",
    )


def test_the_sender_refuses_replies_out_of_place() -> None:
    def sender() -> SenderCore:
        core = SenderCore(transfer_sequence(0), Offer("ab" * 32, 3 * CHUNK_SIZE, 0, "x", CHUNK_SIZE, 2 * CHUNK_SIZE))
        core.offer_frame()
        return core

    sequence = transfer_sequence(0)
    with pytest.raises(TransferProtocolError, match="request from byte 5: not a chunk boundary"):
        sender().handle(message_frame(sequence, Request(5)))
    with pytest.raises(TransferProtocolError, match="a verdict message while offered"):
        sender().handle(message_frame(sequence, Verdict(True)))
    core = sender()
    core.handle(message_frame(sequence, Request(CHUNK_SIZE)))
    assert core.next_chunk() == (CHUNK_SIZE, CHUNK_SIZE)
    core.chunk_frame(CHUNK_SIZE, bytes(CHUNK_SIZE))
    core.chunk_frame(2 * CHUNK_SIZE, bytes(CHUNK_SIZE))
    assert core.next_chunk() is None and core.end_frame() is not None and core.sent == 2 * CHUNK_SIZE
    with pytest.raises(TransferProtocolError, match="ack of 9999999 bytes"):
        core.handle(message_frame(sequence, Ack(9999999)))
    with pytest.raises(TransferProtocolError, match="a FILE frame where a transfer message"):
        core.handle(chunk(0))
    with pytest.raises(TransferRejected, match="the receiver refused the file: no"):
        core.handle(message_frame(sequence, Verdict(False, "no")))
    with pytest.raises(TransferRejected, match="the peer's link refused the transfer stream: bad"):
        core.handle(Frame(Kind.ERROR, sequence, payload=b"bad"))


def test_messages_round_trip() -> None:
    for message in (Offer("cd" * 32, 10, 3, "s.gguf"), Request(4096), Ack(7), End(), Verdict(False, "why")):
        assert parse_message(message_frame(transfer_sequence(3), message)) == message


def test_malformed_transfer_frames_on_a_live_link_get_clear_errors_and_the_link_goes_on(tmp_path: Path) -> None:
    async def go() -> None:
        a, b, link_a, link_b = await links()
        cache = tmp_path / "cache"
        numbers = iter(range(100, 200))

        async def refused(make: Callable[[int], list[Frame]], message: str, expect_request: bool = False) -> None:
            sequence = transfer_sequence(next(numbers))  # each attempt has its own sequence, as send_stage_file's
            frames = make(sequence)
            receiving = asyncio.ensure_future(receive_stage_file(link_b, cache))
            await link_a.send(frames[0])
            if expect_request:
                assert parse_message(await asyncio.wait_for(link_a.receive(), WAIT)) == Request(0)
            for frame in frames[1:]:
                await link_a.send(frame)
            with pytest.raises(TransferProtocolError, match=message):
                await asyncio.wait_for(receiving, WAIT)
            abort = parse_message(await asyncio.wait_for(link_a.receive(), WAIT))  # the sender is told why
            assert message.split(":")[0] in getattr(abort, "reason", ""), abort
            await link_a.finish(sequence)

        await refused(lambda s: [chunk_frame(s, 0, b"data")], "began with a FILE chunk")
        await refused(lambda s: [Frame(Kind.PING, s, payload=b"\xff not json")], "not JSON")
        await refused(lambda s: [ping({"transfer": "offer", "version": 1, "sha256": "../x"}, s)], "'sha256' must be")
        await refused(lambda s: [offer(sequence=s), chunk(1, sequence=s)], "out-of-order chunk 1", True)
        await refused(lambda s: [offer(sequence=s), chunk(0, 17, s)], "chunk 0 holds 17 bytes", True)
        await refused(lambda s: [offer(sequence=s), chunk(7, sequence=s)], "past the announced", True)
        # A sender that goes quiet: the receiver gives up after its stall timeout and says so.
        quiet = transfer_sequence(next(numbers))
        receiving = asyncio.ensure_future(receive_stage_file(link_b, cache, stall_timeout_s=0.3))
        await link_a.send(offer(sequence=quiet))
        assert parse_message(await asyncio.wait_for(link_a.receive(), WAIT)) == Request(0)
        with pytest.raises(TransferError, match="nothing heard about transfer"):
            await asyncio.wait_for(receiving, WAIT)
        abort = parse_message(await asyncio.wait_for(link_a.receive(), WAIT))
        assert "nothing heard" in getattr(abort, "reason", ""), abort
        await link_a.finish(quiet)
        # Late frames of a refused attempt (chunks still in flight) are dropped, not taken for a new one.
        await link_a.send(chunk(0, sequence=transfer_sequence(105)))

        # The codec refuses a FILE frame outside the transfer range: the link answers with an
        # ERROR frame on that stream, and carries on.
        stream = await link_a.send_raw(Frame(Kind.FILE, 5, payload=b"x").encode())
        error = await asyncio.wait_for(link_a.receive(), WAIT)
        assert error.kind is Kind.ERROR and "outside the control range" in error.text()
        assert link_b.rejected[-1].stream_id == stream

        path, sha = random_file(tmp_path / "small.gguf", 100_000, seed=4)
        sent, received, _, _ = await transfer(link_a, link_b, path, sha, cache)
        assert sent == 100_000 and received.read_bytes() == path.read_bytes()
        assert not link_a.closed.done() and not link_b.closed.done()
        await shut(link_a, link_b, a, b)

    run(go)


def test_a_transfer_shares_its_link_with_activations(tmp_path: Path) -> None:
    """With a TransferChannel fed by one reader per link, activations and a stage file interleave."""

    async def go() -> None:
        a, b, link_a, link_b = await links()
        channels = TransferChannel(), TransferChannel()
        others: tuple[list[Frame], list[Frame]] = ([], [])
        readers = [
            asyncio.ensure_future(route(link, channel, other.append))
            for link, channel, other in zip((link_a, link_b), channels, others, strict=True)
        ]
        path, sha = random_file(tmp_path / "stage-5.gguf", 4 * CHUNK_SIZE + 1, seed=5)
        states = np.ones((1, 64), dtype=np.float32)
        activations = [Frame.of_hidden(Kind.DECODE, 1 + i % 3, i, states) for i in range(200)]

        async def chatter() -> None:
            for frame in activations:
                await link_a.send(frame)
                await link_b.send(frame)
                await asyncio.sleep(0)

        sent, received, _ = await asyncio.wait_for(
            asyncio.gather(
                send_stage_file(link_a, path, sha, 5, channel=channels[0]),
                receive_stage_file(link_b, tmp_path / "cache", channel=channels[1]),
                chatter(),
            ),
            WAIT * 2,
        )
        assert sent == path.stat().st_size and received.read_bytes() == path.read_bytes()
        await until_async(
            lambda: len(others[0]) == len(others[1]) == len(activations),
            lambda: f"every activation both ways: {len(others[0])} and {len(others[1])} of {len(activations)}",
            WAIT,
        )
        for other in others:  # every activation, each sequence in order, none taken by the transfer
            for sequence in (1, 2, 3):
                assert [f for f in other if f.sequence_id == sequence] == [
                    f for f in activations if f.sequence_id == sequence
                ]
            assert len(other) == len(activations)
        await shut(link_a, link_b, a, b)
        await asyncio.wait_for(asyncio.gather(*readers), WAIT)
        for channel in channels:  # the readers closed the channels with the link's error
            assert isinstance(channel.error, LinkError)

    run(go)


def test_the_transfer_range_is_inside_the_control_range() -> None:
    assert transfer_sequence(0) == CONTROL_SEQUENCE_BASE == 2**63
    assert transfer_sequence(2**32 - 1) == 2**63 + 2**32 - 1 < 2**64 - 1  # below the session's control stream
    with pytest.raises(ValueError):
        transfer_sequence(2**32)


def test_an_assign_names_its_transfer_inside_the_transfer_range() -> None:
    assign = {
        "epoch": 1, "stage_index": 0, "first_block": 0, "end_block": 2, "sha256": "ab" * 32, "size": 10,
        "source": "transfer", "predecessor": "h", "successor": "h", "n_ctx": 256, "n_batch": 32, "n_seq_max": 2,
    }  # fmt: skip
    for inside in (transfer_sequence(0), transfer_sequence(2**32 - 1)):
        assert Assign.model_validate(assign | {"transfer": inside}).transfer == inside
    for outside in (CONTROL_SEQUENCE_BASE - 1, transfer_sequence(2**32 - 1) + 1, CONTROL_SEQUENCE):
        with pytest.raises(ValidationError):
            Assign.model_validate(assign | {"transfer": outside})
