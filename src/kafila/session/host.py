"""`kafila host` with members: gather them, plan, deliver their stages, and drive the ring.

The order, and why:
1. open the session at the rendezvous and print the full code (channel + secret);
2. prove the code to every joiner and pin their certificates (SPAKE2, `verify_members`);
3. bring up a pinned QUIC link to each member, punched where possible, relayed where not;
4. hear what each member already holds (`Hello`), then plan with every member's probe, the
   head here unless this machine cannot hold it, refusing before anything loads if the model
   does not fit;
5. assign each member its stage and ring neighbours: members link to their neighbours (only the
   planned edges come up) while their stage files arrive from their cache, from their own copy
   of the model, or over their link; each answers `Staged`;
6. have the stages load downstream-first (`Load`, `Loaded`), this machine's own in its turn
   (the head's, if it holds the head, last), and serve.

With the head here, the ring runs host → block 0 … → host. With the head on a member, the host
embeds each step's tokens from the model file and serves its own block range as a plain stage;
the head member sends each step's logits back to the host, which samples: host → block 0 … →
head → host, the host's own stage somewhere along the way.

When a member's link goes down, or a serving member reports that its stage stopped (a ring link
between members went down), steps 4-6 run again with the members that are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from kafila.contracts import (
    EdgeStatus,
    MemberStatus,
    PlanStatus,
    RebalanceStatus,
    SessionStatus,
    StageReport,
)
from kafila.network.edges import connect_edges
from kafila.network.link import DatagramDemux
from kafila.network.pake import TrustError
from kafila.network.rendezvous import MemberInfo
from kafila.network.rendezvous_client import (
    RendezvousClient,
    RendezvousError,
    send_abort,
    verify_members,
    verify_newcomer,
)
from kafila.network.session_codes import full_code, new_secret
from kafila.network.transfer import send_stage_file
from kafila.planner.fleet import ModelPricing
from kafila.planner.rebalance import RebalanceVerdict
from kafila.planner.types import ModelManifest, Plan, SessionSpec
from kafila.runtime.llama_backend import ContextSettings, set_up_to_share_cores, sharing_cores_hint
from kafila.runtime.local_plan import cached_model_pricings
from kafila.runtime.pipeline import RingEngine
from kafila.runtime.slicer import StageFile, cached_slices
from kafila.runtime.stage import BlockStage
from kafila.session.member import serve_stage
from kafila.session.presence import Presence, machine_tag
from kafila.session.pricing import Machine, PlannedRing, RingPricing
from kafila.session.protocol import Assign, End, Failed, Hello, Load, Loaded, RingEdge, Staged
from kafila.session.quic_ring import QuicRing
from kafila.session.router import FrameSink, LinkRouter, LocalChannel

Say = Callable[[str], None]
Reply = TypeVar("Reply", Staged, Loaded)
T = TypeVar("T")
HELLO_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 900.0  # a stage file of several GB over a relayed link
GOODBYE_WAIT_S = 2.0  # how long the host waits for members to close their links after their End


class SessionFailed(RuntimeError):
    """The session cannot go on as planned; the message says why, for the person at the host.

    `member`: the member that failed its part (stalled, left, or could not take its stage), if
    one did; the host can then leave it out and plan again with the others.
    """

    def __init__(self, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member


async def all_or_none(work: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, or the first failure with the rest cancelled: a waiter left behind would
    read, and drop, the control messages of the next deployment."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Deployment:
    """One epoch's plan, put in place: which member holds which stage."""

    epoch: int
    plan: Plan
    chain: list[str]  # member ids in chain order, the head last (this host, unless it cannot hold it)
    counts: list[int]
    stages: list[StageFile]
    host: str  # this host's member id

    @property
    def members(self) -> list[str]:
        """The other machines of the ring, in chain order."""
        return [m for m in self.chain if m != self.host]

    @property
    def head_here(self) -> bool:
        return self.chain[-1] == self.host


@dataclass
class OwnStage:
    """This host's block range, served as a member serves one, when the head is on a member."""

    stage: BlockStage
    task: asyncio.Task[None]
    inbound: LocalChannel | None  # what the engine sends it, when it holds block 0
    executor: ThreadPoolExecutor

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        await asyncio.get_running_loop().run_in_executor(self.executor, self.stage.close)
        self.executor.shutdown(wait=False)


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
    model_hash: asyncio.Future[str]  # the model's sha256, begun before the members came
    routers: dict[str, LinkRouter] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # member id → "direct" / "relayed"
    hellos: dict[str, Hello] = field(default_factory=dict)
    epoch: int = 0
    deployment: Deployment | None = None
    demux: DatagramDemux | None = None  # the links' socket, once the members are verified
    prices: RingPricing = field(init=False)  # each machine's price for the planner (`session.pricing`)
    own_pricings: tuple[ModelPricing, ...] = ()  # the models this machine priced itself (`kafila probe --model`)
    known: dict[str, MemberInfo] = field(default_factory=dict)  # everyone verified, kept after they leave
    ring: QuicRing | None = None
    ring_edges: dict[str, dict[str, RingEdge]] = field(default_factory=dict)  # member → neighbour → edge
    broken: str | None = None  # a serving member's report that its stage stopped
    broken_edges: set[frozenset[str]] = field(default_factory=set)  # member pairs whose ring link broke
    own_stage: OwnStage | None = None
    newcomers: set[str] = field(default_factory=set)  # verified and linked since the last plan, waiting for one
    _admissions: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # member id → its admission
    _listeners: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prices = RingPricing(self.manifest, self.session)

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
        model_hash: asyncio.Future[str],
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
        return cls(presence, client, code, manifest, model, session, settings, cache, say, model_hash)

    def member_name(self, member_id: str) -> str:
        """Unique, readable names for the planner's table: the member's own, with its id if shared."""
        known = self.known or self.client.members
        info = known[member_id]
        # The rendezvous keeps names unique among those present, so a present member is named
        # plainly even where one that left had its name (a machine that rejoins keeps its own).
        among = self.client.members if member_id in self.client.members else known
        names = [m.name for m in among.values()]
        return info.name if names.count(info.name) == 1 else f"{info.name} ({member_id[:6]})"

    # --- newcomers: a member that takes a seat another left ---------------------------------------

    def arrivals(self) -> list[str]:
        """Members the rendezvous introduced after the session formed, not yet being admitted."""
        return [m for m in self.client.members if m != self.me and m not in self.known and m not in self._admissions]

    def admit(self, member_id: str, done: Callable[[BaseException | None], None]) -> None:
        """Verify, link and hear from a newcomer in the background; `done(error)` says how it went
        (None: admitted). A verified newcomer joins `newcomers`, for the next plan."""
        self._in_background(member_id, self._admit(member_id), done)

    def refuse(self, member_id: str, reason: str, done: Callable[[BaseException | None], None]) -> None:
        """Turn a joiner away without checking its code; `done` hears the refusal."""
        self._in_background(member_id, self._refuse(member_id, reason), done)

    def _in_background(
        self, member_id: str, admission: Coroutine[Any, Any, None], done: Callable[[BaseException | None], None]
    ) -> None:
        task = asyncio.create_task(admission)
        self._admissions[member_id] = task
        task.add_done_callback(lambda t: None if t.cancelled() else done(t.exception()))

    async def _refuse(self, member_id: str, reason: str) -> None:
        refusal = TrustError(reason)
        await send_abort(self.client, [member_id], refusal)
        raise refusal

    def waiting_newcomers(self) -> list[str]:
        """Admitted newcomers still linked and in the session, for the next plan; one that went is
        forgotten (the rendezvous says so at once, its link's idle bound only seconds later)."""
        self.newcomers &= set(self.alive()) & set(self.client.members)
        return sorted(self.newcomers)

    async def _admit(self, member_id: str) -> None:
        trusted = {m: info.fingerprint for m, info in self.known.items()}
        proved = await verify_newcomer(self.client, self.code, self.presence.identity.fingerprint, member_id, trusted)
        info = self.client.members.get(member_id)
        if info is None:
            raise RendezvousError("member_left", f"{member_id} left after proving the code")
        # What it proved, not what the rendezvous says now: this is what its link and its ring
        # neighbours pin.
        info = info.model_copy(update={"fingerprint": proved})
        self.known[member_id] = info
        assert self.demux is not None  # newcomers come after the session formed
        edges = await connect_edges(self.client, self.demux, self.presence.identity, self.client.code, [info])
        self.routers[member_id] = LinkRouter(edges[member_id].link, member_id)
        self.paths[member_id] = edges[member_id].path
        self.hellos[member_id] = await self._hello(member_id)
        self._note_members_on_this_machine({member_id: self.hellos[member_id]})
        self.prices.forget(member_id)  # the seat may now be another machine
        self.newcomers.add(member_id)

    @property
    def me(self) -> str:
        return self.client.member_id

    def others(self) -> list[MemberInfo]:
        """The verified members other than this host, with the fingerprints they proved."""
        return [m for m in self.known.values() if m.member_id != self.me]

    async def gather(self, ready_timeout: float | None) -> None:
        """Trust, links, hellos: after this every member is verified, linked and has said what it holds."""
        roster = await verify_members(
            self.client, self.code, self.presence.identity.fingerprint, ready_timeout=ready_timeout
        )
        # Pin what each proved, whatever the rendezvous has said of them since.
        self.known = {
            m: info.model_copy(update={"fingerprint": roster[m]})
            for m, info in self.client.members.items()
            if m in roster
        }
        self.say(f"all {len(self.known)} members verified; connecting")
        self.demux = await DatagramDemux.over(self.presence.sock)
        edges = await connect_edges(self.client, self.demux, self.presence.identity, self.client.code, self.others())
        for member_id, edge in edges.items():
            self.routers[member_id] = LinkRouter(edge.link, member_id)
            self.paths[member_id] = edge.path
        hellos = await all_or_none([self._hello(m) for m in self.routers])
        self.hellos = dict(zip(self.routers, hellos, strict=True))
        self._note_members_on_this_machine(self.hellos)
        self.prices.model_sha256 = await self.model_hash
        self.own_pricings = tuple(await asyncio.to_thread(cached_model_pricings))

    def _note_members_on_this_machine(self, hellos: Mapping[str, Hello]) -> None:
        """Stages on one machine take turns on its cores. The demo sets its processes up for that
        (1.4× the tokens/s of two processes left to libgomp's defaults, measured with gemma), but
        a process can only be set up before llama.cpp loads, so a host and members started by
        hand on one machine are told how."""
        own = machine_tag(self.client.code)
        here = [self.member_name(m) for m, hello in hellos.items() if hello.machine == own]
        if here and not set_up_to_share_cores():
            self.say(
                f"{', '.join(here)} {'runs' if len(here) == 1 else 'run'} on this machine too, sharing its cores "
                f"with this host's stage; for their best speed together, {sharing_cores_hint()}"
            )

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

    def known_machines(self) -> dict[str, Machine]:
        """What this host knows of every machine it may plan with, itself included."""
        own = Machine(self.member_name(self.me), self.presence.capability, self.own_pricings)
        found = {self.me: own}
        for member, info in self.known.items():
            if member != self.me:
                hello = self.hellos.get(member)
                pricings = tuple(hello.priced_models) if hello is not None else ()
                found[member] = Machine(self.member_name(member), info.capability, pricings)
        return found

    @property
    def model_sha256(self) -> str | None:
        return self.prices.model_sha256

    def priced_on(self, member: str) -> str:
        return self.prices.priced_on(self.known_machines(), member)

    def _planned_ring(self) -> PlannedRing | None:
        deployment = self.deployment
        return None if deployment is None else PlannedRing(tuple(deployment.chain), deployment.plan)

    def learn_from_serving(self, report: Sequence[StageReport]) -> list[str]:
        """Price every machine of the ring by what its stage measured, for the next plan
        (`RingPricing.learn_from_serving`); returns the names of those repriced."""
        ring = self._planned_ring()
        if ring is None:
            return []
        return [self.member_name(m) for m in self.prices.learn_from_serving(self.known_machines(), ring, report)]

    def rebalance_verdict(self, report: Sequence[StageReport]) -> RebalanceVerdict | None:
        """Whether the serving ring would be clearly faster divided again (`RingPricing.rebalance_verdict`)."""
        ring = self._planned_ring()
        if ring is None:
            return None
        return self.prices.rebalance_verdict(self.known_machines(), ring, [self.me, *self.planned_members()], report)

    def planned_members(self) -> list[str]:
        """The members of the current plan in the order it was planned with (its ring search
        breaks ties by that order), so a plan made again over them differs only by its prices."""
        planned = set(self.deployment.members) if self.deployment is not None else set()
        return [m for m in self.alive() if m in planned]

    def pricing_note(self, members: Sequence[str]) -> str:
        """Which machines' stage times come from what, for the plan's reader."""
        return self.prices.note(self.known_machines(), [self.me, *members], self.model)

    def plan(self, members: Sequence[str]) -> Plan:
        """The plan over this host and `members`, the head here if it fits (`plan_serving_host`);
        PlanRefused names who cannot hold its share."""
        return self.prices.plan(self.known_machines(), [self.me, *members])

    async def deploy(
        self,
        members: Sequence[str],
        progress: Callable[[str, int, int], None],
        pending: Callable[[list[str]], None] = lambda _names: None,
    ) -> Deployment:
        """Plan, assign, deliver and wait for every member's stage; raises SessionFailed or PlanRefused.

        `progress` hears (what, bytes done, bytes in all) of cutting the stage files and of sending
        each; `pending` hears what the ring still waits for, member by member, as that shrinks.
        """
        plan = self.plan(members)
        self.newcomers -= set(members)
        await self.stop_listening()  # the replies to this deployment are read below
        await self.drop_own_stage()  # its memory is the new plan's, and its frames must not reach the new ring
        by_name = {self.member_name(m): m for m in [self.me, *members]}
        chain = [by_name[stage.device] for stage in plan.stages]
        counts = [stage.end - stage.start for stage in plan.stages]
        self.epoch += 1
        cutting = functools.partial(progress, f"cutting {self.model.name} into {len(counts)} stage files")
        stages = await asyncio.to_thread(cached_slices, self.model, counts, self.cache, cutting)
        assigns: dict[str, Assign] = {}
        last = len(chain) - 1
        for index, member in enumerate(chain):
            if member == self.me:
                continue
            stage = stages[index]
            hello = self.hellos[member]
            source: Literal["cache", "slice", "transfer"] = (
                "cache" if stage.sha256 in hello.cached_stages
                else "slice" if hello.model_sha256 is not None and hello.model_sha256 == self.model_sha256
                else "transfer"
            )  # fmt: skip
            # Block 0 is fed by the host (the embedding), and the head answers the host (the logits).
            predecessor = chain[index - 1] if index > 0 else self.me
            successor = chain[index + 1] if index < last else self.me
            assigns[member] = Assign(
                epoch=self.epoch, stage_index=index, first_block=stage.first_block, end_block=stage.end_block,
                sha256=stage.sha256, size=stage.n_bytes, source=source,
                predecessor=predecessor, successor=successor,
                n_ctx=self.settings.n_ctx, n_batch=self.settings.n_batch, n_seq_max=self.settings.n_seq_max,
                relink=sorted({p for p in (predecessor, successor) if frozenset((member, p)) in self.broken_edges}),
                fingerprints={p: self.known[p].fingerprint for p in (predecessor, successor) if p != self.me},
                head=index == last,
            )  # fmt: skip
        for router in self.routers.values():
            router.activation.drain()  # frames of a broken ring must not reach the new one
        for member, assign in assigns.items():
            await self.routers[member].send_control(assign)
        # Every member links to its neighbours and gets its file at once; they load one by one.
        preparing = {self.member_name(m): "to link and get its stage" for m in assigns}

        def report() -> None:
            pending([f"{name} {what}" for name, what in sorted(preparing.items())])

        async def prepared(member: str, assign: Assign) -> Staged:
            staged = await self._stage(member, assign, stages[assign.stage_index], progress)
            preparing[self.member_name(member)] = "to load its stage"
            report()
            return staged

        report()

        staged = await all_or_none([prepared(m, a) for m, a in assigns.items()])
        self.ring_edges = {m: {e.peer: e for e in s.edges} for m, s in zip(assigns, staged, strict=True)}
        for index in reversed(range(len(chain))):  # downstream first: a stage serves only once its successor does
            member = chain[index]
            if member == self.me:
                if index < last:  # the head's own stage loads with the engine, last of all
                    await self._load_own_stage(chain, index, stages[index])
                continue
            assign = assigns[member]
            await self.routers[member].send_control(Load(epoch=assign.epoch))
            loaded = await self._expect(member, assign.epoch, Loaded, "load its stage")
            self.say(
                f"{self.member_name(member)} loaded blocks {assign.first_block}-{assign.end_block - 1} "
                f"in {loaded.seconds:.1f} s"
            )
            del preparing[self.member_name(member)]
            report()
        self.deployment = Deployment(self.epoch, plan, chain, counts, stages, self.me)
        self.prices.last_verdict = None  # a new plan has measured nothing yet
        self.broken_edges.clear()  # rebuilt, or no longer in the ring
        self._listen(self.deployment.members, self.epoch)
        return self.deployment

    async def _load_own_stage(self, chain: Sequence[str], index: int, stage_file: StageFile) -> None:
        """Load this host's block range and serve it between its ring neighbours, as a member would;
        the engine feeds it directly when it holds block 0."""
        what = f"blocks {stage_file.first_block}-{stage_file.end_block - 1}"
        started = time.perf_counter()
        executor = ThreadPoolExecutor(1, thread_name_prefix="own-stage")
        try:
            loop = asyncio.get_running_loop()
            stage = await loop.run_in_executor(executor, BlockStage, stage_file.path, self.settings)
        except Exception as error:
            executor.shutdown(wait=False)
            raise SessionFailed(f"this machine could not load its {what}: {error}") from None
        local = LocalChannel() if index == 0 else None
        inbound = local if local is not None else self.routers[chain[index - 1]].activation
        outbound = self.routers[chain[index + 1]].activation
        task = asyncio.create_task(serve_stage(stage, inbound, outbound, executor), name="own-stage")
        task.add_done_callback(self._own_stage_stopped)
        self.own_stage = OwnStage(stage, task, local, executor)
        self.say(f"this machine loaded {what} in {time.perf_counter() - started:.1f} s")

    def _own_stage_stopped(self, task: asyncio.Task[None]) -> None:
        """This host's stage stopped by itself (a ring link it serves went down): replan."""
        if not task.cancelled() and task.exception() is not None:
            self.broken = f"this machine's stage stopped: {task.exception()}"

    async def drop_own_stage(self) -> None:
        """Stop serving this host's block range and free it: before a new plan, or alone, or at the end."""
        own, self.own_stage = self.own_stage, None
        if own is not None:
            await own.close()

    async def _stage(
        self, member: str, assign: Assign, stage: StageFile, progress: Callable[[str, int, int], None]
    ) -> Staged:
        """Stream the stage file if the member needs it, then wait until it has linked and verified."""
        if assign.source == "transfer":
            name = self.member_name(member)
            try:
                await send_stage_file(
                    self.routers[member].transfer,
                    stage.path,
                    stage.sha256,
                    assign.stage_index,
                    functools.partial(progress, f"stage file to {name}"),
                )
            except Exception as error:  # its side gave up, or its link went down
                raise SessionFailed(f"{name} could not receive its stage: {error}", member) from None
        return await self._expect(member, assign.epoch, Staged, "link to its neighbours and get its stage")

    async def _expect(self, member: str, epoch: int, kind: type[Reply], what: str) -> Reply:
        """The member's next `kind` message of this epoch; SessionFailed if it fails, leaves or stalls."""
        name = self.member_name(member)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            try:
                message = await self.routers[member].next_control(max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise SessionFailed(f"{name} did not {what} in {LOAD_TIMEOUT_S:.0f} s", member) from None
            except Exception as error:
                raise SessionFailed(f"{name} left before it could {what}: {error}", member) from None
            if isinstance(message, kind) and message.epoch == epoch:
                return message
            if isinstance(message, Failed) and message.epoch == epoch:
                raise SessionFailed(f"{name} could not {what}: {message.message}", member)

    # --- while serving ---------------------------------------------------------------------

    def _listen(self, members: Sequence[str], epoch: int) -> None:
        """Hear members while the ring serves: a stage that lost a ring link says so, and the host replans."""
        self.broken = None
        self._listeners = [asyncio.create_task(self._listen_to(m, epoch)) for m in members]

    async def _listen_to(self, member: str, epoch: int) -> None:
        router = self.routers[member]
        while True:
            try:
                message = await router.next_control()
            except Exception:  # its link went down: the host's watcher sees that by itself
                return
            if isinstance(message, Failed) and message.epoch == epoch:
                self.broken = f"{self.member_name(member)}: {message.message}"
                if message.lost_peer is not None:  # both ends rebuild it if the next plan keeps it
                    self.broken_edges.add(frozenset((member, message.lost_peer)))
                return

    async def stop_listening(self) -> None:
        listeners, self._listeners = self._listeners, []
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)

    def engine(self, deployment: Deployment, loop: asyncio.AbstractEventLoop) -> RingEngine:
        """The engine over the links (blocking: loads the head, or the vocabulary; run it in a thread).

        With the head here, frames come back from the last member as hidden states; with the head
        on a member, they come back from it as logits, and this engine holds only the vocabulary.
        """
        chain, depth = deployment.chain, self.machines(deployment.chain)
        members = {self.member_name(m): self.routers[m].link.closed for m in deployment.members}
        back = chain[-2] if deployment.head_here else chain[-1]
        first: FrameSink
        if chain[0] == self.me and not deployment.head_here:
            assert self.own_stage is not None and self.own_stage.inbound is not None
            first, first_name = self.own_stage.inbound, "this machine's stage"
        else:
            first, first_name = self.routers[chain[0]].activation, self.member_name(chain[0])
        ring = QuicRing(loop, first, first_name, self.routers[back].activation, self.member_name(back), members)
        self.ring = ring
        if deployment.head_here:
            return RingEngine([deployment.stages[-1]], self.settings, ring=ring, depth=depth)
        return RingEngine(deployment.stages, self.settings, ring=ring, depth=depth, model=self.model)

    def machines(self, chain: Sequence[str]) -> int:
        """Distinct machines in the ring: the waves worth keeping in flight (stages sharing a
        machine share its cores, and overlapping them there only makes them contend)."""
        own = machine_tag(self.client.code)
        return len({own if m == self.me else (self.hellos[m].machine or m) for m in chain})

    def abandon_ring(self) -> None:
        """End every wait of the current ring at once, before its engine is retired for a new plan."""
        if self.ring is not None:
            self.ring.abandon()

    def status(self, admitting: bool) -> SessionStatus:
        """`admitting`: whether a freed seat may still be taken (the session core decides)."""
        deployment = self.deployment
        members = []
        for member_id, info in (self.known or self.client.members).items():
            entry: dict[str, Any] = {"id": member_id, "name": self.member_name(member_id), "host": info.host}
            if member_id in self.routers:
                router = self.routers[member_id]
                entry["path"] = self.paths.get(member_id)
                entry["link"] = "down" if router.link.closed.done() else "up"
                if member_id not in self.client.members:
                    entry["left"] = True
                if member_id in self.newcomers:
                    entry["joining"] = True
                rtt = router.link.core.rtt_ms
                if rtt is not None:
                    entry["rtt_ms"] = rtt
            if deployment is not None and member_id in deployment.chain:
                index = deployment.chain.index(member_id)
                stage = deployment.plan.stages[index]
                entry["blocks"] = (stage.start, stage.end)
                entry["predicted_ms_per_token"] = round(stage.cost_s * 1e3, 3) if stage.cost_s is not None else None
                entry["priced_on"] = self.priced_on(member_id)
            members.append(MemberStatus(**entry))  # only what applies is set, and shown
        plan = deployment.plan if deployment else None
        verdict = self.prices.last_verdict
        return SessionStatus(
            code=self.code,
            admitting=admitting,
            members=members,
            epoch=self.epoch,
            edges=self.chain_edges(deployment.chain) if deployment is not None else [],
            plan=None if plan is None else PlanStatus(
                tier=plan.tier.value, ring=list(plan.ring), head=plan.head,
                division=deployment.counts if deployment else None,
                predicted_bottleneck_ms=round(plan.bottleneck_s * 1e3, 3) if plan.bottleneck_s else None,
            ),
            rebalance=None if verdict is None else RebalanceStatus(
                reason=verdict.reason,
                measured_bottleneck_ms=round(verdict.measured_bottleneck_s * 1e3, 3),
                planned_bottleneck_ms=None if verdict.planned_bottleneck_s is None
                else round(verdict.planned_bottleneck_s * 1e3, 3),
            ),
        )  # fmt: skip

    def chain_edges(self, chain: Sequence[str]) -> list[EdgeStatus]:
        """The ring's links in the order a token crosses them: how each goes (direct or relayed) and
        its round trip. A head on a member answers the host, which feeds block 0."""
        path = [*chain, self.me] if chain[-1] != self.me else list(chain)
        hops = list(itertools.pairwise(path))
        if path[0] != path[-1]:
            hops.append((path[-1], path[0]))
        edges = []
        for member, successor in hops:
            if self.me in (member, successor):
                other = successor if member == self.me else member
                router = self.routers.get(other)
                way, rtt = self.paths.get(other), router.link.core.rtt_ms if router is not None else None
            else:
                edge = self.ring_edges.get(member, {}).get(successor)
                way, rtt = (edge.path, edge.rtt_ms) if edge else (None, None)
            ends = {"from": self.member_name(member), "to": self.member_name(successor)}
            edges.append(EdgeStatus.model_validate({**ends, "path": way, "rtt_ms": rtt}))
        return edges

    async def dismiss(self, member: str, reason: str) -> None:
        """Send one member home (it failed its part): it hears why, and its link closes."""
        router = self.routers.get(member)
        if router is not None:
            await self._send_home([router], reason)

    @staticmethod
    async def _send_home(routers: Sequence[LinkRouter], reason: str) -> None:
        """Tell each member why it is done, then close its link. A member closes its end once it has
        read its End, so the host waits for that (up to GOODBYE_WAIT_S) rather than for a time: a
        link closed before the End arrived would read as a lost host, which the member joins again."""
        for router in routers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(router.send_control(End(reason=reason)), 1.0)
        answering = [router.link.closed for router in routers if not router.link.closed.done()]
        if answering:
            await asyncio.wait(answering, timeout=GOODBYE_WAIT_S)
        for router in routers:
            with contextlib.suppress(Exception):
                await router.close(reason)

    async def end(self, reason: str) -> None:
        """Tell every member the session is over, then close links, the rendezvous session and the socket."""
        for admission in self._admissions.values():
            admission.cancel()
        await self.stop_listening()
        await self.drop_own_stage()
        await self._send_home(list(self.routers.values()), reason)
        with contextlib.suppress(Exception):
            await self.client.close()
        if self.demux is not None:
            self.demux.close()
        self.presence.sock.close()
