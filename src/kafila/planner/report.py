"""The plan as `kafila plan --json` prints it: the contract other tools and checks read."""

from __future__ import annotations

from pydantic import Field

from kafila.planner.types import EdgePrediction, Plan, RingSearch, Strict, Tier
from kafila.planner.who_serves import MemberSearch, Role, ServingChoice, Why


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
    ms_per_token: float | None = None  # t_c of this division on the same ring, where the members were chosen


class MemberReport(Strict):
    """Whether a member serves and why: `words` for people, the rest for programs."""

    device: str
    role: Role
    why: Why
    blocks: int | None
    ms_per_token_with: float | None
    ms_per_token_without: float | None
    added_ring_ms: float | None
    words: str


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
    # Who serves (`kafila plan`); empty where the plan was made for the members given.
    concurrency: int | None = None
    ms_per_token: float | None = Field(default=None, description="t_c, the time per token the members were chosen by.")
    ring_trip_ms: float | None = Field(default=None, description="One way round the serving ring.")
    member_search: MemberSearch | None = None
    members: list[MemberReport] = Field(default_factory=list)
    standby: list[str] = Field(default_factory=list)


def plan_report(plan: Plan, planner_s: float, choice: ServingChoice | None = None) -> PlanReport:
    """The report of a plan, with who serves and who stands by where the members were chosen."""
    report = _report(plan, planner_s)
    if choice is None:
        return report
    return report.model_copy(
        update={
            "concurrency": choice.concurrency,
            "ms_per_token": _ms(choice.time_per_token_s),
            "ring_trip_ms": _ms(choice.ring_trip_s),
            "member_search": choice.member_search,
            "members": [
                MemberReport(
                    device=m.device,
                    role=m.role,
                    why=m.why,
                    blocks=m.blocks,
                    ms_per_token_with=_ms(m.time_with_s),
                    ms_per_token_without=_ms(m.time_without_s),
                    added_ring_ms=_ms(m.added_ring_s),
                    words=m.words,
                )
                for m in choice.members
            ],
            "standby": list(choice.standby),
            "baselines": {
                name: baseline.model_copy(update={"ms_per_token": _baseline_ms_per_token(baseline, choice)})
                for name, baseline in report.baselines.items()
            },
        }
    )


def _baseline_ms_per_token(baseline: BaselineReport, choice: ServingChoice) -> float | None:
    """t_c of a rule-of-thumb division: its stages sum to utilisation × bottleneck × their count."""
    if baseline.bottleneck_ms is None or baseline.utilisation is None or choice.ring_trip_s is None:
        return None
    total_ms = baseline.utilisation * baseline.bottleneck_ms * len(baseline.counts)
    return max(baseline.bottleneck_ms, (total_ms + choice.ring_trip_s * 1e3) / choice.concurrency)


def _report(plan: Plan, planner_s: float) -> PlanReport:
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
