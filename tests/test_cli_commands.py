"""The entry point builds `kafila` with only the command a command line names (`cli.commands`), so a
member's `kafila join` starts without importing what the host's API and the rendezvous need; and
`kafila host` loads its API server only once its join line is out, while the members start."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from host_process import running_host, running_rendezvous, seeded_cache, until_status
from tiny_models import write_tiny_model

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


def test_neither_kafila_join_nor_kafila_host_imports_the_api_server_or_the_rendezvous_server_to_start() -> None:
    assert imported_by("join", "--help") == {"kafila.cli.join_command"}
    host = imported_by("host", "--help")
    assert "kafila.cli.host_command" in host
    assert not host & {"fastapi", "uvicorn", "kafila.api.server", "kafila.network.rendezvous_server"}, host
    assert imported_by("--help") >= {"kafila.cli.host_command", "kafila.cli.join_command"}


@pytest.fixture
def rendezvous() -> Iterator[str]:
    with running_rendezvous() as rendezvous:
        yield rendezvous.address


def test_kafila_host_loads_its_api_server_after_its_join_line_and_then_serves_it(
    tmp_path: Path, rendezvous: str
) -> None:
    """The members start on the host's join line: the API's modules (FastAPI, uvicorn, the routes)
    load after it, and the rendezvous server's not at all where the rendezvous is another's. Python's
    own account of its imports (`-X importtime`, on the same stderr as the join line) orders them."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    launcher = (sys.executable, "-X", "importtime", "-m", "kafila")
    env = {"KAFILA_CACHE": str(seeded_cache(tmp_path / "cache"))}
    args = ("--model", model, "--members", "2", "--rendezvous", rendezvous, "--threads", "1")
    with running_host(*args, ready=False, env=env, launcher=launcher) as host:
        host.join_line()
        waiting = until_status(host, lambda status: status["members"] == [], "its API answering as it waits")
        said = host.output()
    assert not waiting["ready"] and waiting["waiting_for"] == ["1 member to join with the code on the host's console"]

    def loaded(module: str) -> int:
        found = re.search(rf"^import time:.*\|\s+{re.escape(module)}$", said, re.MULTILINE)
        assert found is not None, f"{module} was never imported: {said[-3000:]}"
        return found.start()

    join_line = said.index("kafila join ")
    assert (
        loaded("kafila.session.runner") < join_line < loaded("kafila.api.server")
    )  # what host_command imports; host_api
    assert join_line < loaded("fastapi") and join_line < loaded("uvicorn")
    assert not re.search(r"\|\s+kafila\.network\.rendezvous_server$", said, re.MULTILINE)
