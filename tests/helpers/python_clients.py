"""The Python agent frameworks, each run as a real subprocess by the python of its own virtual
environment (`.clients/NAME`, which `.ci/python-clients` makes with pinned versions), through a
driver script beside this file that prints one of client_reports' types as JSON."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TypeVar

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / ".clients"
HELPERS = Path(__file__).resolve().parent
INSTALL = "bash .ci/python-clients"
Report = TypeVar("Report", bound=BaseModel)


def run_driver(client: str, driver: str, report: type[Report], *args: str) -> Report:
    """Run `driver` (a file beside this one) with `client`'s python and `args`; its last line of
    output, read as `report`. A missing environment skips the test saying what to run (as the real
    agents' tests do: the README's test command installs neither; under CI a skip fails), and a
    failed run fails it, saying why."""
    python = CLIENTS / client / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{client} is not installed in {python.parent.parent}: run `{INSTALL}` (.ci/run does)")
    # Only the helpers on the path: the framework sees its own environment, not this checkout's.
    environment = {**os.environ, "PYTHONPATH": str(HELPERS)}
    done = subprocess.run(
        [str(python), str(HELPERS / driver), *args], check=False, env=environment, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(
            f"{driver} in {python.parent.parent} exited {done.returncode} (an incomplete environment: "
            f"run `{INSTALL}`): {done.stderr[-4000:]}"
        )
    return report.model_validate_json(done.stdout.strip().splitlines()[-1])
