"""How much memory a stage may fill on this machine, read in one place: the probe, the host
and a member before it loads a stage, `kafila doctor` and the macOS pressure warning all ask here.

A GPU's free memory less a headroom where layers go there; else the memory the system says is
available (Linux's MemAvailable, macOS's vm_stat), else ggml's figure for the CPU, else sysconf.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal

from kafila.contracts import FleetDevice
from kafila.runtime.llama.backends import KINDS, backend_devices
from kafila.runtime.llama.loading import LlamaUnavailable, llama
from kafila.runtime.llama.unified_memory import pressure_warning, stage_memory, system_available_bytes

MemorySource = Literal["gpu", "MemAvailable", "vm_stat", "ggml-cpu", "sysconf"]


class MemoryUnknown(RuntimeError):
    """No source on this machine says how much memory is available."""


def _meminfo() -> str | None:
    try:
        return Path("/proc/meminfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def mem_available_bytes(meminfo: str) -> int | None:
    """MemAvailable from /proc/meminfo text: what can be allocated without swapping."""
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                unit = fields[1].lower() if len(fields) > 1 else "b"
                return int(fields[0]) * (1024 if unit == "kb" else 1)
    return None


def backend_free_memory(device_types: tuple[int, ...]) -> int | None:
    """Free bytes summed over ggml backend devices of the given types (0 CPU, 1 GPU, 2 iGPU), as
    `backends.backend_devices` reads them now (those of the ggml next to the libllama that
    loaded); None where there is none or ggml cannot say."""
    kinds = {KINDS[t] for t in device_types if 0 <= t < len(KINDS)}
    try:
        devices = [device for device in backend_devices() if device.kind in kinds]
    except LlamaUnavailable:
        return None
    total_free = sum(device.free_bytes for device in devices)
    return total_free if devices and total_free > 0 else None


GPU_HEADROOM_SHARE = 20  # a twentieth of a GPU's free memory, and at least GPU_HEADROOM_MIN_BYTES
GPU_HEADROOM_MIN_BYTES = 256 * 2**20


def gpu_headroom(free: int) -> int:
    """What a GPU keeps back from its free memory for what no stage's plan counts: the backend's
    library workspaces (cuBLAS, CUDA graphs) and its allocator's rounding. The planner counts each
    stage's own buffers (`ContextNeeds`); this is the device's margin beyond them."""
    return min(free, max(GPU_HEADROOM_MIN_BYTES, free // GPU_HEADROOM_SHARE))


def available_memory(gpu: bool) -> tuple[int, MemorySource]:
    """Bytes a stage may fill: the GPU's free memory less its headroom when layers go there, else
    available RAM."""
    if gpu:
        free = backend_free_memory((1, 2))
        if free is not None:
            usable = max(1, free - gpu_headroom(free))
            return stage_memory(usable, system_available_bytes()), "gpu"  # macOS: others' use of unified memory
    meminfo = _meminfo()
    available = mem_available_bytes(meminfo) if meminfo is not None else None
    if available:
        return available, "MemAvailable"
    available = system_available_bytes()  # macOS, where ggml's CPU figure would be all of RAM
    if available:
        return available, "vm_stat"
    free = backend_free_memory((0,))
    if free is not None:
        return free, "ggml-cpu"
    with contextlib.suppress(ValueError, OSError, AttributeError):
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if pages > 0:
            return pages, "sysconf"
    raise MemoryUnknown("cannot tell how much memory this device has available")


def memory_pressure(lent: int | None) -> str | None:
    """On macOS, a warning where unified memory is under pressure (`pressure_warning`); None elsewhere."""
    system = system_available_bytes()
    if system is None:
        return None
    return pressure_warning(system, backend_free_memory((1, 2)), lent)


def free_memory_now() -> int | None:
    """Bytes a stage may fill on this machine now, read as the probe reads them (`available_memory`);
    None where there is no telling."""
    try:
        return available_memory(bool(llama().llama_supports_gpu_offload()))[0]
    except (MemoryUnknown, LlamaUnavailable):
        return None


def short_of_memory(need_bytes: int | None) -> int | None:
    """What is free on this machine now, where that is less than `need_bytes` (a stage that would
    not fit, refused before it is tried); None where enough is free, or there is no telling."""
    free = free_memory_now() if need_bytes is not None else None
    return free if free is not None and need_bytes is not None and free < need_bytes else None


def free_now(device: FleetDevice) -> FleetDevice:
    """The device with at most the memory free at this moment: a cached probe's figure is what was
    free then, and a game or a browser may have taken some of it since. As it was, where the
    memory cannot be read."""
    free = free_memory_now()
    return device if free is None else device.lending(free)
