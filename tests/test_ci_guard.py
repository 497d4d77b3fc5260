"""The suite's own guards, each run on a planted test in a separate pytest: under KAFILA_CI a skip
fails (tests/helpers/ci_guard.py), Hypothesis runs the same examples every time with no clock, and
a test that waits forever is stopped with its stack (pytest-timeout, as pyproject.toml configures
it), and the session's caches are its own (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).parent / "helpers"
CONFTEST = Path(__file__).parent / "conftest.py"
PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"

PLANTED_SKIP = """
import pytest

def test_passes():
    pass

def test_needs_what_this_machine_lacks():
    pytest.skip("this machine lacks a frobnicator")
"""

PLANTED_PROPERTIES = """
import os
import time

from hypothesis import given, settings, strategies as st


@settings(max_examples=5)
@given(st.integers())
def test_slow_examples(n):
    with open(os.environ["EXAMPLES"], "a") as seen:
        seen.write(f"{n}\\n")
    time.sleep(0.25)  # past Hypothesis's own 200 ms deadline


@given(st.integers())
def test_false_for_some(n):
    assert n < 1000
"""

CACHES_OF_A_CHILD = """
from huggingface_hub import constants
from kafila.runtime.machine.this_machine import cache_dir
print(cache_dir(), constants.HF_HUB_CACHE)
"""

PLANTED_HANG = """
import threading

def test_waits_forever():
    threading.Event().wait()  # a reply that never comes

def test_after_it():
    pass
"""


PLANTED_GROUPED = """
import os

import pytest


@pytest.fixture(scope="module")
def built_once():
    with open(os.environ["BUILT"], "a") as built:
        built.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")


@pytest.mark.parametrize("n", range(3))
def test_one_of_three(built_once, n):
    pass
"""


def run_pytest(
    directory: Path, ci: bool, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(HELPERS), "KAFILA_CI": "1" if ci else ""}
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
    # On pytest-xdist's workers, as the suite runs: the controller, which runs no test, counts it.
    spread = run_pytest(tmp_path, True, "-n", "2")
    assert spread.returncode == 1, spread.stdout
    assert "1 failed, 1 passed" in spread.stdout
    assert "this one would have skipped: this machine lacks a frobnicator" in spread.stdout
    assert "KAFILA_CI: 0 expected skips, 1 unexpected (failed)" in spread.stdout
    assert "unexpected skip, failed: test_planted.py::test_needs_what_this_machine_lacks" in spread.stdout


def test_a_test_that_waits_forever_is_stopped_with_its_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text(PLANTED_HANG)
    # The project's own settings (method, faulthandler), with a timeout short enough to wait for.
    done = run_pytest(tmp_path, False, "-c", str(PYPROJECT), "--rootdir", str(tmp_path), "--timeout", "3")
    assert done.returncode == 1, done.stdout
    assert "1 failed, 1 passed" in done.stdout
    assert "timeout method: signal" in done.stdout
    assert "Failed: Timeout (>3.0s) from pytest-timeout" in done.stdout
    # The stack, down to the wait that never ended.
    assert "threading.Event().wait()  # a reply that never comes" in done.stdout
    assert "test_planted.py:5: " in done.stdout and "in wait" in done.stdout


def test_hypothesis_under_ci_has_no_deadline_draws_the_same_examples_and_prints_how_to_reproduce(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_planted.py").write_text(PLANTED_PROPERTIES)
    runs = []
    for n in range(2):
        examples = tmp_path / f"examples-{n}"
        done = run_pytest(tmp_path, True, env={"EXAMPLES": str(examples)})
        assert done.returncode == 1, done.stdout
        assert "1 failed, 1 passed" in done.stdout  # the slow one passes: no deadline
        assert "FAILED test_planted.py::test_false_for_some" in done.stdout
        assert "@reproduce_failure(" in done.stdout and "n=1000" in done.stdout
        runs.append(examples.read_text().split())
    assert len(runs[0]) >= 5 and runs[0] == runs[1]


def test_this_session_and_its_children_use_caches_of_their_own() -> None:
    """conftest.py set KAFILA_CACHE and the Hugging Face cache before kafila or huggingface_hub was
    imported: both, here and in a child `kafila` process, name this session's temporary folder."""
    import tempfile

    from huggingface_hub import constants

    from kafila.runtime.machine.this_machine import cache_dir

    session = Path(os.environ["KAFILA_CACHE"]).parent
    assert session.parent == Path(tempfile.gettempdir()) and session.name.startswith("kafila-tests-")
    assert cache_dir() == session / "kafila"
    assert Path(constants.HF_HUB_CACHE) == session / "huggingface" / "hub"
    child = subprocess.run(
        [sys.executable, "-c", CACHES_OF_A_CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    assert child.stdout.split() == [str(session / "kafila"), str(session / "huggingface" / "hub")]


def test_on_xdist_the_lab_stays_on_one_worker_and_a_module_fixture_is_built_once(tmp_path: Path) -> None:
    """The suite's own conftest, on planted files: under `-n 3` the NAT lab's files all run on one
    worker, and each file's module fixture is built once (its tests kept on one worker)."""
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    for name in ("test_nat_lab_one", "test_nat_lab_two", "test_natlab", "test_plain"):
        (tmp_path / f"{name}.py").write_text(PLANTED_GROUPED)
    built = tmp_path / "built"
    done = run_pytest(tmp_path, False, "-n", "3", "--dist", "loadgroup", "-v", env={"BUILT": str(built)})
    assert done.returncode == 0, done.stdout
    ran: dict[str, set[str]] = {}
    for line in done.stdout.splitlines():
        if "PASSED" in line and line.startswith("[gw"):
            ran.setdefault(line.split("PASSED ")[1].split("::")[0], set()).add(line[1:4])
    lab = ran["test_nat_lab_one.py"] | ran["test_nat_lab_two.py"] | ran["test_natlab.py"]
    assert len(lab) == 1, ran  # one worker for the whole lab
    assert "test_nat_lab_one.py::test_one_of_three[0]@lab" in done.stdout
    assert sorted(line.split()[0] for line in built.read_text().splitlines()) == [
        "test_nat_lab_one",
        "test_nat_lab_two",
        "test_natlab",
        "test_plain",
    ]
