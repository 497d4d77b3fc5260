"""Frames handed from the event loop straight to a thread: `FrameFeed` alone, a channel handing
its frames over a real link (`Channel.hand_to`), and `serve_stage`'s thread freed when its task
is cancelled."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from linked_routers import linked_routers
from waiting import until_async

from kafila.network.link import LinkClosed
from kafila.runtime.engine.stage import StepInput
from kafila.session.member import serve_stage
from kafila.session.router import FrameFeed
from kafila.wire.frames import Frame, Kind


def rows(position: int) -> Frame:
    return Frame.of_hidden(Kind.DECODE, 1, position, np.full((1, 64), position, dtype=np.float32))


def positions(frames: Sequence[Frame] | None) -> list[int] | None:
    return None if frames is None else [frame.position for frame in frames]


def test_a_feed_hands_over_every_frame_held_in_order_and_ends_after_them() -> None:
    feed = FrameFeed()
    feed.put(rows(0))
    feed.put(rows(1))
    assert positions(feed.take()) == [0, 1]
    feed.put(rows(2))
    feed.put(None)  # nothing more comes: what came before it is still taken
    assert positions(feed.take()) == [2]
    assert feed.take() is None
    assert feed.take() is None


def test_a_stopped_feed_takes_nothing_more_and_leaves_what_it_held() -> None:
    feed = FrameFeed()
    feed.put(rows(0))
    feed.stop()
    assert feed.take() is None
    assert positions(feed.left()) == [0]
    assert feed.left() == []


def test_a_reader_waits_for_the_next_frame_and_gives_up_when_abandoned_without_a_word() -> None:
    feed = FrameFeed()
    taken: list[list[int] | None] = []
    reader = threading.Thread(target=lambda: taken.append(positions(feed.take())))
    reader.start()
    feed.put(rows(7))
    reader.join(10)
    assert taken == [[7]]

    abandoned = threading.Event()
    reader = threading.Thread(target=lambda: taken.append(positions(feed.take(abandoned.is_set, every_s=0.01))))
    reader.start()
    abandoned.set()
    reader.join(10)
    assert not reader.is_alive() and taken[-1] is None
    feed.put(rows(8))  # giving up is the reader's: the feed itself goes on
    assert positions(feed.take()) == [8]


def test_a_channel_hands_its_frames_over_in_order_counted_until_taken_then_its_end() -> None:
    async def scenario() -> None:
        host, member, demuxes = await linked_routers()
        try:
            await member.activation.send(rows(0))
            await until_async(lambda: host.activation.held_bytes > 0, "the first frame here")
            handed: list[Frame | None] = []
            host.activation.hand_to(handed.append)  # the frame already here goes first
            for position in (1, 2):
                await member.activation.send(rows(position))
            await until_async(lambda: len(handed) == 3, lambda: f"{len(handed)} of 3 frames handed over")
            assert positions([f for f in handed if f is not None]) == [0, 1, 2]
            assert host.activation.receive_nowait() is None
            assert (
                host.link.held_bytes == host.activation.held_bytes == sum(f.wire_bytes for f in handed if f is not None)
            )
            for frame in handed:
                assert frame is not None
                host.activation.taken(frame)
            assert host.link.held_bytes == host.activation.held_bytes == 0

            host.activation.take_back(lambda _frame: None)  # not the sink in use: it stays
            await member.activation.send(rows(3))
            await until_async(lambda: len(handed) == 4, "the fourth frame handed over")
            host.activation.take_back(handed.append)
            await member.activation.send(rows(4))
            assert positions([await asyncio.wait_for(host.activation.receive(), 10)]) == [4]

            host.activation.hand_to(handed.append)
            await member.link.close("done")
            await until_async(lambda: handed[-1] is None, "the link's end handed over")
            with pytest.raises(LinkClosed):  # and kept for a reader of the channel
                await host.activation.receive()
        finally:
            for demux in demuxes:
                demux.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


class EchoStage:
    """A block stage whose forward returns its rows as they came."""

    name, hidden, first_block, n_layers = "echo stage", 64, 0, 1

    def forward(self, steps: Sequence[StepInput], decode: bool = True, row_by_row: Any = None) -> list[Any]:
        return [step.states for step in steps]


def test_a_served_stage_answers_each_frame_and_frees_its_thread_once_cancelled() -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="stage")

    async def scenario() -> None:
        host, member, demuxes = await linked_routers()
        serving = asyncio.create_task(serve_stage(EchoStage(), member.activation, member.activation, executor))  # type: ignore[arg-type]
        try:
            for position in range(3):
                await host.activation.send(rows(position))
            answers = [await asyncio.wait_for(host.activation.receive(), 10) for _ in range(3)]
            assert positions(answers) == [0, 1, 2]
            assert [np.asarray(f.hidden_states()).max() for f in answers] == [0, 1, 2]
            await until_async(lambda: member.link.held_bytes == 0, "the member's frames released once answered")
        finally:
            serving.cancel()
            # The loop does not run again before the thread is wanted (a test's teardown closing the
            # stage and shutting its executor down at once): the thread still sees the cancel.
            assert executor.submit(lambda: True).result(10)
            for demux in demuxes:
                demux.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    executor.shutdown()
