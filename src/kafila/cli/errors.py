"""How every command fails: one line for people on stderr, or one JSON object for programs."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import typer
from rich.console import Console

stderr = Console(stderr=True)


def fail(message: str, as_json: bool, code: int = 1, **extra: Any) -> NoReturn:
    """Print the error without a traceback and exit with `code`; `extra` goes into the JSON."""
    if as_json:
        print(json.dumps({"error": message, **extra}))
    else:
        stderr.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def warn(message: str) -> None:
    """A warning for the person at the terminal: the command goes on."""
    stderr.print(f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True)
