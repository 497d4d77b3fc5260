"""Planner benchmark: Kafila's division against uniform and memory-proportional division.

For each of the three fleets modelled on the paper's (tests/helpers/fleets.py) and each Qwen3 model
(the dense 8B, 14B and 32B, and the mixture of experts 30B-A3B, priced by the experts a token reads)
and gpt-oss-120b, and for DeepSeek-V3 on a fleet of five large-memory machines, plan the session
and evaluate the two rules of thumb on the same ring and head, with the same cost model. Then
time the planner itself on 64 blocks x 16 members, and the exact ring search alone at growing
membership. Everything is computed in one run, so ratios are comparable.

    python scripts/bench_planner.py            # prints markdown tables
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from fleets import FLEETS, fleet

from kafila.contracts import NatBehaviour, NatClass
from kafila.planner import PlanRefused, plan_session
from kafila.planner.fleet import Fleet, device_of
from kafila.planner.ring import best_ring
from kafila.planner.types import Device, ModelManifest, ServingSpec


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def _short(model: str) -> str:
    """The model's name without its quantization (Qwen3-32B-Q4_K_M: Qwen3-32B)."""
    return model.removesuffix("-Q4_K_M").removesuffix("-MXFP4")


def division_table() -> None:
    print(
        "| fleet | model | uniform ms | memory ms | Kafila ms | uniform / Kafila | memory / Kafila "
        "| utilisation uniform / memory / Kafila | head | planner ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fleet_name, spec in FLEETS.items():
        for model in spec["benchmark"]:
            parsed = Fleet.model_validate(fleet(fleet_name, model))
            assert parsed.model is not None
            devices = [device_of(d) for d in parsed.devices]
            started = time.perf_counter()
            try:
                plan = plan_session(parsed.model.manifest(), devices, parsed.session, parsed.anchor_name)
            except PlanRefused as refusal:
                print(f"| {fleet_name} | {model} | refused: {refusal} |||||||")
                continue
            elapsed_ms = (time.perf_counter() - started) * 1e3
            uniform, memory = plan.baselines["uniform"], plan.baselines["memory"]
            assert plan.bottleneck_s is not None

            def cell(summary) -> str:  # type: ignore[no-untyped-def]
                text = _fmt(summary.bottleneck_s * 1e3)
                return text if summary.fits else f"{text} (does not fit)"

            print(
                f"| {fleet_name} | {_short(model)} | {cell(uniform)} | {cell(memory)} "
                f"| {plan.bottleneck_s * 1e3:.2f} | {uniform.bottleneck_s / plan.bottleneck_s:.2f}× "
                f"| {memory.bottleneck_s / plan.bottleneck_s:.2f}× "
                f"| {uniform.utilisation:.0%} / {memory.utilisation:.0%} / {plan.utilisation:.0%} "
                f"| {plan.head} | {elapsed_ms:.1f} |"
            )


def memory_wall(fleet_name: str = "lan", model: str = "Qwen3-32B-Q4_K_M") -> None:
    """Longer contexts and more concurrent requests: which divisions still fit, and refusals."""
    print(
        f"\n| {fleet_name}, {_short(model)}: context × concurrency | Kafila ms | uniform fits | memory fits | outcome |"
    )
    print("|---|---|---|---|---|")
    for context, concurrency in ((4096, 4), (32768, 6), (65536, 4), (131072, 4)):
        parsed = Fleet.model_validate(fleet(fleet_name, model, context, concurrency))
        assert parsed.model is not None
        try:
            plan = plan_session(
                parsed.model.manifest(), [device_of(d) for d in parsed.devices], parsed.session, parsed.anchor_name
            )
        except PlanRefused as refusal:
            print(f"| {context} × {concurrency} | — | — | — | refused: {refusal} |")
            continue
        assert plan.bottleneck_s is not None
        fits = ["yes" if plan.baselines[name].fits else "**no**" for name in ("uniform", "memory")]
        print(f"| {context} × {concurrency} | {plan.bottleneck_s * 1e3:.2f} | {fits[0]} | {fits[1]} | planned |")


def random_fleet(n_devices: int, rng: random.Random) -> list[Device]:
    classes = list(NatClass)
    return [
        Device(
            name=f"d{i}",
            memory_bytes=rng.randint(12, 48) * 2**30,
            bandwidth_bytes_per_s=rng.uniform(150e9, 1700e9),
            overhead_s=rng.uniform(30e-6, 60e-6),
            nat=NatBehaviour.from_class(rng.choice(classes)),
            rtt_s=rng.uniform(0.02, 0.23),
        )
        for i in range(n_devices)
    ]


def planner_timing(repeats: int = 15) -> None:
    rng = random.Random(2026)
    manifest = ModelManifest(
        name="synthetic-64",
        block_bytes=tuple(rng.randint(250_000_000, 330_000_000) for _ in range(64)),
        head_bytes=1_600_000_000,
        kv_bytes_per_token=(4096,) * 64,
    )
    session = ServingSpec(context=4096, concurrency=4)
    print("\n| blocks × members | planner median ms | min ms | max ms | target |")
    print("|---|---|---|---|---|")
    for n_devices in (4, 8, 12, 16):
        times = []
        for _ in range(repeats):
            devices = random_fleet(n_devices, rng)
            started = time.perf_counter()
            plan_session(manifest, devices, session)
            times.append((time.perf_counter() - started) * 1e3)
        target = "< 50 ms" if n_devices == 16 else ""
        print(f"| 64 × {n_devices} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} | {target} |")

    print("\n| members | exact ring search median ms | (m-1)! orders it replaces |")
    print("|---|---|---|")
    for m in (8, 10, 12, 14, 16):
        times = []
        for _ in range(5):
            points = np.array([rng.randint(0, 10**6) for _ in range(m)], dtype=np.int64)
            weights = np.abs(points[:, None] - points[None, :]) + rng.randint(0, 1)
            started = time.perf_counter()
            found = best_ring(weights, anchor=0)
            times.append((time.perf_counter() - started) * 1e3)
            assert found.search.value == "exact"
        orders = 1
        for i in range(2, m):
            orders *= i
        print(f"| {m} | {statistics.median(times):.1f} | {orders:.2e} |")


if __name__ == "__main__":
    division_table()
    memory_wall()
    planner_timing()
