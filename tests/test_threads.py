"""One thread count for the probe and for serving: llama.cpp's one per physical math core."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.threads import (
    CoreShare,
    ThreadFigures,
    core_shares,
    cores_by_physical,
    math_threads,
    read_thread_figures,
    serving_threads,
    sysctl_int,
)
from kafila.runtime.machine.probe import probe_threads

# Two packages of two cores with two hyperthreads each, as Linux's /proc/cpuinfo lists them.
HYPERTHREADED = "".join(
    f"processor\t: {i}\nphysical id\t: {i // 4}\ncore id\t\t: {i % 2}\nsiblings\t: 4\n\n" for i in range(8)
)
ARM_WITHOUT_CORE_IDS = "".join(f"processor\t: {i}\nBogoMIPS\t: 50.00\n\n" for i in range(4))


def test_linux_counts_physical_cores_within_the_usable_cpus() -> None:
    assert math_threads(ThreadFigures("linux", usable_cpus=8, cpuinfo=HYPERTHREADED)) == 4
    assert math_threads(ThreadFigures("linux", usable_cpus=3, cpuinfo=HYPERTHREADED)) == 3  # taskset, a container
    assert math_threads(ThreadFigures("linux", usable_cpus=4, cpuinfo=ARM_WITHOUT_CORE_IDS)) == 4
    assert math_threads(ThreadFigures("linux", usable_cpus=6, cpuinfo=None)) == 6


def test_macos_counts_performance_cores_then_physical_ones() -> None:
    m2_pro = ThreadFigures("darwin", usable_cpus=12, performance_cores=8, physical_cores=12)
    assert math_threads(m2_pro) == 8  # the four efficiency cores would hold every step back
    intel = ThreadFigures("darwin", usable_cpus=16, performance_cores=None, physical_cores=8)
    assert math_threads(intel) == 8  # no perflevels: the physical cores, without hyperthreads
    assert math_threads(ThreadFigures("darwin", usable_cpus=10)) == 10  # sysctl unreadable


def test_other_systems_use_every_usable_cpu_and_never_fewer_than_one() -> None:
    assert math_threads(ThreadFigures("win32", usable_cpus=16, cpuinfo=HYPERTHREADED)) == 16
    assert math_threads(ThreadFigures("freebsd14", usable_cpus=4)) == 4
    assert math_threads(ThreadFigures("linux", usable_cpus=0, cpuinfo=None)) == 1


def physical_cores_by_sysfs() -> int:
    """This machine's physical cores as llama.cpp's `cpu_get_num_physical_cores` counts them on
    Linux: distinct sets of hyperthread siblings in sysfs, a source the code under test never reads."""
    sibling_sets = {
        path.read_text().strip() for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings")
    }
    assert sibling_sets, "sysfs lists no CPU topology"
    return len(sibling_sets)


def test_this_machine_probes_and_serves_with_one_count() -> None:
    """The count is this machine's physical cores (sysfs, as llama.cpp counts them), no more than
    the CPUs this process may use (coreutils' nproc), whichever path asks for it."""
    figures = read_thread_figures()
    assert figures.platform.startswith("linux") and figures.cpuinfo is not None
    usable = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
    assert figures.usable_cpus == usable == len(os.sched_getaffinity(0))
    expected = max(1, min(usable, physical_cores_by_sysfs()))
    assert serving_threads() == probe_threads() == ContextSettings().n_threads == math_threads(figures) == expected
    assert 1 <= serving_threads() <= figures.usable_cpus


def test_sysctl_and_darwin_figures_where_there_is_no_sysctl() -> None:
    assert sysctl_int("hw.physicalcpu") is None  # glibc has no sysctlbyname
    darwin_here = read_thread_figures("darwin")
    assert (darwin_here.performance_cores, darwin_here.physical_cores) == (None, None)
    assert math_threads(darwin_here) == darwin_here.usable_cpus
    assert read_thread_figures("win32") == ThreadFigures("win32", darwin_here.usable_cpus)


def test_cores_are_grouped_by_physical_core_within_the_usable_cpus() -> None:
    # HYPERTHREADED: CPUs 0 and 2 are core 0 of package 0, 1 and 3 its core 1; 4-7 package 1.
    assert cores_by_physical(HYPERTHREADED, set(range(8))) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert cores_by_physical(HYPERTHREADED, {1, 2, 3}) == [(1, 3), (2,)]  # taskset left one sibling
    assert cores_by_physical(ARM_WITHOUT_CORE_IDS, {0, 1, 2, 3}) == [(0,), (1,), (2,), (3,)]
    assert cores_by_physical(None, {3, 1}) == [(1,), (3,)]


def test_core_shares_deal_whole_cores_in_runs_and_need_a_core_a_process() -> None:
    cores = cores_by_physical(HYPERTHREADED, set(range(8)))
    assert core_shares(cores, 2) == [CoreShare((0, 2, 1, 3), 2), CoreShare((4, 6, 5, 7), 2)]
    assert core_shares(cores, 3) == [CoreShare((0, 2, 1, 3), 2), CoreShare((4, 6), 1), CoreShare((5, 7), 1)]
    assert core_shares([(0,), (1,)], 2) == [CoreShare((0,), 1), CoreShare((1,), 1)]
    assert core_shares([(0,), (1,)], 3) is None  # two would take turns on one core
    assert core_shares([(0,)], 0) is None
