"""`kafila`: the one program a person installs. Each command reads, calls a core, prints.

`app` holds every command, and `main` runs it; the console script and `python -m kafila` start
at `commands.main` instead, which builds the app with only the command a command line names, so
that a command imports only what it needs.
"""

from __future__ import annotations

from kafila.cli.commands import COMMANDS, command_app, prepare_process

app = command_app(list(COMMANDS))


def main() -> None:
    """`kafila` with every command (and any a caller has added to `app`)."""
    prepare_process()
    app()
