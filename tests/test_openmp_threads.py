"""Where llama.cpp's threads may run, in a process that shares its machine with other stages.

Each case is a real process that loads llama.cpp, runs a decode of a tiny model on two threads
from a helper thread (as a member's stage executor does), and reports every thread's allowed
cores from /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two cores to tell bound threads from free ones",
)

REPORT = """
import json, os, sys, threading
from pathlib import Path
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.loading import load_llama
from kafila.runtime.engine.stage import WholeModel

load_llama(shared_machine=sys.argv[2] != "alone", bind_teams=sys.argv[2] == "session")
main_cores = sorted(os.sched_getaffinity(0))
cores = {}
later = []

def allowed_cores():
    for task in Path("/proc/self/task").iterdir():
        line = next(l for l in (task / "status").read_text().splitlines() if l.startswith("Cpus_allowed_list"))
        cores[task.name] = line.split()[-1]

def decode():  # as a member's stage executor runs it, while its team of threads is alive
    model = WholeModel(sys.argv[1], ContextSettings(n_ctx=64, n_batch=64, n_seq_max=1, n_threads=2))
    model.forward_tokens(0, 0, [1, 2, 3])
    allowed_cores()
    model.close()

worker = threading.Thread(target=decode)
worker.start()
worker.join()
after = threading.Thread(target=lambda: later.extend(sorted(os.sched_getaffinity(0))))
after.start()
after.join()
print(json.dumps({"main": main_cores, "all": sorted(os.sched_getaffinity(0)), "later_thread": later, "threads": cores}))
"""


def _threads_of_a_decode(model: Path, mode: str, **env: str) -> dict[str, object]:
    """`mode`: "session" (the demo's processes), "local-ring" (kafila generate's) or "alone"."""
    environment = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_PROC_BIND")}
    result = subprocess.run(
        [sys.executable, "-c", REPORT, str(model), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**environment, **env},
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def _single_cores(report: dict[str, object]) -> list[str]:
    threads = report["threads"]
    assert isinstance(threads, dict)
    return sorted(v for v in threads.values() if v.isdigit())


def test_a_session_process_on_a_shared_machine_binds_each_team_thread_to_its_own_core_and_nothing_else(
    tmp_path: Path,
) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=2)
    report = _threads_of_a_decode(model, "session")
    everything = report["all"]
    assert report["main"] == everything, "the thread that loaded llama.cpp must keep every core"
    assert report["later_thread"] == everything, "threads started later must not inherit one core"
    bound = _single_cores(report)
    assert len(bound) == 2 and bound[0] != bound[1], f"the team's two threads, on two cores: {report['threads']}"


@pytest.mark.parametrize("mode", ["alone", "local-ring"])
def test_a_process_alone_on_its_machine_or_in_a_local_ring_binds_no_thread(tmp_path: Path, mode: str) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=2)
    report = _threads_of_a_decode(model, mode)
    assert _single_cores(report) == []
    assert report["later_thread"] == report["all"]


def test_binding_the_user_turned_off_stays_off(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=2)
    report = _threads_of_a_decode(model, "session", OMP_PROC_BIND="false")
    assert _single_cores(report) == []


RING_REPORT = """
import json, sys
from pathlib import Path
from kafila.runtime.llama.loading import computed_as_served, load_llama
load_llama(shared_machine=True)
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.model import ContextSettings

def cores_of(pid):
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        line = next(l for l in (task / "status").read_text().splitlines() if l.startswith("Cpus_allowed_list"))
        found[task.name] = line.split()[-1]
    return found

settings = ContextSettings(n_ctx=64, n_batch=64, n_seq_max=1, n_threads=2)
engine = open_engine(Path(sys.argv[1]), [1, 1], settings, Path(sys.argv[2]))
def decode():  # as the host's measure runs its rings; read while this thread's team is alive
    generate(engine, "a b c", 4, SamplingSettings())
    return cores_of("self")

head = computed_as_served(decode)
(worker,) = engine.ring.workers
print(json.dumps({"head": head, "stage": cores_of(worker.process.pid)}))
engine.close()
"""


@pytest.mark.parametrize("bound", [True, False])
def test_a_demo_hosts_measure_of_its_model_times_its_ring_with_teams_bound_as_they_will_serve(
    tmp_path: Path, bound: bool
) -> None:
    """The quick measure a demo's host runs before its first plan (`model_probe.probe_child_env`):
    with the host's teams bound, each stage of its ring binds its team of two, the head's (run on a
    thread of its own) and a block stage's process (`worker`, which then computes on a thread of
    its own too); with them free, nothing is bound."""
    from kafila.runtime.machine.model_probe import probe_child_env

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=2)
    environment = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_PROC_BIND")}
    result = subprocess.run(
        [sys.executable, "-c", RING_REPORT, str(model), str(tmp_path / "stages")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=probe_child_env({**environment, "OMP_PROC_BIND": "true"}, bound),
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for stage in ("head", "stage"):
        bound_threads = _single_cores({"threads": report[stage]})
        if bound:
            assert len(bound_threads) == 2 and bound_threads[0] != bound_threads[1], f"{stage}: {report[stage]}"
        else:
            assert bound_threads == [], f"{stage}: {report[stage]}"
