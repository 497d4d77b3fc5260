"""`kafila status`: the host's `/status` as tables, for a person at a terminal."""

from __future__ import annotations

import json
import time
from typing import Annotated
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kafila.cli.errors import fail, shown
from kafila.contracts import BackendReport, HostStatus, MemberStatus, SpeculationStatus
from kafila.validation import one_line


def _number(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None else "—"


def speculation_line(speculation: SpeculationStatus) -> str:
    """What `kafila host --speculate` drafted and kept, in a line."""
    if speculation.off is not None:
        return f"none ({shown(speculation.off)})"
    line = (
        f"{speculation.mode}, {speculation.drafted_tokens} drafted, {speculation.accepted_tokens} kept, "
        f"{_number(speculation.accepted_per_trip)} kept a trip, window {_number(speculation.mean_window, 1)}"
    )
    if speculation.trip_ms is not None and speculation.row_ms is not None:  # what the cost rule weighs
        line += f"; a trip {_number(speculation.trip_ms, 1)} ms"
        if speculation.fixed_ms is not None:  # what carrying drafts at all adds to a wave (a host before it: none)
            line += f", a wave with drafts {_number(speculation.fixed_ms, 1)} ms more"
        line += f", a drafted row {_number(speculation.row_ms, 1)} ms more"
    if speculation.draft_ms is not None:  # a draft model's own decode, before the wave leaves
        line += f"; the draft {_number(speculation.draft_ms, 1)} ms a token"
    return line


def render_status(status: HostStatus, console: Console) -> None:
    ready = "[green]ready[/green]" if status.ready else "[yellow]not ready[/yellow]"
    console.print(f"[bold]{shown(status.model)}[/bold]: {ready}", highlight=False, soft_wrap=True)
    for line in status.waiting_for:
        console.print(f"  waiting for {shown(line)}", highlight=False, soft_wrap=True)
    if status.error:
        console.print(f"  [red]error:[/red] {shown(status.error, True)}", highlight=False, soft_wrap=True)
    if status.join:
        console.print(f"  a member joins with: {shown(status.join)}", highlight=False, soft_wrap=True)
    console.print(
        f"tokens/s {_number(status.tokens_per_s, 1)}, running {status.running}, "
        f"queued {status.queue_depth}, context {status.context_per_sequence} per request, "
        f"waves in flight up to {status.pipeline_waves or '—'}"
        + (f", prompt chunks up to {status.prefill.chunks}" if status.prefill and status.prefill.chunks > 1 else ""),
        highlight=False,
        soft_wrap=True,
    )
    if status.speculation is not None:
        console.print(f"drafts: {speculation_line(status.speculation)}", highlight=False, soft_wrap=True)
    if status.requests_by_dialect:
        counts = ", ".join(f"{shown(name)} {count}" for name, count in sorted(status.requests_by_dialect.items()))
        console.print(f"requests by dialect: {counts}", highlight=False, soft_wrap=True)
    reports = {stage.range: stage for stage in status.stages}
    head = status.plan.head if status.plan else None  # none planned: one machine, which holds it
    if status.members:
        table = Table(title="Members")
        columns = (
            "member", "role", "blocks", "link", "backend", "stage from", "predicted ms/token", "measured ms/token",
            "ms/row, all decodes",
        )  # fmt: skip
        left = ("member", "role", "link", "backend", "stage from")
        for column in columns:
            table.add_column(column, justify="left" if column in left else "right")
        for member in status.members:
            span = member.blocks
            state = "left" if member.left else (member.link or "?")
            link = "—" if member.host else f"{member.path or '?'}, {state}"
            if member.rtt_ms is not None:
                link += f", {_number(member.rtt_ms)} ms"
            report = reports.get(span) if span is not None else None
            blocks = f"{span[0]}–{span[1] - 1}" if span else "—"
            if member.stages:  # one machine split into local stages
                blocks = "stages " + ", ".join(map(str, member.stages))
            table.add_row(
                shown(member.name),
                ("host" if member.host else "member")
                + (" (head)" if member.name == head or (head is None and member.host) else "")
                + (" (joining)" if member.joining else "")
                + (" (stands by)" if member.role == "stands-by" else ""),
                blocks,
                link,
                _backend(member.backend),
                _stage_from(member),
                _number(member.predicted_ms_per_token) + (" *" if _generic(member) else ""),
                # a decode of one token alone is what the prediction prices; batched rows cost less each
                _number(report.ms_per_token_alone) if report else "—",
                _number(report.ms_per_token) if report else "—",
            )
        console.print(table)
        for member in status.members:
            if member.role == "stands-by" and member.why:
                console.print(shown(member.why), highlight=False, soft_wrap=True)
        for member in status.members:
            if member.stage_why:
                why = f"{shown(member.name)}'s stage came from the host, not the hub: {shown(member.stage_why, True)}"
                console.print(why, highlight=False, soft_wrap=True)
        if any(_generic(member) for member in status.members):
            console.print(
                "* predicted from the generic probe, which misjudges narrow models: `kafila probe --model` on that "
                "machine prices this model's own stages for later sessions",
                highlight=False,
                soft_wrap=True,
            )
    if status.edges:
        ring = Table(title="Ring edges")
        for column in ("from", "to", "path", "rtt ms"):
            ring.add_column(column, justify="right" if column == "rtt ms" else "left")
        for edge in status.edges:
            ring.add_row(shown(edge.source), shown(edge.to), shown(edge.path or "—"), _number(edge.rtt_ms))
        console.print(ring)
    plan = status.plan
    if plan:
        console.print(
            f"plan (epoch {status.epoch}): tier {shown(plan.tier)}, ring {shown(' → '.join(plan.ring))}, "
            f"division {plan.division}, predicted bottleneck {_number(plan.predicted_bottleneck_ms)} ms"
            + (
                f", {_number(plan.predicted_ms_per_token)} ms a token at {plan.concurrency} concurrent"
                if plan.predicted_ms_per_token is not None
                else ""
            ),
            highlight=False,
            soft_wrap=True,
        )
    if status.rebalance:
        console.print(f"rebalance: {shown(status.rebalance.reason)}", highlight=False, soft_wrap=True)
    if status.load:
        load = status.load
        measured = f", {load.measured:g} measured" if load.measured is not None else ""
        said = f": {shown(load.reason)}" if load.reason else ""
        text = f"load: planned for {load.planned} request{'s' if load.planned != 1 else ''} at once{measured}{said}"
        console.print(text, highlight=False, soft_wrap=True)
    if status.incidents:
        latest = status.incidents[-1]
        when = time.strftime("%H:%M:%S", time.localtime(latest.at))
        more = f" ({len(status.incidents) - 1} earlier: --json shows them)" if len(status.incidents) > 1 else ""
        console.print(f"last incident, at {when}{more}:", highlight=False)
        console.print(
            f"  [yellow]{shown(latest.what)}:[/yellow] {shown(latest.detail, True)}", highlight=False, soft_wrap=True
        )


def _backend(report: BackendReport | None) -> str:
    """The devices that serve a member's stage, and a GPU it leaves idle, in a few words."""
    if report is None:
        return "—"
    idle = f" ({report.idle_gpu} GPU idle)" if report.idle_gpu else ""
    return escape(", ".join(report.serving) + idle)


def _generic(member: MemberStatus) -> bool:
    return member.priced_on == "the generic probe" and member.predicted_ms_per_token is not None


def status(
    url: Annotated[str, typer.Option("--url", help="The host's API address.")] = "http://127.0.0.1:8080",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KAFILA_API_KEY")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print /status as it came.")] = False,
) -> None:
    """Show a running host's session: members, links, the plan, stage times, load."""
    if not url.startswith(("http://", "https://")):
        fail(f"--url {url!r} is not an address: write it like http://127.0.0.1:8080", as_json)
    request = Request(url.rstrip("/") + "/status", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urlopen(request, timeout=10) as response:
            body = json.loads(response.read())
    except HTTPError as error:
        hint = {401: " (pass --api-key)", 404: " (is it a kafila host?)"}.get(error.code, "")
        fail(f"{url} answered {error.code}{hint}", as_json)
    except (URLError, OSError, ValueError) as error:
        fail(f"no kafila host answers at {url}: {getattr(error, 'reason', error)}", as_json)
    if as_json:
        print(json.dumps(body))
        return
    try:
        parsed = HostStatus.model_validate(body)
    except ValidationError as invalid:
        fail(f"{url}/status is not a kafila host's status: {one_line(invalid)}", as_json)
    render_status(parsed, Console())


def _stage_from(member: MemberStatus) -> str:
    """Where a member's stage file came from, its size and how long that took: "hub, 12.3 MB in 4.1 s"."""
    if member.stage_source is None:
        return "—"
    size = f", {member.stage_bytes / 1e6:.1f} MB" if member.stage_bytes is not None else ""
    took = f" in {member.stage_seconds:.1f} s" if member.stage_seconds is not None else ""
    return f"{member.stage_source}{size}{took}"
