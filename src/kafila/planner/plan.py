"""Plan a session: ring order, then head and division together, then admission.

Ring order comes first, from reachability alone, because an order is a property of the network
and a division is a property of the devices: fixing the order turns placement into an exactly
solvable chain-on-chain partition (Pinar et al.), and rotating the fixed ring to try every head
costs m exact solves rather than a search over m! orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from kafila.planner import cost
from kafila.planner.cost import BoolMatrix, ChainPrefix, FloatMatrix
from kafila.planner.division import proportional_division, summarise
from kafila.planner.partition import Division, candidate_bottlenecks, partition
from kafila.planner.reachability import edge_cost_s, predict_edge
from kafila.planner.ring import EXACT_LIMIT, best_ring, combine
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import (
    Device,
    DivisionSummary,
    EdgePrediction,
    ModelManifest,
    Plan,
    PlanRefused,
    RingEdge,
    ServingSpec,
    Stage,
    Tier,
)

HEAD_MARGIN = 0.05  # another head must beat the anchor by more than overhead noise can explain


def choose_tier(devices: Sequence[Device]) -> Tier:
    if all(d.bandwidth_bytes_per_s is not None and d.overhead_s is not None for d in devices):
        return Tier.COST_MODEL
    if all(d.flops is not None for d in devices):
        return Tier.THROUGHPUT
    return Tier.MEMORY


@dataclass(frozen=True)
class DevicePrices:
    """One device's prices for every range, each as a pair indexed by role: (plain member, head)."""

    cost: tuple[FloatMatrix, FloatMatrix] | None  # unconstrained by memory; None in the memory tier
    fill: tuple[FloatMatrix, FloatMatrix]
    fits: tuple[BoolMatrix, BoolMatrix]
    search: tuple[FloatMatrix, FloatMatrix]  # what the partition minimises; overfull ranges at infinity


def price_devices(devices: Sequence[Device], prefix: ChainPrefix, tier: Tier) -> list[DevicePrices]:
    priced = []
    for device in devices:
        costs: tuple[FloatMatrix, FloatMatrix] | None
        if tier is Tier.COST_MODEL:
            costs = (cost.cost_model_matrix(device, prefix, False), cost.cost_model_matrix(device, prefix, True))
        elif tier is Tier.THROUGHPUT:
            shared = cost.throughput_matrix(device, prefix)
            costs = (shared, shared)
        else:
            costs = None
        fill = (cost.fill_matrix(device, prefix, False), cost.fill_matrix(device, prefix, True))
        fits = (cost.fits_matrix(device, prefix, False), cost.fits_matrix(device, prefix, True))
        objective = costs if costs is not None else fill  # memory fill where there is no cost
        search = (cost.within_memory(objective[0], fits[0]), cost.within_memory(objective[1], fits[1]))
        priced.append(DevicePrices(cost=costs, fill=fill, fits=fits, search=search))
    return priced


def chain_from_head(ring: Sequence[int], head_position: int) -> list[int]:
    """Chain order for a head: the member after the head holds block 0, the head the last blocks."""
    from_head = list(ring[head_position:]) + list(ring[:head_position])
    return from_head[1:] + from_head[:1]


def _roles(chain: Sequence[int]) -> list[tuple[int, bool]]:
    """Each chain member with whether it is the head (the last)."""
    return [(d, i == len(chain) - 1) for i, d in enumerate(chain)]


def search_matrices(prices: Sequence[DevicePrices], chain: Sequence[int]) -> list[FloatMatrix]:
    return [prices[d].search[is_head] for d, is_head in _roles(chain)]


@dataclass(frozen=True)
class HeadChoice:
    head_position: int
    division: Division


def place_head(
    prices: Sequence[DevicePrices], ring: Sequence[int], tier: Tier, pinned: bool = False
) -> tuple[HeadChoice | None, str | None]:
    """Solve every rotation of the ring; keep the anchor unless another head is clearly better.

    Only the full cost model can price the head, so the lower tiers keep it at the anchor and
    move it only when the anchor cannot hold it at all. `pinned` keeps it at the anchor always
    (a host that serves the API holds the head itself).
    """
    chains = [chain_from_head(ring, r) for r in range(1 if pinned else len(ring))]
    matrices = [search_matrices(prices, chain) for chain in chains]
    if tier is not Tier.COST_MODEL:
        for r, chain_matrices in enumerate(matrices):
            division = partition(chain_matrices)
            if division is not None:
                note = None if r == 0 else "the anchor cannot hold the head, so the head moved"
                return HeadChoice(r, division), note
        return None, None
    candidates = candidate_bottlenecks([matrix for device in prices for matrix in device.search])
    anchor = partition(matrices[0], candidates)
    best = HeadChoice(0, anchor) if anchor is not None else None
    below = anchor.bottleneck * (1 - HEAD_MARGIN) if anchor is not None else np.inf
    for r in range(1, len(chains)):
        division = partition(matrices[r], candidates, below=below)
        if division is not None:
            best, below = HeadChoice(r, division), division.bottleneck
    note = None
    if best is not None and best.head_position != 0:
        note = (
            "the anchor cannot hold the head, so the head moved"
            if anchor is None
            else f"the head moved off the anchor: it lowers the bottleneck by more than {HEAD_MARGIN:.0%}"
        )
    return best, note


def refuse(
    devices: Sequence[Device],
    prices: Sequence[DevicePrices],
    ring: Sequence[int],
    prefix: ChainPrefix,
    pinned: bool = False,
) -> PlanRefused:
    """Name the member that cannot hold its share in the most even division there is.

    Balancing memory fill over every head choice gives the division that asks least of the
    fullest member; that member, and by how much it is over, is what the user has to change.
    """
    best: tuple[float, list[int], Division] | None = None
    for r in range(1 if pinned else len(ring)):
        chain = chain_from_head(ring, r)
        division = partition([prices[d].fill[is_head] for d, is_head in _roles(chain)])
        assert division is not None  # fill has no limit, so a division with one block each exists
        if best is None or division.bottleneck < best[0]:
            best = (division.bottleneck, chain, division)
    assert best is not None
    _, chain, division = best
    roles, spans = _roles(chain), division.spans
    fullest = max(range(len(chain)), key=lambda i: prices[roles[i][0]].fill[roles[i][1]][spans[i]])
    d, is_head = roles[fullest]
    device = devices[d]
    a, b = spans[fullest]
    need = int(prefix.resident_matrix(is_head)[a, b])
    shortfall = need - device.memory_bytes
    role = " and the head" if is_head else ""
    message = (
        f"no division fits: '{device.name}' cannot hold its share (blocks {a}-{b - 1}{role}, "
        f"{need / 2**30:.2f} GiB with KV cache) in {device.memory_bytes / 2**30:.2f} GiB; "
        f"it is short by {shortfall} bytes ({shortfall / 2**30:.2f} GiB) even in the most even division "
        f"(the session needs {int(prefix.resident_matrix(True)[0, -1]) / 2**30:.2f} GiB in all; "
        f"the members have {sum(d.memory_bytes for d in devices) / 2**30:.2f} GiB)"
    )
    return PlanRefused(message, device=device.name, shortfall_bytes=shortfall)


def ring_weights(
    devices: Sequence[Device], round_trips: RoundTrips | None = None
) -> tuple[np.ndarray, list[list[EdgePrediction]], bool]:
    """Integer edge weights for the ring search, and whether they are priced in time: the measured
    round trips where given, else estimates from each member's trip to the rendezvous."""
    m = len(devices)
    predicted = [[predict_edge(devices[i].nat, devices[j].nat) for j in range(m)] for i in range(m)]
    if round_trips is not None:
        names = [d.name for d in devices]
        measured = [[round(round_trips.between(a, b) * 1e6) for b in names] for a in names]
        return np.array(measured, dtype=np.int64), predicted, True
    rtts = [d.rtt_s for d in devices]
    if all(r is not None for r in rtts):
        rtt_us = [round(r * 1e6) for r in rtts if r is not None]
        primary = np.array(
            [[round(edge_cost_s(predicted[i][j], rtt_us[i], rtt_us[j])) for j in range(m)] for i in range(m)],
            dtype=np.int64,
        )
        separation = np.array([[abs(rtt_us[i] - rtt_us[j]) for j in range(m)] for i in range(m)], dtype=np.int64)
        return combine(primary, separation), predicted, True
    relayed = np.array([[int(p is EdgePrediction.RELAYED) for p in row] for row in predicted], dtype=np.int64)
    return relayed, predicted, False


def plan_stages(
    devices: Sequence[Device],
    prices: Sequence[DevicePrices],
    prefix: ChainPrefix,
    chain: Sequence[int],
    division: Division,
) -> tuple[Stage, ...]:
    stages = []
    for (d, is_head), (a, b) in zip(_roles(chain), division.spans, strict=True):
        costs = prices[d].cost
        stages.append(
            Stage(
                device=devices[d].name,
                start=a,
                end=b,
                is_head=is_head,
                cost_s=float(costs[is_head][a, b]) if costs is not None else None,
                resident_bytes=int(prefix.resident_matrix(is_head)[a, b]),
                memory_bytes=devices[d].memory_bytes,
            )
        )
    return tuple(stages)


def edge_round_trip_s(
    devices: Sequence[Device],
    predicted: list[list[EdgePrediction]],
    d: int,
    e: int,
    round_trips: RoundTrips | None = None,
) -> float | None:
    """The round trip of the edge d–e: measured where given, else bounded from the members' trips
    to the rendezvous, else unknown."""
    if round_trips is not None:
        return round_trips.between(devices[d].name, devices[e].name)
    rtt_d, rtt_e = devices[d].rtt_s, devices[e].rtt_s
    if rtt_d is None or rtt_e is None:
        return None
    return edge_cost_s(predicted[d][e], rtt_d, rtt_e)


def ring_edges(
    devices: Sequence[Device],
    ring_from_head: Sequence[int],
    predicted: list[list[EdgePrediction]],
    priced_in_time: bool,
    round_trips: RoundTrips | None = None,
) -> tuple[RingEdge, ...]:
    if len(ring_from_head) == 1:
        return ()
    edges = []
    for d, e in zip(ring_from_head, [*ring_from_head[1:], ring_from_head[0]], strict=True):
        edge_cost = edge_round_trip_s(devices, predicted, d, e, round_trips) if priced_in_time else None
        edges.append(RingEdge(a=devices[d].name, b=devices[e].name, predicted=predicted[d][e], cost_s=edge_cost))
    return tuple(edges)


def compare_divisions(
    devices: Sequence[Device],
    prices: Sequence[DevicePrices],
    chain: Sequence[int],
    division: Division,
    positions: Sequence[int],
    tier: Tier,
) -> tuple[DivisionSummary, dict[str, DivisionSummary]]:
    """Kafila's division and the two rules of thumb, judged on the same chain by the same prices."""
    roles = _roles(chain)
    cost_matrices = None
    if tier is not Tier.MEMORY:
        cost_matrices = [costs[is_head] for d, is_head in roles if (costs := prices[d].cost) is not None]
    fits_matrices = [prices[d].fits[is_head] for d, is_head in roles]
    uniform = proportional_division([1.0] * len(chain), positions)
    by_memory = proportional_division([devices[d].memory_bytes for d in chain], positions)
    return summarise(division.counts, cost_matrices, fits_matrices), {
        "uniform": summarise(uniform, cost_matrices, fits_matrices),
        "memory": summarise(by_memory, cost_matrices, fits_matrices),
    }


def plan_session(
    manifest: ModelManifest,
    devices: Sequence[Device],
    session: ServingSpec,
    anchor: str | None = None,
    pin_head: bool = False,
    round_trips: RoundTrips | None = None,
) -> Plan:
    """Decide ring, head, division and admission before a single weight is loaded.

    `pin_head` keeps the head on the anchor (the serving host) instead of wherever is fastest;
    `round_trips`, the measured round trip of every edge, orders the ring in their place.
    """
    names = [d.name for d in devices]
    if not devices:
        raise ValueError("a session needs at least one device")
    if len(set(names)) != len(names):
        raise ValueError("device names must be unique")
    if anchor is not None and anchor not in names:
        raise ValueError(f"anchor '{anchor}' is not one of the devices")
    if round_trips is not None and (missing := round_trips.missing(names)):
        raise ValueError(f"no round trips for {', '.join(missing)}")
    anchor_index = names.index(anchor) if anchor is not None else 0
    if len(devices) > manifest.max_stages:
        limit = ""
        if manifest.stage_starts == ():
            limit = ", which its family cannot split,"
        elif manifest.stage_starts is not None:
            starts = ", ".join(map(str, manifest.stage_starts))
            limit = f", which divide into at most {manifest.max_stages} stages (its family's start at blocks {starts}),"
        raise PlanRefused(
            f"the model has {manifest.n_blocks} blocks{limit} but the fleet has {len(devices)} members: "
            "every member needs at least one block",
            device=None,
        )
    total_need = manifest.total_bytes + sum(manifest.cache_bytes(session.context, session.concurrency))
    if total_need > 2**60:  # beyond any fleet's memory, and beyond exact int64 arithmetic
        raise PlanRefused(
            f"the session needs {total_need / 2**30:.3g} GiB in all; the members have "
            f"{sum(d.memory_bytes for d in devices) / 2**30:.3g} GiB",
            device=None,
        )
    notes: list[str] = []
    tier = choose_tier(devices)
    weights, predicted, priced_in_time = ring_weights(devices, round_trips)
    found = best_ring(weights, anchor_index)
    if found.search.value == "heuristic":
        notes.append(f"ring order by 2-opt local search: the exact search covers up to {EXACT_LIMIT} members")
    ring = found.order
    prefix = ChainPrefix.of(manifest, session)
    prices = price_devices(devices, prefix, tier)
    if pin_head and anchor is None:
        raise ValueError("pin_head needs an anchor: the device that must hold the head")
    choice, head_note = place_head(prices, ring, tier, pin_head)
    if choice is None:
        raise refuse(devices, prices, ring, prefix, pin_head)
    if head_note:
        notes.append(head_note)

    chain = chain_from_head(ring, choice.head_position)
    stages = plan_stages(devices, prices, prefix, chain, choice.division)
    ring_from_head = [chain[-1], *chain[:-1]]
    edges = ring_edges(devices, ring_from_head, predicted, priced_in_time, round_trips)
    own, baselines = compare_divisions(devices, prices, chain, choice.division, manifest.cut_positions(), tier)
    if tier is Tier.THROUGHPUT:
        notes.append("some members have no bandwidth or overhead: stages priced by arithmetic throughput")
    elif tier is Tier.MEMORY:
        notes.append("members lack speed measurements: blocks divided in proportion to memory")
    return Plan(
        tier=tier,
        ring=tuple(names[d] for d in ring_from_head),
        head=names[chain[-1]],
        stages=stages,
        bottleneck_s=own.bottleneck_s,
        utilisation=own.utilisation,
        edges=edges,
        ring_search=found.search,
        baselines=baselines,
        notes=tuple(notes),
    )


def plan_serving_host(manifest: ModelManifest, devices: Sequence[Device], session: ServingSpec) -> Plan:
    """The plan for a session served from `devices[0]`: the head there if it can hold it, else
    wherever it fits.

    The host serves the API and samples, so a head on a member sends the host logits every token
    (the few its sampler can pick from, at worst the whole row: a megabyte for a 262k vocabulary),
    a cost the model of Section V does not price; the paper finds a head moved for speed alone
    within run-to-run noise. So the head leaves the host only for capacity: when the host cannot
    hold it, and another machine can.

    A host that cannot hold even one block with its cache takes no stage at all: the members hold
    every block and the head, and the host only embeds, samples and serves the API.
    """
    host = devices[0]
    if len(devices) > 1 and not holds_a_block(manifest, host, session):
        plan = plan_session(manifest, devices[1:], session)
        note = f"'{host.name}' cannot hold a single block with its cache: it holds no stage, and embeds and samples"
        return plan.model_copy(update={"notes": (*plan.notes, note)})
    try:
        return plan_session(manifest, devices, session, anchor=host.name, pin_head=True)
    except PlanRefused:
        return plan_session(manifest, devices, session, anchor=host.name)  # its refusal weighs every head


def holds_a_block(manifest: ModelManifest, device: Device, session: ServingSpec) -> bool:
    """Whether the device can hold the smallest stage there can be, with its cache and context."""
    return smallest_stage_bytes(manifest, session) <= device.memory_bytes


def smallest_stage_bytes(manifest: ModelManifest, session: ServingSpec) -> int:
    """The bytes of the smallest stage there can be (a block, where the model may be cut anywhere)
    with its KV cache and llama.cpp context: a machine that cannot lend that holds no stage at all."""
    need = ChainPrefix.of(manifest, session).resident_matrix(is_head=False)  # the memory rule every plan applies
    return min(int(need[a, b]) for a, b in pairwise(manifest.cut_positions()))
