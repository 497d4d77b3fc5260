"""The plan as `kafila plan --json` prints it: the contract other tools and checks read."""

from __future__ import annotations

from pydantic import Field

from kafila.planner.types import EdgePrediction, Plan, RingSearch, Strict, Tier


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class EdgeReport(Strict):
    a: str
    b: str
    predicted: EdgePrediction
    cost_ms: float | None


class BaselineReport(Strict):
    bottleneck_ms: float | None
    utilisation: float | None
    fits: bool
    counts: list[int]


class PlanReport(Strict):
    tier: Tier
    ring: list[str]
    head: str
    ranges: dict[str, tuple[int, int]] = Field(description="Blocks [start, end) per member.")
    stage_ms: dict[str, float | None]
    bottleneck_ms: float | None
    utilisation: float | None
    edges: list[EdgeReport]
    ring_search: RingSearch
    planner_ms: float
    baselines: dict[str, BaselineReport]
    memory_bytes: dict[str, dict[str, int]]
    notes: list[str]


def plan_report(plan: Plan, planner_s: float) -> PlanReport:
    return PlanReport(
        tier=plan.tier,
        ring=list(plan.ring),
        head=plan.head,
        ranges={s.device: (s.start, s.end) for s in plan.stages},
        stage_ms={s.device: _ms(s.cost_s) for s in plan.stages},
        bottleneck_ms=_ms(plan.bottleneck_s),
        utilisation=plan.utilisation,
        edges=[EdgeReport(a=e.a, b=e.b, predicted=e.predicted, cost_ms=_ms(e.cost_s)) for e in plan.edges],
        ring_search=plan.ring_search,
        planner_ms=planner_s * 1e3,
        baselines={
            name: BaselineReport(
                bottleneck_ms=_ms(b.bottleneck_s), utilisation=b.utilisation, fits=b.fits, counts=list(b.counts)
            )
            for name, b in plan.baselines.items()
        },
        memory_bytes={s.device: {"needed": s.resident_bytes, "available": s.memory_bytes} for s in plan.stages},
        notes=list(plan.notes),
    )
