"""Who serves: the members, ring and division of least time per token at the session's load.

A short pure policy over typed candidates, after petals' block_selection and Parallax's
scheduler. Each set of members that includes the anchor is a candidate: planned on the ring of
least round trip (ring.py), with the division of least time per token (time_per_token.py) for
every head, the head kept on the anchor unless another is clearly faster, as plan.py keeps it.
The largest set within STANDBY_MARGIN of the fastest serves; the others stand by. A set the model
does not fit is no candidate, so a member the others cannot do without always serves.

As a session's host, the anchor also does the host's own work a token beside its stage (its
`host_work_s`, where measured): the search prices it on the anchor's stage, and then a head on
one of the anchor's ring neighbours, with the anchor holding block 0, is weighed against the head
on the anchor (the ring's trip is the same: the anchor embeds, the head samples).

Every set is tried up to EXACT_MEMBERS members (2^(m-1) sets); beyond, members are dropped one at
a time while dropping one is faster, and the same rule chooses among the sets passed through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from itertools import combinations, pairwise

import numpy as np
import numpy.typing as npt

from kafila.planner.cost import ChainPrefix
from kafila.planner.partition import candidate_bottlenecks
from kafila.planner.plan import (
    HEAD_MARGIN,
    DevicePrices,
    chain_from_head,
    choose_tier,
    compare_divisions,
    edge_round_trip_s,
    holds_a_block,
    plan_session,
    plan_stages,
    price_devices,
    ring_edges,
    ring_weights,
    search_matrices,
)
from kafila.planner.reachability import predict_edge
from kafila.planner.ring import EXACT_LIMIT, best_ring
from kafila.planner.round_trips import RoundTrips
from kafila.planner.time_per_token import TIE_TOLERANCE, TimedDivision, fastest_division
from kafila.planner.types import Device, ModelManifest, Plan, PlanRefused, RingSearch, ServingSpec, Strict, Tier

EXACT_MEMBERS = 8  # 128 sets of members with the anchor in each
STANDBY_MARGIN = 0.05  # a member stands by only when the ring is this much faster without it
# A serving ring changes who serves for its load only when the new ring is this much faster: the
# replan moves blocks and holds new requests meanwhile, and within this margin prices that wobble
# by a few per cent would take a member in and leave it out again.
LOAD_REPLAN_GAIN = 0.15


class Role(StrEnum):
    SERVES = "serves"
    STANDS_BY = "stands-by"


class Why(StrEnum):
    ANCHOR = "anchor"  # it opened the session
    NEEDED = "needed"  # the others cannot hold the model without it
    HOLDS_SHARE = "holds-share"  # the members serving cannot hold the model without it
    PAYS = "pays"  # tokens come faster with it, or not clearly slower
    COSTS_MORE = "costs-more"  # tokens come clearly slower with it
    NO_ROOM = "no-room"  # the model cannot be cut into one more stage
    UNPRICED = "unpriced"  # no speeds measured: nothing to weigh, so every member serves
    ASKED = "asked"  # the host asked every member to serve (`kafila host --every-member-serves`)


class MemberSearch(StrEnum):
    EXACT = "exact"
    GREEDY = "greedy"


class Membership(Strict):
    """Whether a member serves, why, and the numbers behind it."""

    device: str
    role: Role
    why: Why
    blocks: int | None  # the blocks it holds, or would hold were it to serve
    time_with_s: float | None  # time per token with it serving
    time_without_s: float | None  # and without it
    added_ring_s: float | None  # what its place adds to a pass of the ring (one way round)
    words: str


class ServingChoice(Strict):
    """The plan for the members who serve, and who stands by."""

    plan: Plan
    concurrency: int  # the load chosen for: requests at once
    time_per_token_s: float | None
    ring_trip_s: float | None  # one way round the serving ring: half the sum of its edges' round trips
    members: tuple[Membership, ...]
    member_search: MemberSearch

    @property
    def standby(self) -> tuple[str, ...]:
        return tuple(m.device for m in self.members if m.role is Role.STANDS_BY)


@dataclass(frozen=True)
class Candidate:
    """One set of members, planned."""

    members: frozenset[int]
    chain: tuple[int, ...]  # block 0 first, head last
    timed: TimedDivision
    ring_trip_s: float
    ring_search: RingSearch

    @property
    def time_per_token_s(self) -> float:
        return self.timed.time_per_token_s

    def blocks_of(self, member: int) -> int:
        return self.timed.division.counts[self.chain.index(member)]

    def stages_s(self, prices: Sequence[DevicePrices]) -> float:
        """What every stage of this candidate's division costs a token, together: a pass's compute."""
        return sum(self.stage_cost_s(prices, member) for member in self.chain)

    def stage_cost_s(self, prices: Sequence[DevicePrices], member: int) -> float:
        """What the member's stage costs a token in this candidate's division."""
        position = self.chain.index(member)
        start, end = self.timed.division.spans[position]
        return float(prices[member].search[position == len(self.chain) - 1][start, end])


@dataclass
class _Search:
    """One fleet's prices and the sets of its members planned so far: the exact search, the greedy
    one and the reasons each member is given all ask of the same sets."""

    devices: Sequence[Device]
    prices: Sequence[DevicePrices]
    anchor: int
    concurrency: int
    max_stages: int
    pin_head: bool
    round_trips: RoundTrips | None
    candidates: npt.NDArray[np.float64]  # every value a bottleneck can take in this fleet, sorted
    seen: dict[frozenset[int], Candidate | None]
    head_beside_anchor: bool = False  # a head off the anchor only where the anchor holds block 0

    def plan(self, members: frozenset[int]) -> Candidate | None:
        if members not in self.seen:
            self.seen[members] = self._plan(members)
        return self.seen[members]

    def _plan(self, members: frozenset[int]) -> Candidate | None:
        if len(members) > self.max_stages:
            return None
        order = [self.anchor, *sorted(members - {self.anchor})]
        local = [self.devices[i] for i in order]
        weights, predicted, priced_in_time = ring_weights(local, self.round_trips)
        found = best_ring(weights, 0)
        ring = [order[i] for i in found.order]
        trip = 0.0
        if priced_in_time and len(ring) > 1:
            closed = [*found.order, found.order[0]]
            trip = sum(edge_round_trip_s(local, predicted, a, b, self.round_trips) or 0.0 for a, b in pairwise(closed))
            trip /= 2
        directions = [ring] if len(ring) < 3 else [ring, [ring[0], *reversed(ring[1:])]]
        anchor_best = self._fastest(directions, [0], trip)
        choice = anchor_best
        if not self.pin_head and len(ring) > 1:
            below = anchor_best[1].time_per_token_s * (1 - HEAD_MARGIN) if anchor_best else float("inf")
            # The anchor's predecessor as head gives the anchor block 0; both directions are tried.
            heads = [len(ring) - 1] if self.head_beside_anchor else range(1, len(ring))
            other = self._fastest(directions, heads, trip, below)
            choice = other or anchor_best
        if choice is None:
            return None
        chain, timed = choice
        return Candidate(members, tuple(chain), timed, trip, found.search)

    def _fastest(
        self, directions: list[list[int]], heads: Sequence[int], trip: float, below: float = float("inf")
    ) -> tuple[list[int], TimedDivision] | None:
        """The fastest chain over these rings and head positions, strictly faster than `below`.

        A later chain must beat an earlier one by more than rounding (TIE_TOLERANCE): chains that
        tie, as rotations over alike members do, are decided by the order tried, not by which sum
        of the same prices rounded a bit lower for these round trips."""
        best: tuple[list[int], TimedDivision] | None = None
        for head in heads:
            for ring in directions:
                chain = chain_from_head(ring, head)
                matrices = search_matrices(self.prices, chain)
                timed = fastest_division(matrices, trip, self.concurrency, below, self.candidates)
                if timed is not None:
                    best, below = (chain, timed), timed.time_per_token_s * (1 - TIE_TOLERANCE)
        return best


def _exact(search: _Search, m: int) -> tuple[Candidate | None, MemberSearch]:
    others = [i for i in range(m) if i != search.anchor]
    planned = [
        search.plan(frozenset({search.anchor, *chosen})) for size in range(m) for chosen in combinations(others, size)
    ]
    return _largest_close_to_fastest([c for c in planned if c is not None]), MemberSearch.EXACT


def _greedy(search: _Search, m: int) -> tuple[Candidate | None, MemberSearch]:
    """Drop the member whose leaving is fastest while that is faster; then choose among the sets
    passed through by the exact rule (the largest within the margin of the fastest)."""
    current = search.plan(frozenset(range(m)))
    path = [current] if current is not None else []
    while current is not None and len(current.members) > 1:
        fewer = [search.plan(current.members - {i}) for i in sorted(current.members - {search.anchor})]
        best = min(filter(None, fewer), key=lambda c: c.time_per_token_s, default=None)
        if best is None or best.time_per_token_s >= current.time_per_token_s:
            break
        current = best
        path.append(current)
    return _largest_close_to_fastest(path), MemberSearch.GREEDY


def _largest_close_to_fastest(candidates: Sequence[Candidate]) -> Candidate | None:
    """The largest set within STANDBY_MARGIN of the fastest; among those, the fastest."""
    if not candidates:
        return None
    fastest = min(c.time_per_token_s for c in candidates)
    close = [c for c in candidates if c.time_per_token_s <= fastest * (1 + STANDBY_MARGIN)]
    return min(close, key=lambda c: (-len(c.members), c.time_per_token_s, sorted(c.members)))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _its_blocks(count: int, verb: str) -> str:
    """'its block saves', 'its 6 blocks save'."""
    return f"its block {verb}s" if count == 1 else f"its {count} blocks {verb}"


def _serving(search: _Search, chosen: Candidate, member: int, needed: bool) -> Membership:
    name, blocks, with_it = search.devices[member].name, chosen.blocks_of(member), chosen.time_per_token_s
    without = search.plan(chosen.members - {member}) if member != search.anchor else None
    without_s = without.time_per_token_s if without is not None else None
    if member == search.anchor:
        why, words = Why.ANCHOR, f"{name} serves: it opened the session"
    elif needed:
        why, words = Why.NEEDED, f"{name} serves: the others cannot hold the model without it"
    elif without_s is None:
        why, words = Why.HOLDS_SHARE, f"{name} serves: the members serving cannot hold the model without it"
    elif without_s > with_it:
        why = Why.PAYS
        words = (
            f"{name} serves: {_its_blocks(blocks, 'save')} more than its place costs "
            f"({_ms(with_it)} a token with it, {_ms(without_s)} without)"
        )
    else:
        why = Why.PAYS
        words = (
            f"{name} serves: without it a token takes {_ms(without_s)} against {_ms(with_it)}, "
            f"within the {STANDBY_MARGIN:.0%} a member must cost to stand by"
        )
    return Membership(
        device=name,
        role=Role.SERVES,
        why=why,
        blocks=blocks,
        time_with_s=with_it,
        time_without_s=without_s,
        added_ring_s=chosen.ring_trip_s - without.ring_trip_s if without is not None else None,
        words=words,
    )


def _asked(search: _Search, chosen: Candidate, member: int) -> Membership:
    name = search.devices[member].name
    words = f"{name} serves: it opened the session" if member == search.anchor else f"{name} serves: every member is to"
    return Membership(
        device=name,
        role=Role.SERVES,
        why=Why.ANCHOR if member == search.anchor else Why.ASKED,
        blocks=chosen.blocks_of(member),
        time_with_s=chosen.time_per_token_s,
        time_without_s=None,
        added_ring_s=None,
        words=words,
    )


def _membership(search: _Search, chosen: Candidate, member: int, needed: bool) -> Membership:
    if member in chosen.members:
        return _serving(search, chosen, member, needed)
    name = search.devices[member].name
    more = search.plan(chosen.members | {member})
    if more is None:
        return Membership(
            device=name,
            role=Role.STANDS_BY,
            why=Why.NO_ROOM,
            blocks=None,
            time_with_s=None,
            time_without_s=chosen.time_per_token_s,
            added_ring_s=None,
            words=f"{name} stands by: the model divides into at most {search.max_stages} stages",
        )
    blocks, added = more.blocks_of(member), more.ring_trip_s - chosen.ring_trip_s
    stage_s = more.stage_cost_s(search.prices, member)
    computed = more.stages_s(search.prices) - chosen.stages_s(search.prices)  # what its stage adds to a pass
    cost = "its place costs more than"
    paces = stage_s >= more.time_per_token_s * (1 - TIE_TOLERANCE)
    if paces or 0 < computed >= added:  # a slow machine: its stage sets the pace, or adds more than its edges
        cost = f"its stage would take {_ms(stage_s)} a token, more than"
    elif added > 0:
        cost = f"its edges add {_ms(added)} to each pass of the ring, more than"
    return Membership(
        device=name,
        role=Role.STANDS_BY,
        why=Why.COSTS_MORE,
        blocks=blocks,
        time_with_s=more.time_per_token_s,
        time_without_s=chosen.time_per_token_s,
        added_ring_s=added,
        words=(
            f"{name} stands by: {cost} {_its_blocks(blocks, 'save')} "
            f"({_ms(more.time_per_token_s)} a token with it, {_ms(chosen.time_per_token_s)} without)"
        ),
    )


def _needed(search: _Search, m: int, member: int) -> bool:
    """Whether no set of members without it can hold the model (what was searched of them)."""
    return member != search.anchor and not any(c is not None and member not in c.members for c in search.seen.values())


def _unpriced(plan: Plan, concurrency: int) -> ServingChoice:
    members = tuple(
        Membership(
            device=name,
            role=Role.SERVES,
            why=Why.UNPRICED,
            blocks=next(s.end - s.start for s in plan.stages if s.device == name),
            time_with_s=None,
            time_without_s=None,
            added_ring_s=None,
            words=f"{name} serves: no speeds were measured, so every member serves",
        )
        for name in plan.ring
    )
    return ServingChoice(
        plan=plan,
        concurrency=concurrency,
        time_per_token_s=None,
        ring_trip_s=None,
        members=members,
        member_search=MemberSearch.EXACT,
    )


def with_host_work(prices: DevicePrices, host_work_s: tuple[float, float]) -> DevicePrices:
    """A machine's prices as the session's host: every stage it could hold costs the host's own
    work a token more, beside a stage of blocks and beside the head (`Device.host_work`), on the
    same cores."""
    if prices.cost is None:
        return prices
    (plain, head), cost, search = host_work_s, prices.cost, prices.search
    return replace(prices, cost=(cost[0] + plain, cost[1] + head), search=(search[0] + plain, search[1] + head))


def plan_who_serves(
    manifest: ModelManifest,
    devices: Sequence[Device],
    session: ServingSpec,
    anchor: str | None = None,
    round_trips: RoundTrips | None = None,
    pin_head: bool = False,
    every_member: bool = False,
    hosting: bool = False,
) -> ServingChoice:
    """The members of least time per token at the session's load (`session.users`), their ring and division;
    with `every_member`, every member serves, on the ring and division of least time per token.

    With `hosting`, the anchor is the session's host: its own work a token (`host_work_s`, where
    measured) is priced on its stage, and a head off the anchor sits where the anchor holds block 0.
    The plan's stages keep their own prices: what the stages will measure, without the host's work.

    Refuses as `plan_session` does when no set of members can hold the model.
    """
    names = [d.name for d in devices]
    if len(set(names)) != len(names) or (anchor is not None and anchor not in names) or not devices:
        plan_session(manifest, devices, session, anchor, pin_head, round_trips)  # raises what is wrong
    if round_trips is not None and (missing := round_trips.missing(names)):
        raise ValueError(f"no round trips for {', '.join(missing)}")
    tier = choose_tier(devices)
    if tier is Tier.MEMORY:
        unpriced = plan_session(manifest, devices, session, anchor, pin_head, round_trips)
        return _unpriced(unpriced, session.users)
    m, anchor_index = len(devices), names.index(anchor) if anchor is not None else 0
    prefix = ChainPrefix.of(manifest, session)
    prices = price_devices(devices, prefix, tier)
    searched = list(prices)
    host_work_s = devices[anchor_index].host_work() if hosting else None
    if host_work_s is not None and tier is Tier.COST_MODEL:
        searched[anchor_index] = with_host_work(prices[anchor_index], host_work_s)
    candidates = np.unique(candidate_bottlenecks([matrix for device in searched for matrix in device.search]))
    search = _Search(
        devices, searched, anchor_index, session.users, manifest.max_stages, pin_head, round_trips, candidates, {},
        head_beside_anchor=hosting,
    )  # fmt: skip
    if every_member:
        chosen, member_search = search.plan(frozenset(range(m))), MemberSearch.EXACT
    else:
        chosen, member_search = (_exact if m <= EXACT_MEMBERS else _greedy)(search, m)
    if chosen is None:
        plan_session(manifest, devices, session, anchor, pin_head, round_trips)  # raises its refusal
        raise PlanRefused("no set of members can hold the model", device=None)
    plan = _plan_of(devices, prices, prefix, manifest, tier, chosen, anchor_index, round_trips)
    if member_search is MemberSearch.GREEDY:
        note = f"who serves by dropping one member at a time: the exact search covers up to {EXACT_MEMBERS} members"
        plan = plan.model_copy(update={"notes": (*plan.notes, note)})
    if every_member:
        members = tuple(_asked(search, chosen, i) for i in range(m))
    else:
        members = tuple(_membership(search, chosen, i, _needed(search, m, i)) for i in range(m))
    return ServingChoice(
        plan=plan,
        concurrency=session.users,
        time_per_token_s=chosen.time_per_token_s,
        ring_trip_s=chosen.ring_trip_s,
        members=members,
        member_search=member_search,
    )


def plan_serving_host_choice(
    manifest: ModelManifest,
    devices: Sequence[Device],
    session: ServingSpec,
    round_trips: RoundTrips | None = None,
    every_member: bool = False,
) -> ServingChoice:
    """Who serves a session hosted on `devices[0]`, by `plan_who_serves`. The head: where the host's
    own work a token is measured (`Device.host_work`), priced on the host's stage, on the host or on a
    ring neighbour of it with the host holding block 0, whichever is faster (by more than
    HEAD_MARGIN to leave the host); where it is not, `plan_serving_host`'s rule: on the host if it
    can hold it (its own work unpriced would favour members), else wherever it fits. A host that
    cannot hold a block takes no stage: the members are chosen among themselves."""
    host = devices[0]
    if len(devices) > 1 and not holds_a_block(manifest, host, session):
        choice = plan_who_serves(manifest, devices[1:], session, round_trips=round_trips, every_member=every_member)
        note = f"'{host.name}' cannot hold a single block with its cache: it holds no stage, and embeds and samples"
        plan = choice.plan.model_copy(update={"notes": (*choice.plan.notes, note)})
        first, *rest = choice.members  # the anchor of that search, which did not open the session
        words = f"{first.device} serves: the host holds no stage, and the ring is planned from this member"
        return choice.model_copy(update={"plan": plan, "members": (first.model_copy(update={"words": words}), *rest)})
    pin = host.host_work() is None
    try:
        return plan_who_serves(manifest, devices, session, host.name, round_trips, pin, every_member, hosting=True)
    except PlanRefused:  # the host cannot hold the head: its refusal weighs every head
        return plan_who_serves(manifest, devices, session, host.name, round_trips, False, every_member)


def _plan_of(
    devices: Sequence[Device],
    prices: Sequence[DevicePrices],
    prefix: ChainPrefix,
    manifest: ModelManifest,
    tier: Tier,
    chosen: Candidate,
    anchor: int,
    round_trips: RoundTrips | None,
) -> Plan:
    chain, division = list(chosen.chain), chosen.timed.division
    m = len(devices)
    predicted = [[predict_edge(devices[i].nat, devices[j].nat) for j in range(m)] for i in range(m)]
    priced_in_time = round_trips is not None or all(d.rtt_s is not None for d in devices)
    ring_from_head = [chain[-1], *chain[:-1]]
    own, baselines = compare_divisions(devices, prices, chain, division, manifest.cut_positions(), tier)
    notes = []
    if chosen.ring_search is RingSearch.HEURISTIC:
        notes.append(f"ring order by 2-opt local search: the exact search covers up to {EXACT_LIMIT} members")
    if chain[-1] != anchor:
        notes.append(f"the head moved off the anchor: it is more than {HEAD_MARGIN:.0%} faster per token")
    if tier is Tier.THROUGHPUT:
        notes.append("some members have no bandwidth or overhead: stages priced by arithmetic throughput")
    return Plan(
        tier=tier,
        ring=tuple(devices[d].name for d in ring_from_head),
        head=devices[chain[-1]].name,
        stages=plan_stages(devices, prices, prefix, chain, division),
        bottleneck_s=own.bottleneck_s,
        utilisation=own.utilisation,
        edges=ring_edges(devices, ring_from_head, predicted, priced_in_time, round_trips),
        ring_search=chosen.ring_search,
        baselines=baselines,
        notes=tuple(notes),
    )


class LoadVerdict(Strict):
    """Whether a serving ring's load calls for other members: who `proposed` takes in and leaves
    out against the ring as it serves, and whether that is worth a replan."""

    users: int
    worth_it: bool
    taken_in: tuple[str, ...]
    left_out: tuple[str, ...]
    time_as_it_serves_s: float | None  # time per token at this load, the members serving as they are
    time_proposed_s: float | None
    reason: str


def _users(count: int) -> str:
    return f"{count} user{'' if count == 1 else 's'} at once"


def judge_load(as_it_serves: ServingChoice, proposed: ServingChoice, gain: float = LOAD_REPLAN_GAIN) -> LoadVerdict:
    """Compare who serves now with who the planner chooses at `proposed`'s load, both planned at
    that load with the same prices (`as_it_serves` with every member of the ring as it serves):
    worth a replan when the members change and the new ring is at least `gain` faster a token."""
    if not 0 < gain < 1:
        raise ValueError(f"a load replan's gain is a fraction between 0 and 1, not {gain}")
    users = proposed.concurrency
    serving, chosen = set(as_it_serves.plan.ring), set(proposed.plan.ring)
    taken_in = tuple(m for m in proposed.plan.ring if m not in serving)
    left_out = tuple(m for m in as_it_serves.plan.ring if m not in chosen)
    now, then = as_it_serves.time_per_token_s, proposed.time_per_token_s

    def verdict(worth_it: bool, reason: str) -> LoadVerdict:
        return LoadVerdict(
            users=users,
            worth_it=worth_it,
            taken_in=taken_in,
            left_out=left_out,
            time_as_it_serves_s=now,
            time_proposed_s=then,
            reason=reason,
        )

    if not taken_in and not left_out:
        return verdict(False, f"at {_users(users)} the members serving stay the fastest ring")
    if now is None or then is None:
        return verdict(False, f"at {_users(users)} no speeds were measured to weigh who serves by")
    changes = " and ".join([*(f"{m} taken in" for m in taken_in), *(f"{m} left out" for m in left_out)])
    if len(taken_in) + len(left_out) == 1:  # the member's own reason, from the plan that would serve
        member = next(m for m in proposed.members if m.device in (*taken_in, *left_out))
        detail = member.words.split(": ", 1)[1]
    else:
        detail = f"{_ms(then)} a token against {_ms(now)} with the members serving as they are"
    reason = f"{changes}: at {_users(users)}, {detail}"
    if then > now * (1 - gain):
        return verdict(False, f"{reason}; less than {gain:.0%} faster, so who serves stays")
    return verdict(True, reason)
