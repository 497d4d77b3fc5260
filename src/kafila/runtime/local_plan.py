"""Dividing a model among stages that all run on this machine, with the planner and a cached probe.

All local stages share one device, so the planner sees N identical members, each with 1/N of
the memory; what it still decides is how many fewer blocks the head takes for its extra read.
The probe takes several seconds, so its result is cached per machine and llama.cpp version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kafila.planner import plan_session
from kafila.planner.fleet import FleetDevice
from kafila.planner.types import ModelManifest, SessionSpec


def cache_dir() -> Path:
    return Path(os.environ.get("KAFILA_CACHE", Path.home() / ".cache" / "kafila"))


def this_device(progress: Callable[[str, float], None] | None = None, memory: int | None = None) -> FleetDevice:
    """This machine as the probe measured it, measuring it first if no cached result fits;
    with `memory`, offering at most that many bytes of it (what `--memory` lends)."""
    return _measured(progress).lending(memory)


def _measured(progress: Callable[[str, float], None] | None) -> FleetDevice:
    import llama_cpp

    from kafila.runtime.probe import run_probe

    path = cache_dir() / "probe.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("llama_cpp_version") == llama_cpp.__version__:
            return FleetDevice.model_validate(cached["device"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = run_probe(progress) if progress is not None else run_probe()
    device = result.fleet_device()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"llama_cpp_version": llama_cpp.__version__, "device": device.model_dump()}))
    return device


def local_division(manifest: ModelManifest, n_stages: int, device: FleetDevice, session: SessionSpec) -> list[int]:
    """Block counts in chain order (head last) for n stages sharing this device."""
    base = device.device()
    share = max(1, base.memory_bytes // n_stages)
    members = [base.model_copy(update={"name": f"stage-{i}", "memory_bytes": share}) for i in range(n_stages)]
    plan = plan_session(manifest, members, session, anchor=members[-1].name)
    return [stage.end - stage.start for stage in plan.stages]


def admit_alone(manifest: ModelManifest, device: FleetDevice, session: SessionSpec) -> None:
    """PlanRefused naming "this machine" unless it can hold every block, the head and the KV cache."""
    plan_session(manifest, [device.device().model_copy(update={"name": "this machine"})], session)
