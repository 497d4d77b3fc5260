"""`kafila host` with members: gather them, plan, deliver their stages, and drive the ring.

The order, and why:
1. open the session at the rendezvous and print the full code (channel + secret);
2. prove the code to every joiner and pin their certificates (SPAKE2, `verify_members`);
3. bring up a pinned QUIC link to each member, punched where possible, relayed where not;
4. hear what each member already holds (`Hello`), then plan with every member's probe and every
   edge's measured round trip: who serves (the members of least time per token at the session's
   concurrency; the others stand by, linked), the head here unless this machine cannot hold it,
   refusing before anything loads if the model does not fit;
5. put the plan in place (`deployer.Deployer`): assign each member its stage and neighbours,
   deliver the stage files, have the stages load (all at once), and serve.

With the head here, the ring runs host → block 0 … → host. With the head on a member, the host
embeds each step's tokens from the model file (or, for a model on the hub, from the vocabulary
file it fetched: `HostModel.vocabulary`) and serves its own block range as a plain stage;
the head member sends each step's logits back to the host, which samples: host → block 0 … →
head → host, the host's own stage somewhere along the way.

When a member's link goes down, or a serving member reports that its stage stopped (a ring link
between members went down), steps 4-6 run again with the members that are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kafila.contracts import (
    BackendReport,
    ModelPricing,
    Progress,
    StageReport,
    Tell,
)
from kafila.network.pake import TrustError
from kafila.network.rendezvous import MemberInfo
from kafila.network.rendezvous_client import (
    RendezvousClient,
    RendezvousClosed,
)
from kafila.network.session_codes import full_code, new_secret
from kafila.planner.rebalance import RebalanceVerdict
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import ModelManifest, ServingSpec
from kafila.planner.who_serves import LoadVerdict, ServingChoice
from kafila.runtime.llama.backends import backend_or_none
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.model_probe import host_prices_model
from kafila.runtime.machine.this_machine import cached_model_pricings, save_model_pricing
from kafila.session.admissions import TRUST_EXCHANGE_S, Admissions
from kafila.session.deployer import Deployer, Deployment, Roster
from kafila.session.host_model import HostModel
from kafila.session.presence import Presence, machine_tag
from kafila.session.pricing import Machine, PlannedRing, RingPricing, measured_round_trips
from kafila.session.router import LinkRouter
from kafila.wire.control import End

RENEW_EVERY_S = 600.0  # a rendezvous that does not say how long an idle session lasts gets renewed this often
KEPT_CHANGE = 0.05  # an idle ring's report refreshes every few seconds: kept again only when it moved this much
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
    model: HostModel
    session: ServingSpec
    settings: ContextSettings
    cache: Path
    say: Tell
    model_hash: asyncio.Future[str | None]  # the model's sha256 (`HostModel.identity`), begun before the members came
    roster: Roster = field(init=False)
    admissions: Admissions = field(init=False)
    deployer: Deployer = field(init=False)
    prices: RingPricing = field(init=False)  # each machine's price for the planner (`session.pricing`)
    own_pricings: tuple[ModelPricing, ...] = ()  # the models this machine priced itself (`kafila probe --model`)
    own_backend: BackendReport | None = None  # llama.cpp's devices here, for /status
    memory_caps: dict[str, int] = field(default_factory=dict)  # member → bytes it held at most (it ran out)
    every_member_serves: bool = False  # `kafila host --every-member-serves`: no member stands by
    choice: ServingChoice | None = None  # who serves the deployed ring, who stands by and why
    kept_pricing: ModelPricing | None = None  # what this machine last kept of its stage's serving
    renewing: Callable[[], bool] = lambda: True  # whether the session at the rendezvous must live on
    rendezvous_lost: Callable[[str], None] = lambda _why: None  # told once if the rendezvous ends it first
    _renewals: asyncio.Task[None] = field(init=False)
    _watching: asyncio.Task[None] = field(init=False)
    _ending: bool = False

    def __post_init__(self) -> None:
        self.roster = Roster(self.client, machine_tag(self.client.code))
        self.admissions = Admissions(self.client, self.code, self.presence, self.roster, self.say, self._admitted)
        self.deployer = Deployer(self.roster, self.model, self.settings, self.cache, self.say)
        self.prices = RingPricing(self.manifest, self.session, host=self.me)
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
        model: HostModel,
        session: ServingSpec,
        settings: ContextSettings,
        cache: Path,
        say: Tell,
        model_hash: asyncio.Future[str | None],
        open_token: str | None = None,
    ) -> HostSession:
        client = await RendezvousClient.open(
            presence.url,
            model=model.name[:64],
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

    def forget_ring(self) -> None:
        """Nothing serves now: no ring is left to watch."""
        self.deployer.deployment, self.choice = None, None

    # --- gathering ---------------------------------------------------------------------------

    async def gather(
        self,
        ready_timeout: float | None,
        refused: Callable[[str, TrustError], None],
        exchange_timeout: float = TRUST_EXCHANGE_S,
    ) -> None:
        """Every member verified, linked and heard (`Admissions.gather`); then what this host
        prices itself by."""
        await self.admissions.gather(ready_timeout, refused, exchange_timeout)
        self.prices.model_sha256 = await self.model_hash
        self.own_pricings = tuple(await asyncio.to_thread(cached_model_pricings))
        self.own_backend = await asyncio.to_thread(backend_or_none)

    def _admitted(self, member_id: str) -> None:
        """A newcomer took a seat: the seat may now be another machine."""
        self.prices.forget(member_id)
        self.memory_caps.pop(member_id, None)

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
        machines = self.known_machines()
        repriced = self.prices.learn_from_serving(machines, ring, report)
        self.keep_own_pricing(self.prices.with_host_work(self.prices.served.get(self.me), machines))
        return [self.member_name(m) for m in repriced]

    def keep_own_pricing(self, pricing: ModelPricing | None) -> None:
        """Keep what this machine's stage measured serving the model, for its next session here
        (`save_model_pricing`): the next first plan starts from it, not from the calibration."""
        if pricing is None or not host_prices_model():
            return
        if self.kept_pricing is not None and _within(pricing, self.kept_pricing, KEPT_CHANGE):
            return
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the next start a measure
            save_model_pricing(pricing, "measured serving it")
            self.kept_pricing = pricing

    def note_host_work(self, report: Sequence[StageReport], tokens: int) -> float | None:
        """Read this host's own work a token beside its stages (`HostWork`): this process's CPU time
        less what its own stages of the ring in `report` computed, over the `tokens` served; µs a
        token, or None until enough were served. Read on an idle ring, whose report is current;
        not with the host's pricing of its model off (`host_prices_model`: the test suite's
        default), where its head stays pinned as it was."""
        deployment = self.deployment
        if deployment is None or not host_prices_model():
            return None
        own = {(s.start, s.end) for m, s in zip(deployment.chain, deployment.plan.stages, strict=True) if m == self.me}
        timed = [entry.seconds for entry in report if tuple(entry.range) in own]
        if len(timed) != len(own) or None in timed:  # a stage of its own not reported, or without its totals
            return None
        own_s = sum(seconds or 0.0 for seconds in timed)
        head_here = deployment.chain[-1] == self.me
        return self.prices.host_work.sample(deployment.epoch, time.process_time(), own_s, tokens, head_here)

    def rebalance_verdict(self, report: Sequence[StageReport], tokens: int | None = None) -> RebalanceVerdict | None:
        """Whether the serving ring would be clearly faster divided again (`RingPricing.rebalance_verdict`);
        with `tokens`, the tokens served so far, the host's own work a token is read first."""
        ring = self._planned_ring()
        if ring is None:
            return None
        if tokens is not None:
            self.note_host_work(report, tokens)
        members = self.planned_members()
        machines, trips = self.known_machines(), self.round_trips(members)
        self.keep_own_pricing(self.prices.own_by_serving(machines, ring, report))
        return self.prices.rebalance_verdict(machines, ring, [self.me, *members], report, trips)

    def planned_members(self) -> list[str]:
        """The members of the current plan in the order it was planned with (its ring search
        breaks ties by that order), so a plan made again over them differs only by its prices."""
        planned = set(self.deployment.members) if self.deployment is not None else set()
        return [m for m in self.alive() if m in planned]

    def pricing_note(self, members: Sequence[str]) -> str:
        """Which machines' stage times come from what, for the plan's reader."""
        return self.prices.note(self.known_machines(), [self.me, *members], self.model.label)

    def round_trips(self, members: Sequence[str]) -> RoundTrips | None:
        """The round trip of every edge among this host and `members`, as their links measured it
        (`pricing.measured_round_trips`)."""
        ids = [self.me, *members]
        routers = self.roster.routers
        to_host = {m: routers[m].link.core.rtt_ms if m in routers else None for m in members}
        names = {m: self.member_name(m) for m in ids}
        return measured_round_trips(names, self.me, to_host, self.deployer.measured_rtts)

    def choose(self, members: Sequence[str], load: int | None = None) -> ServingChoice:
        """Who of this host and `members` serves, their ring and division (`RingPricing.choose`),
        for `load` requests at once (None: the session's room) over the measured round trips; the
        ring that serves is planned for that load from then on, rebalances included. PlanRefused
        names who cannot hold its share."""
        machines, trips = self.known_machines(), self.round_trips(members)
        self.prices.load = load
        return self.prices.choose(machines, [self.me, *members], None, trips, self.every_member_serves)

    async def load_verdict(self, report: Sequence[StageReport], users: int) -> LoadVerdict | None:
        """Whether other members of those linked would serve `users` requests at once clearly
        faster than the ring's (`RingPricing.load_verdict`); None with no ring, or no plan. What
        it plans with is read here, and the planning runs off the event loop, which carries the
        ring's frames meanwhile (it takes up to a second at 8 members)."""
        ring = self._planned_ring()
        if ring is None:
            return None
        serving, linked = [self.me, *self.planned_members()], [self.me, *self.alive()]
        machines, trips = self.known_machines(), self.round_trips(linked[1:])
        weigh = self.prices.load_verdict
        return await asyncio.to_thread(weigh, machines, ring, serving, linked, list(report), users, trips)

    def standing_by(self, choice: ServingChoice) -> list[str]:
        """The member ids `choice` leaves out of the ring."""
        by_name = {self.member_name(m): m for m in self.known}
        return [by_name[name] for name in choice.standby if name in by_name]

    async def deploy(
        self,
        choice: ServingChoice,
        progress: Progress,
        pending: Callable[[list[str]], None] = lambda _names: None,
    ) -> Deployment:
        """Put the chosen plan in place (`Deployer.deploy`); raises SessionFailed."""
        self.choice = None  # until the new ring serves
        by_name = {self.member_name(m): m for m in self.known}
        standing_by = {by_name[m.device]: m.words for m in choice.members if m.device in choice.standby}
        sha256 = self.prices.model_sha256
        deployment = await self.deployer.deploy(choice.plan, sha256, progress, pending, standing_by)
        self.choice = choice
        self.prices.last_verdict = None  # a new plan has measured nothing yet
        return deployment

    # --- status and the end -----------------------------------------------------------------

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
        self.admissions.cancel()
        await self.deployer.stop_listening()
        await self.deployer.drop_own_stage()
        await _send_home(list(self.roster.routers.values()), reason)
        with contextlib.suppress(Exception):
            await self.client.close()
        if self.admissions.demux is not None:
            self.admissions.demux.close()
        self.presence.sock.close()


def _within(a: ModelPricing, b: ModelPricing, share: float) -> bool:
    """Whether two pricings of a model differ by no more than `share` in any of their numbers."""
    pairs = [(a.bandwidth_gb_s, b.bandwidth_gb_s), (a.head_bandwidth_gb_s, b.head_bandwidth_gb_s)]
    pairs.append((a.overhead_us, b.overhead_us))
    for x, y in ((a.host_work_us, b.host_work_us), (a.host_work_with_head_us, b.host_work_with_head_us)):
        if (x is None) != (y is None):
            return False
        if x is not None and y is not None:
            pairs.append((x, y))
    return a.model_sha256 == b.model_sha256 and all(abs(x - y) <= share * max(abs(x), abs(y)) for x, y in pairs)


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
