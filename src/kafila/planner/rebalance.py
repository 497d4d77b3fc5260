"""Whether a serving ring should be divided again, judged on what its stages measured.

A plan is only as good as the prices it was made with, and a probe can misjudge a machine (a
stale cache, a narrow model, a machine busy with something else when it probed). Once every
stage has timed enough decodes, the host can plan again with prices that pass through those
times and compare. Moving blocks costs a pause (slicing, streaming, loading), and stage times
on a shared machine wobble, so only a clear gain is worth it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from kafila.planner.types import Plan, Strict

# The new plan's slowest stage must be at least this much faster than the slowest one measured:
# well past the run-to-run wobble of stage times (a few percent, 10-20% on a busy machine).
REBALANCE_GAIN = 0.25


class RebalanceVerdict(Strict):
    """The host's reading of a ring that has served: keep it, or divide it again."""

    worth_it: bool
    measured_bottleneck_s: float = Field(gt=0)
    planned_bottleneck_s: float | None
    reason: str
    # The largest over the smallest of each stage's measured time over its plan's: 1 where the
    # stages ran as planned or a load slowed them alike; under 1 / (1 - gain), never worth it
    spread: float | None = None


def _division(plan: Plan) -> tuple[tuple[str, int, int, bool], ...]:
    return tuple((s.device, s.start, s.end, s.is_head) for s in plan.stages)


def judge_rebalance(
    current: Plan, measured_s: Sequence[float | None], proposed: Plan, gain: float = REBALANCE_GAIN
) -> RebalanceVerdict | None:
    """Compare the slowest stage measured on `current` with the slowest `proposed` predicts.

    `measured_s` holds each stage's time per token, in chain order (None: too few decodes timed);
    `proposed` is the plan made with prices scaled to pass through those times, so on the current
    division it would predict exactly what was measured. None where there is nothing to judge: a
    stage not measured yet, or a proposal without stage prices.
    """
    if not 0 < gain < 1:
        raise ValueError(f"a rebalance gain is a fraction between 0 and 1, not {gain}")
    if len(measured_s) != len(current.stages) or proposed.bottleneck_s is None:
        return None
    times = [t for t in measured_s if t is not None and t > 0]
    if len(times) != len(current.stages):
        return None
    slowest = max(times)
    planned = proposed.bottleneck_s
    scales = [t / s.cost_s for t, s in zip(times, current.stages, strict=True) if s.cost_s]
    spread = max(scales) / min(scales) if len(scales) == len(times) else None
    if _division(proposed) == _division(current):
        return RebalanceVerdict(
            worth_it=False,
            measured_bottleneck_s=slowest,
            planned_bottleneck_s=planned,
            reason="the plan stands",
            spread=spread,
        )
    worth_it = planned <= slowest * (1 - gain)
    measured = f"the slowest stage measured {slowest * 1e3:.3g} ms a token"
    if spread is not None:
        measured += f" (each stage {min(scales):.3g} to {max(scales):.3g} times its planned time)"
    verdict = "worth it" if worth_it else f"less than {gain:.0%} faster, so the plan stands"
    return RebalanceVerdict(
        worth_it=worth_it,
        measured_bottleneck_s=slowest,
        planned_bottleneck_s=planned,
        reason=f"{measured}; divided again, {planned * 1e3:.3g} ms: {verdict}",
        spread=spread,
    )
