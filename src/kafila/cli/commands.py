"""The `kafila` command line: which module holds each command, and the entry point that imports
only the one a command line names.

`kafila join` on a member need not import the API server, the planner's reports or the
rendezvous server that other commands use: Python's imports were most of a member's start
(issue 36). So the entry point looks at the command named and builds the app with that command
alone; with no command, `--help`, `--version` or a name it does not know, it builds every
command, so help lists them all and a typo is told what there is (`kafila.cli.app.app` is that
full app, for tests).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from kafila import __version__
from kafila.cli.errors import fail
from kafila.log_repeats import summarise_repeats
from kafila.runtime.llama.cpu_safety import repack_mode
from kafila.serving.settings import prefill_chunks_setting

# Each command's name, the module that defines it, and its function there; in `kafila --help`'s order.
COMMANDS = {
    "plan": "kafila.cli.plan_command",
    "probe": "kafila.cli.probe_command",
    "generate": "kafila.cli.generate_command",
    "nat": "kafila.cli.network_commands",
    "rendezvous": "kafila.cli.network_commands",
    "host": "kafila.cli.host_command",
    "join": "kafila.cli.join_command",
    "status": "kafila.cli.status_command",
    "doctor": "kafila.cli.doctor_command",
}
EARLY_START = ("host", "join")  # commands that begin work before importing their module (`cli.early_start`)


def _version(value: bool) -> None:
    if value:
        print(f"kafila {__version__}")
        raise typer.Exit()


def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run one large language model across the few machines you own or trust."""
    try:
        repack_mode(os.environ)  # read where models load, deep in a session: a bad value is said here
        prefill_chunks_setting(os.environ)  # read where a ring starts serving: likewise
    except ValueError as error:
        fail(str(error), as_json=False)


def command_app(names: Sequence[str]) -> typer.Typer:
    """The `kafila` app with the commands `names`, each imported from its module (`COMMANDS`)."""
    app = typer.Typer(
        name="kafila",
        help="Run one large language model across the few machines you own or trust.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for name in names:
        app.command()(getattr(importlib.import_module(COMMANDS[name]), name))
    app.callback()(root)
    return app


def named_command(arguments: Sequence[str]) -> str | None:
    """The command a command line names, where it names one that exists and asks for no help of the
    program as a whole: the first argument that is not an option (the program's own options,
    `--help` and `--version`, take no value)."""
    for argument in arguments:
        if argument.startswith("-"):
            if argument in ("--help", "--version"):
                return None
            continue
        return argument if argument in COMMANDS else None
    return None


def prepare_process() -> None:
    """What every `kafila` process sets up before its command runs."""
    faulthandler.enable()  # a crash in native code (llama.cpp) leaves a Python traceback in the log
    summarise_repeats()


def main() -> None:
    """`kafila`'s entry point: the app with the command named alone (every command without one);
    for `host` and `join`, what they will wait on begun first (`early_start.begin`)."""
    prepare_process()
    named = named_command(sys.argv[1:])
    if named in EARLY_START:
        arguments = sys.argv[1:]
        importlib.import_module("kafila.cli.early_start").begin(named, arguments[arguments.index(named) + 1 :])
    command_app([named] if named is not None else list(COMMANDS))()
