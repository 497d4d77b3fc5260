"""What /status shows of a host's session: its members and their links, the plan and its
division, the ring's edges, the last rebalance verdict and the load served."""

from __future__ import annotations

from typing import Any

from kafila.contracts import LoadStatus, MemberStatus, PlanStatus, RebalanceStatus, SessionStatus
from kafila.session.host import HostSession


def session_status(
    session: HostSession,
    admitting: bool,
    failed_proofs: int = 0,
    guess_budget: int | None = None,
    joining: frozenset[str] = frozenset(),
    load: LoadStatus | None = None,
) -> SessionStatus:
    """`admitting`: whether a freed seat may still be taken, `failed_proofs` the possible
    guesses counted so far of `guess_budget`, `joining` the newcomers waiting for a plan, `load`
    the load served where members may stand by (the session core decides and counts)."""
    deployment = session.deployment
    machines = session.known_machines() if deployment is not None else {}  # only a deployment's members are priced
    choice = session.choice if deployment is not None else None
    roles = {m.device: m for m in choice.members} if choice is not None else {}
    members = []
    for member_id, info in (session.known or session.client.members).items():
        entry: dict[str, Any] = {"id": member_id, "name": session.member_name(member_id), "host": info.host}
        hello = session.roster.hellos.get(member_id)
        backend = session.own_backend if member_id == session.me else hello.backend if hello is not None else None
        if backend is not None:
            entry["backend"] = backend
        router = session.roster.routers.get(member_id)
        if router is not None:
            entry["path"] = session.roster.paths.get(member_id)
            entry["link"] = "down" if router.link.closed.done() else "up"
            if member_id not in session.client.members:
                entry["left"] = True
            if member_id in joining:
                entry["joining"] = True
            if router.link.core.rtt_ms is not None:
                entry["rtt_ms"] = router.link.core.rtt_ms
        membership = roles.get(entry["name"])
        if membership is not None:
            entry.update(role=membership.role.value, why=membership.words)
        if deployment is not None and member_id in deployment.chain:
            stage = deployment.plan.stages[deployment.chain.index(member_id)]
            entry["blocks"] = (stage.start, stage.end)
            entry["predicted_ms_per_token"] = round(stage.cost_s * 1e3, 3) if stage.cost_s is not None else None
            entry["priced_on"] = session.prices.priced_on(machines, member_id)
        origin = session.deployer.origins.get(member_id) if deployment is not None else None
        if origin is not None:
            entry.update(stage_source=origin.source, stage_bytes=origin.n_bytes, stage_seconds=origin.seconds)
            if origin.why is not None:
                entry["stage_why"] = origin.why
        members.append(MemberStatus(**entry))  # only what applies is set, and shown
    plan = deployment.plan if deployment else None
    verdict = session.prices.last_verdict
    return SessionStatus(
        code=session.code,
        admitting=admitting,
        failed_proofs=failed_proofs,
        guess_budget=guess_budget,
        members=members,
        epoch=session.deployer.epoch,
        edges=session.deployer.chain_edges(deployment.chain) if deployment is not None else [],
        plan=None if plan is None else PlanStatus(
            tier=plan.tier.value, ring=list(plan.ring), head=plan.head,
            division=deployment.counts if deployment else None,
            predicted_bottleneck_ms=round(plan.bottleneck_s * 1e3, 3) if plan.bottleneck_s else None,
            standby=list(choice.standby) if choice else [],
            concurrency=choice.concurrency if choice else None,
            predicted_ms_per_token=round(choice.time_per_token_s * 1e3, 3)
            if choice and choice.time_per_token_s else None,
        ),
        rebalance=None if verdict is None else RebalanceStatus(
            reason=verdict.reason,
            measured_bottleneck_ms=round(verdict.measured_bottleneck_s * 1e3, 3),
            planned_bottleneck_ms=None if verdict.planned_bottleneck_s is None
            else round(verdict.planned_bottleneck_s * 1e3, 3),
        ),
        load=load if deployment is not None else None,
    )  # fmt: skip
