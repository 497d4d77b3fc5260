"""Dividing a model among stages that all run on this machine, with the planner and a cached probe.

All local stages share one device, so the planner sees N identical members, each with 1/N of
the memory; what it still decides is how many fewer blocks the head takes for its extra read.
The probe takes several seconds, so its result is cached per machine, llama.cpp version and set of
devices; the memory it offers is never more than is free when it is offered.
So is each model's own pricing, by the model file's sha256 and under the same key as the probe:
`kafila probe --model`, a host's measure of its model before the first plan, or what a stage
here later measured serving it. Sessions serving that model on this machine plan with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from kafila.contracts import BackendReport, CountProgress, FleetDevice, ModelPricing
from kafila.planner import plan_session
from kafila.planner.fleet import device_of
from kafila.planner.types import ModelManifest, ServingSpec
from kafila.runtime.gguf.slicer import file_sha256
from kafila.runtime.llama.backends import backend_or_none, device_set
from kafila.runtime.llama.loading import load_llama, repack_choice
from kafila.runtime.machine.memory import free_now
from kafila.runtime.machine.probe_child import probe_in_child


def cache_dir() -> Path:
    return Path(os.environ.get("KAFILA_CACHE", Path.home() / ".cache" / "kafila"))


def this_device(progress: Callable[[str, float], None] | None = None, memory: int | None = None) -> FleetDevice:
    """This machine as the probe measured it, measuring it first if no cached result fits, with
    no more memory than is free now; with `memory`, offering at most that many bytes of it (what
    `--memory` lends)."""
    return free_now(_measured(progress)).lending(memory)


ProbeKey = dict[str, object]


def probe_key(llama_version: str, repack: bool, backend: BackendReport | None) -> ProbeKey:
    """What a probe of this machine depends on: llama.cpp's version, the weights' layout, and the
    devices llama.cpp serves on and sees (the same version rebuilt for CUDA is another machine)."""
    return {
        "llama_cpp_version": llama_version,
        "repack": repack,
        "devices": device_set(backend) if backend is not None else None,
    }


def cached_device(record: object, key: ProbeKey) -> FleetDevice | None:
    """The device a probe cache record holds, if it was measured under `key`; None where it is
    stale (any part of its key differs, or is missing) or unreadable."""
    if not isinstance(record, dict) or any(record.get(name) != value for name, value in key.items()):
        return None
    try:
        return FleetDevice.model_validate(record["device"])
    except (KeyError, ValueError):
        return None


def _measured(progress: Callable[[str, float], None] | None) -> FleetDevice:
    """The cached probe of this machine, for this llama.cpp, this way of laying out weights and
    these devices (`probe_key`); or a new one, in a child process (`probe_child`): llama.cpp's
    first prompt batch here runs there, so a native crash is explained rather than fatal, and the
    cache spares every later start it."""
    llama_cpp = load_llama()
    key = probe_key(llama_cpp.__version__, repack_choice().repack, backend_or_none())
    path = cache_dir() / "probe.json"
    try:
        device = cached_device(json.loads(path.read_text()), key)
    except (OSError, ValueError):
        device = None
    if device is not None:
        return device
    result = probe_in_child(progress) if progress is not None else probe_in_child()
    device = result.fleet_device()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps({**key, "device": device.model_dump()}))
    partial.replace(path)  # a member reading it meanwhile never sees half a file
    return device


def model_sha256(path: Path, progress: CountProgress | None = None) -> str:
    """The model file's sha256, remembered by its path, size and modification time: a model of
    tens of gigabytes takes a minute to hash, and every session start asks for it.

    Safe to trust: where the hash names a model a member then cuts its stage from, the stage
    file's own hash is checked against the host's. `progress` hears the hashing, where it is not
    remembered.
    """
    stat = path.stat()
    name, seen = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    memo_path = cache_dir() / "model-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    known = memo.get(name)
    if isinstance(known, list) and known[:2] == seen and isinstance(known[-1], str) and len(known[-1]) == 64:
        return known[-1]
    digest = file_sha256(path, progress)
    memo[name] = [*seen, digest]  # one entry per path: the file as it is now
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        partial = memo_path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(memo))
        partial.replace(memo_path)
    return digest


class HashingStopped(Exception):
    """Raised in the hashing thread when whoever waits for the hash has gone."""


async def hash_model(path: Path, progress: CountProgress | None = None) -> str:
    """`model_sha256` off the event loop. A caller that is cancelled (Ctrl-C) stops the hashing
    thread too, at its next 4 MiB: a thread cannot be cancelled, and the process would otherwise
    wait out the rest of a large model's hash before it could exit."""
    caller_gone = threading.Event()

    def report(done: int, total: int) -> None:
        if caller_gone.is_set():
            raise HashingStopped(f"hashing {path.name} was stopped")
        if progress is not None:
            progress(done, total)

    try:
        return await asyncio.to_thread(model_sha256, path, report)
    finally:
        caller_gone.set()


def _model_pricing_dir() -> Path:
    return cache_dir() / "model-pricing"


def _pricing_key() -> ProbeKey:
    """A model's pricing holds for what the probe's does (`probe_key`): this llama.cpp, this
    layout of the weights, these devices."""
    return probe_key(load_llama().__version__, repack_choice().repack, backend_or_none())


def save_model_pricing(pricing: ModelPricing, source: str = "kafila probe --model") -> Path:
    """Keep a model's pricing for sessions on this machine, saying where it came from (`source`,
    in words); returns where it went."""
    path = _model_pricing_dir() / f"{pricing.model_sha256}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**_pricing_key(), "source": source, "pricing": pricing.model_dump()}
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)  # a reader never sees half a file
    return path


def cached_model_pricings(limit: int = 16) -> list[ModelPricing]:
    """The models this machine priced under the probe's key now (`_pricing_key`), most recent first.

    A pricing from another llama.cpp version is stale (its kernels set the costs), as is one with
    weights laid out otherwise or other devices; an unreadable file is skipped, as if it were not there.
    """
    key = _pricing_key()
    try:
        paths = sorted(_model_pricing_dir().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    found: list[ModelPricing] = []
    for path in paths:
        if len(found) == limit:
            break
        try:
            record = json.loads(path.read_text())
            if all(record.get(name) == value for name, value in key.items()):
                found.append(ModelPricing.model_validate(record["pricing"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def local_division(manifest: ModelManifest, n_stages: int, device: FleetDevice, session: ServingSpec) -> list[int]:
    """Block counts in chain order (head last) for n stages sharing this device."""
    base = device_of(device)
    share = max(1, base.memory_bytes // n_stages)
    members = [base.model_copy(update={"name": f"stage-{i}", "memory_bytes": share}) for i in range(n_stages)]
    plan = plan_session(manifest, members, session, anchor=members[-1].name)
    return [stage.end - stage.start for stage in plan.stages]


def admit_alone(manifest: ModelManifest, device: FleetDevice, session: ServingSpec) -> None:
    """PlanRefused naming "this machine" unless it can hold every block, the head and the KV cache."""
    plan_session(manifest, [device_of(device).model_copy(update={"name": "this machine"})], session)
