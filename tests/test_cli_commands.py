"""The entry point builds `kafila` with only the command a command line names (`cli.commands`), so a
member's `kafila join` starts without importing what the host's API and the rendezvous need."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kafila.cli.app import app
from kafila.cli.commands import COMMANDS, named_command

IMPORTED_BY = """
import sys
sys.argv = ["kafila", *sys.argv[1:]]
from kafila.cli.commands import main
try:
    main()
except SystemExit:
    pass
print(" ".join(sorted(m for m in ("fastapi", "uvicorn", "kafila.api.server", "kafila.network.rendezvous_server",
      "kafila.serving.engine_loop", "kafila.cli.host_command", "kafila.cli.join_command") if m in sys.modules)))
"""


def imported_by(*arguments: str) -> set[str]:
    """Which of the heavy modules `kafila ARGUMENTS` imported, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED_BY, *arguments], capture_output=True, text=True, timeout=120, check=True
    )
    return set(done.stdout.split("\n")[-2].split())


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["join", "CODE", "--rendezvous", "h:1"], "join"),
        (["host", "--help"], "host"),
        (["--help"], None),
        (["--version", "join"], None),
        (["--help", "join"], None),
        ([], None),
        (["joint"], None),  # a typo: the full app says what there is
    ],
)
def test_the_command_named_is_the_first_argument_that_is_no_option(arguments: list[str], named: str | None) -> None:
    assert named_command(arguments) == named


def test_every_command_is_in_the_full_app_in_the_table_s_order() -> None:
    assert [command.callback.__name__ for command in app.registered_commands if command.callback] == list(COMMANDS)


def test_kafila_join_imports_neither_the_api_server_nor_the_rendezvous_server() -> None:
    assert imported_by("join", "--help") == {"kafila.cli.join_command"}
    assert imported_by("host", "--help") >= {"kafila.cli.host_command", "fastapi", "uvicorn"}
    assert imported_by("--help") >= {"kafila.cli.host_command", "kafila.cli.join_command"}
