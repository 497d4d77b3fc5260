"""`kafila host` with members: gather them, plan, deliver their stages, and drive the ring.

The order, and why:
1. open the session at the rendezvous and print the full code (channel + secret);
2. prove the code to every joiner and pin their certificates (SPAKE2, `verify_members`);
3. bring up a pinned QUIC link to each member, punched where possible, relayed where not;
4. hear what each member already holds (`Hello`), then plan with every member's probe, the
   head pinned here, refusing before anything loads if the model does not fit;
5. assign each member its stage: from its cache, sliced from its own copy of the model, or
   streamed over its link; wait until every stage reports loaded;
6. only then build the head's engine over the links and serve.

When a member's link goes down, the same steps 4-6 run again with the members that are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kafila.network.rendezvous import MemberInfo
from kafila.network.rendezvous_client import RendezvousClient, verify_members
from kafila.network.session_codes import full_code, new_secret
from kafila.planner import plan_session
from kafila.planner.types import Device, ModelManifest, Plan, SessionSpec
from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.pipeline import RingEngine
from kafila.runtime.slicer import StageFile, cached_slices, file_sha256
from kafila.session.presence import Presence
from kafila.session.protocol import Assign, End, Failed, Hello, Loaded
from kafila.session.quic_ring import QuicRing
from kafila.session.router import LinkRouter

Say = Callable[[str], None]
HELLO_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 900.0  # a stage file of several GB over a relayed link


class SessionFailed(RuntimeError):
    """The session cannot go on; the message says why, for the person at the host."""


@dataclass
class Deployment:
    """One epoch's plan, put in place: which member holds which stage."""

    epoch: int
    plan: Plan
    chain: list[str]  # member ids in chain order, this host last
    counts: list[int]
    stages: list[StageFile]


@dataclass
class HostSession:
    presence: Presence
    client: RendezvousClient
    code: str
    manifest: ModelManifest
    model: Path
    session: SessionSpec
    settings: ContextSettings
    cache: Path
    say: Say
    routers: dict[str, LinkRouter] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # member id → "direct" / "relayed"
    hellos: dict[str, Hello] = field(default_factory=dict)
    epoch: int = 0
    deployment: Deployment | None = None
    demux: Any = None
    model_sha256: str | None = None
    known: dict[str, MemberInfo] = field(default_factory=dict)  # everyone verified, kept after they leave
    ring: QuicRing | None = None

    # --- gathering ---------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        presence: Presence,
        members: int,
        manifest: ModelManifest,
        model: Path,
        session: SessionSpec,
        settings: ContextSettings,
        cache: Path,
        say: Say,
    ) -> HostSession:
        client = await RendezvousClient.open(
            presence.url,
            model=model.stem[:64],
            expected_members=members,
            capability=presence.capability,
            fingerprint=presence.identity.fingerprint,
            candidates=presence.candidates,
        )
        code = full_code(client.code, new_secret(random.SystemRandom()))
        return cls(presence, client, code, manifest, model, session, settings, cache, say)

    def member_name(self, member_id: str) -> str:
        """Unique, readable names for the planner's table: the member's own, with its id if shared."""
        known = self.known or self.client.members
        info = known[member_id]
        names = [m.name for m in known.values()]
        return info.name if names.count(info.name) == 1 else f"{info.name} ({member_id[:6]})"

    @property
    def me(self) -> str:
        return self.client.member_id

    def others(self) -> list[MemberInfo]:
        return [m for m in self.client.members.values() if m.member_id != self.me]

    async def gather(self, ready_timeout: float | None) -> None:
        """Trust, links, hellos: after this every member is verified, linked and has said what it holds."""
        from kafila.network.edges import connect_edges
        from kafila.network.link import DatagramDemux

        await verify_members(self.client, self.code, self.presence.identity.fingerprint, ready_timeout=ready_timeout)
        self.known = dict(self.client.members)
        self.say(f"all {len(self.client.members)} members verified; connecting")
        self.demux = await DatagramDemux.over(self.presence.sock)
        edges = await connect_edges(self.client, self.demux, self.presence.identity, self.client.code, self.others())
        for member_id, edge in edges.items():
            self.routers[member_id] = LinkRouter(edge.link, member_id)
            self.paths[member_id] = edge.path
        hellos = await asyncio.gather(*(self._hello(m) for m in self.routers))
        self.hellos = dict(zip(self.routers, hellos, strict=True))
        self.model_sha256 = await asyncio.to_thread(file_sha256, self.model)

    async def _hello(self, member_id: str) -> Hello:
        try:
            message = await self.routers[member_id].next_control(HELLO_TIMEOUT_S)
        except TimeoutError:
            raise SessionFailed(f"{self.member_name(member_id)} did not report in {HELLO_TIMEOUT_S:.0f} s") from None
        if not isinstance(message, Hello):
            raise SessionFailed(f"{self.member_name(member_id)} sent {message.type} before hello")
        return message

    # --- planning and deployment -----------------------------------------------------------

    def alive(self) -> list[str]:
        return [m for m, r in self.routers.items() if not r.link.closed.done()]

    def devices(self, members: Sequence[str]) -> list[Device]:
        host = self.presence.capability.device().model_copy(update={"name": self.member_name(self.me)})
        others = [self.known[m].capability.device().model_copy(update={"name": self.member_name(m)}) for m in members]
        return [host, *others]

    def plan(self, members: Sequence[str]) -> Plan:
        """The plan over this host and `members`, head here; PlanRefused names who cannot hold its share."""
        devices = self.devices(members)
        return plan_session(self.manifest, devices, self.session, anchor=devices[0].name, pin_head=True)

    async def deploy(
        self,
        members: Sequence[str],
        progress: Callable[[str, int, int], None],
        pending: Callable[[list[str]], None] = lambda _names: None,
    ) -> Deployment:
        """Plan, assign, deliver and wait for every member's stage; raises SessionFailed or PlanRefused.

        `pending` hears the names of the members whose stages are not loaded yet, as that shrinks.
        """
        plan = self.plan(members)
        by_name = {self.member_name(m): m for m in [self.me, *members]}
        chain = [by_name[stage.device] for stage in plan.stages]
        counts = [stage.end - stage.start for stage in plan.stages]
        self.epoch += 1
        stages = await asyncio.to_thread(cached_slices, self.model, counts, self.cache)
        assigns: dict[str, Assign] = {}
        for index, member in enumerate(chain[:-1]):
            stage = stages[index]
            hello = self.hellos[member]
            source: Literal["cache", "slice", "transfer"] = (
                "cache" if stage.sha256 in hello.cached_stages
                else "slice" if hello.model_sha256 is not None and hello.model_sha256 == self.model_sha256
                else "transfer"
            )  # fmt: skip
            assigns[member] = Assign(
                epoch=self.epoch, stage_index=index, first_block=stage.first_block, end_block=stage.end_block,
                sha256=stage.sha256, size=stage.n_bytes, source=source,
                predecessor=chain[index - 1] if index > 0 else self.me, successor=chain[index + 1],
                n_ctx=self.settings.n_ctx, n_batch=self.settings.n_batch, n_seq_max=self.settings.n_seq_max,
            )  # fmt: skip
        for router in self.routers.values():
            router.activation.drain()  # frames of a broken ring must not reach the new one
        for member, assign in assigns.items():
            await self.routers[member].send_control(assign)
        waiting = {self.member_name(m) for m in assigns}
        pending(sorted(waiting))

        async def deliver(member: str, assign: Assign) -> None:
            await self._deliver(member, assign, stages[assign.stage_index], progress)
            waiting.discard(self.member_name(member))
            pending(sorted(waiting))

        await asyncio.gather(*(deliver(m, a) for m, a in assigns.items()))
        self.deployment = Deployment(self.epoch, plan, chain, counts, stages)
        return self.deployment

    async def _deliver(
        self, member: str, assign: Assign, stage: StageFile, progress: Callable[[str, int, int], None]
    ) -> None:
        name = self.member_name(member)
        router = self.routers[member]
        if assign.source == "transfer":
            from kafila.network.transfer import send_stage_file

            await send_stage_file(
                router.transfer,
                stage.path,
                stage.sha256,
                assign.stage_index,
                lambda done, total: progress(name, done, total),
            )
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            try:
                message = await router.next_control(max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise SessionFailed(f"{name} did not load its stage in {LOAD_TIMEOUT_S:.0f} s") from None
            except Exception as error:
                raise SessionFailed(f"{name} left while loading its stage: {error}") from None
            if isinstance(message, Loaded) and message.epoch == assign.epoch:
                self.say(f"{name} loaded blocks {assign.first_block}-{assign.end_block - 1} in {message.seconds:.1f} s")
                return
            if isinstance(message, Failed) and message.epoch == assign.epoch:
                raise SessionFailed(f"{name} could not load its stage: {message.message}")

    def engine(self, deployment: Deployment, loop: asyncio.AbstractEventLoop) -> RingEngine:
        """The head's engine over the links (blocking: loads the head stage; run it in a thread)."""
        first, last = deployment.chain[0], deployment.chain[-2]
        members = {self.member_name(m): self.routers[m].link.closed for m in deployment.chain[:-1]}
        ring = QuicRing(
            loop,
            self.routers[first].activation,
            self.member_name(first),
            self.routers[last].activation,
            self.member_name(last),
            members,
        )
        self.ring = ring
        return RingEngine([deployment.stages[-1]], self.settings, ring=ring)

    def abandon_ring(self) -> None:
        """End every wait of the current ring at once, before its engine is retired for a new plan."""
        if self.ring is not None:
            self.ring.abandon()

    def status(self) -> dict[str, Any]:
        deployment = self.deployment
        members = []
        for member_id, info in (self.known or self.client.members).items():
            entry: dict[str, Any] = {"id": member_id, "name": self.member_name(member_id), "host": info.host}
            if member_id in self.routers:
                router = self.routers[member_id]
                entry["path"] = self.paths.get(member_id)
                entry["link"] = "down" if router.link.closed.done() else "up"
                rtt = router.link.core.rtt_ms
                if rtt is not None:
                    entry["rtt_ms"] = rtt
            if deployment is not None and member_id in deployment.chain:
                index = deployment.chain.index(member_id)
                stage = deployment.plan.stages[index]
                entry["blocks"] = [stage.start, stage.end]
                entry["predicted_ms_per_token"] = round(stage.cost_s * 1e3, 3) if stage.cost_s is not None else None
            members.append(entry)
        plan = deployment.plan if deployment else None
        return {
            "code": self.code,
            "members": members,
            "epoch": self.epoch,
            "plan": None if plan is None else {
                "tier": plan.tier.value, "ring": list(plan.ring), "head": plan.head,
                "division": deployment.counts if deployment else None,
                "predicted_bottleneck_ms": round(plan.bottleneck_s * 1e3, 3) if plan.bottleneck_s else None,
            },
        }  # fmt: skip

    async def end(self, reason: str) -> None:
        """Tell every member the session is over, then close links, the rendezvous session and the socket."""
        for router in self.routers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(router.send_control(End(reason=reason)), 1.0)
        await asyncio.sleep(0.2)  # let the End frames leave before the goodbyes
        for router in self.routers.values():
            with contextlib.suppress(Exception):
                await router.close(reason)
        with contextlib.suppress(Exception):
            await self.client.close()
        if self.demux is not None:
            self.demux.close()
        self.presence.sock.close()
