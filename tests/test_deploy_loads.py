"""The host's deployer loads the ring at once, not one stage after another (issue 36): it tells
every member to load its stage together, each as soon as it is staged, while this host's own stage
still arrives, and its own head's engine loads while the members still get and load theirs, so the
ring is ready as the last stage loads; a head stage still arriving from the hub has its engine
begun before its last byte. Real QUIC links, a real rendezvous and a real head engine; the two
members are scripted, so that each can see, before it answers `Loaded`, what the host has begun
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from linked_routers import linked_routers
from tiny_models import write_tiny_model
from waiting import until, until_async

from kafila.contracts import FleetDevice, HubModel, HubPart, Progress
from kafila.hub.ranges import partial_stage
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous
from kafila.planner.types import Plan, Stage
from kafila.runtime.gguf.arriving import arriving
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.slicer import StageFile
from kafila.runtime.llama.model import ContextSettings
from kafila.session.deployer import Deployer, Roster
from kafila.session.host_model import LocalModel, PlannedStage
from kafila.session.router import LinkRouter
from kafila.wire.control import Assign, Hello, Load, Loaded, Staged

SETTINGS = ContextSettings(n_ctx=256, n_batch=32, n_seq_max=2, n_threads=1)
ANSWER_WITHIN_S = 5.0  # how long a scripted member waits, on Load, for what it looks for


async def scripted_member(router: LinkRouter, told: asyncio.Event, seen: Callable[[], bool]) -> bool:
    """Answer the host's Assign as a member holding its stage in its cache; on Load, wait (a
    while) until `seen()`, then answer Loaded. Whether it was seen."""
    assign = await router.next_control(30)
    assert isinstance(assign, Assign) and assign.source == "cache", assign
    await router.send_control(Staged(epoch=assign.epoch, source="cache", seconds=0.0))
    load = await router.next_control(30)
    assert isinstance(load, Load) and load.epoch == assign.epoch, load
    told.set()
    try:
        await until_async(seen, "what the member waits for", ANSWER_WITHIN_S)
        saw = True
    except AssertionError:
        saw = False
    await router.send_control(Loaded(epoch=assign.epoch, stage_index=assign.stage_index, seconds=0.0))
    return saw


class OwnStageArriving(LocalModel):
    """A local model whose host's own stage is still arriving (as one fetched from the hub) until
    every member has been told to load, or `ANSWER_WITHIN_S` has passed: whether they were."""

    def __init__(self, path: Path, told: list[asyncio.Event]) -> None:
        super().__init__(path)
        self.told = told
        self.members_loading_meanwhile: bool | None = None

    def own_stages(self, own: Sequence[PlannedStage], progress: Progress) -> None:
        try:
            until(lambda: all(event.is_set() for event in self.told), "the members told to load", ANSWER_WITHIN_S)
            self.members_loading_meanwhile = True
        except AssertionError:
            self.members_loading_meanwhile = False


HUB_MODEL = HubModel(
    repo_id="org/tiny",
    commit="e" * 40,
    parts=(HubPart(path="tiny.gguf", size=1, header_bytes=1, header_sha256="f" * 64),),
)


class HeadArrivingFromTheHub(LocalModel):
    """A model whose host's head stage arrives as a fetch from the hub lays one out: in its partial
    file, its tensor data zeros, as the plan is made (a fetch ahead of the plan, `ahead`) or once
    the deployment asks for this host's share (a fetch after it); its bytes land once a load of it
    waits for them (or `ANSWER_WITHIN_S` has passed): whether one did."""

    def __init__(self, path: Path, cache: Path, ahead: bool) -> None:
        super().__init__(path, HUB_MODEL)
        self.cache, self.ahead = cache, ahead
        self.head_loading_meanwhile: bool | None = None
        self._head: StageFile | None = None
        self._fetch = contextlib.ExitStack()

    def stages(self, counts: Sequence[int], cache: Path, progress: Progress) -> list[PlannedStage]:
        planned = super().stages(counts, cache, progress)
        if self._head is None:  # the fetch begins with the first plan (the test's own look first)
            self._head = planned[-1].file
            if self.ahead:
                self._lay_out(self._head)
        return [*planned[:-1], dataclasses.replace(planned[-1], file=None)]  # the head's not here yet

    def _lay_out(self, head: StageFile | None) -> None:
        assert head is not None
        partial = partial_stage(HUB_MODEL, head.first_block, head.end_block, True, self.cache)
        partial.parent.mkdir(parents=True)
        start = FastGGUFReader(head.path).data_offset
        partial.write_bytes(head.path.read_bytes()[:start] + bytes(head.n_bytes - start))
        fd = os.open(partial, os.O_RDWR)
        self._fetch.callback(os.close, fd)
        self.arrival = self._fetch.enter_context(arriving(fd))
        self._fd, self._start = fd, start

    def stage_file(self, stage: PlannedStage, cache: Path, progress: Progress) -> StageFile:
        file = stage.file or self._head
        assert file is not None
        return file

    def own_stages(self, own: Sequence[PlannedStage], progress: Progress) -> None:
        assert self._head is not None
        if not self.ahead:
            self._lay_out(self._head)
        with self._fetch:
            try:
                until(lambda: self.arrival.waiting == 1, "a load of the head waiting for its bytes", ANSWER_WITHIN_S)
                self.head_loading_meanwhile = True
            except AssertionError:
                self.head_loading_meanwhile = False
            os.pwrite(self._fd, self._head.path.read_bytes()[self._start :], self._start)
            self.arrival.settle(True)


def deploy_to_scripted_members(
    tmp_path: Path, waits_for: str, own_arriving: bool = False, head_arriving: str | None = None
) -> list[bool]:
    """A ring of three blocks: one each on two scripted members, the head on this host. Each
    member, told to load, waits for `waits_for` ("both told": the other member told to load too;
    "head loading": the host's head engine begun) before it answers; whether each saw it. With
    `own_arriving`, this host's own stage arrives only once both members are told to load (or a
    while has passed): whether they were is the last answer. With `head_arriving` ("ahead" or "after
    the plan"), its head stage arrives as from the hub, fetched then, its bytes landing once a load
    of it waits: whether one did is the last answer. The engine the deployment yields is checked
    to hold the head, and closed."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=3)
    told = [asyncio.Event(), asyncio.Event()]
    local = OwnStageArriving(model, told) if own_arriving else LocalModel(model)
    if head_arriving is not None:
        local = HeadArrivingFromTheHub(model, tmp_path / "stages", ahead=head_arriving == "ahead")
    stage_files = local.stages([1, 1, 1], tmp_path / "stages", lambda *_progress: None)

    async def scenario() -> list[bool]:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        host = await RendezvousClient.open(
            handle.url, model="tiny", expected_members=3, capability=FleetDevice(name="host", memory_gib=8),
            fingerprint="a1" * 32,
        )  # fmt: skip
        clients = [host]
        pairs = [await linked_routers(), await linked_routers()]
        try:
            for name, fingerprint in (("first", "b2"), ("second", "c3")):
                device = FleetDevice(name=name, memory_gib=8)
                clients.append(
                    await RendezvousClient.join(handle.url, host.code, capability=device, fingerprint=fingerprint * 32)
                )
            await host.wait_for_members(3, 10)
            members = [client.member_id for client in clients[1:]]
            roster = Roster(client=host, machine="m", known=dict(host.members))
            for member, (host_end, _member_end, _demuxes), stage in zip(members, pairs, stage_files, strict=False):
                roster.routers[member] = host_end
                roster.hellos[member] = Hello(cached_stages=[stage.sha256])
            deployer = Deployer(roster, local, SETTINGS, tmp_path / "stages", say=lambda _text: None)
            stages = tuple(
                Stage(device=name, start=i, end=i + 1, is_head=i == 2, cost_s=None, resident_bytes=1, memory_bytes=1)
                for i, name in enumerate(("first", "second", "host"))
            )
            plan = Plan.model_construct(stages=stages, head="host", ring=("host", "first", "second"))
            seen = {
                "both told": lambda: all(event.is_set() for event in told),
                "head loading": lambda: deployer.ring is not None,  # set as the head's engine begins
            }[waits_for]
            answering = [
                asyncio.create_task(scripted_member(member_end, event, seen))
                for (_host_end, member_end, _demuxes), event in zip(pairs, told, strict=True)
            ]
            deployment = await deployer.deploy(plan, None, lambda *_progress: None)
            assert deployment.chain == [*members, host.member_id]
            saw = list(await asyncio.gather(*answering))
            engine = await deployer.ring_engine(deployment)
            try:
                assert engine.n_vocab() > 0 and deployer.ring is not None
            finally:
                await asyncio.to_thread(engine.close)
                await deployer.stop_listening()
            if isinstance(local, OwnStageArriving):
                saw.append(local.members_loading_meanwhile is True)
            if isinstance(local, HeadArrivingFromTheHub):
                saw.append(local.head_loading_meanwhile is True)
            return saw
        finally:
            for client in clients:
                await client.close()
            for host_end, member_end, demuxes in pairs:
                await host_end.close()
                await member_end.close()
                for demux in demuxes:
                    demux.close()
            await handle.close()

    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_members_are_told_to_load_at_once(tmp_path: Path) -> None:
    # Told one by one, the first told would wait out its ANSWER_WITHIN_S for the other, in vain.
    assert deploy_to_scripted_members(tmp_path, "both told") == [True, True]


def test_the_heads_engine_loads_while_the_members_load(tmp_path: Path) -> None:
    # Built only once every member had loaded, the engine would not have begun while they wait.
    assert deploy_to_scripted_members(tmp_path, "head loading") == [True, True]


def test_members_load_while_the_hosts_own_stage_still_arrives(tmp_path: Path) -> None:
    # Told only once this host's own stage is at hand, the members would not be told while it
    # arrives: their loads would then share the head's time to load rather than the fetch's.
    assert deploy_to_scripted_members(tmp_path, "both told", own_arriving=True) == [True, True, True]


@pytest.mark.parametrize("fetched", ["ahead", "after the plan"])
def test_the_heads_engine_begins_while_its_stage_still_arrives_from_the_hub(tmp_path: Path, fetched: str) -> None:
    # Begun only once this host's own share is at hand, no load would wait for the head's bytes,
    # and llama.cpp's reading of the head's vocabulary would follow its last byte.
    assert deploy_to_scripted_members(tmp_path, "head loading", head_arriving=fetched) == [True, True, True]
