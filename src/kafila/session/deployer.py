"""Putting a plan in place over the members' links, and hearing its stages while they serve.

The host assigns each member its stage and ring neighbours; members link to their neighbours
(only the planned edges come up) while their stage files arrive from their cache, from their own
copy of the model, from the hub, or over their link, and each answers `Staged`. Each member's stage
then loads at once (`Load`, `Loaded`), and this machine's own once its share is at hand (the head's,
if it holds the head, last of all, with the engine; a head stage still arriving from the hub begins
loading before its last byte, and reads its tensors once every byte is in).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from kafila.contracts import EdgeStatus, HubModel, Progress, Tell
from kafila.hub.ranges import arriving_stage
from kafila.network.rendezvous import MemberInfo
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.transfer import new_transfer_sequence, send_stage_file
from kafila.planner.types import Plan
from kafila.runtime.engine.engines import RingEngine
from kafila.runtime.engine.stage import BlockStage
from kafila.runtime.gguf.slicer import StageFile
from kafila.runtime.llama.errors import out_of_memory
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.memory import short_of_memory
from kafila.session.host_model import HostModel, PlannedStage, held
from kafila.session.lifecycle import MemoryShortage, StageBroken
from kafila.session.member import serve_stage
from kafila.session.quic_ring import QuicRing
from kafila.session.router import FrameSink, LinkRouter, LocalChannel
from kafila.wire.control import (
    MAX_CONTROL_BYTES,
    Assign,
    ControlError,
    Hello,
    Load,
    Loaded,
    RingEdge,
    Staged,
    StageFailedReport,
    StageSource,
    StageWanted,
    StandBy,
)

Reply = TypeVar("Reply", Staged, Loaded, Staged | StageWanted)
T = TypeVar("T")
LOAD_TIMEOUT_S = 900.0  # a stage file of several GB over a relayed link


class SessionFailed(RuntimeError):
    """The session cannot go on as planned; the message says why, for the person at the host.

    `member`: the member that failed its part (stalled, left, or could not take its stage), if
    one did; the host can then leave it out and plan again with the others. `shortage`: it (or,
    with no `member`, this host) could not load its stage for lack of memory, so a smaller share
    may fit it.
    """

    def __init__(self, message: str, member: str | None = None, shortage: MemoryShortage | None = None) -> None:
        super().__init__(message)
        self.member = member
        self.shortage = shortage


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
class Roster:
    """The members this host verified: what each proved, its link, and what it said it holds."""

    client: RendezvousClient
    machine: str  # this machine's tag in the session (`presence.machine_tag`)
    known: dict[str, MemberInfo] = field(default_factory=dict)  # everyone verified, kept after they leave
    routers: dict[str, LinkRouter] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # member id → "direct" / "relayed"
    hellos: dict[str, Hello] = field(default_factory=dict)
    link_down: Callable[[str], None] = lambda _member: None  # told when a member's link closes

    @property
    def me(self) -> str:
        return self.client.member_id

    def linked(self, member_id: str, router: LinkRouter, path: str) -> None:
        """A verified member's link is up; `link_down` hears when it closes."""
        self.routers[member_id], self.paths[member_id] = router, path
        router.link.closed.add_done_callback(lambda _closed: self.link_down(member_id))

    def name(self, member_id: str) -> str:
        """Unique, readable names for the planner's table: the member's own, with its id if shared."""
        known = self.known or self.client.members
        info = known[member_id]
        # The rendezvous keeps names unique among those present, so a present member is named
        # plainly even where one that left had its name (a machine that rejoins keeps its own).
        among = self.client.members if member_id in self.client.members else known
        names = [m.name for m in among.values()]
        return info.name if names.count(info.name) == 1 else f"{info.name} ({member_id[:6]})"

    def alive(self) -> list[str]:
        return [m for m, r in self.routers.items() if not r.link.closed.done()]

    def others(self) -> list[MemberInfo]:
        """The verified members other than this host, with the fingerprints they proved."""
        return [m for m in self.known.values() if m.member_id != self.me]

    def machines(self, chain: Sequence[str]) -> int:
        """Distinct machines in the ring: the waves worth keeping in flight (stages sharing a
        machine share its cores, and overlapping them there only makes them contend)."""
        return len(set(self.stage_machines(chain)))

    def stage_machines(self, chain: Sequence[str]) -> tuple[int, ...]:
        """The machine of each member of `chain`, numbered in order of first appearance."""
        own = self.machine
        named = [own if m == self.me else (self.hellos[m].machine or m) for m in chain]
        numbers = {name: number for number, name in enumerate(dict.fromkeys(named))}
        return tuple(numbers[name] for name in named)


@dataclass
class Deployment:
    """One epoch's plan, put in place: which member holds which stage."""

    epoch: int
    plan: Plan
    chain: list[str]  # member ids in chain order, the head last (this host, unless it cannot hold it)
    counts: list[int]
    stages: list[PlannedStage]
    host: str  # this host's member id
    vocabulary: Path | None = None  # what the engine samples and embeds with, where the head is on a member

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


@dataclass(frozen=True)
class StageOrigin:
    """Where a member's stage file came from, as it said (`Staged`), for /status."""

    source: StageSource
    n_bytes: int
    seconds: float | None
    why: str | None = None  # why not from the hub, where it was offered


def stage_source(
    stage: PlannedStage, hello: Hello, model_sha256: str | None, hub: HubModel | None
) -> Literal["cache", "slice", "hub", "transfer"]:
    """How a member gets its stage: from its cache, cut from its own copy of the model, fetched from
    the hub by its ranges (the host sends it where that fails), or sent by the host."""
    if stage.sha256 is not None and stage.sha256 in hello.cached_stages:
        return "cache"
    if hello.model_sha256 is not None and hello.model_sha256 == model_sha256:
        return "slice"
    return "hub" if hub is not None else "transfer"


def offered(assign: Assign) -> Assign:
    """`assign`, or, where naming the hub model makes it more than a control message carries (a
    model split in very many parts), the same stage sent by the host (which then names it by its
    sha256, fetching it first where it holds no file of it: `Deployer.deploy`)."""
    if assign.source != "hub" or len(assign.model_dump_json()) <= MAX_CONTROL_BYTES - 1024:
        return assign
    return assign.model_copy(update={"source": "transfer", "hub": None})


@dataclass
class Deployer:
    """Puts one plan after another in place over the roster's links, and hears the stages while
    they serve: a stage that lost a ring link says so (`stage_broken`), and the host replans."""

    roster: Roster
    model: HostModel
    settings: ContextSettings
    cache: Path
    say: Tell
    epoch: int = 0
    deployment: Deployment | None = None
    ring: QuicRing | None = None
    ring_edges: dict[str, dict[str, RingEdge]] = field(default_factory=dict)  # member → neighbour → edge
    stage_broken: Callable[[StageBroken], None] = lambda _report: None  # told when a serving stage stops
    broken_edges: set[frozenset[str]] = field(default_factory=set)  # member pairs whose ring link broke
    own_stage: OwnStage | None = None
    _listeners: list[asyncio.Task[None]] = field(default_factory=list)
    refused_controls: dict[str, int] = field(default_factory=dict)  # member → control messages not understood
    origins: dict[str, StageOrigin] = field(default_factory=dict)  # member → where its stage came from
    # Each pair of members ever linked in a ring → the round trip its link measured (ms), kept
    # after the ring changes, for the planner's choice of who serves.
    measured_rtts: dict[frozenset[str], float] = field(default_factory=dict)
    # The head's engine, loading since this host's own stage was at hand, and its epoch.
    _head_engine: tuple[int, asyncio.Future[RingEngine]] | None = None

    async def deploy(
        self,
        plan: Plan,
        model_sha256: str | None,
        progress: Progress,
        pending: Callable[[list[str]], None] = lambda _names: None,
        standing_by: Mapping[str, str] | None = None,
    ) -> Deployment:
        """Assign, deliver and wait for every member's stage; raises SessionFailed.

        `model_sha256`: the model's, for members with their own copy of it; `progress` hears (what,
        bytes done, bytes in all) of cutting (or fetching) the stage files and of sending each;
        `pending` hears what the ring still waits for, member by member, as that shrinks;
        `standing_by`: the members the plan leaves out, each told why (`StandBy`), so that one
        that served drops its stage and its ring links.
        """
        me = self.roster.me
        await self.stop_listening()  # the replies to this deployment are read below
        await self.drop_own_stage()  # its memory is the new plan's, and its frames must not reach the new ring
        await self.discard_head_engine()  # one begun for a deployment whose engine never served
        by_name = {self.roster.name(m): m for m in self.roster.known}
        chain = [by_name[stage.device] for stage in plan.stages]
        counts = [stage.end - stage.start for stage in plan.stages]
        self.epoch += 1
        stages = await asyncio.to_thread(self.model.stages, counts, self.cache, progress)
        hub = self.model.hub
        assigns: dict[str, Assign] = {}
        last = len(chain) - 1
        for index, member in enumerate(chain):
            if member == me:
                continue
            stage = stages[index]
            source = stage_source(stage, self.roster.hellos[member], model_sha256, hub)
            # Block 0 is fed by the host (the embedding), and the head answers the host (the logits).
            predecessor = chain[index - 1] if index > 0 else me
            successor = chain[index + 1] if index < last else me
            assigns[member] = offered(Assign(
                epoch=self.epoch, stage_index=index, first_block=stage.first_block, end_block=stage.end_block,
                sha256=stage.sha256, size=stage.n_bytes, source=source, hub=hub if source == "hub" else None,
                predecessor=predecessor, successor=successor,
                n_ctx=self.settings.n_ctx, n_batch=self.settings.n_batch, n_seq_max=self.settings.n_seq_max,
                relink=sorted({p for p in (predecessor, successor) if frozenset((member, p)) in self.broken_edges}),
                fingerprints={p: self.roster.known[p].fingerprint for p in (predecessor, successor) if p != me},
                head=index == last, need_bytes=plan.stages[index].resident_bytes,
                transfer=new_transfer_sequence() if source in ("transfer", "hub") else None,
            ))  # fmt: skip
            if assigns[member].source == "transfer" and stage.file is None:  # the hub too long to name
                stages[index] = held(await asyncio.to_thread(self.model.stage_file, stage, self.cache, progress))
                named = {"sha256": stages[index].sha256, "size": stages[index].n_bytes}
                assigns[member] = assigns[member].model_copy(update=named)
        for router in self.roster.routers.values():
            router.activation.drain()  # frames of a broken ring must not reach the new one
        for member, why in (standing_by or {}).items():
            if member in self.roster.routers:
                with contextlib.suppress(Exception):  # a member gone is the next look's to see
                    await self.roster.routers[member].send_control(StandBy(epoch=self.epoch, reason=why[:1000]))
        for member, assign in assigns.items():
            await self._tell(member, assign, "take its part")
        # Every member links to its neighbours and gets its file at once.
        preparing = {self.roster.name(m): "to link and get its stage" for m in assigns}

        def report() -> None:
            pending([f"{name} {what}" for name, what in sorted(preparing.items())])

        async def load(member: str, assign: Assign) -> None:
            await self._tell(member, Load(epoch=assign.epoch), "load its stage")
            loaded = await self._expect(member, assign.epoch, Loaded, "load its stage", assign)
            self.say(
                f"{self.roster.name(member)} loaded blocks {assign.first_block}-{assign.end_block - 1} "
                f"in {loaded.seconds:.1f} s"
            )
            del preparing[self.roster.name(member)]
            report()

        async def prepared_and_loaded(member: str, assign: Assign) -> Staged:
            """The member's stage got, then loaded at once: its load is done while this host's own
            stage still arrives (a head fetched from the hub is the ring's last), rather than beside
            the head's. Nothing enters the ring before the engine starts, after every load."""
            staged = await self._stage(member, assign, stages[assign.stage_index], progress)
            preparing[self.roster.name(member)] = "to load its stage"
            report()
            await load(member, assign)
            return staged

        report()

        async def own_share() -> Path | None:
            """This host's own stage files where it has yet to fetch them (a model on the hub), and,
            with the head on a member, what it samples and embeds with: got while the members get
            theirs."""
            own = [i for i, member in enumerate(chain) if member == me]
            await asyncio.to_thread(self.model.own_stages, [stages[i] for i in own], progress)
            for index in (i for i in own if stages[i].file is None):
                fetch = functools.partial(self.model.stage_file, stages[index], self.cache, progress)
                stages[index] = held(await asyncio.to_thread(fetch))
            if chain[-1] == me:
                return None
            return await asyncio.to_thread(self.model.vocabulary, self.cache, progress)

        async def own_then_head() -> Path | None:
            """This host's share, then, with the head here, the head's engine loading while the
            members still get and load their stages: the ring is ready as their last loads. Where
            the head's own stage is still arriving from the hub, its engine begins loading at once
            (`_arriving_engine`), and takes its tensors as the last byte lands."""
            loop = asyncio.get_running_loop()
            share = asyncio.ensure_future(own_share())
            arriving: asyncio.Future[RingEngine] | None = None
            try:
                arriving = await self._arriving_engine(Deployment(self.epoch, plan, chain, counts, stages, me), share)
                vocabulary = await share
            except BaseException:
                share.cancel()
                if arriving is not None:  # closed once loaded (a thread cannot be stopped), not waited for
                    arriving.add_done_callback(_close_loaded)
                raise
            if chain[-1] == me:
                early = Deployment(self.epoch, plan, chain, counts, stages, me, vocabulary)
                engine = self._head_once_arrived(arriving, early, loop)
                self._head_engine = (self.epoch, asyncio.ensure_future(engine))
            return vocabulary

        own_task = asyncio.ensure_future(own_then_head())
        try:
            staged = await all_or_none([prepared_and_loaded(m, a) for m, a in assigns.items()])
            vocabulary_path = await own_task
        except BaseException:
            own_task.cancel()
            await asyncio.gather(own_task, return_exceptions=True)
            await self.discard_head_engine()
            raise
        self.origins = {
            m: StageOrigin(s.source or ("host" if a.source == "transfer" else a.source), a.size, s.seconds, s.why)
            for (m, a), s in zip(assigns.items(), staged, strict=True)
        }
        self.ring_edges = {m: {e.peer: e for e in s.edges} for m, s in zip(assigns, staged, strict=True)}
        self.measured_rtts.update(mean_round_trips(self.ring_edges))

        # This host's own block stages load once its share is at hand, the head's last of all (with
        # the engine): nothing enters the ring before the engine starts, so no stage can send to
        # one still loading.
        loads = []
        for index in (i for i in range(last) if chain[i] == me):
            own_file = stages[index].file
            assert own_file is not None, "this host's own stages are at hand"
            loads.append(self._load_own_stage(chain, index, own_file, plan.stages[index].resident_bytes))
        try:
            await all_or_none(loads)
        except BaseException:
            await self.discard_head_engine()
            raise
        self.deployment = Deployment(self.epoch, plan, chain, counts, stages, me, vocabulary_path)
        self.broken_edges.clear()  # rebuilt, or no longer in the ring
        self._listen(self.deployment.members, self.epoch)
        return self.deployment

    async def _load_own_stage(self, chain: Sequence[str], index: int, stage_file: StageFile, need_bytes: int) -> None:
        """Load this host's block range and serve it between its ring neighbours, as a member would;
        the engine feeds it directly when it holds block 0."""
        what = f"blocks {stage_file.first_block}-{stage_file.end_block - 1}"
        started = time.perf_counter()
        executor = ThreadPoolExecutor(1, thread_name_prefix="own-stage")
        blocks = (stage_file.first_block, stage_file.end_block)
        loading = executor.submit(
            load_here, blocks, need_bytes, functools.partial(BlockStage, stage_file.path, self.settings)
        )
        try:
            stage = await asyncio.wrap_future(loading)
        except SessionFailed:
            executor.shutdown(wait=False)
            raise
        except asyncio.CancelledError:  # a member's load failed meanwhile: this one is freed once loaded
            loading.add_done_callback(_close_loaded)
            executor.shutdown(wait=False)
            raise
        local = LocalChannel() if index == 0 else None
        inbound = local if local is not None else self.roster.routers[chain[index - 1]].activation
        outbound = self.roster.routers[chain[index + 1]].activation
        task = asyncio.create_task(serve_stage(stage, inbound, outbound, executor), name="own-stage")
        task.add_done_callback(functools.partial(self._own_stage_stopped, self.epoch))
        self.own_stage = OwnStage(stage, task, local, executor)
        self.say(f"this machine loaded {what} in {time.perf_counter() - started:.1f} s")

    def _own_stage_stopped(self, epoch: int, task: asyncio.Task[None]) -> None:
        """This host's stage stopped by itself (a ring link it serves went down): replan."""
        if not task.cancelled() and task.exception() is not None:
            self.stage_broken(StageBroken(f"this machine's stage stopped: {task.exception()}", epoch))

    async def drop_own_stage(self) -> None:
        """Stop serving this host's block range and free it: before a new plan, or alone, or at the end."""
        own, self.own_stage = self.own_stage, None
        if own is not None:
            await own.close()

    async def _stage(self, member: str, assign: Assign, stage: PlannedStage, progress: Progress) -> Staged:
        """Stream the stage file if the member needs it (or asks for it, where the hub would not give
        it: this host then gets the file first, where it does not hold it), then wait until it has
        linked and verified."""
        what = "link to its neighbours and get its stage"
        if assign.source == "hub":
            either = cast(type[Staged | StageWanted], (Staged, StageWanted))  # `isinstance` takes the pair
            answer: Staged | StageWanted = await self._expect(member, assign.epoch, either, what)
            if isinstance(answer, Staged):
                return answer
            name = self.roster.name(member)
            self.say(f"{name} could not fetch its stage from the hub ({answer.reason}): sending it from here")
        if assign.source in ("transfer", "hub"):
            name = self.roster.name(member)
            try:
                file = stage.file
                if file is None:
                    self.say(f"fetching {name}'s blocks {stage.first_block}-{stage.end_block - 1} here, to send them")
                    file = await asyncio.to_thread(self.model.stage_file, stage, self.cache, progress)
                sent = await send_stage_file(
                    self.roster.routers[member].transfer,
                    file.path,
                    file.sha256,
                    assign.stage_index,
                    functools.partial(progress, f"stage file to {name}"),
                    sequence_id=assign.transfer,
                )
                if 0 < sent < file.n_bytes:  # a partial file kept from a transfer that broke
                    self.say(f"{name} held {file.n_bytes - sent} bytes of its stage from before: sent the other {sent}")
            except Exception as error:  # its side gave up, or its link went down
                raise SessionFailed(f"{name} could not receive its stage: {error}", member) from None
        return await self._expect(member, assign.epoch, Staged, what)

    async def _tell(self, member: str, message: Assign | Load, what: str) -> None:
        """Send a member its part of the deployment; SessionFailed naming it where its link is down
        (it died, say, while the host replanned for another reason), so the host leaves it out."""
        try:
            await self.roster.routers[member].send_control(message)
        except Exception as error:
            raise SessionFailed(f"{self.roster.name(member)} left before it could {what}: {error}", member) from None

    async def _expect(
        self,
        member: str,
        epoch: int,
        kind: type[Reply],
        what: str,
        loading: Assign | None = None,
    ) -> Reply:
        """The member's next `kind` message of this epoch; SessionFailed if it fails, leaves or stalls
        (with the shortage, where it could not load the stage `loading` for lack of memory)."""
        name = self.roster.name(member)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            try:
                message = await self.roster.routers[member].next_control(max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise SessionFailed(f"{name} did not {what} in {LOAD_TIMEOUT_S:.0f} s", member) from None
            except Exception as error:
                raise SessionFailed(f"{name} left before it could {what}: {error}", member) from None
            if isinstance(message, kind) and message.epoch == epoch:
                return message
            if isinstance(message, StageFailedReport) and message.epoch == epoch:
                shortage = None
                if message.out_of_memory and loading is not None and loading.need_bytes is not None:
                    blocks = (loading.first_block, loading.end_block)
                    shortage = MemoryShortage(blocks, loading.need_bytes, message.can_hold_bytes)
                raise SessionFailed(f"{name} could not {what}: {message.message}", member, shortage)

    def _listen(self, members: Sequence[str], epoch: int) -> None:
        """Hear members while the ring serves: a stage that lost a ring link says so, and the host replans."""
        self._listeners = [asyncio.create_task(self._listen_to(m, epoch)) for m in members]

    async def _listen_to(self, member: str, epoch: int) -> None:
        router = self.roster.routers[member]
        while True:
            try:
                message = await router.next_control()
            except ControlError:  # one unreadable or unknown message is refused; the next is heard
                self.refused_controls[member] = self.refused_controls.get(member, 0) + 1
                continue
            except Exception:  # its link went down: the host's watcher sees that by itself
                return
            if isinstance(message, StageFailedReport) and message.epoch == epoch:
                if message.lost_peer is not None:  # both ends rebuild it if the next plan keeps it
                    self.broken_edges.add(frozenset((member, message.lost_peer)))
                self.stage_broken(StageBroken(f"{self.roster.name(member)}: {message.message}", epoch))
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
        chain, depth = deployment.chain, self.roster.machines(deployment.chain)
        machines = self.roster.stage_machines(chain)
        members = {self.roster.name(m): self.roster.routers[m].link.closed for m in deployment.members}
        back = chain[-2] if deployment.head_here else chain[-1]
        first: FrameSink
        if chain[0] == self.roster.me and not deployment.head_here:
            assert self.own_stage is not None and self.own_stage.inbound is not None
            first, first_name = self.own_stage.inbound, "this machine's stage"
        else:
            first, first_name = self.roster.routers[chain[0]].activation, self.roster.name(chain[0])
        ring = QuicRing(loop, first, first_name, self.roster.routers[back].activation, self.roster.name(back), members)
        self.ring = ring
        cut = self.model.prefix_cut()
        if deployment.head_here:
            head = deployment.stages[-1].file
            assert head is not None, "this host's own stages are at hand"
            return load_here(
                (head.first_block, head.end_block),
                deployment.plan.stages[-1].resident_bytes,
                lambda: RingEngine(
                    [head], self.settings, ring=ring, depth=depth, prefix_cut=cut, stage_machines=machines
                ),
            )
        vocabulary = deployment.vocabulary
        assert vocabulary is not None, "got with the deployment"
        return RingEngine(
            deployment.stages, self.settings, ring=ring, depth=depth, model=vocabulary, prefix_cut=cut,
            stage_machines=machines,
        )  # fmt: skip

    async def _arriving_engine(
        self, deployment: Deployment, share: asyncio.Future[Any]
    ) -> asyncio.Future[RingEngine] | None:
        """The head's engine begun as soon as its stage file is laid out while its tensors still
        arrive from the hub in this process (fetched ahead of the plan, or by `share`, this host's
        share got after it): llama.cpp reads its vocabulary meanwhile and its tensors once the last
        byte lands (`runtime.gguf.arriving`). None where the head is not here, or `share` ended
        with its stage never arriving."""
        head = deployment.stages[-1]
        hub = self.model.hub
        if not deployment.head_here or head.file is not None or hub is None:
            return None
        found = await arriving_stage(hub, head.first_block, head.end_block, True, self.cache, share)
        if found is None:
            return None
        path, arrival = found
        stage = StageFile(len(deployment.stages) - 1, head.first_block, head.end_block, True, path, "", head.n_bytes)
        stages = [*deployment.stages[:-1], held(stage)]
        loading = replace(deployment, stages=stages)
        loop = asyncio.get_running_loop()

        def load() -> RingEngine:
            engine = self.engine(loading, loop)
            if not arrival.wait():  # a fetch that broke after the load took its bytes: not this head
                engine.close()
                raise SessionFailed(f"this machine's stage at {path} never arrived whole")
            return engine

        return asyncio.ensure_future(asyncio.to_thread(load))

    async def _head_once_arrived(
        self, arriving: asyncio.Future[RingEngine] | None, deployment: Deployment, loop: asyncio.AbstractEventLoop
    ) -> RingEngine:
        """The head's engine: the one begun while its stage arrived, where it loaded; else loaded now
        from the stage file at hand."""
        if arriving is not None:
            with contextlib.suppress(Exception):  # its fetch failed, or was halted for another stage
                return await arriving
        return await asyncio.to_thread(self.engine, deployment, loop)

    async def ring_engine(self, deployment: Deployment) -> RingEngine:
        """The engine over `deployment`'s ring: the one `deploy` began loading with the head, or
        one built now."""
        begun, self._head_engine = self._head_engine, None
        if begun is not None and begun[0] == deployment.epoch:
            return await begun[1]
        if begun is not None:
            await _closed(begun[1])
        return await asyncio.to_thread(self.engine, deployment, asyncio.get_running_loop())

    async def discard_head_engine(self) -> None:
        """Close the head's engine `deploy` began, where the deployment failed after all."""
        begun, self._head_engine = self._head_engine, None
        if begun is not None:
            await _closed(begun[1])

    def abandon_ring(self) -> None:
        """End every wait of the current ring at once, before its engine is retired for a new plan."""
        if self.ring is not None:
            self.ring.abandon()

    def chain_edges(self, chain: Sequence[str]) -> list[EdgeStatus]:
        """The ring's links in the order a token crosses them: how each goes (direct or relayed) and
        its round trip. A head on a member answers the host, which feeds block 0."""
        path = [*chain, self.roster.me] if chain[-1] != self.roster.me else list(chain)
        hops = list(itertools.pairwise(path))
        if path[0] != path[-1]:
            hops.append((path[-1], path[0]))
        edges = []
        for member, successor in hops:
            if self.roster.me in (member, successor):
                other = successor if member == self.roster.me else member
                router = self.roster.routers.get(other)
                way, rtt = self.roster.paths.get(other), router.link.core.rtt_ms if router is not None else None
            else:
                edge = self.ring_edges.get(member, {}).get(successor)
                way, rtt = (edge.path, edge.rtt_ms) if edge else (None, None)
            ends = {"from": self.roster.name(member), "to": self.roster.name(successor)}
            edges.append(EdgeStatus.model_validate({**ends, "path": way, "rtt_ms": rtt}))
        return edges


def mean_round_trips(edges: dict[str, dict[str, RingEdge]]) -> dict[frozenset[str], float]:
    """Each pair of members' round trip, the mean of what either end measured of their link."""
    seen: dict[frozenset[str], list[float]] = {}
    for member, by_peer in edges.items():
        for peer, edge in by_peer.items():
            if edge.rtt_ms is not None:
                seen.setdefault(frozenset((member, peer)), []).append(edge.rtt_ms)
    return {pair: sum(trips) / len(trips) for pair, trips in seen.items()}


async def _closed(building: asyncio.Future[RingEngine]) -> None:
    """Wait out an engine's load (a thread cannot be stopped) and close it; its failure is moot."""
    with contextlib.suppress(Exception):
        engine = await asyncio.shield(building)
        await asyncio.to_thread(engine.close)


def _close_loaded(loading: Future[BlockStage] | asyncio.Future[RingEngine]) -> None:
    """Close a stage or engine whose load went on after the deployment that wanted it failed."""
    if not loading.cancelled() and loading.exception() is None:
        loading.result().close()


def load_here(blocks: tuple[int, int], need_bytes: int, load: Callable[[], T]) -> T:
    """Load this host's part of the ring (blocking), as a member loads its own: refused before
    loading where less memory is free than the plan counted, and an allocation llama.cpp could not
    make read as a shortage, so that the host plans again with less of its memory."""
    what = f"blocks {blocks[0]}-{blocks[1] - 1}"
    free = short_of_memory(need_bytes)
    if free is not None:
        raise SessionFailed(
            f"this machine cannot load its {what}: {free / 2**30:.2f} GiB free here; they need "
            f"{need_bytes / 2**30:.2f} GiB",
            shortage=MemoryShortage(blocks, need_bytes, free),
        )
    try:
        return load()
    except Exception as error:
        shortage = MemoryShortage(blocks, need_bytes) if out_of_memory(error) else None
        raise SessionFailed(f"this machine could not load its {what}: {error}", shortage=shortage) from None
