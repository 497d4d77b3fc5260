"""A pytest plugin (tests/conftest.py loads it): under CI, a skip is a failure unless listed here.

`.ci/run` exports KAFILA_CI=1. Elsewhere a test that needs what a machine lacks (root, the NAT
lab's tools, /dev/net/tun, a system Chromium, a tmpfs) skips and says why; on the CI machine,
which has all of them, the same skip would hide a failure (a broken nft ruleset, a removed
package), so it fails instead, with the reason it would have skipped for. The session's summary
says how many tests skipped and which of those were expected. It also picks Hypothesis's profile.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

CI_ENV = "KAFILA_CI"

# Tests CI may skip, by node id prefix, with why. Empty: the CI machine (Debian, root, 2 cores,
# no GPU) runs every test; nothing in the suite needs a GPU (the GPU paths are tested through
# the probe's readings, which run anywhere). Add an entry only for a test that cannot run on CI.
EXPECTED_SKIPS: dict[str, str] = {}


# Hypothesis under CI: the same examples on every run (a failure is reproduced by running again, and
# its @reproduce_failure blob is printed), no example database, and no clock: a loaded 2-core
# machine may take longer than 200 ms an example or to generate one, which proves nothing.
# Elsewhere Hypothesis explores with a fresh seed each run, which it prints with a failure.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", print_blob=True)


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "") not in ("", "0")


def _prefix(nodeid: str) -> str:
    return next((prefix for prefix in EXPECTED_SKIPS if nodeid.startswith(prefix)), "")


def _expected(nodeid: str) -> bool:
    return _prefix(nodeid) != ""


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


GUARD_PROPERTY = "ci_guard"  # on a report's user_properties, which pytest-xdist carries to the controller


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.skipped and not hasattr(report, "wasxfail") and in_ci() and not _expected(item.nodeid):
        report.outcome = "failed"
        report.longrepr = (
            f"{CI_ENV} is set, where a test may skip only if ci_guard.EXPECTED_SKIPS lists it; "
            f"this one would have skipped: {_reason(report)}"
        )
        report.user_properties.append((GUARD_PROPERTY, "unexpected skip"))
    return report


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile("ci" if in_ci() else "dev")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """The count from the reports themselves: under pytest-xdist they reach the controller, which
    runs no test."""
    if not in_ci():
        return
    expected = sorted({r.nodeid for r in terminalreporter.stats.get("skipped", []) if hasattr(r, "nodeid")})
    unexpected = sorted(
        {
            r.nodeid
            for r in terminalreporter.stats.get("failed", [])
            if (GUARD_PROPERTY, "unexpected skip") in getattr(r, "user_properties", [])
        }
    )
    terminalreporter.write_sep("-", f"{CI_ENV}: {len(expected)} expected skips, {len(unexpected)} unexpected (failed)")
    for nodeid in expected:
        terminalreporter.write_line(f"expected skip: {nodeid} ({EXPECTED_SKIPS.get(_prefix(nodeid), '?')})")
    for nodeid in unexpected:
        terminalreporter.write_line(f"unexpected skip, failed: {nodeid}")
