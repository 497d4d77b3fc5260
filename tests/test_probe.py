"""`kafila probe`: the pure fit and parsers, and the real command on this machine's llama.cpp.

Timings are never asserted: the machine is shared. The subprocess tests check the contract
(the five fleet keys, plausible values, the fleet schema, a clean failure without llama.cpp).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given
from hypothesis import strategies as st

from kafila.contracts import FleetDevice
from kafila.planner.fleet import device_of
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.threads import physical_cores
from kafila.runtime.machine.memory import gpu_headroom, mem_available_bytes
from kafila.runtime.machine.probe import (
    GIB,
    NARROW,
    PROBE_MODELS,
    Q8_0_BLOCK_BYTES,
    DecodeSample,
    ProbeModel,
    device_fit,
    fit_below,
    fit_line,
    fit_through_origin,
    low_quantile,
    q8_0_bytes,
    random_q8_0,
    significant,
    write_probe_model,
)

T = TypeVar("T")
FLEET_KEYS = {"name", "bandwidth_gb_s", "overhead_us", "tflops", "memory_gib"}
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")

# Runs `kafila` with `import llama_cpp` failing as it does where the package is absent.
HIDE_LLAMA_CPP = """
import sys
class HideLlamaCpp:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideLlamaCpp())
sys.argv = ["kafila", *sys.argv[1:]]
from kafila.cli.app import main
main()
"""


def run_kafila(
    *args: str, env: dict[str, str] | None = None, hide_llama_cpp: bool = False
) -> subprocess.CompletedProcess[str]:
    prefix = ["-c", HIDE_LLAMA_CPP] if hide_llama_cpp else ["-m", "kafila"]
    return subprocess.run(
        [sys.executable, *prefix, *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, **(env or {})},
    )


BUSY = "the device is too busy to measure"  # the probe's own answer to noise, not a fault


def when_not_busy(probe: Callable[[], T]) -> T:
    """The model-stage probe, asked once more if noise swamped a tiny model's microsecond stages."""
    from kafila.runtime.machine.probe import ProbeError

    try:
        return probe()
    except ProbeError as error:
        if BUSY not in str(error):
            raise
        return probe()


# --- the pure core ---------------------------------------------------------------------------


def test_fit_recovers_an_exact_line() -> None:
    bandwidth, overhead = 25e9, 80e-6
    xs = [float(model.weight_bytes) for model in PROBE_MODELS]
    fit = fit_line(xs, [overhead + x / bandwidth for x in xs])
    assert fit.slope == pytest.approx(1 / bandwidth, rel=1e-9)
    assert fit.intercept == pytest.approx(overhead, rel=1e-9)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-12)


def test_fit_of_two_points_is_the_line_through_them() -> None:
    fit = fit_line([1.0, 3.0], [5.0, 11.0])
    assert (fit.slope, fit.intercept, fit.r_squared) == pytest.approx((3.0, 2.0, 1.0))


def test_a_fit_through_the_origin_keeps_y_in_proportion_to_x() -> None:
    fit = fit_through_origin([1.0, 3.0], [2.0, 6.0])
    assert fit.slope == pytest.approx(2.0) and fit.intercept == 0 and fit.r_squared == pytest.approx(1.0)
    assert fit_through_origin([2.0, 6.0], [3.6, 3.7]).slope == pytest.approx((7.2 + 22.2) / 40)
    with pytest.raises(ValueError):
        fit_through_origin([0.0], [1.0])


def test_fit_reports_scatter_and_refuses_a_single_size() -> None:
    assert fit_line([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]).r_squared == pytest.approx(0.64)
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError):
        fit_line([1.0, 2.0], [1.0])


# The probe's four steps (10th percentiles, ms) at a load average of 5.7 on the 2-vCPU box: the
# two short ones ran through, the two long ones were preempted (min 12.7 and 32.8 ms).
BUSY_STEPS_MS = [0.27, 1.43, 16.76, 56.69]


def _decode(steps_ms: list[float], medians_ms: list[float] | None = None) -> list[DecodeSample]:
    return [
        DecodeSample(
            n_embd=model.shape.n_embd,
            n_blocks=model.n_blocks,
            weight_bytes=model.weight_bytes,
            step_ms=step,
            median_ms=median,
            min_ms=step,
            max_ms=median,
            repetitions=15,
        )
        for model, step, median in zip(PROBE_MODELS, steps_ms, medians_ms or steps_ms, strict=True)
    ]


def test_the_line_below_recovers_an_exact_line_and_the_quiet_line_under_inflated_long_steps() -> None:
    bandwidth, overhead = 40e9, 100e-6
    xs = [float(model.weight_bytes) for model in PROBE_MODELS]
    exact = fit_below(xs, [overhead + x / bandwidth for x in xs])
    assert (exact.slope, exact.intercept) == pytest.approx((1 / bandwidth, overhead), rel=1e-9)
    inflated = [overhead + x / bandwidth for x in xs[:2]] + [4 * (overhead + x / bandwidth) for x in xs[2:]]
    below = fit_below(xs, inflated)
    assert 35 < 1e-9 / below.slope < 40 and below.intercept < overhead  # leaning on the 55 MB step
    assert fit_line(xs, inflated).intercept < 0  # least squares reads the inflation as the line's tilt
    busy = fit_below(xs, [ms * 1e-3 for ms in BUSY_STEPS_MS])
    assert 30 < 1e-9 / busy.slope < 50 and busy.intercept < 300e-6  # the quiet box: 35 to 40 GB/s, 0.1 ms
    short_held = fit_below(xs, [1.2e-3, 1.8e-3, 16e-3, 56e-3])  # the 3 MB step held up, the 55 MB one not
    assert 1e-9 / short_held.slope < 40 and short_held.intercept == 0
    assert 1e-9 / fit_line(xs, [ms * 1e-3 for ms in BUSY_STEPS_MS]).slope < 6


@given(st.lists(st.tuples(st.floats(0, 1e9), st.floats(1e-6, 10.0)), min_size=2, max_size=6))
def test_the_line_below_rises_and_passes_under_every_point(points: list[tuple[float, float]]) -> None:
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return
    if all(y / x == math.inf for x, y in points if x > 0):  # subnormal x: no finite slope from the origin
        with pytest.raises(ValueError, match="too close to 0"):
            fit_below(xs, ys)
        return
    fit = fit_below(xs, ys)
    assert fit.slope > 0 and fit.intercept >= 0 and 0 <= fit.r_squared <= 1
    assert all(y >= fit.slope * x + fit.intercept - 1e-9 * max(ys) for x, y in points)


def test_the_line_below_steps_that_fall_with_size_is_the_flattest_through_the_origin() -> None:
    fit = fit_below([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert (fit.slope, fit.intercept) == pytest.approx((1 / 3, 0.0))


def test_the_line_below_refuses_points_it_cannot_bound() -> None:
    with pytest.raises(ValueError, match="two distinct"):
        fit_below([2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError, match="x values"):
        fit_below([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="y > 0"):
        fit_below([1.0, 2.0], [0.0, 1.0])


def test_a_steady_device_is_fitted_by_least_squares_and_a_busy_one_by_the_line_below() -> None:
    quiet = [0.19, 1.48, 4.2, 8.3]
    fit, steady = device_fit(_decode(quiet))
    assert steady and fit == fit_line([m.weight_bytes for m in PROBE_MODELS], [ms * 1e-3 for ms in quiet])
    fit, steady = device_fit(_decode(quiet, medians_ms=[0.2, 1.5, 9.0, 8.4]))  # a typical step 2x its quantile
    assert not steady and fit == fit_below([m.weight_bytes for m in PROBE_MODELS], [ms * 1e-3 for ms in quiet])
    fit, steady = device_fit(_decode(BUSY_STEPS_MS))
    assert not steady and fit.intercept < 300e-6 and 30 < 1e-9 / fit.slope < 50
    fit, steady = device_fit(_decode([9.0, 8.0, 7.0, 6.0]))  # least squares would fall: no reading at all
    assert not steady and fit.intercept == 0 and fit.slope == pytest.approx(6e-3 / PROBE_MODELS[-1].weight_bytes)


def test_low_quantile_ignores_a_slow_tail() -> None:
    assert low_quantile([1.0] * 18 + [90.0, 100.0]) == pytest.approx(1.0)
    assert low_quantile([5.0]) == 5.0


def test_a_gpu_keeps_a_margin_of_its_free_memory() -> None:
    """A twentieth of a large card, at least 256 MiB of a small one, never more than it has."""
    assert gpu_headroom(24 * GIB) == 24 * GIB // 20
    assert gpu_headroom(2 * GIB) == 256 * 2**20
    assert gpu_headroom(100 * 2**20) == 100 * 2**20


def test_meminfo_and_cpuinfo_parsers() -> None:
    meminfo = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   23426892 kB\n"
    assert mem_available_bytes(meminfo) == 23426892 * 1024
    assert mem_available_bytes("MemTotal: 1 kB\n") is None
    # Two cores with two hyperthreads each, as Linux lists them.
    cpuinfo = "".join(f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i % 2}\n\n" for i in range(4))
    assert physical_cores(cpuinfo) == 2
    assert physical_cores("processor\t: 0\nBogoMIPS\t: 50.00\n\n") is None


def test_significant_rounding_keeps_small_figures_positive() -> None:
    assert significant(0.000123456) == 0.0001235
    assert significant(32.4567) == 32.46
    assert significant(88010.4) == 88010.0


def test_probe_weights_are_valid_q8_0() -> None:
    raw = random_q8_0(q8_0_bytes(64 * 128))
    assert raw.size == 64 * 128 // 32 * Q8_0_BLOCK_BYTES
    values = dequantize(raw.reshape(64, -1), GGMLQuantizationType.Q8_0)
    assert values.shape == (64, 128)
    assert np.isfinite(values).all() and 0 < np.abs(values).max() <= 127 / 512


def test_probe_model_bytes_agree_with_the_planner_manifest(tmp_path: Path) -> None:
    """The fit's x axis is the same byte count `kafila plan` reads from a GGUF header."""
    model = ProbeModel(shape=NARROW, n_blocks=2)
    pool = random_q8_0(q8_0_bytes(NARROW.n_ff * NARROW.n_embd))
    manifest = read_manifest(write_probe_model(tmp_path / "probe.gguf", model, pool))
    assert manifest.n_blocks == 2
    assert sum(manifest.block_bytes) == model.weight_bytes


# --- the real command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One real `kafila probe --json`, its temporary models confined to a folder we can inspect."""
    tmp = tmp_path_factory.mktemp("probe-tmp")
    result = run_kafila("probe", "--json", env={"TMPDIR": str(tmp)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0]), tmp


@needs_llama_cpp
def test_probe_json_is_a_plausible_fleet_device(probe_json: tuple[dict[str, Any], Path]) -> None:
    report, _ = probe_json
    assert set(report) >= FLEET_KEYS
    assert 0.1 <= report["bandwidth_gb_s"] <= 10_000
    assert 0 <= report["overhead_us"] < 1e6
    assert report["tflops"] > 0
    assert report["memory_gib"] > 0
    device = FleetDevice.model_validate({key: report[key] for key in FLEET_KEYS})
    assert device_of(device).bandwidth_bytes_per_s == pytest.approx(report["bandwidth_gb_s"] * 1e9)


@needs_llama_cpp
def test_probe_json_says_how_it_measured(probe_json: tuple[dict[str, Any], Path]) -> None:
    details = probe_json[0]["probe"]
    assert details["weight_type"] == "Q8_0"
    assert details["threads"] >= 1
    assert details["backend"] in {"cpu", "gpu"}
    devices = details["devices"]  # which of llama.cpp's devices served, and every one it sees
    assert devices["serving"] and set(devices["serving"]) <= {d["name"] for d in devices["devices"]}
    assert devices["cpu_features"] == details["cpu_features"]
    if details["backend"] == "cpu":
        assert devices["serving"] == ["CPU"]
    sizes = [d["weight_bytes"] for d in details["decode"]]
    assert len(set(sizes)) >= 2 and max(sizes) > 5 * min(sizes)
    assert all(d["repetitions"] >= 3 for d in details["decode"])
    assert 0 <= details["fit"]["r_squared"] <= 1


@needs_llama_cpp
def test_probe_removes_its_models(probe_json: tuple[dict[str, Any], Path]) -> None:
    assert list(probe_json[1].iterdir()) == []


@needs_llama_cpp
def test_probe_with_a_model_prices_that_models_stages(tmp_path: Path) -> None:
    """`--model` adds the model's own o, b and b_head to the fleet entry, with the rings behind them.
    Its blocks are a few MB each: a block of a tiny model costs microseconds, below the noise."""
    from tiny_models import write_wide_model

    from kafila.runtime.gguf.slicer import file_sha256

    model = write_wide_model(tmp_path / "llama.gguf", n_blocks=4)
    env = {"KAFILA_CACHE": str(tmp_path / "cache")}
    result = run_kafila("probe", "--json", "--model", str(model), env=env)
    if BUSY in result.stdout:  # a busy machine can hide even these once
        result = run_kafila("probe", "--json", "--model", str(model), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    # Kept for sessions on this machine, by the model's hash, with the numbers the entry shows.
    assert report["model_sha256"] == file_sha256(model)
    kept = json.loads(Path(report["model_pricing_saved"]).read_text())["pricing"]
    assert Path(report["model_pricing_saved"]).parent == tmp_path / "cache" / "model-pricing"
    assert kept == {
        **{key: report[key] for key in ("model_sha256", "bandwidth_gb_s", "head_bandwidth_gb_s", "overhead_us")},
        # a host's own work a token is measured serving (session/pricing.py HostWork), never by a probe
        "host_work_us": None,
        "host_work_with_head_us": None,
    }
    stages = report["model_stages"]
    assert stages["divisions"] == [[1, 3], [3, 1]]
    assert report["bandwidth_gb_s"] == pytest.approx(stages["bandwidth_gb_s"], rel=1e-3)
    assert report["head_bandwidth_gb_s"] == pytest.approx(stages["head_bandwidth_gb_s"], rel=1e-3)
    assert report["overhead_us"] == pytest.approx(stages["overhead_us"], rel=1e-3, abs=1e-3)
    device = FleetDevice.model_validate({key: report[key] for key in (*FLEET_KEYS, "head_bandwidth_gb_s")})
    assert device_of(device).head_bandwidth_bytes_per_s == pytest.approx(report["head_bandwidth_gb_s"] * 1e9)


@needs_llama_cpp
def test_kept_model_pricings_are_read_newest_first_and_stale_or_broken_ones_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pricing from another llama.cpp build priced other kernels; a broken file is as if absent."""
    from kafila.contracts import ModelPricing
    from kafila.planner.fleet import pricing_for
    from kafila.runtime.machine.this_machine import cached_model_pricings, save_model_pricing

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    assert cached_model_pricings() == []  # nothing kept yet, not even the folder
    older, newer = (
        ModelPricing(model_sha256=c * 64, bandwidth_gb_s=b, head_bandwidth_gb_s=b, overhead_us=10.0)
        for c, b in (("a", 1.0), ("b", 2.0))
    )
    os.utime(save_model_pricing(older), (1_000, 1_000))
    save_model_pricing(newer)
    folder = tmp_path / "model-pricing"
    stale = {"llama_cpp_version": "0.0.1", "pricing": newer.model_copy(update={"model_sha256": "c" * 64}).model_dump()}
    (folder / f"{'c' * 64}.json").write_text(json.dumps(stale))
    (folder / f"{'d' * 64}.json").write_text('{"llama_cpp_version": ')
    (folder / f"{'e' * 64}.json").write_text(json.dumps({"pricing": None}))
    assert cached_model_pricings() == [newer, older]
    assert cached_model_pricings(limit=1) == [newer]
    assert pricing_for("a" * 64, cached_model_pricings()) == older
    assert pricing_for("c" * 64, cached_model_pricings()) is None


def test_a_models_hash_is_remembered_until_the_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashing a large model takes a minute and every session start asks: the hash is kept by the
    file's path, size and modification time, and taken again when any of them changes."""
    import hashlib

    from kafila.runtime.machine.this_machine import model_sha256

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert model_sha256(model) == hashlib.sha256(b"weights").hexdigest()
    memo = json.loads((tmp_path / "cache" / "model-hashes.json").read_text())
    entry = memo[str(model.resolve())]
    memo[str(model.resolve())] = [*entry[:2], "f" * 64]  # as if remembered: it is not read again
    (tmp_path / "cache" / "model-hashes.json").write_text(json.dumps(memo))
    assert model_sha256(model) == "f" * 64
    model.write_bytes(b"other weights")  # a new size and time: hashed again
    assert model_sha256(model) == hashlib.sha256(b"other weights").hexdigest()
    (tmp_path / "cache" / "model-hashes.json").write_text("{not json")  # a broken memo is no memo
    assert model_sha256(model) == hashlib.sha256(b"other weights").hexdigest()


def test_probe_with_a_missing_model_fails_in_one_line(tmp_path: Path) -> None:
    result = run_kafila("probe", "--model", str(tmp_path / "absent.gguf"))
    assert result.returncode == 1
    assert "no model file at" in result.stderr and "Traceback" not in result.stderr + result.stdout


def test_probe_with_a_file_that_is_no_model_fails_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "notes.gguf").write_text("not a model")
    result = run_kafila("probe", "--json", "--model", str(tmp_path / "notes.gguf"))
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    assert json.loads(result.stdout)["error"].startswith(f"cannot price {tmp_path / 'notes.gguf'}: ")
    assert "GGUF" in result.stdout and "bandwidth" not in result.stdout  # refused before the device was measured


@pytest.mark.parametrize("as_json", [False, True])
def test_probe_without_llama_cpp_fails_in_one_line(as_json: bool) -> None:
    result = run_kafila("probe", *(["--json"] if as_json else []), hide_llama_cpp=True)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert len(output.strip().splitlines()) == 1, output
    assert "llama.cpp is not installed" in output and "pip install llama-cpp-python" in output
    if as_json:
        assert json.loads(result.stdout)["error"].startswith("llama.cpp is not installed")


def test_model_stage_probe_prices_a_model_from_its_own_rings(tmp_path: Path) -> None:
    """The model-stage probe runs real local rings and derives o, b and b_head from their stage times."""
    from tiny_models import write_tiny_model

    from kafila.runtime.machine.model_probe import probe_model_stages

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    result = when_not_busy(lambda: probe_model_stages(model, repeats=1, n_threads=1))
    assert result.divisions == [[1, 3], [3, 1]]
    assert [(s.first_block, s.end_block, s.is_head) for s in result.stages] == [
        (0, 1, False),
        (1, 4, True),
        (0, 3, False),
        (3, 4, True),
    ]
    assert result.bandwidth_gb_s > 0 and result.head_bandwidth_gb_s > 0 and result.overhead_us >= 0


def test_a_model_too_big_for_this_machine_is_priced_on_the_part_that_fits(tmp_path: Path) -> None:
    """Run whole from disk it would price the disk: the rings hold its last blocks with the head,
    cut as a small model of their own, and refuse where not even three blocks fit."""
    from tiny_models import write_tiny_model

    from kafila.runtime.machine.model_probe import blocks_that_fit, probe_model_stages
    from kafila.runtime.machine.probe import ProbeError

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=8)
    manifest = read_manifest(model)
    assert blocks_that_fit(manifest, manifest.total_bytes * 2) == 8
    room = int((manifest.head_bytes + sum(manifest.block_bytes[-4:])) / 0.75) + 1
    assert blocks_that_fit(manifest, room) == 4
    result = when_not_busy(lambda: probe_model_stages(model, repeats=1, n_threads=1, memory_bytes=room))
    assert result.first_priced_block == 4 and result.divisions == [[1, 3], [3, 1]]
    assert result.bandwidth_gb_s > 0 and result.head_bandwidth_gb_s > 0 and result.overhead_us >= 0
    too_little = int((manifest.head_bytes + sum(manifest.block_bytes[-2:])) / 0.75)
    with pytest.raises(ProbeError, match=r"runs at least 3 of its blocks with its head .* do not fit in the [0-9.]+KB"):
        probe_model_stages(model, memory_bytes=too_little)


def test_model_stage_costs_are_recovered_from_exact_stage_times() -> None:
    """Stage times made from known o, b and b_head give back exactly those numbers."""
    from kafila.planner.types import ModelManifest
    from kafila.runtime.machine.model_probe import calibration_divisions, derive_costs, stage_times

    manifest = ModelManifest(
        name="m", block_bytes=(4_000_000,) * 17 + (3_000_000,), head_bytes=180_000_000, kv_bytes_per_token=(0,) * 18
    )
    o, b, b_head = 0.9e-3, 15e9, 27e9
    divisions = calibration_divisions(manifest.n_blocks)
    assert divisions == [[2, 16], [16, 2]]

    def ms(first: int, end: int, head: bool) -> float:
        return 1e3 * (o + sum(manifest.block_bytes[first:end]) / b + (manifest.head_bytes / b_head if head else 0))

    runs = [[ms(0, c[0], False), ms(c[0], 18, True)] for c in divisions]
    fit, head_bandwidth = derive_costs(manifest, stage_times(divisions, runs))
    assert fit.intercept == pytest.approx(o) and 1 / fit.slope == pytest.approx(b)
    assert head_bandwidth == pytest.approx(b_head)


def test_the_quick_form_times_a_short_and_a_long_block_stage_and_the_head_in_one_ring() -> None:
    """A host pricing its model before the first plan loads one ring, [k, n - 2k, k]: its two
    block stages give o and b, its head b_head, exactly, from exact stage times."""
    from kafila.planner.types import ModelManifest
    from kafila.runtime.machine.model_probe import derive_costs, quick_division, stage_times

    assert quick_division(18) == [2, 14, 2] and quick_division(48) == [5, 38, 5] and quick_division(4) == [1, 2, 1]
    assert quick_division(3) is None and quick_division(2) is None  # no two block stages of different lengths
    assert quick_division(48, tuple(range(4, 45, 4))) == [4, 40, 4]  # llama4: cut at multiples of 4
    assert quick_division(8, (4,)) is None
    manifest = ModelManifest(
        name="m", block_bytes=(4_000_000,) * 17 + (3_000_000,), head_bytes=180_000_000, kv_bytes_per_token=(0,) * 18
    )
    o, b, b_head = 0.4e-3, 13e9, 22e9

    def ms(first: int, end: int, head: bool) -> float:
        return 1e3 * (o + sum(manifest.block_bytes[first:end]) / b + (manifest.head_bytes / b_head if head else 0))

    division = quick_division(manifest.n_blocks)
    assert division == [2, 14, 2]
    fit, head_bandwidth = derive_costs(
        manifest, stage_times([division], [[ms(0, 2, False), ms(2, 16, False), ms(16, 18, True)]])
    )
    assert fit.intercept == pytest.approx(o) and 1 / fit.slope == pytest.approx(b)
    assert head_bandwidth == pytest.approx(b_head)


def test_the_quick_ring_is_sized_like_the_stages_a_session_will_serve() -> None:
    """[k, s, k] with s the blocks a served stage holds, within what the model has: on a busy
    machine a stage's time grows faster than its blocks, so it is timed at the length it serves."""
    from kafila.runtime.machine.model_probe import quick_ring

    assert quick_ring(18, 6) == [2, 6, 2]  # three machines: the last 10 blocks, cut as a small model
    assert quick_ring(18, 9) == [2, 9, 2]
    assert quick_ring(18, 40) == [2, 14, 2]  # no more than the whole model
    assert quick_ring(18, 1) == [2, 3, 2]  # longer than the short stage, or there is no line to draw
    assert quick_ring(4, 2) == [1, 2, 1] and quick_ring(3, 2) is None


@needs_llama_cpp
def test_a_host_prices_its_model_once_in_a_child_and_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`price_model_here`: the quick form in a child process, its ring sized like a served stage
    (two blocks of six: the last four cut as a small model), kept by the model's hash under the
    probe's key; a second start reads it back without measuring."""
    import json

    from tiny_models import write_wide_model

    from kafila.runtime.gguf.slicer import file_sha256
    from kafila.runtime.machine.model_probe import MEASURED_BEFORE_THE_FIRST_PLAN, price_model_here
    from kafila.runtime.machine.this_machine import cached_model_pricings

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    model = write_wide_model(tmp_path / "llama.gguf", n_blocks=6)
    digest = file_sha256(model)
    said: list[str] = []
    pricing, stages = when_not_busy(
        lambda: price_model_here(
            model, digest, 1 << 30, n_threads=1, progress=lambda text, _f: said.append(text), served_blocks=2
        )
    )
    assert said[:2] == [
        "cutting the last 4 of 6 blocks, with the head, to time stages as long as it will serve",
        "timing [1, 2, 1] as a local ring",
    ]
    assert stages is not None and stages.divisions == [[1, 2, 1]] and stages.first_priced_block == 2
    assert [(s.first_block, s.end_block, s.is_head) for s in stages.stages] == [
        (0, 1, False),
        (1, 3, False),
        (3, 4, True),
    ]
    assert pricing.model_sha256 == digest and pricing.bandwidth_gb_s > 0 and pricing.overhead_us >= 0
    assert cached_model_pricings() == [pricing]
    (record,) = (json.loads(path.read_text()) for path in (tmp_path / "cache" / "model-pricing").glob("*.json"))
    assert record["source"] == MEASURED_BEFORE_THE_FIRST_PLAN and {"llama_cpp_version", "repack", "devices"} <= set(
        record
    )
    assert price_model_here(model, digest, 1 << 30) == (pricing, None)  # kept: nothing measured again


@needs_llama_cpp
def test_a_quick_measure_whose_block_line_came_out_flat_prices_the_blocks_in_proportion_to_their_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where other work held the quick ring's block stages more than their blocks did (a flat
    line), its blocks are priced through the origin on the same run, not left to the generic probe."""
    from tiny_models import write_wide_model

    from kafila.runtime.machine import model_probe

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    model = write_wide_model(tmp_path / "llama.gguf", n_blocks=6)
    derived = model_probe.derive_costs
    fits: list[bool] = []

    def flat_as_a_line(manifest: Any, stages: Any, through_origin: bool = False) -> Any:
        fits.append(through_origin)
        if not through_origin:
            raise model_probe.FlatLine("stage time did not grow with the number of blocks")
        return derived(manifest, stages, through_origin=True)

    monkeypatch.setattr(model_probe, "derive_costs", flat_as_a_line)
    said: list[str] = []
    result = when_not_busy(
        lambda: model_probe.probe_model_stages(
            model, lambda text, _f: said.append(text), n_threads=1, quick=True, served_blocks=2
        )
    )
    assert "its block stages' times did not grow with their blocks: priced in proportion to them" in said
    assert fits[-2:] == [False, True] and said.count("timing [1, 2, 1] as a local ring") == 1
    assert result.overhead_us == 0 and result.bandwidth_gb_s > 0 and result.head_bandwidth_gb_s > 0


def test_a_stages_spread_is_its_mean_decode_over_its_typical_one() -> None:
    from kafila.runtime.machine.model_probe import busy_spread

    assert busy_spread([2.0, 9.0, 40.0], [2.0, 6.0, 40.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        busy_spread([], [])
    with pytest.raises(ValueError):
        busy_spread([1.0], [0.0])


def test_a_quick_measure_says_when_the_machine_was_busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick ring reads how far its stages' mean decodes lay above their typical ones; where
    that is past BUSY_SPREAD (here every reading is), the measure says the machine was busy."""
    from tiny_models import write_wide_model

    from kafila.runtime.machine import model_probe

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    model = write_wide_model(tmp_path / "llama.gguf", n_blocks=6)
    said: list[str] = []

    def measured() -> model_probe.ModelStageProbe:
        said.clear()
        return model_probe.probe_model_stages(
            model, lambda text, _f: said.append(text), n_threads=1, quick=True, served_blocks=2
        )

    monkeypatch.setattr(model_probe, "BUSY_SPREAD", 0.0)
    result = when_not_busy(measured)
    assert result.spread is not None and result.spread > 0 and result.busy
    assert any(text.startswith("the machine was busy while they were timed") for text in said), said


def test_a_model_cut_only_at_some_blocks_is_calibrated_and_kept_there() -> None:
    """llama4's stages start at multiples of 4: the calibration rings cut there, and a part that
    fits begins there."""
    from kafila.planner.types import ModelManifest
    from kafila.runtime.machine.model_probe import blocks_that_fit, calibration_divisions
    from kafila.runtime.machine.probe import ProbeError

    starts = tuple(range(4, 45, 4))
    assert calibration_divisions(48, starts) == [[4, 44], [44, 4]]
    with pytest.raises(ProbeError, match="cut at 1 block"):
        calibration_divisions(8, (4,))
    manifest = ModelManifest(
        name="m", block_bytes=(100,) * 48, head_bytes=0, kv_bytes_per_token=(0,) * 48, stage_starts=starts
    )
    assert blocks_that_fit(manifest, 1100, share=1.0) == 8  # 11 blocks fit; the part starts at block 40
    assert blocks_that_fit(manifest, 300, share=1.0) is None


def test_model_stage_probe_refuses_what_it_cannot_measure() -> None:
    from kafila.planner.types import ModelManifest
    from kafila.runtime.machine.model_probe import FlatLine, StageTime, calibration_divisions, derive_costs
    from kafila.runtime.machine.probe import ProbeError

    with pytest.raises(ProbeError, match="at least 3"):
        calibration_divisions(2)
    manifest = ModelManifest(name="m", block_bytes=(1000,) * 4, head_bytes=10, kv_bytes_per_token=(0,) * 4)
    same = [
        StageTime(first_block=0, end_block=2, is_head=False, ms_per_token=1.0),
        StageTime(first_block=2, end_block=4, is_head=True, ms_per_token=1.5),
    ] * 2
    with pytest.raises(ProbeError, match="two different numbers of blocks"):
        derive_costs(manifest, same)
    shrinking = [
        StageTime(first_block=0, end_block=1, is_head=False, ms_per_token=2.0),
        StageTime(first_block=0, end_block=3, is_head=False, ms_per_token=1.0),
        StageTime(first_block=3, end_block=4, is_head=True, ms_per_token=3.0),
    ]
    with pytest.raises(FlatLine, match="too busy"):  # a ProbeError; the quick form prices it through the origin
        derive_costs(manifest, shrinking)
    assert issubclass(FlatLine, ProbeError)
    fit, head_bandwidth = derive_costs(manifest, shrinking, through_origin=True)
    assert fit.intercept == 0 and fit.slope == pytest.approx((2.0 * 1000 + 1.0 * 3000) * 1e-3 / (1000**2 + 3000**2))
    assert head_bandwidth == pytest.approx(10 / (3.0e-3 - 1000 * fit.slope))


def test_the_hosts_measure_binds_its_teams_only_where_the_host_serves_them_bound() -> None:
    """`probe_child_env`: the demo's host (bound teams) measures bound, keeping a binding the user
    chose; any other host measures free, whatever it was set up with; the rest passes through."""
    from kafila.runtime.llama.loading import teams_bound
    from kafila.runtime.machine.model_probe import probe_child_env

    demo = {"OMP_PROC_BIND": "true", "GOMP_SPINCOUNT": "1000", "PATH": "/bin"}
    assert probe_child_env(demo, bound_teams=True) == demo
    assert probe_child_env({"PATH": "/bin"}, bound_teams=True) == {"PATH": "/bin", "OMP_PROC_BIND": "true"}
    assert probe_child_env({"OMP_PROC_BIND": "spread"}, bound_teams=True) == {"OMP_PROC_BIND": "spread"}
    assert probe_child_env(demo, bound_teams=False) == {"GOMP_SPINCOUNT": "1000", "PATH": "/bin"}
    assert [
        teams_bound(env)
        for env in ({}, {"OMP_PROC_BIND": "False "}, {"OMP_PROC_BIND": "true"}, {"OMP_PROC_BIND": "close"})
    ] == [
        False,
        False,
        True,
        True,
    ]
