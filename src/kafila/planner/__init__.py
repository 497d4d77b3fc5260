"""The planner: a pure core that decides ring order, head, division and admission.

Nothing here touches a file, a socket or a clock, so every decision is reproducible from its
inputs and testable against brute force.
"""

from kafila.planner.plan import plan_serving_host, plan_session
from kafila.planner.types import Device, ModelManifest, Plan, PlanRefused, ServingSpec, Tier

__all__ = ["Device", "ModelManifest", "Plan", "PlanRefused", "ServingSpec", "Tier", "plan_serving_host", "plan_session"]
