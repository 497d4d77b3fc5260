"""How the commands that run llama.cpp say which backend serves, and warn, loudly, of a GPU that
llama.cpp was built without: the rebuild command on a line of its own, ready to copy."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from kafila.cli.errors import stderr
from kafila.contracts import BackendReport
from kafila.runtime.llama.backends import backend_report
from kafila.runtime.llama.loading import IdleGpu, LlamaUnavailable, idle_gpu


def shout_idle_gpu(idle: IdleGpu, console: Console = stderr) -> None:
    """The idle-GPU warning set apart between rules, the command alone on its line."""
    console.rule("[bold yellow]GPU idle[/bold yellow]", style="yellow")
    console.print(f"[bold yellow]warning:[/bold yellow] {idle.message}:", highlight=False, soft_wrap=True)
    console.print(f"\n    {idle.command}\n", markup=False, highlight=False, soft_wrap=True)
    console.rule(style="yellow")


def say_backend(who: str = "") -> BackendReport | None:
    """At a command's start: which backend serves this machine's stages, then the idle-GPU
    warning where there is one. None where ggml cannot be asked (the stages may still run)."""
    prefix = f"[dim]{escape(who)}:[/dim] " if who else ""
    try:
        report = backend_report()
    except LlamaUnavailable as error:
        stderr.print(
            f"{prefix}[yellow]warning:[/yellow] cannot tell which backend serves: {escape(str(error))}", highlight=False
        )
        report = None
    if report is not None:
        stderr.print(f"{prefix}llama.cpp serves on {escape(report.summary())}", highlight=False, soft_wrap=True)
    idle = idle_gpu()
    if idle is not None:
        shout_idle_gpu(idle)
    return report
