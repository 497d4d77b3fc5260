"""A readable rendering of a plan for people; `--json` is the one for programs."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kafila.cli.errors import shown
from kafila.planner.report import PlanReport


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _ratio(baseline: float | None, ours: float | None) -> str:
    if baseline is None or ours is None or ours == 0:
        return "—"
    return f"{baseline / ours:.2f}×"


def render_plan(report: PlanReport, console: Console) -> None:
    console.print(
        f"[bold]Plan[/bold] — tier [cyan]{report.tier.value}[/cyan], head [cyan]{shown(report.head)}[/cyan], "
        f"ring search {report.ring_search.value}, planned in {report.planner_ms:.1f} ms"
    )
    stages = Table(title="Stages in chain order (block 0 first, head last)")
    for column in ("member", "blocks", "stage ms", "memory needed", "available"):
        stages.add_column(column, justify="left" if column == "member" else "right")
    for name, (start, end) in report.ranges.items():
        memory = report.memory_bytes[name]
        stages.add_row(
            shown(name) + (" (head)" if name == report.head else ""),
            f"{start}–{end - 1} ({end - start})",
            _ms(report.stage_ms[name]),
            f"{memory['needed'] / 2**30:.2f} GiB",
            f"{memory['available'] / 2**30:.2f} GiB",
        )
    console.print(stages)
    _render_members(report, console)

    if report.edges:
        edges = Table(title="Ring edges (activations flow head → … → head)")
        for column in ("from", "to", "predicted", "cost ms"):
            edges.add_column(column)
        for edge in report.edges:
            colour = "green" if edge.predicted.value == "direct" else "yellow"
            edges.add_row(
                shown(edge.a), shown(edge.b), f"[{colour}]{edge.predicted.value}[/{colour}]", _ms(edge.cost_ms)
            )
        console.print(edges)

    comparison = Table(title="Division compared on the same ring")
    timed = report.ms_per_token is not None
    columns = ["division", "bottleneck ms", "utilisation", "fits", "bottleneck vs Kafila"]
    columns += ["ms a token", "vs Kafila"] if timed else []
    for column in columns:
        comparison.add_column(column, justify="left" if column == "division" else "right")
    utilisation = "—" if report.utilisation is None else f"{report.utilisation:.0%}"
    ours = ["Kafila", _ms(report.bottleneck_ms), utilisation, "yes", "1.00×"]
    comparison.add_row(*ours, *([_ms(report.ms_per_token), "1.00×"] if timed else []))
    for name, baseline in report.baselines.items():
        row = [
            name,
            _ms(baseline.bottleneck_ms),
            "—" if baseline.utilisation is None else f"{baseline.utilisation:.0%}",
            "yes" if baseline.fits else "[red]no[/red]",
            _ratio(baseline.bottleneck_ms, report.bottleneck_ms),
        ]
        if timed:
            row += [_ms(baseline.ms_per_token), _ratio(baseline.ms_per_token, report.ms_per_token)]
        comparison.add_row(*row)
    console.print(comparison)
    for note in report.notes:
        console.print(f"• {shown(note)}")


def _render_members(report: PlanReport, console: Console) -> None:
    """Who serves and who stands by, each with its reason in words."""
    if not report.members:
        return
    title = "Who serves"
    if report.ms_per_token is not None:
        title += f" ({report.ms_per_token:.1f} ms a token at {report.concurrency} concurrent)"
    members = Table(title=title)
    for column in ("member", "role", "why"):
        members.add_column(column)
    for member in report.members:
        colour = "green" if member.role.value == "serves" else "yellow"
        members.add_row(shown(member.device), f"[{colour}]{member.role.value}[/{colour}]", shown(member.words))
    console.print(members)
