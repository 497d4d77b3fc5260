"""`QuicRing` over real links on loopback: the engine thread's blocking calls, run on the loop.

Sends are plain callbacks on the loop; these check that frames leave in order, that a link that
refuses them fails the send and every call after, and that any member's link going down ends a
receive at once, naming that member, through the one watch a ring keeps."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from linked_routers import linked_routers

from kafila.runtime.engine.ring import StageFailed
from kafila.session.quic_ring import QuicRing
from kafila.session.router import LinkRouter
from kafila.wire.frames import Frame, Kind

T = TypeVar("T")


def rows(position: int) -> Frame:
    return Frame.of_hidden(Kind.DECODE, 1, position, np.full((1, 640), position, dtype=np.float32))


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, 30))


def test_frames_sent_in_waves_leave_in_order_and_come_back() -> None:
    async def scenario() -> list[int]:
        host, member, demuxes = await linked_routers()
        echo = asyncio.create_task(_echo(member))
        ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
        try:

            def engine() -> list[int]:
                for position in range(0, 40, 4):  # waves of four frames, as the engine sends them
                    ring.send([rows(position + i) for i in range(4)])
                return [frame.position for frame in ring.receive(40)]

            return await asyncio.to_thread(engine)
        finally:
            ring.close()
            echo.cancel()
            for demux in demuxes:
                demux.close()

    assert run(scenario()) == list(range(40))


async def _echo(router: LinkRouter) -> None:
    while True:
        await router.activation.send(await router.activation.receive())


def test_a_link_that_refuses_the_frames_fails_the_send_and_every_call_after() -> None:
    async def scenario() -> None:
        host, _member, demuxes = await linked_routers()
        ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
        await host.link.close("gone")  # no members to watch: only the send can tell
        try:
            with pytest.raises(StageFailed, match="link to member is down"):
                await asyncio.to_thread(ring.send, [rows(0)])
            with pytest.raises(StageFailed, match="link to member is down"):
                await asyncio.to_thread(ring.receive, 1)
            with pytest.raises(StageFailed, match="link to member is down"):
                await asyncio.to_thread(ring.send, [rows(1)])
        finally:
            for demux in demuxes:
                demux.close()

    run(scenario())


def test_any_member_whose_link_goes_down_ends_a_wait_at_once_and_is_named() -> None:
    """The ring waits on its last stage's link; the member that vanishes is another one."""

    async def scenario() -> float:
        host, _member, demuxes = await linked_routers()
        far, _far_end, far_demuxes = await linked_routers()
        members = {"near": host.link.closed, "far": far.link.closed}
        loop = asyncio.get_running_loop()
        ring = QuicRing(loop, host.activation, "near", host.activation, "near", members)
        waiting = asyncio.create_task(asyncio.to_thread(ring.receive, 1))  # nothing ever answers
        started = loop.time()
        await far.link.close("far went away")
        try:
            with pytest.raises(StageFailed, match="link to far is down"):
                await waiting
            with pytest.raises(StageFailed, match="link to far is down"):  # and every call after
                await asyncio.to_thread(ring.send, [rows(0)])
            return loop.time() - started
        finally:
            for demux in demuxes + far_demuxes:
                demux.close()

    assert run(scenario()) < 2.0  # at once: not the step's 120 s bound, nor the link's idle one


def test_an_abandoned_ring_ends_its_wait_and_takes_no_more_frames() -> None:
    async def scenario() -> None:
        host, member, demuxes = await linked_routers()
        ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
        waiting = asyncio.create_task(asyncio.to_thread(ring.receive, 1))  # waiting, or about to
        ring.abandon()
        try:
            with pytest.raises(StageFailed, match="abandoned"):
                await waiting
            with pytest.raises(StageFailed, match="abandoned"):
                await asyncio.to_thread(ring.send, [rows(0)])
            assert member.activation.receive_nowait() is None
        finally:
            for demux in demuxes:
                demux.close()

    run(scenario())
