"""The host's deployer tells every member to load its stage at once, not one after another: a
member's load does not wait on another's, so the ring is ready one load after the last stage
arrives, not one load a member after (issue 36). Real QUIC links and a real rendezvous; the two
members are scripted, so that each can tell whether the other was told to load before it answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from linked_routers import linked_routers
from tiny_models import write_tiny_model

from kafila.contracts import FleetDevice
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous
from kafila.planner.types import Plan, Stage
from kafila.runtime.llama.model import ContextSettings
from kafila.session.deployer import Deployer, Roster
from kafila.session.host_model import LocalModel
from kafila.session.router import LinkRouter
from kafila.wire.control import Assign, Hello, Load, Loaded, Staged

SETTINGS = ContextSettings(n_ctx=256, n_batch=32, n_seq_max=2, n_threads=1)
ANSWER_WITHIN_S = 5.0  # how long a scripted member waits to see the other told to load


async def scripted_member(router: LinkRouter, told: asyncio.Event, both_told: list[asyncio.Event]) -> bool:
    """Answer the host's Assign as a member holding its stage in its cache; on Load, wait (a
    while) until both members were told to load, then answer Loaded. Whether both were."""
    assign = await router.next_control(30)
    assert isinstance(assign, Assign) and assign.source == "cache", assign
    await router.send_control(Staged(epoch=assign.epoch, source="cache", seconds=0.0))
    load = await router.next_control(30)
    assert isinstance(load, Load) and load.epoch == assign.epoch, load
    told.set()
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in both_told)), ANSWER_WITHIN_S)
        saw_both = True
    except TimeoutError:
        saw_both = False
    await router.send_control(Loaded(epoch=assign.epoch, stage_index=assign.stage_index, seconds=0.0))
    return saw_both


def test_members_are_told_to_load_at_once(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=3)
    local = LocalModel(model)
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
            names = ["first", "second", "host"]
            stages = tuple(
                Stage(device=name, start=i, end=i + 1, is_head=i == 2, cost_s=None, resident_bytes=1, memory_bytes=1)
                for i, name in enumerate(names)
            )
            plan = Plan.model_construct(stages=stages, head="host", ring=("host", "first", "second"))
            told = [asyncio.Event(), asyncio.Event()]
            answering = [
                asyncio.create_task(scripted_member(member_end, event, told))
                for (_host_end, member_end, _demuxes), event in zip(pairs, told, strict=True)
            ]
            deployment = await deployer.deploy(plan, None, lambda *_progress: None)
            assert deployment.chain == [*members, host.member_id]
            await deployer.stop_listening()
            return list(await asyncio.gather(*answering))
        finally:
            for client in clients:
                await client.close()
            for host_end, member_end, demuxes in pairs:
                await host_end.close()
                await member_end.close()
                for demux in demuxes:
                    demux.close()
            await handle.close()

    # Told one by one, the first told would wait out its ANSWER_WITHIN_S for the other, in vain.
    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [True, True]
