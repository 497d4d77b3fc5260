"""`kafila probe`: the pure fit and parsers, and the real command on this machine's llama.cpp.

Timings are never asserted: the machine is shared. The subprocess tests check the contract
(the five fleet keys, plausible values, the fleet schema, a clean failure without llama.cpp).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kafila.planner.fleet import FleetDevice
from kafila.runtime.manifest import read_manifest
from kafila.runtime.probe import (
    NARROW,
    PROBE_MODELS,
    Q8_0_BLOCK_BYTES,
    ProbeModel,
    fit_line,
    low_quantile,
    mem_available_bytes,
    physical_cores,
    q8_0_bytes,
    random_q8_0,
    significant,
    write_probe_model,
)

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


def test_fit_reports_scatter_and_refuses_a_single_size() -> None:
    assert fit_line([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]).r_squared == pytest.approx(0.64)
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError):
        fit_line([1.0, 2.0], [1.0])


def test_low_quantile_ignores_a_slow_tail() -> None:
    assert low_quantile([1.0] * 18 + [90.0, 100.0]) == pytest.approx(1.0)
    assert low_quantile([5.0]) == 5.0


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
    assert device.device().bandwidth_bytes_per_s == pytest.approx(report["bandwidth_gb_s"] * 1e9)


@needs_llama_cpp
def test_probe_json_says_how_it_measured(probe_json: tuple[dict[str, Any], Path]) -> None:
    details = probe_json[0]["probe"]
    assert details["weight_type"] == "Q8_0"
    assert details["threads"] >= 1
    assert details["backend"] in {"cpu", "gpu"}
    sizes = [d["weight_bytes"] for d in details["decode"]]
    assert len(set(sizes)) >= 2 and max(sizes) > 5 * min(sizes)
    assert all(d["repetitions"] >= 3 for d in details["decode"])
    assert 0 <= details["fit"]["r_squared"] <= 1


@needs_llama_cpp
def test_probe_removes_its_models(probe_json: tuple[dict[str, Any], Path]) -> None:
    assert list(probe_json[1].iterdir()) == []


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


def test_probe_on_a_models_own_blocks(tmp_path: Path) -> None:
    """The model-block probe times real block stages cut from the model and fits bytes to time."""
    from tiny_models import write_tiny_model

    from kafila.runtime.manifest import read_manifest
    from kafila.runtime.probe import probe_model_blocks

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    result = probe_model_blocks(model)
    blocks = read_manifest(model).block_bytes
    assert result.ranges == [(0, 1), (0, 2), (0, 4)]
    assert result.weight_bytes == [blocks[0], sum(blocks[:2]), sum(blocks)]
    assert result.bandwidth_gb_s > 0 and result.overhead_us >= 0
    assert len(result.step_ms) == 3 and all(ms > 0 for ms in result.step_ms)
    assert not list(tmp_path.glob("kafila-probe-*"))
