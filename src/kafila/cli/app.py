"""`kafila`: the one program a person installs. Each command reads, calls a core, prints.

`app` holds every command; the entry point (`commands.main`) builds one with only the command a
command line names, so that a command imports only what it needs.
"""

from __future__ import annotations

from kafila.cli.commands import COMMANDS, command_app, main

app = command_app(list(COMMANDS))

__all__ = ["app", "main"]
