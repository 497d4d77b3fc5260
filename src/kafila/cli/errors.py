"""How every command fails: one line for people on stderr, or one JSON object for programs."""

from __future__ import annotations

import json
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from kafila.untrusted import check_name, printable

stderr = Console(stderr=True)


def shown(text: object, newlines: bool = False) -> str:
    """Text that may have come from the network, for a rich print: no control characters, and its
    brackets escaped so none is read as markup."""
    return escape(printable(str(text), newlines=newlines))


def fail(message: str, as_json: bool, code: int = 1, **extra: Any) -> NoReturn:
    """Print the error without a traceback and exit with `code`; `extra` goes into the JSON."""
    if as_json:
        print(json.dumps({"error": message, **extra}))
    else:
        stderr.print(f"[red]error:[/red] {shown(message, newlines=True)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def device_name(given: str | None, default: str) -> str:
    """This machine's name in a session: `--name`, else `default` (from its host name); one line
    and exit where it is not a name a session takes."""
    name = given or default
    try:
        return check_name(name)
    except ValueError as error:
        fail(f"--name {name!r}: {error}" if given else f"this machine's name {name!r}: {error}; give --name", False)


def warn(message: str) -> None:
    """A warning for the person at the terminal: the command goes on."""
    stderr.print(f"[yellow]warning:[/yellow] {shown(message, newlines=True)}", highlight=False, soft_wrap=True)
