"""`kafila host` with members: gather them, plan, deliver their stages, and drive the ring.

The order, and why:
1. open the session at the rendezvous and print the full code (channel + secret);
2. prove the code to every joiner and pin their certificates (SPAKE2, `verify_members`);
3. bring up a pinned QUIC link to each member, punched where possible, relayed where not;
4. hear what each member already holds (`Hello`), then plan with every member's probe, the
   head here unless this machine cannot hold it, refusing before anything loads if the model
   does not fit;
5. put the plan in place (`deployer.Deployer`): assign each member its stage and neighbours,
   deliver the stage files, have the stages load downstream-first, and serve.

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
import random
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafila.contracts import (
    BackendReport,
    MemberStatus,
    ModelPricing,
    PlanStatus,
    Progress,
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
    RendezvousClosed,
    RendezvousError,
    send_abort,
    verify_members,
    verify_newcomer,
)
from kafila.network.session_codes import full_code, new_secret
from kafila.planner.rebalance import RebalanceVerdict
from kafila.planner.types import ModelManifest, Plan, ServingSpec
from kafila.runtime.llama.backends import backend_or_none
from kafila.runtime.llama.loading import set_up_to_share_cores, sharing_cores_hint
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.this_machine import cached_model_pricings
from kafila.session.deployer import Deployer, Deployment, Roster, SessionFailed, all_or_none
from kafila.session.presence import Presence, machine_tag
from kafila.session.pricing import Machine, PlannedRing, RingPricing
from kafila.session.router import LinkRouter
from kafila.wire.control import End, Hello

Say = Callable[[str], None]
HELLO_TIMEOUT_S = 60.0
TRUST_EXCHANGE_S = 30.0  # for a joiner to prove the code, and to accept the member list
RENEW_EVERY_S = 600.0  # a rendezvous that does not say how long an idle session lasts gets renewed this often
GOODBYE_WAIT_S = 2.0  # how long the host waits for members to close their links after their End


@dataclass
class HostSession:
    """One session at the rendezvous, from its code to its end: who is in it (the roster), who
    may join it (admissions), what each machine costs (pricing) and the ring put in place (the
    deployer). The session core (`session.core`) decides when each of these happens."""

    presence: Presence
    client: RendezvousClient
    code: str
    manifest: ModelManifest
    model: Path
    session: ServingSpec
    settings: ContextSettings
    cache: Path
    say: Say
    model_hash: asyncio.Future[str]  # the model's sha256, begun before the members came
    demux: DatagramDemux | None = None  # the links' socket, once the members are verified
    roster: Roster = field(init=False)
    deployer: Deployer = field(init=False)
    prices: RingPricing = field(init=False)  # each machine's price for the planner (`session.pricing`)
    own_pricings: tuple[ModelPricing, ...] = ()  # the models this machine priced itself (`kafila probe --model`)
    own_backend: BackendReport | None = None  # llama.cpp's devices here, for /status
    newcomers: set[str] = field(default_factory=set)  # verified and linked since the last plan, waiting for one
    memory_caps: dict[str, int] = field(default_factory=dict)  # member → bytes it held at most (it ran out)
    _admissions: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # member id → its admission
    renewing: Callable[[], bool] = lambda: True  # whether the session at the rendezvous must live on
    rendezvous_lost: Callable[[str], None] = lambda _why: None  # told once if the rendezvous ends it first
    _renewals: asyncio.Task[None] = field(init=False)
    _watching: asyncio.Task[None] = field(init=False)
    _ending: bool = False

    def __post_init__(self) -> None:
        self.roster = Roster(self.client, machine_tag(self.client.code))
        self.deployer = Deployer(self.roster, self.model, self.settings, self.cache, self.say)
        self.prices = RingPricing(self.manifest, self.session)
        loop = asyncio.get_running_loop()
        self._renewals = loop.create_task(self._renew_forever())
        self._watching = loop.create_task(self._watch_rendezvous())

    async def _watch_rendezvous(self) -> None:
        """The rendezvous may end the session before the host does (it restarted, or expired the
        session): the ring serves on over its own links, but no one can join it any more."""
        ended = await self.client.wait_closed()
        if not self._ending:
            why = f"it said {ended.reason.value}" if ended is not None else "its connection closed"
            self.rendezvous_lost(f"the rendezvous ended this session ({why})")

    async def _renew_forever(self) -> None:
        """Renew the session at the rendezvous every third of its idle expiry, whatever the host
        is doing (a replan may move stages for minutes): a direct-only ring shows the rendezvous
        nothing else, and a member that blips must find the session to rejoin."""
        every = (self.client.idle_expiry_s or 3 * RENEW_EVERY_S) / 3
        while not self.client.closed:
            await asyncio.sleep(every)
            if self.renewing():
                await self.keep()

    @classmethod
    async def open(
        cls,
        presence: Presence,
        members: int,
        manifest: ModelManifest,
        model: Path,
        session: ServingSpec,
        settings: ContextSettings,
        cache: Path,
        say: Say,
        model_hash: asyncio.Future[str],
        open_token: str | None = None,
    ) -> HostSession:
        client = await RendezvousClient.open(
            presence.url,
            model=model.stem[:64],
            expected_members=members,
            capability=presence.capability,
            fingerprint=presence.identity.fingerprint,
            candidates=presence.candidates,
            open_token=open_token,
        )
        code = full_code(client.code, new_secret(random.SystemRandom()))
        return cls(presence, client, code, manifest, model, session, settings, cache, say, model_hash)

    @property
    def me(self) -> str:
        return self.client.member_id

    @property
    def known(self) -> dict[str, MemberInfo]:
        return self.roster.known

    def member_name(self, member_id: str) -> str:
        return self.roster.name(member_id)

    def joiner_name(self, member_id: str) -> str:
        """The name a joiner gave the rendezvous, not yet verified; its id once it has gone."""
        info = self.client.members.get(member_id)
        return info.name if info is not None else member_id

    def alive(self) -> list[str]:
        return self.roster.alive()

    @property
    def deployment(self) -> Deployment | None:
        return self.deployer.deployment

    @property
    def broken(self) -> str | None:
        """A serving stage's report that it stopped (the ring is broken), if one came."""
        return self.deployer.broken

    def forget_ring(self) -> None:
        """Nothing serves now: no ring is left to watch."""
        self.deployer.deployment, self.deployer.broken = None, None

    # --- gathering ---------------------------------------------------------------------------

    async def gather(
        self,
        ready_timeout: float | None,
        refused: Callable[[str, TrustError], None],
        exchange_timeout: float = TRUST_EXCHANGE_S,
    ) -> None:
        """Trust, links, hellos: after this every member is verified, linked and has said what it holds.
        A joiner that fails the trust exchange is sent away and reported to `refused` (`verify_members`)."""
        proved = await verify_members(
            self.client, self.code, self.presence.identity.fingerprint,
            exchange_timeout=exchange_timeout, ready_timeout=ready_timeout, refused=refused,
        )  # fmt: skip
        # Pin what each proved, whatever the rendezvous has said of them since.
        self.roster.known.update(
            {
                m: info.model_copy(update={"fingerprint": proved[m]})
                for m, info in self.client.members.items()
                if m in proved
            }
        )
        self.say(f"all {len(self.known)} members verified; connecting")
        self.demux = await DatagramDemux.over(self.presence.sock)
        edges = await connect_edges(
            self.client, self.demux, self.presence.identity, self.client.code, self.roster.others()
        )
        for member_id, edge in edges.items():
            self.roster.routers[member_id] = LinkRouter(edge.link, member_id)
            self.roster.paths[member_id] = edge.path
        members = list(self.roster.routers)
        hellos = await all_or_none([self._hello(m) for m in members])
        self.roster.hellos.update(zip(members, hellos, strict=True))
        self._note_members_on_this_machine(self.roster.hellos)
        self.prices.model_sha256 = await self.model_hash
        self.own_pricings = tuple(await asyncio.to_thread(cached_model_pricings))
        self.own_backend = await asyncio.to_thread(backend_or_none)

    def _note_members_on_this_machine(self, hellos: Mapping[str, Hello]) -> None:
        """Stages on one machine take turns on its cores. The demo sets its processes up for that
        (1.4× the tokens/s of two processes left to libgomp's defaults, measured with gemma), but
        a process can only be set up before llama.cpp loads, so a host and members started by
        hand on one machine are told how."""
        here = [self.member_name(m) for m, hello in hellos.items() if hello.machine == self.roster.machine]
        if here and not set_up_to_share_cores():
            self.say(
                f"{', '.join(here)} {'runs' if len(here) == 1 else 'run'} on this machine too, sharing its cores "
                f"with this host's stage; for their best speed together, {sharing_cores_hint()}"
            )

    async def _hello(self, member_id: str) -> Hello:
        try:
            message = await self.roster.routers[member_id].next_control(HELLO_TIMEOUT_S)
        except TimeoutError:
            raise SessionFailed(f"{self.member_name(member_id)} did not report in {HELLO_TIMEOUT_S:.0f} s") from None
        if not isinstance(message, Hello):
            raise SessionFailed(f"{self.member_name(member_id)} sent {message.type} before hello")
        return message

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
        with contextlib.suppress(RendezvousError):
            await self.client.remove(member_id)
        raise refusal

    async def _admit(self, member_id: str) -> None:
        trusted = {m: info.fingerprint for m, info in self.known.items()}
        try:
            proved = await verify_newcomer(
                self.client, self.code, self.presence.identity.fingerprint, member_id, trusted
            )
        except TrustError:  # it was told why; its seat is free again for whoever proves the code
            with contextlib.suppress(RendezvousError):
                await self.client.remove(member_id)
            raise
        info = self.client.members.get(member_id)
        if info is None:
            raise RendezvousError("member_left", f"{member_id} left after proving the code")
        # What it proved, not what the rendezvous says now: this is what its link and its ring
        # neighbours pin.
        info = info.model_copy(update={"fingerprint": proved})
        self.known[member_id] = info
        assert self.demux is not None  # newcomers come after the session formed
        edges = await connect_edges(self.client, self.demux, self.presence.identity, self.client.code, [info])
        self.roster.routers[member_id] = LinkRouter(edges[member_id].link, member_id)
        self.roster.paths[member_id] = edges[member_id].path
        self.roster.hellos[member_id] = await self._hello(member_id)
        self._note_members_on_this_machine({member_id: self.roster.hellos[member_id]})
        self.prices.forget(member_id)  # the seat may now be another machine
        self.memory_caps.pop(member_id, None)
        self.newcomers.add(member_id)

    def waiting_newcomers(self) -> list[str]:
        """Admitted newcomers still linked and in the session, for the next plan; one that went is
        forgotten (the rendezvous says so at once, its link's idle bound only seconds later)."""
        self.newcomers &= set(self.alive()) & set(self.client.members)
        return sorted(self.newcomers)

    # --- pricing and planning ----------------------------------------------------------------

    def known_machines(self) -> dict[str, Machine]:
        """What this host knows of every machine it may plan with, itself included."""
        own = Machine(
            self.member_name(self.me),
            self.presence.capability.lending(self.memory_caps.get(self.me)),
            self.own_pricings,
        )
        found = {self.me: own}
        for member, info in self.known.items():
            if member != self.me:
                hello = self.roster.hellos.get(member)
                pricings = tuple(hello.priced_models) if hello is not None else ()
                capability = info.capability.lending(self.memory_caps.get(member))
                found[member] = Machine(self.member_name(member), capability, pricings)
        return found

    def lower_memory(self, member: str, memory_bytes: int) -> None:
        """Plan with at most `memory_bytes` of the member's memory from now on: it ran out loading a
        larger share (the session core decides by how much)."""
        self.memory_caps[member] = min(memory_bytes, self.memory_caps.get(member, memory_bytes))

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
        progress: Progress,
        pending: Callable[[list[str]], None] = lambda _names: None,
    ) -> Deployment:
        """Plan over `members` and put the plan in place (`Deployer.deploy`); raises SessionFailed or PlanRefused."""
        plan = self.plan(members)
        self.newcomers -= set(members)
        deployment = await self.deployer.deploy(plan, self.prices.model_sha256, progress, pending)
        self.prices.last_verdict = None  # a new plan has measured nothing yet
        return deployment

    # --- status and the end -----------------------------------------------------------------

    def status(self, admitting: bool, failed_proofs: int = 0, guess_budget: int | None = None) -> SessionStatus:
        """`admitting`: whether a freed seat may still be taken, `failed_proofs` the possible
        guesses counted so far of `guess_budget` (the session core decides and counts)."""
        deployment = self.deployment
        machines = self.known_machines() if deployment is not None else {}  # only a deployment's members are priced
        members = []
        for member_id, info in (self.known or self.client.members).items():
            entry: dict[str, Any] = {"id": member_id, "name": self.member_name(member_id), "host": info.host}
            hello = self.roster.hellos.get(member_id)
            backend = self.own_backend if member_id == self.me else hello.backend if hello is not None else None
            if backend is not None:
                entry["backend"] = backend
            router = self.roster.routers.get(member_id)
            if router is not None:
                entry["path"] = self.roster.paths.get(member_id)
                entry["link"] = "down" if router.link.closed.done() else "up"
                if member_id not in self.client.members:
                    entry["left"] = True
                if member_id in self.newcomers:
                    entry["joining"] = True
                if router.link.core.rtt_ms is not None:
                    entry["rtt_ms"] = router.link.core.rtt_ms
            if deployment is not None and member_id in deployment.chain:
                stage = deployment.plan.stages[deployment.chain.index(member_id)]
                entry["blocks"] = (stage.start, stage.end)
                entry["predicted_ms_per_token"] = round(stage.cost_s * 1e3, 3) if stage.cost_s is not None else None
                entry["priced_on"] = self.prices.priced_on(machines, member_id)
            members.append(MemberStatus(**entry))  # only what applies is set, and shown
        plan = deployment.plan if deployment else None
        verdict = self.prices.last_verdict
        return SessionStatus(
            code=self.code,
            admitting=admitting,
            failed_proofs=failed_proofs,
            guess_budget=guess_budget,
            members=members,
            epoch=self.deployer.epoch,
            edges=self.deployer.chain_edges(deployment.chain) if deployment is not None else [],
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

    async def dismiss(self, member: str, reason: str) -> None:
        """Send one member home (it failed its part): it hears why, and its link closes."""
        router = self.roster.routers.get(member)
        if router is not None:
            await _send_home([router], reason)

    async def send_away(self, members: Sequence[str]) -> None:
        """Remove members at the rendezvous (those still listed there), so their seats are free."""

        async def remove(member: str) -> None:
            with contextlib.suppress(RendezvousClosed):
                await self.client.remove(member)

        await asyncio.gather(*(remove(m) for m in members if m in self.client.members))

    async def keep(self) -> None:
        """Renew the session at the rendezvous; a rendezvous already gone is not the ring's failure."""
        with contextlib.suppress(RendezvousClosed):
            await self.client.renew()

    async def end(self, reason: str) -> None:
        """Tell every member the session is over, then close links, the rendezvous session and the socket."""
        self._ending = True
        self._renewals.cancel()
        self._watching.cancel()
        for admission in self._admissions.values():
            admission.cancel()
        await self.deployer.stop_listening()
        await self.deployer.drop_own_stage()
        await _send_home(list(self.roster.routers.values()), reason)
        with contextlib.suppress(Exception):
            await self.client.close()
        if self.demux is not None:
            self.demux.close()
        self.presence.sock.close()


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
