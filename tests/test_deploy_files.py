"""The deployment files docs/deploy.md points to: the Containerfile is well formed and starts the
rendezvous with flags `kafila rendezvous` takes, and so does the systemd unit. (Building the
image needs a container engine and the network; this checks what can go stale without them.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = {"FROM", "WORKDIR", "COPY", "RUN", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ENV", "ARG", "LABEL"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(instruction, argument) per logical line, continuations joined, comments dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    assert not pending, "a continuation runs off the end"
    return [(line.split(None, 1)[0], line.split(None, 1)[1] if " " in line else "") for line in logical]


def rendezvous_flags() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "rendezvous", "--help"], capture_output=True, text=True, timeout=60,
        check=True, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    return set(re.findall(r"--[a-z][a-z-]+", done.stdout))


def test_the_containerfile_is_well_formed_and_runs_the_rendezvous() -> None:
    parsed = instructions((ROOT / "deploy" / "Containerfile").read_text())
    assert {name for name, _ in parsed} <= INSTRUCTIONS, parsed
    assert parsed[0][0] == "FROM"
    for name, argument in parsed:
        if name == "COPY":
            *sources, _ = argument.split()
            assert all((ROOT / source).exists() for source in sources), argument
    (entrypoint,) = [json.loads(argument) for name, argument in parsed if name == "ENTRYPOINT"]
    assert entrypoint[:2] == ["kafila", "rendezvous"]
    flags = {word for word in entrypoint if word.startswith("--")}
    assert flags <= rendezvous_flags(), flags
    assert {"8470/tcp", "3478/udp"} <= {p for name, a in parsed if name == "EXPOSE" for p in a.split()}


def test_the_systemd_unit_runs_the_rendezvous_with_flags_it_takes() -> None:
    unit = (ROOT / "deploy" / "kafila-rendezvous.service").read_text()
    sections = re.findall(r"^\[(\w+)\]$", unit, re.M)
    assert sections == ["Unit", "Service", "Install"]
    (command,) = re.findall(r"^ExecStart=(.+)$", unit, re.M)
    words = shlex.split(command)
    assert words[0].endswith("/kafila") and words[1] == "rendezvous"
    assert {w for w in words if w.startswith("--")} <= rendezvous_flags()


def test_deploy_md_uses_only_flags_the_commands_take() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for command in ("host", "join", "doctor", "rendezvous"):
        done = subprocess.run(
            [sys.executable, "-m", "kafila", command, "--help"], capture_output=True, text=True, timeout=60,
            check=True, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        taken = set(re.findall(r"--[a-z][a-z-]+", done.stdout))
        used = {
            flag
            for line in re.findall(rf"^kafila {command} .*$", text, re.M)
            for flag in re.findall(r"--[a-z][a-z-]+", line)
        }
        assert used <= taken, (command, used - taken)
