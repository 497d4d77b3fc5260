"""`kafila status`: the host's `/status` as tables, for a person at a terminal."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import typer
from rich.console import Console
from rich.table import Table

from kafila.cli.errors import fail


def _number(value: object, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "—"


def render_status(status: dict[str, Any], console: Console) -> None:
    ready = "[green]ready[/green]" if status.get("ready") else "[yellow]not ready[/yellow]"
    console.print(f"[bold]{status.get('model')}[/bold]: {ready}", highlight=False, soft_wrap=True)
    for line in status.get("waiting_for") or []:
        console.print(f"  waiting for {line}", highlight=False, soft_wrap=True)
    if status.get("error"):
        console.print(f"  [red]error:[/red] {status['error']}", highlight=False, soft_wrap=True)
    console.print(
        f"tokens/s {_number(status.get('tokens_per_s'), 1)}, running {status.get('running', 0)}, "
        f"queued {status.get('queue_depth', 0)}, context {status.get('context_per_sequence')} per request, "
        f"waves in flight up to {status.get('pipeline_waves') or '—'}",
        highlight=False,
        soft_wrap=True,
    )
    reports = {tuple(s["range"]): s for s in status.get("stages") or [] if "range" in s}
    members = status.get("members") or []
    head = (status.get("plan") or {}).get("head")  # none planned: one machine, which holds it
    if members:
        table = Table(title="Members")
        columns = ("member", "role", "blocks", "link", "predicted ms/token", "measured ms/token", "ms/row, all decodes")
        for column in columns:
            table.add_column(column, justify="left" if column in ("member", "role", "link") else "right")
        for member in members:
            blocks = member.get("blocks") or member.get("stages")
            span = tuple(blocks) if isinstance(blocks, list) and len(blocks) == 2 else None
            state = "left" if member.get("left") else member.get("link", "?")
            link = "—" if member.get("host") else f"{member.get('path', '?')}, {state}"
            if "rtt_ms" in member:
                link += f", {_number(member['rtt_ms'])} ms"
            table.add_row(
                str(member.get("name")),
                ("host" if member.get("host") else "member")
                + (" (head)" if member.get("name") == head or (head is None and member.get("host")) else "")
                + (" (joining)" if member.get("joining") else ""),
                f"{span[0]}–{span[1] - 1}" if span else "—",
                link,
                _number(member.get("predicted_ms_per_token")) + (" *" if _generic(member) else ""),
                # a decode of one token alone is what the prediction prices; batched rows cost less each
                _number((reports.get(span) or {}).get("ms_per_token_alone")) if span else "—",
                _number((reports.get(span) or {}).get("ms_per_token")) if span else "—",
            )
        console.print(table)
        if any(_generic(member) for member in members):
            console.print(
                "* predicted from the generic probe, which misjudges narrow models: `kafila probe --model` on that "
                "machine prices this model's own stages for later sessions",
                highlight=False,
                soft_wrap=True,
            )
    edges = status.get("edges") or []
    if edges:
        ring = Table(title="Ring edges")
        for column in ("from", "to", "path", "rtt ms"):
            ring.add_column(column, justify="right" if column == "rtt ms" else "left")
        for edge in edges:
            ring.add_row(
                str(edge.get("from")), str(edge.get("to")), str(edge.get("path") or "—"), _number(edge.get("rtt_ms"))
            )
        console.print(ring)
    plan = status.get("plan")
    if plan:
        console.print(
            f"plan (epoch {status.get('epoch')}): tier {plan.get('tier')}, ring {' → '.join(plan.get('ring', []))}, "
            f"division {plan.get('division')}, predicted bottleneck {_number(plan.get('predicted_bottleneck_ms'))} ms",
            highlight=False,
            soft_wrap=True,
        )
    rebalance = status.get("rebalance")
    if isinstance(rebalance, dict) and rebalance.get("reason"):
        console.print(f"rebalance: {rebalance['reason']}", highlight=False, soft_wrap=True)
    incidents = [i for i in status.get("incidents") or [] if isinstance(i, dict)]
    if incidents:
        latest = incidents[-1]
        when = time.strftime("%H:%M:%S", time.localtime(latest.get("at") or 0))
        more = f" ({len(incidents) - 1} earlier: --json shows them)" if len(incidents) > 1 else ""
        console.print(f"last incident, at {when}{more}:", highlight=False)
        console.print(
            f"  [yellow]{latest.get('what')}:[/yellow] {latest.get('detail')}", highlight=False, soft_wrap=True
        )


def _generic(member: dict[str, Any]) -> bool:
    return member.get("priced_on") == "the generic probe" and member.get("predicted_ms_per_token") is not None


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
    else:
        render_status(body, Console())
