"""llama.cpp's backends: ggml found next to the libllama that loaded (a real copy of the libraries
loaded through LLAMA_CPP_LIB_PATH, in a real child process), the devices ggml reports, and which
of them serve; the choice and the report's wording are pure and tested on made-up devices."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError
from tiny_models import write_tiny_llama

from kafila.contracts import BackendDevice, BackendReport, FleetDevice
from kafila.runtime.llama.backends import backend_devices, backend_report, device_set, serving_devices
from kafila.runtime.llama.cpu_safety import reported_features
from kafila.runtime.llama.loading import (
    ggml_library_path,
    load_llama,
    loaded_llama_path,
    rebuild_for_gpu,
    repack_choice,
    system_info,
)
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.runtime.machine.memory import available_memory
from kafila.runtime.machine.this_machine import cached_device, probe_key, this_device

GIB = 2**30
CPU = BackendDevice(name="CPU", description="AMD Ryzen 9 7950X", kind="cpu", free_bytes=60 * GIB, total_bytes=64 * GIB)
RTX = BackendDevice(
    name="CUDA0", description="NVIDIA GeForce RTX 4090", kind="gpu", free_bytes=22 * GIB, total_bytes=24 * GIB
)
RTX_2 = RTX.model_copy(update={"name": "CUDA1"})
IGPU = BackendDevice(
    name="Vulkan0", description="AMD Radeon 780M", kind="igpu", free_bytes=8 * GIB, total_bytes=8 * GIB
)
BLAS = BackendDevice(name="BLAS", description="OpenBLAS", kind="accel", free_bytes=0, total_bytes=0)
LIBRARIES = ("ggml", "ggml-base", "ggml-cpu")


def ggml_files_mapped() -> dict[str, set[str]]:
    """The ggml library files this process has mapped, by library (Linux's /proc/self/maps)."""
    mapped: dict[str, set[str]] = {stem: set() for stem in LIBRARIES}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        name = Path(path).name
        for stem in LIBRARIES:
            if name.startswith(f"lib{stem}.so"):
                mapped[stem].add(path)
    return mapped


# --- which devices serve (pure) -----------------------------------------------------------------


def test_a_build_that_offloads_serves_on_every_dedicated_gpu() -> None:
    assert serving_devices([CPU, RTX, RTX_2, BLAS], gpu_offload=True) == ["CUDA0", "CUDA1"]
    assert serving_devices([CPU, IGPU, RTX], gpu_offload=True) == ["CUDA0"]  # an iGPU only when no other


def test_an_integrated_gpu_serves_only_where_there_is_no_other() -> None:
    assert serving_devices([CPU, IGPU], gpu_offload=True) == ["Vulkan0"]


def test_the_cpu_serves_a_cpu_build_or_one_without_a_gpu() -> None:
    assert serving_devices([CPU, RTX], gpu_offload=False) == ["CPU"]
    assert serving_devices([CPU, BLAS], gpu_offload=True) == ["CPU"]  # offload through RPC only: no GPU here
    assert serving_devices([], gpu_offload=False) == ["CPU"]


def test_the_summary_names_the_gpu_and_its_memory_or_the_cpu_and_its_features() -> None:
    gpu = BackendReport(serving=["CUDA0"], gpu_offload=True, devices=[CPU, RTX], cpu_features=["AVX2"])
    assert gpu.summary() == "CUDA0 (NVIDIA GeForce RTX 4090, 22.0 of 24.0 GiB free)" and gpu.on_gpu
    cpu = BackendReport(serving=["CPU"], gpu_offload=False, devices=[CPU], cpu_features=["AVX2", "FMA"])
    assert cpu.summary() == "CPU (AMD Ryzen 9 7950X; AVX2, FMA)" and not cpu.on_gpu
    assert cpu.summary(with_features=False) == "CPU (AMD Ryzen 9 7950X)"


def test_a_device_set_changes_with_the_gpu_but_not_with_free_memory() -> None:
    cpu = BackendReport(serving=["CPU"], gpu_offload=False, devices=[CPU])
    gpu = BackendReport(serving=["CUDA0"], gpu_offload=True, devices=[CPU, RTX])
    busier = gpu.model_copy(update={"devices": [CPU, RTX.model_copy(update={"free_bytes": GIB})]})
    assert device_set(cpu) != device_set(gpu) and device_set(gpu) == device_set(busier)


def test_a_report_from_another_machine_is_bounded() -> None:
    """A member's report crosses the network: each string one line, every list short."""
    with pytest.raises(ValidationError):
        BackendDevice(name="CPU\n[red]x", description="", kind="cpu", free_bytes=0, total_bytes=0)
    with pytest.raises(ValidationError):
        BackendDevice(name="CPU", description="x" * 161, kind="cpu", free_bytes=0, total_bytes=0)
    with pytest.raises(ValidationError):
        BackendReport(serving=["CPU"], gpu_offload=False, devices=[CPU] * 17)
    with pytest.raises(ValidationError):
        BackendReport(serving=["CPU"], gpu_offload=False, cpu_features=["AVX"] * 65)
    with pytest.raises(ValidationError):
        BackendReport(serving=[], gpu_offload=False)


@pytest.mark.parametrize(
    ("vendor", "system", "command"),
    [
        ("NVIDIA", "Linux", 'CMAKE_ARGS="-DGGML_CUDA=on" python3 -m pip install --force-reinstall --no-cache-dir'),
        ("Apple", "Darwin", 'CMAKE_ARGS="-DGGML_METAL=on" python3 -m pip install --force-reinstall --no-cache-dir'),
        ("NVIDIA", "Windows", '$env:CMAKE_ARGS="-DGGML_CUDA=on"; python -m pip install --force-reinstall'),
    ],
)
def test_the_rebuild_command_is_the_one_llama_cpp_python_documents(vendor: str, system: str, command: str) -> None:
    advice = rebuild_for_gpu(vendor, "0.3.36", system)
    assert advice.startswith(command) and advice.endswith("llama-cpp-python==0.3.36"), advice


def test_the_readmes_install_lines_name_the_version_kafila_requires() -> None:
    """A GPU build of another version would be replaced, for the CPU, when Kafila is installed."""
    root = Path(__file__).parent.parent
    pinned = re.findall(r'"llama-cpp-python==([0-9.]+)"', (root / "pyproject.toml").read_text())
    named = re.findall(r"llama-cpp-python==([0-9.]+)", (root / "README.md").read_text())
    assert len(pinned) == 1 and len(named) >= 4 and set(named) == set(pinned), (pinned, named)
    builds = re.findall(r'CMAKE_ARGS="-DGGML_(\w+)=on"', (root / "README.md").read_text())
    assert {"CUDA", "METAL", "VULKAN"} <= set(builds)


# --- this machine ----------------------------------------------------------------------------------


def test_this_machines_devices_as_ggml_reports_them() -> None:
    """No GPU here: the CPU serves, with the features llama.cpp reports and memory that is there."""
    devices = backend_devices()
    cpu = [device for device in devices if device.kind == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and 0 < cpu[0].free_bytes <= cpu[0].total_bytes
    report = backend_report()
    assert report.serving == ["CPU"] and not report.gpu_offload and not report.on_gpu
    assert report.cpu_features == reported_features(system_info())
    assert report.summary().startswith("CPU (")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads which libraries are mapped from /proc")
def test_ggml_is_the_copy_libllama_linked_to_and_in_the_process_once(tmp_path: Path) -> None:
    """A wheel ships libggml-base.so and libggml-base.so.0 as two copies: opening the first beside
    the second that libllama linked to would put two ggml in the process."""
    load_llama()
    loaded = loaded_llama_path()
    assert loaded is not None and loaded.is_file()
    for stem in LIBRARIES:
        assert ggml_library_path(stem).parent == loaded.parent
    with LlamaModel(write_tiny_llama(tmp_path / "tiny.gguf"), ContextSettings(n_ctx=64, n_batch=8, n_threads=1)) as m:
        m.decode([0, 0], [0, 1], [False, True], tokens=[1, 2])
    backend_devices()
    mapped = ggml_files_mapped()
    assert all(len(files) == 1 for files in mapped.values()), mapped
    assert mapped["ggml-base"] == {str(ggml_library_path("ggml-base"))}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads which libraries are mapped from /proc")
def test_ggml_is_found_next_to_a_libllama_loaded_from_elsewhere(tmp_path: Path) -> None:
    """llama-cpp-python loads libllama from LLAMA_CPP_LIB_PATH where it is set: ggml is taken
    from there too, so a stage loads and decodes with one ggml, the copy's."""
    load_llama()
    package_lib = Path(load_llama().__file__).parent / "lib"
    copy = shutil.copytree(package_lib, tmp_path / "elsewhere", symlinks=True)
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    script = textwrap.dedent(f"""
        import json, math
        from pathlib import Path
        from kafila.runtime.llama.backends import backend_report
        from kafila.runtime.llama.model import ContextSettings, LlamaModel
        from kafila.runtime.llama.loading import ggml_library_path, loaded_llama_path
        settings = ContextSettings(n_ctx=64, n_batch=8, n_seq_max=1, n_threads=1)
        with LlamaModel({str(model)!r}, settings, input_restored_at="no_node") as llm:
            llm.decode([0, 0], [0, 1], [False, True], tokens=[1, 2])
            finite = all(math.isfinite(x) for x in llm.logits(1))
        maps = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()]
        print(json.dumps({{
            "libllama": str(loaded_llama_path()),
            "found": {{stem: str(ggml_library_path(stem)) for stem in {LIBRARIES!r}}},
            "mapped": sorted({{path for path in maps if "/libggml" in path}}),
            "finite": finite,
            "serving": backend_report().serving,
        }}))
    """)
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(copy)}
    ran = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120, env=env
    )
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(seen["libllama"]).parent == copy
    assert all(Path(path).parent == copy for path in seen["found"].values()), seen
    assert Path(seen["found"]["ggml-base"]).name.startswith("libggml-base.")
    assert seen["mapped"] and all(Path(path).parent == copy for path in seen["mapped"]), seen["mapped"]
    assert len(seen["mapped"]) == len(LIBRARIES)  # each once: no second ggml from the package's folder
    assert seen["finite"] and seen["serving"] == ["CPU"]


# --- the probe's cache, and the memory offered now ---------------------------------------------------

KEPT = {"name": "kept", "bandwidth_gb_s": 1.5, "overhead_us": 10.0, "tflops": 0.5, "memory_gib": 8.0}


def test_a_cached_probe_is_used_only_under_the_same_key() -> None:
    cpu = BackendReport(serving=["CPU"], gpu_offload=False, devices=[CPU])
    key = probe_key("0.3.36", True, cpu)
    assert cached_device({**key, "device": KEPT}, key) == FleetDevice.model_validate(KEPT)
    stale = [
        probe_key("0.3.36", True, BackendReport(serving=["CUDA0"], gpu_offload=True, devices=[CPU, RTX])),
        probe_key("0.3.36", True, BackendReport(serving=["CPU"], gpu_offload=False, devices=[CPU, BLAS])),
        probe_key("0.3.35", True, cpu),
        probe_key("0.3.36", False, cpu),
        probe_key("0.3.36", True, None),
    ]
    for other in stale:
        assert cached_device({**other, "device": KEPT}, key) is None, other
    old = {"llama_cpp_version": "0.3.36", "repack": True, "device": KEPT}  # before devices were part of it
    assert cached_device(old, key) is None
    assert cached_device({**key, "device": {"name": ""}}, key) is None
    assert cached_device(["not", "a", "record"], key) is None


def test_the_memory_offered_is_never_more_than_is_free_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured afresh each time a machine offers itself: a cached figure above what is free now
    is lowered to it; one below is kept."""
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    llama_cpp = load_llama()
    key = probe_key(llama_cpp.__version__, repack_choice().repack, backend_report())
    huge = {**KEPT, "memory_gib": 1 << 20}  # a mebi-GiB: more than this machine has
    (tmp_path / "probe.json").write_text(json.dumps({**key, "device": huge}))
    offered = this_device()
    free, _ = available_memory(False)
    assert offered.name == "kept" and 0 < offered.memory_gib < huge["memory_gib"]
    assert offered.memory_gib <= 1.05 * free / GIB  # what was free then, give or take what moved since
    small = {**KEPT, "memory_gib": 0.25}
    (tmp_path / "probe.json").write_text(json.dumps({**key, "device": small}))
    assert this_device().memory_gib == 0.25
    assert this_device(memory=GIB // 8).memory_gib == 0.125  # and --memory lends less still
