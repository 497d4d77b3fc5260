"""How many threads llama.cpp computes with on this machine: one per physical "math" core.

llama.cpp's own default (`cpu_get_num_math`) is one thread per physical core, without the second
hyperthread of a core and, on Apple silicon, without the efficiency cores: its matrix kernels
gain nothing from a core's second thread, and a thread on a slow core holds back every step
waiting for it. The probe measures with this count and serving runs with it, so what the
planner prices is what runs; `--threads` still overrides it for serving.

`math_threads` is the pure count from the figures; `read_thread_figures` reads them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

THREADS_HELP = "Threads for llama.cpp; default: one per physical core (on Apple silicon, per performance core)."


@dataclass(frozen=True)
class ThreadFigures:
    """What decides the count: the platform, the CPUs this process may use, and what the system
    says about its cores (Linux's /proc/cpuinfo text; macOS's sysctl counts), None where unknown."""

    platform: str  # as sys.platform spells it
    usable_cpus: int  # logical CPUs this process may run on
    cpuinfo: str | None = None
    performance_cores: int | None = None  # macOS hw.perflevel0.physicalcpu: Apple silicon's P cores
    physical_cores: int | None = None  # macOS hw.physicalcpu


def _placed_cpus(cpuinfo: str) -> list[tuple[int | None, tuple[str, str]]]:
    """Each logical CPU that /proc/cpuinfo text places on a physical core: its number (None where
    its block has none) and that core, (package, core id), the package "0" where it is not named."""
    placed: list[tuple[int | None, tuple[str, str]]] = []
    processor: int | None = None
    package = core = None
    for line in [*cpuinfo.splitlines(), ""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor" and value.strip().isdigit():
            processor = int(value)
        elif key == "physical id":
            package = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not key:
            if core is not None:
                placed.append((processor, (package or "0", core)))
            processor = package = core = None
    return placed


def physical_cores(cpuinfo: str) -> int | None:
    """Distinct (package, core) pairs in /proc/cpuinfo text; None where the file says neither."""
    return len({core for _cpu, core in _placed_cpus(cpuinfo)}) or None


def math_threads(figures: ThreadFigures) -> int:
    """One thread per physical math core this process may use: on Linux the cores /proc/cpuinfo
    names, on macOS the performance cores (else all physical ones), elsewhere every usable CPU;
    never more than the usable CPUs, never fewer than one."""
    usable = max(1, figures.usable_cpus)
    if figures.platform == "darwin":
        cores = figures.performance_cores or figures.physical_cores
    elif figures.platform.startswith("linux") and figures.cpuinfo is not None:
        cores = physical_cores(figures.cpuinfo)
    else:
        cores = None
    return max(1, min(usable, cores or usable))


def _usable_cpus() -> int:
    getter = getattr(os, "sched_getaffinity", None)  # Linux: what taskset or a container allows
    return len(getter(0)) if getter is not None else (os.cpu_count() or 1)


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def sysctl_int(name: str) -> int | None:
    """An integer sysctl by name through libc's `sysctlbyname` (macOS, the BSDs); None where
    the system has no such call or no such name."""
    try:
        libc = ctypes.CDLL(None)
        call = libc.sysctlbyname
    except (OSError, AttributeError, TypeError):  # TypeError: Windows cannot open the process itself
        return None
    size_p = ctypes.POINTER(ctypes.c_size_t)
    call.argtypes = [ctypes.c_char_p, ctypes.c_void_p, size_p, ctypes.c_void_p, ctypes.c_size_t]
    call.restype = ctypes.c_int
    buffer = ctypes.create_string_buffer(8)
    size = ctypes.c_size_t(len(buffer))
    if call(name.encode(), buffer, ctypes.byref(size), None, 0) != 0 or size.value not in (4, 8):
        return None
    return int.from_bytes(buffer.raw[: size.value], sys.byteorder, signed=True)


def read_thread_figures(platform: str = sys.platform) -> ThreadFigures:
    """This machine's figures, each read only on the platform that has it."""
    usable = _usable_cpus()
    if platform.startswith("linux"):
        return ThreadFigures(platform, usable, cpuinfo=_read_text("/proc/cpuinfo"))
    if platform == "darwin":
        performance, physical = sysctl_int("hw.perflevel0.physicalcpu"), sysctl_int("hw.physicalcpu")
        return ThreadFigures(platform, usable, performance_cores=performance, physical_cores=physical)
    return ThreadFigures(platform, usable)


def serving_threads() -> int:
    """llama.cpp's thread count on this machine, for the probe and for serving alike."""
    return math_threads(read_thread_figures())


@dataclass(frozen=True)
class CoreShare:
    """One process's part of a machine that several stages share as if each were a machine of its
    own: the logical CPUs it may run on, and the llama.cpp threads it computes with (one per
    physical core among them)."""

    cpus: tuple[int, ...]
    threads: int


def cores_by_physical(cpuinfo: str | None, usable: set[int]) -> list[tuple[int, ...]]:
    """The usable logical CPUs grouped by the physical core they are hyperthreads of, in CPU order;
    a CPU that /proc/cpuinfo does not place on a core is a core of its own."""
    where = {cpu: core for cpu, core in _placed_cpus(cpuinfo or "") if cpu is not None}
    groups: dict[tuple[str, str] | int, list[int]] = {}
    for cpu in sorted(usable):
        groups.setdefault(where.get(cpu, cpu), []).append(cpu)
    return [tuple(cpus) for cpus in groups.values()]


def core_shares(cores: list[tuple[int, ...]], processes: int) -> list[CoreShare] | None:
    """Physical cores (each its hyperthreads) dealt out to `processes` in contiguous runs, the
    first processes taking one more where they do not divide evenly; None where there are fewer
    cores than processes, so that some would have to take turns on one."""
    if processes < 1 or len(cores) < processes:
        return None
    each, extra = divmod(len(cores), processes)
    shares, start = [], 0
    for index in range(processes):
        taken = cores[start : start + each + (index < extra)]
        start += len(taken)
        shares.append(CoreShare(tuple(cpu for core in taken for cpu in core), len(taken)))
    return shares


def this_machine_shares(processes: int) -> list[CoreShare] | None:
    """`core_shares` of the CPUs this process may use (Linux only: elsewhere a process cannot be
    held to cores, and None is returned)."""
    if getattr(os, "sched_getaffinity", None) is None or not sys.platform.startswith("linux"):
        return None
    return core_shares(cores_by_physical(_read_text("/proc/cpuinfo"), os.sched_getaffinity(0)), processes)


def hold_to(cpus: tuple[int, ...]) -> None:
    """Hold this whole process, every thread it has now and those it starts later, to `cpus`
    (Linux: affinity is a thread's, so each of /proc/self/task is set)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)
    os.sched_setaffinity(0, cpus)
