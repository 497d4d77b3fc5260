"""Which of llama.cpp's backends serves this machine: the ggml devices its build sees, read once
from the ggml libraries next to the loaded libllama (`loading.ggml_library`).

`serving_devices` decides, purely, which devices hold a stage's layers, as llama.cpp does when a
model loads with every layer offloaded: the dedicated GPUs if there are any, else the integrated
ones, else the CPU. Everything that reads ggml sits below it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import get_args

from kafila.contracts import MAX_BACKEND_DEVICES, MAX_REPORTED_FEATURES, BackendDevice, BackendReport, DeviceKind
from kafila.runtime.llama.cpu_safety import reported_features
from kafila.runtime.llama.loading import LlamaUnavailable, ggml_library, gpu_present, llama, system_info

KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)


def serving_devices(devices: Sequence[BackendDevice], gpu_offload: bool) -> list[str]:
    """The devices llama.cpp puts a model's layers on: with a build that offloads, every dedicated
    GPU, else every integrated one (llama.cpp takes those only when there is no other); with
    none, or a build for the CPU, the CPU."""
    if gpu_offload:
        for kind in ("gpu", "igpu"):
            found = [device.name for device in devices if device.kind == kind]
            if found:
                return found[:MAX_BACKEND_DEVICES]
    cpu = [device.name for device in devices if device.kind == "cpu"]
    return cpu[:1] or ["CPU"]


def _one_line(raw: bytes | None, limit: int) -> str:
    text = raw.decode("utf-8", errors="replace") if raw else ""
    return "".join(c if c.isprintable() else " " for c in text).strip()[:limit]


@functools.cache
def _device_calls() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml (the device registry) and libggml-base (each device's calls), typed for ctypes."""
    registry, base = ggml_library("ggml"), ggml_library("ggml-base")
    try:
        registry.ggml_backend_dev_count.argtypes, registry.ggml_backend_dev_count.restype = [], ctypes.c_size_t
        registry.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        registry.ggml_backend_dev_get.restype = ctypes.c_void_p
        for call in (base.ggml_backend_dev_name, base.ggml_backend_dev_description):
            call.argtypes, call.restype = [ctypes.c_void_p], ctypes.c_char_p
        base.ggml_backend_dev_type.argtypes, base.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
        size_p = ctypes.POINTER(ctypes.c_size_t)
        base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
        base.ggml_backend_dev_memory.restype = None
    except AttributeError as error:
        raise LlamaUnavailable(f"this ggml has no device calls: {error}") from None
    return registry, base


def backend_devices() -> list[BackendDevice]:
    """Every device ggml sees now, with its free memory at this moment (memory is read afresh on
    every call; the rest never changes in a process). Raises LlamaUnavailable where ggml's
    libraries cannot be found or lack the calls."""
    llama()  # the backends are registered, and llama.cpp's log routed, before ggml is asked
    registry, base = _device_calls()
    devices = []
    for index in range(min(int(registry.ggml_backend_dev_count()), MAX_BACKEND_DEVICES)):
        device = registry.ggml_backend_dev_get(index)
        if not device:
            continue
        kind = int(base.ggml_backend_dev_type(device))
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        devices.append(
            BackendDevice(
                name=_one_line(base.ggml_backend_dev_name(device), 64) or f"device{index}",
                description=_one_line(base.ggml_backend_dev_description(device), 160),
                kind=KINDS[kind] if 0 <= kind < len(KINDS) else "accel",
                free_bytes=free.value,
                total_bytes=total.value,
            )
        )
    return devices


def backend_report() -> BackendReport:
    """Which backend serves this machine's stages, what else llama.cpp sees, and the CPU's features."""
    gpu_offload = bool(llama().llama_supports_gpu_offload())
    devices = backend_devices()
    vendor = gpu_present()
    return BackendReport(
        serving=serving_devices(devices, gpu_offload),
        gpu_offload=gpu_offload,
        devices=devices,
        cpu_features=[_one_line(f.encode(), 32) for f in reported_features(system_info())][:MAX_REPORTED_FEATURES],
        idle_gpu=vendor if vendor is not None and not gpu_offload else None,
    )


def backend_or_none() -> BackendReport | None:
    """`backend_report`, or None where ggml cannot be asked: a report to show, never a reason to stop."""
    try:
        return backend_report()
    except LlamaUnavailable:
        return None


def device_set(report: BackendReport) -> list[str]:
    """What a measurement of this machine depends on besides llama.cpp's version: the serving
    devices, then every device by name and description (memory, which changes, is left out)."""
    return [*report.serving, *(f"{device.name}: {device.description}" for device in report.devices)]
