"""How the host prices each machine for the planner, and what it learns from a ring that served.

Pure: the host hands in what it knows of the machines (`Machine`) and of the ring it deployed
(`PlannedRing`); nothing here reads a link, a file or a clock. A machine is priced, best first,
by what its stage measured serving this model in this session, by its own pricing of the model
(`kafila probe --model`, a host's measure before its first plan, or what it served before; kept
on that machine and reported in its hello), by the host's pricing scaled by the ratio of the
two machines' generic probes (`pricing_by_ratio`), or by the generic probe alone. Before a
replan the host learns from what the stages measured (`learn_from_serving`); on an idle ring it
asks whether another division would be clearly faster (`rebalance_verdict`), and when the load
moves, whether other members would be (`load_verdict`). The host's own work a token beside its
stage (`HostWork`) prices the host as the planner's `host_work_s`, and is kept with its pricing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kafila.contracts import FleetDevice, ModelPricing, StageReport
from kafila.planner.fleet import device_of, pricing_by_ratio, pricing_for, pricing_from_serving
from kafila.planner.rebalance import RebalanceVerdict, judge_rebalance
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import Device, ModelManifest, Plan, PlanRefused, ServingSpec
from kafila.planner.who_serves import LoadVerdict, ServingChoice, judge_load, plan_serving_host_choice

MIN_STEPS_TO_REPRICE = 16  # single-token decodes a stage must have timed before a replan trusts them
# A rebalance moves blocks on the strength of the measurements alone, so it waits for more of
# them: the first decodes after a load can run slow (pages faulted in, buffers first used).
MIN_STEPS_TO_REBALANCE = 32
# Tokens the host must have served since the last reading of its own work before another: fewer
# would let a request's start (its prompt, the API's set-up) weigh as much as its tokens.
MIN_TOKENS_FOR_HOST_WORK = 64

# Where a machine's prices come from.
SERVING, THE_MODEL, SCALED, GENERIC = "serving", "the model", "the host's, scaled", "the generic probe"


@dataclass(frozen=True)
class Machine:
    """What the host knows of one machine when it plans."""

    name: str
    capability: FleetDevice  # as its probe measured it, lent as it said
    pricings: tuple[ModelPricing, ...] = ()  # the models it priced itself, kept on that machine


@dataclass(frozen=True)
class PlannedRing:
    """The ring being served: who holds which stage of which plan, in chain order."""

    chain: tuple[str, ...]  # machine ids, block 0 first, the head last
    plan: Plan


@dataclass
class HostWork:
    """The host's own work a token beside its stages: its process's CPU time less what its own
    stages computed (their timers), over the tokens it served, between two readings of the same
    ring. What the API, sampling, batching, detokenising and the links cost, which no stage's
    timer sees, and which shares the host's cores with its stage."""

    measured_us: dict[bool, float] = field(default_factory=dict)  # the latest readings, µs a token, by head here
    _since: tuple[object, float, float, int] | None = None  # (ring, CPU s, own stages' s, tokens) at the last

    def sample(self, ring: object, cpu_s: float, own_stage_s: float, tokens: int, head_here: bool) -> float | None:
        """Read the counters for `ring` (any key naming the ring served: a new ring starts over),
        whose head is here or not; the µs a token since the last reading, once
        MIN_TOKENS_FOR_HOST_WORK were served, else None. The stages' timers are wall time, so on
        cores that other programs share the reading is low, and where they exceed the CPU time
        there is none."""
        since = self._since
        if since is None or since[0] != ring or tokens < since[3] or own_stage_s < since[2]:
            self._since = (ring, cpu_s, own_stage_s, tokens)
            return None
        served = tokens - since[3]
        if served < MIN_TOKENS_FOR_HOST_WORK:
            return None
        self._since = (ring, cpu_s, own_stage_s, tokens)
        own = (cpu_s - since[1]) - (own_stage_s - since[2])
        if own <= 0:  # the stages' timers (wall time) ran ahead of the CPU: the cores were shared
            return None
        self.measured_us[head_here] = 1e6 * own / served
        return self.measured_us[head_here]

    def kept(self, pricing: ModelPricing | None) -> dict[str, float | None]:
        """The host's own work a token for the pricing's fields: as measured now, else as `pricing`
        (kept by an earlier session) has it."""
        return {
            name: self.measured_us.get(head, getattr(pricing, name) if pricing is not None else None)
            for name, head in (("host_work_us", False), ("host_work_with_head_us", True))
        }


@dataclass
class RingPricing:
    """The host's prices for the machines of its session, and what serving taught it."""

    manifest: ModelManifest
    session: ServingSpec
    model_sha256: str | None = None  # known once the host has hashed its model
    host: str | None = None  # the host's machine id: its pricing of the model prices the others by ratio
    served: dict[str, ModelPricing] = field(default_factory=dict)  # machine → priced by what it served
    last_verdict: RebalanceVerdict | None = None  # the latest reading of the serving ring's measurements
    load: int | None = None  # requests at once the serving ring was planned for; None: the session's room
    host_work: HostWork = field(default_factory=HostWork)  # the host's own work a token, as it served

    def pricing(
        self, machines: Mapping[str, Machine], member: str, served: Mapping[str, ModelPricing] | None = None
    ) -> ModelPricing | None:
        """The machine's pricing of the model served: from what its stage measured serving it in this
        session (`served`, by default what was learned so far), its own, or the host's scaled by
        their generic probes (`scaled_from_host`); None where only the generic probe prices it."""
        if self.model_sha256 is None or member not in machines:
            return None
        served = self.served if served is None else served
        if member in served:
            return served[member]
        own = pricing_for(self.model_sha256, list(machines[member].pricings))
        if own is not None or member == self.host:
            return own
        return self.scaled_from_host(machines, member, served)

    def scaled_from_host(
        self, machines: Mapping[str, Machine], member: str, served: Mapping[str, ModelPricing]
    ) -> ModelPricing | None:
        """The host's pricing of the model (served or its own), scaled to `member` by the ratio of
        their generic probes (`pricing_by_ratio`); None where the host has none."""
        if self.host is None or self.host not in machines or member not in machines:
            return None
        hosts = self.pricing(machines, self.host, served)
        if hosts is None:
            return None
        return pricing_by_ratio(self.manifest, machines[self.host].capability, hosts, machines[member].capability)

    def priced_on(self, machines: Mapping[str, Machine], member: str) -> str:
        """Where the machine's stage prices come from, in words."""
        if member in self.served:
            return SERVING
        if self.model_sha256 is not None and member in machines:
            if pricing_for(self.model_sha256, list(machines[member].pricings)) is not None:
                return THE_MODEL
        return SCALED if self.pricing(machines, member) is not None else GENERIC

    def forget(self, member: str) -> None:
        """A machine left: its seat may next be taken by another, which must not inherit its prices."""
        self.served.pop(member, None)

    def host_work_of(self, machines: Mapping[str, Machine]) -> dict[str, float | None]:
        """The host's own work a token, by `ModelPricing`'s fields: as measured serving in this
        session, else as the host's own pricing of the model kept it from an earlier one."""
        own = None
        if self.model_sha256 is not None and self.host is not None and self.host in machines:
            own = pricing_for(self.model_sha256, list(machines[self.host].pricings))
        return self.host_work.kept(own)

    def with_host_work(self, pricing: ModelPricing | None, machines: Mapping[str, Machine]) -> ModelPricing | None:
        """The host's pricing (what its stage measured serving, say) with its own work a token
        (`host_work_of`), for the host to keep."""
        return None if pricing is None else pricing.model_copy(update=self.host_work_of(machines))

    def devices(
        self, machines: Mapping[str, Machine], members: Sequence[str], served: Mapping[str, ModelPricing] | None = None
    ) -> list[Device]:
        """Each machine as the planner sees it, named, and priced as `pricing` says; the host with
        its own work a token (`host_work_s`): as measured serving now, else as its own pricing kept it."""
        devices = []
        for m in members:
            capability = machines[m].capability.priced(self.pricing(machines, m, served))
            if m == self.host:
                capability = capability.model_copy(update=self.host_work_of(machines))
            devices.append(device_of(capability).model_copy(update={"name": machines[m].name}))
        return devices

    def choose(
        self,
        machines: Mapping[str, Machine],
        members: Sequence[str],
        served: Mapping[str, ModelPricing] | None = None,
        round_trips: RoundTrips | None = None,
        every_member: bool = False,
        load: int | None = None,
    ) -> ServingChoice:
        """Who of `members` (the host first) serves, their ring and division, for `load` requests at
        once (by default the load planned for, `self.load`) and over the edges' `round_trips`
        (`plan_serving_host_choice`), as `kafila plan` chooses; with `every_member`, all of them
        serve. PlanRefused names who cannot hold its share."""
        devices = self.devices(machines, members, served)
        load = self.load if load is None else load
        session = self.session if load is None else self.session.model_copy(update={"load": load})
        return plan_serving_host_choice(self.manifest, devices, session, round_trips, every_member)

    def plan(
        self,
        machines: Mapping[str, Machine],
        members: Sequence[str],
        served: Mapping[str, ModelPricing] | None = None,
        round_trips: RoundTrips | None = None,
    ) -> Plan:
        """The plan with every one of `members` serving, the head on the host if it fits."""
        return self.choose(machines, members, served, round_trips, every_member=True).plan

    @staticmethod
    def measured_stage_times(report: Sequence[StageReport], min_steps: int) -> dict[tuple[int, int], float]:
        """Seconds per token of each stage (by block range) that decoded at least `min_steps`
        tokens one at a time: only those decodes compare with a stage's price."""
        return {
            entry.range: entry.ms_per_token_alone * 1e-3
            for entry in report
            if entry.steps_alone >= min_steps and entry.ms_per_token_alone
        }

    def priced_by_serving(
        self, machines: Mapping[str, Machine], ring: PlannedRing, measured: Mapping[tuple[int, int], float]
    ) -> dict[str, ModelPricing]:
        """Each machine of the ring whose stage was measured, priced so that the stage costs what it
        measured; the others are left out."""
        if self.model_sha256 is None:
            return {}
        learned: dict[str, ModelPricing] = {}
        for member, stage in zip(ring.chain, ring.plan.stages, strict=True):
            seconds = measured.get((stage.start, stage.end))
            if seconds is None or stage.cost_s is None or member not in machines:
                continue
            priced_as = machines[member].capability.priced(self.pricing(machines, member))
            pricing = pricing_from_serving(priced_as, self.model_sha256, stage.cost_s, seconds)
            if pricing is not None:
                learned[member] = pricing
        return learned

    def learn_from_serving(
        self, machines: Mapping[str, Machine], ring: PlannedRing, report: Sequence[StageReport]
    ) -> list[str]:
        """Price every machine of the ring by what its stage measured, decoding one token at a time,
        for the next plan; returns those repriced.

        Called before a replan: the machines kept then get divisions that fit what they showed, where
        the generic probe misjudged them. A stage that decoded too few tokens alone keeps its price.
        """
        learned = self.priced_by_serving(machines, ring, self.measured_stage_times(report, MIN_STEPS_TO_REPRICE))
        self.served.update(learned)
        return list(learned)

    def own_by_serving(
        self, machines: Mapping[str, Machine], ring: PlannedRing, report: Sequence[StageReport]
    ) -> ModelPricing | None:
        """The host's own pricing by what its stage measured, once it has timed
        MIN_STEPS_TO_REBALANCE tokens alone: what this machine keeps for its next session."""
        if self.host is None or self.host not in ring.chain:
            return None
        measured = self.measured_stage_times(report, MIN_STEPS_TO_REBALANCE)
        return self.with_host_work(self.priced_by_serving(machines, ring, measured).get(self.host), machines)

    def rebalance_verdict(
        self,
        machines: Mapping[str, Machine],
        ring: PlannedRing,
        members: Sequence[str],
        report: Sequence[StageReport],
        round_trips: RoundTrips | None = None,
    ) -> RebalanceVerdict | None:
        """Whether the ring would be clearly faster divided again over the same `members` (the host
        first, in the order it was planned with) by what its stages measured (`judge_rebalance`);
        None until every stage has timed MIN_STEPS_TO_REBALANCE tokens alone, or where no plan over
        them fits. Learns nothing."""
        measured = self.measured_stage_times(report, MIN_STEPS_TO_REBALANCE)
        times = [measured.get((s.start, s.end)) for s in ring.plan.stages]
        if None in times:
            return None
        served = {**self.served, **self.priced_by_serving(machines, ring, measured)}
        try:
            proposed = self.plan(machines, members, served, round_trips)
        except PlanRefused:
            return None
        verdict = judge_rebalance(ring.plan, times, proposed)
        self.last_verdict = verdict
        return verdict

    def load_verdict(
        self,
        machines: Mapping[str, Machine],
        ring: PlannedRing,
        serving: Sequence[str],
        linked: Sequence[str],
        report: Sequence[StageReport],
        users: int,
        round_trips: RoundTrips | None = None,
    ) -> LoadVerdict | None:
        """Whether, at `users` requests at once, the members the host would choose of `linked` (the
        host first, each linked member) are clearly faster than `serving` (the host first, the ring's
        members as planned) with every one of them serving (`judge_load`). Priced as the replan would
        be: what the stages measured serving counts as `learn_from_serving` would count it. None
        where no plan fits. Learns nothing."""
        measured = self.measured_stage_times(report, MIN_STEPS_TO_REPRICE)
        served = {**self.served, **self.priced_by_serving(machines, ring, measured)}
        try:
            as_it_serves = self.choose(machines, serving, served, round_trips, every_member=True, load=users)
            proposed = self.choose(machines, linked, served, round_trips, load=users)
        except PlanRefused:
            return None
        return judge_load(as_it_serves, proposed)

    def note(self, machines: Mapping[str, Machine], members: Sequence[str], model: str) -> str:
        """Which machines' stage times come from what, for the plan's reader."""
        sources = {
            SERVING: "from what their stages measured serving",
            THE_MODEL: "priced on this model's own stages",
            SCALED: "from this model's stages as the host measured them, scaled by generic probe",
        }
        how = f"`kafila probe --model {model}` on a machine prices this model's stages there (kept)"
        groups = {
            source: [machines[m].name for m in members if self.priced_on(machines, m) == source]
            for source in (SERVING, THE_MODEL, SCALED, GENERIC)
        }
        present = [source for source, names in groups.items() if names]
        if present == [GENERIC]:
            return f"stage times: from the generic probe, which misjudges narrow models; {how}"
        if len(present) == 1:
            return f"stage times: every machine {sources[present[0]]}"
        parts = [f"{sources[s]} for {', '.join(groups[s])}" for s in (SERVING, THE_MODEL, SCALED) if groups[s]]
        if groups[GENERIC]:
            parts.append(f"from the generic probe for {', '.join(groups[GENERIC])} ({how})")
        return "stage times: " + "; ".join(parts)


def measured_round_trips(
    names: Mapping[str, str],
    host: str,
    to_host_ms: Mapping[str, float | None],
    between_ms: Mapping[frozenset[str], float],
) -> RoundTrips | None:
    """The round trip of every edge among `names` (member id → its name; the host among them) for
    the planner, in seconds: as its link measured it, where the two have been linked (the host's
    link to each member, `to_host_ms`; ring edges between members, `between_ms`). Two members never
    linked are guessed at the larger of their round trips to the host, between what the triangle
    inequality allows (their difference and their sum). None while a member's link to the host has
    measured nothing: the planner then bounds edges from the rendezvous's round trips."""
    ids = list(names)
    if any(to_host_ms.get(m) is None for m in ids if m != host):
        return None

    def to_host(member: str) -> float:
        return 0.0 if member == host else float(to_host_ms[member] or 0.0)

    def between(a: str, b: str) -> float:
        if a == b:
            return 0.0
        if host in (a, b):
            return to_host(b if a == host else a)
        measured = between_ms.get(frozenset((a, b)))
        return measured if measured is not None else max(to_host(a), to_host(b))

    seconds = tuple(tuple(min(60.0, between(a, b) / 1e3) for b in ids) for a in ids)
    return RoundTrips(members=tuple(names[m] for m in ids), seconds=seconds)
