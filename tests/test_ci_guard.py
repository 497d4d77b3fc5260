"""The suite's own guards, each run on a planted test in a separate pytest: under KAFILA_CI a skip
fails (tests/helpers/ci_guard.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).parent / "helpers"

PLANTED_SKIP = """
import pytest

def test_passes():
    pass

def test_needs_what_this_machine_lacks():
    pytest.skip("this machine lacks a frobnicator")
"""


def run_pytest(directory: Path, ci: bool, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(HELPERS), "KAFILA_CI": "1" if ci else ""}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ci_guard", "-p", "no:cacheprovider", "-rA", *args, str(directory)],
        check=False,
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_is_a_skip_outside_ci_and_a_failure_with_its_reason_in_ci(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text(PLANTED_SKIP)
    outside = run_pytest(tmp_path, ci=False)
    assert outside.returncode == 0, outside.stdout
    assert "1 passed, 1 skipped" in outside.stdout
    inside = run_pytest(tmp_path, ci=True)
    assert inside.returncode == 1, inside.stdout
    assert "1 failed, 1 passed" in inside.stdout
    assert "this one would have skipped: this machine lacks a frobnicator" in inside.stdout
    assert "KAFILA_CI: 0 expected skips, 1 unexpected (failed)" in inside.stdout
    assert "unexpected skip, failed: test_planted.py::test_needs_what_this_machine_lacks" in inside.stdout
