"""Every common CPU: the AMX rule, and a native crash that is explained instead of fatal.

The rule is fed llama.cpp's system-info text as other machines print it (this one may have no
AMX); the crash is a real child process dying by a real signal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kafila.runtime.llama.backends import backend_report
from kafila.runtime.llama.cpu_safety import (
    AMX_NOTE,
    REPACK_SETTING,
    RepackMode,
    choose_repack,
    died_by_signal,
    repack_mode,
    reported_features,
    signal_name,
)
from kafila.runtime.llama.loading import llama, model_params, repack_choice, system_info
from kafila.runtime.llama.model import ContextSettings, LlamaModel
from kafila.runtime.llama.process_log import lines_worth_showing
from kafila.runtime.machine import this_machine
from kafila.runtime.machine.probe import LlamaCppMissing, ProbeError
from kafila.runtime.machine.probe_child import probe_in_child

# As llama.cpp prints them (`llama_print_system_info`) on the machines people have.
SAPPHIRE_RAPIDS = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
    "REPACK = 1 | "
)
ZEN4 = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
APPLE_M2 = (
    "Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | MATMUL_INT8 = 1 | DOTPROD = 1 | "
    "ACCELERATE = 1 | REPACK = 1 | "
)
CUDA_ON_XEON = (
    "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
    "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 | "
)


# --- the rule ----------------------------------------------------------------------------------


def test_features_are_read_from_the_cpu_backend_only() -> None:
    assert reported_features(ZEN4)[:3] == ["SSE3", "SSSE3", "AVX"] and "AMX_INT8" not in reported_features(ZEN4)
    assert reported_features(APPLE_M2) == [
        "NEON",
        "ARM_FMA",
        "FP16_VA",
        "MATMUL_INT8",
        "DOTPROD",
        "ACCELERATE",
        "REPACK",
    ]
    assert reported_features(CUDA_ON_XEON) == ["SSE3", "AVX2", "AVX512", "AMX_INT8", "OPENMP", "REPACK"]
    assert reported_features("CPU : AVX2 = 0 | AMX_INT8 = 1 | NAME = text |") == ["AMX_INT8"]
    assert reported_features("") == []


@pytest.mark.parametrize("system_info", [SAPPHIRE_RAPIDS, CUDA_ON_XEON])
def test_auto_keeps_weights_unrepacked_where_llama_cpp_runs_amx(system_info: str) -> None:
    choice = choose_repack(system_info, RepackMode.AUTO)
    assert (choice.repack, choice.amx, choice.note) == (False, True, AMX_NOTE)
    assert model_params(repack=choice.repack).use_extra_bufts is False  # llama.cpp's own struct


@pytest.mark.parametrize("system_info", [ZEN4, APPLE_M2, ""])
def test_auto_keeps_llama_cpps_default_elsewhere(system_info: str) -> None:
    choice = choose_repack(system_info, RepackMode.AUTO)
    assert (choice.repack, choice.amx, choice.note) == (True, False, None)
    assert model_params(repack=choice.repack).use_extra_bufts is True


@pytest.mark.parametrize("setting", [None, "on", "off"])
def test_this_process_loads_as_the_rule_says_for_this_machine(
    setting: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What llama.cpp's struct gets, against the rule read straight from llama.cpp's own text: on
    and off as set, else repacked unless its CPU backend reports AMX_INT8 = 1 (read here with a
    pattern, not the parser under test); the note is said exactly where AMX changed the default."""
    raw = llama().llama_print_system_info()
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    cpu_part = text[text.index("CPU :") :] if "CPU :" in text else text
    amx_here = re.search(r"\bAMX_INT8 = [1-9]", re.split(r"\|\s*[A-Za-z]+ :", cpu_part)[0]) is not None
    if setting is None:
        monkeypatch.delenv(REPACK_SETTING, raising=False)
    else:
        monkeypatch.setenv(REPACK_SETTING, setting)
    repack_choice.cache_clear()
    try:
        expected = {None: not amx_here, "on": True, "off": False}[setting]
        assert repack_choice().repack is expected and repack_choice().amx is amx_here
        assert model_params().use_extra_bufts is expected  # llama.cpp's own struct
        assert (AMX_NOTE in capsys.readouterr().err) is (setting is None and amx_here)
    finally:
        repack_choice.cache_clear()  # the next caller reads this process's own setting again


@pytest.mark.parametrize("system_info", [SAPPHIRE_RAPIDS, ZEN4])
def test_the_setting_forces_either_way(system_info: str) -> None:
    forced_on = choose_repack(system_info, RepackMode.ON)
    forced_off = choose_repack(system_info, RepackMode.OFF)
    assert forced_on.repack and forced_on.note is None and REPACK_SETTING in forced_on.reason
    assert not forced_off.repack and forced_off.note is None  # asked for: nothing to explain


@pytest.mark.parametrize(
    ("value", "mode"), [(None, "auto"), ("", "auto"), ("auto", "auto"), ("ON", "on"), (" off ", "off")]
)
def test_the_setting_is_read_from_the_environment(value: str | None, mode: str) -> None:
    assert repack_mode({} if value is None else {REPACK_SETTING: value}) is RepackMode(mode)


def test_a_bad_setting_is_refused_naming_it_and_its_values() -> None:
    with pytest.raises(ValueError, match=r"KAFILA_LLAMA_REPACK='maybe' is not one of auto\|on\|off"):
        repack_mode({REPACK_SETTING: "maybe"})
    command = [sys.executable, "-m", "kafila", "probe"]
    env = {**os.environ, REPACK_SETTING: "maybe"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1 and "KAFILA_LLAMA_REPACK='maybe'" in result.stderr
    assert "Traceback" not in result.stderr


def test_stages_load_and_decode_with_either_choice(tmp_path: Path) -> None:
    """Unrepacked weights are still llama.cpp's weights: the same logits either way."""
    from tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    rows = []
    for repack in (True, False):
        settings = ContextSettings(n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1, repack=repack)
        with LlamaModel(model, settings) as llm:
            llm.decode([0] * 8, list(range(8)), [False] * 7 + [True], tokens=[5, 6, 7, 8, 9, 10, 11, 12])
            rows.append(llm.logits(7))
    assert rows[0].shape == rows[1].shape and abs(rows[0] - rows[1]).max() < 1e-3


# --- a native crash ------------------------------------------------------------------------------


def test_a_death_by_a_native_signal_is_explained() -> None:
    amx_repacked = choose_repack(SAPPHIRE_RAPIDS, RepackMode.ON)
    message = died_by_signal("the probe", -signal.SIGSEGV, SAPPHIRE_RAPIDS, amx_repacked, ["Fatal Python error"])
    assert message.startswith("the probe died with SIGSEGV")
    assert "AMX_INT8" in message and "AVX512_VNNI" in message  # the CPU features llama.cpp reported
    assert "AMX kernels" in message and "llama.cpp issue 20824" in message  # the likely cause
    assert "KAFILA_LLAMA_REPACK=off" in message  # the setting that avoids it
    assert message.endswith("Its last lines:\n  Fatal Python error")

    elsewhere = died_by_signal("a stage", -signal.SIGSEGV, ZEN4, choose_repack(ZEN4, RepackMode.AUTO))
    assert "AMX kernels" not in elsewhere and "KAFILA_LLAMA_REPACK=off" in elsewhere
    assert "reinstall" in died_by_signal("a stage", -signal.SIGILL, ZEN4, choose_repack(ZEN4, RepackMode.AUTO))
    killed = died_by_signal("a stage", -signal.SIGKILL, ZEN4, choose_repack(ZEN4, RepackMode.AUTO))
    assert "out-of-memory killer" in killed and "CPU features" not in killed
    assert signal_name(signal.SIGBUS).startswith("SIGBUS") and signal_name(200) == "signal 200"
    with pytest.raises(ValueError):
        died_by_signal("a stage", 1, ZEN4, amx_repacked)


def child(code: str) -> list[str]:
    """A probe child that speaks the real child's protocol, then does what `code` says."""
    prelude = "import ctypes, faulthandler, json, os, sys, time\nfaulthandler.enable()\n"
    return [sys.executable, "-c", prelude + textwrap.dedent(code)]


def test_a_probe_child_that_dies_by_sigsegv_is_a_clear_error_not_a_crash() -> None:
    heard: list[tuple[str, float]] = []
    crashing = child("""
        print(json.dumps({"progress": ["timing prompt processing", 0.9]}), flush=True)
        print("about to multiply", file=sys.stderr, flush=True)
        ctypes.string_at(0)  # a real segmentation fault, in native code
    """)
    with pytest.raises(ProbeError) as failure:
        probe_in_child(lambda text, fraction: heard.append((text, fraction)), command=crashing)
    message = str(failure.value)
    assert heard == [("timing prompt processing", 0.9)]
    assert "first prompt batch on this machine" in message and "died with SIGSEGV" in message
    for feature in reported_features(system_info()):  # this machine's, as llama.cpp reported them
        assert feature in message
    assert "Likely cause:" in message and "KAFILA_LLAMA_REPACK" in message
    assert "about to multiply" in message and "Fatal Python error: Segmentation fault" in message


def test_a_probe_child_that_fails_or_hangs_says_why() -> None:
    with pytest.raises(LlamaCppMissing, match="no llama here"):
        probe_in_child(command=child("""
            print(json.dumps({"error": "no llama here", "kind": "missing"}), flush=True); sys.exit(1)
        """))  # fmt: skip
    with pytest.raises(ProbeError, match=r"exited with status 3 and no result: .*gave up"):
        probe_in_child(command=child('print("gave up", file=sys.stderr); sys.exit(3)'))
    with pytest.raises(ProbeError, match=r"interrupted \(Ctrl-C\)"):
        probe_in_child(command=child("sys.exit(130)"))
    with pytest.raises(ProbeError, match="unreadable result"):
        probe_in_child(command=child('print(json.dumps({"result": {"name": 5}}), flush=True)'))
    with pytest.raises(ProbeError, match=r"did not finish in 2 s"):
        probe_in_child(command=child("print('{not json', flush=True); time.sleep(60)"), timeout_s=2)


def test_this_machines_probe_is_kept_per_llama_cpp_version_repack_choice_and_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept probe spares the host the child; one made with other devices (the same llama.cpp
    rebuilt for CUDA, say) is measured again. Every part of the key: `test_backends`."""
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    version = this_machine.load_llama().__version__
    kept = {"name": "kept", "bandwidth_gb_s": 1.5, "overhead_us": 10.0, "tflops": 0.5, "memory_gib": 1.0}
    key = this_machine.probe_key(version, repack_choice().repack, backend_report())
    (tmp_path / "probe.json").write_text(json.dumps({**key, "device": kept}))
    assert this_machine.this_device().name == "kept"  # no child: a made-up device comes back as it was

    elsewhere = {**key, "devices": ["CUDA0", "CPU: AMD EPYC", "CUDA0: NVIDIA GeForce RTX 4090"], "device": kept}
    (tmp_path / "probe.json").write_text(json.dumps(elsewhere))
    measured = this_machine.this_device()
    assert measured.name != "kept" and measured.bandwidth_gb_s > 0
    again = json.loads((tmp_path / "probe.json").read_text())
    assert {name: again[name] for name in key} == key


def test_kafila_processes_leave_a_traceback_when_they_crash(tmp_path: Path) -> None:
    """faulthandler is on in `kafila` itself: a crash anywhere leaves the Python stack in the log."""
    script = "import ctypes, kafila.cli.app as app, sys; sys.argv = ['kafila', '--version']; app.main()"
    ran = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0
    crash = (
        "import ctypes, os, kafila.cli.app as app\n"
        "app.app.command(name='crash')(lambda: ctypes.string_at(0))\n"
        "import sys; sys.argv = ['kafila', 'crash']; app.main()"
    )
    env = {**os.environ}
    env.pop("PYTHONFAULTHANDLER", None)
    died = subprocess.run(
        [sys.executable, "-c", crash], check=False, capture_output=True, text=True, timeout=60, env=env
    )
    assert died.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in died.stderr and "<lambda>" in died.stderr


def test_a_dead_processs_log_shows_its_crash_report_or_its_last_lines() -> None:
    report = ["Fatal Python error: Segmentation fault", "", "Thread 0x1 (most recent call first):"]
    stacks = [f'  File "x.py", line {i} in f' for i in range(100)]
    lines = [f"step {i}" for i in range(50)] + report + stacks
    shown = lines_worth_showing(lines)
    assert shown[:4] == ["step 47", "step 48", "step 49", "Fatal Python error: Segmentation fault"]
    assert len(shown) == 3 + 30 and "" not in shown  # the crashing thread's stack, not every thread's
    assert lines_worth_showing([f"line {i}" for i in range(40)] + ["x" * 5000]) == [
        *(f"line {i}" for i in range(29, 40)),
        "x" * 400,
    ]
