"""`kafila doctor`: its judgement of findings (pure), then the real command against a real
rendezvous and a real model, and against a rendezvous that is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from host_process import running_rendezvous
from tiny_models import write_tiny_model

from kafila.cli.doctor_command import Check, Findings, judge
from kafila.contracts import NatClass
from kafila.runtime.llama.loading import llama, rebuild_for_gpu

HEALTHY = Findings(
    rendezvous="203.0.113.1:8470", rtt_ms=24.0, nat_class=NatClass.ORDINARY, llama_version="0.3.36",
    backends=("CPU",), free_memory=8 << 30, model="m.gguf", model_architecture="llama", model_bytes=1 << 30,
)  # fmt: skip


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def test_a_healthy_machine_passes_every_check() -> None:
    checks = judge(HEALTHY)
    assert [c.name for c in checks] == ["rendezvous", "UDP", "round trip", "NAT", "llama.cpp", "memory", "model"]
    assert all(c.status == "ok" for c in checks), checks


@pytest.mark.parametrize(
    ("changes", "name", "status", "advice"),
    [
        ({"rendezvous_error": "no kafila rendezvous answers at 203.0.113.1:8470"}, "rendezvous", "fail", "join line"),
        ({"udp_error": "STUN at 203.0.113.1:3478 did not answer: timed out"}, "UDP", "fail", "outbound UDP"),
        ({"rtt_ms": 240.0}, "round trip", "warn", "fewer tokens a second"),
        ({"nat_class": NatClass.RESTRICTIVE}, "NAT", "warn", "relay"),
        ({"nat_class": None, "nat_notes": ("one address",)}, "NAT", "warn", "unknown"),
        ({"gpu_present": "NVIDIA"}, "llama.cpp", "warn", 'CMAKE_ARGS="-DGGML_CUDA=on"'),
        ({"gpu_present": "Apple"}, "llama.cpp", "warn", 'CMAKE_ARGS="-DGGML_METAL=on"'),
        ({"llama_error": "llama.cpp does not load"}, "llama.cpp", "fail", "reinstall"),
        ({"model_error": "Kafila cannot split 'mamba' models"}, "model", "fail", "README"),
        ({"free_memory": None}, "memory", "warn", "--memory"),
        ({"model_bytes": 64 << 30}, "memory", "ok", "divides the model"),
    ],
)
def test_each_problem_is_named_with_what_to_do(changes: dict[str, object], name: str, status: str, advice: str) -> None:
    found = Findings(**{**HEALTHY.__dict__, **changes})  # type: ignore[arg-type]
    check = by_name(judge(found))[name]
    assert check.status == status and advice in check.advice, check


def test_the_llama_check_names_the_devices_that_serve() -> None:
    serving = "CUDA0 (NVIDIA GeForce RTX 4090, 22.0 of 24.0 GiB free)"
    check = by_name(judge(Findings(**{**HEALTHY.__dict__, "serving": serving, "gpu_offload": True})))["llama.cpp"]
    assert check.status == "ok" and check.detail.endswith(f"; serving on {serving} (GPU offload)"), check


def test_what_was_not_asked_is_skipped_with_how_to_ask() -> None:
    checks = by_name(judge(Findings(llama_version="0.3.36", free_memory=1 << 30)))
    assert checks["rendezvous"].status == "skip" and "--rendezvous" in checks["rendezvous"].advice
    assert checks["model"].status == "skip" and "--model" in checks["model"].advice
    assert "UDP" not in checks


@pytest.fixture(scope="module")
def rendezvous() -> Iterator[str]:
    with running_rendezvous() as rendezvous:
        yield rendezvous.address


def doctor(*args: str) -> tuple[int, dict[str, Check]]:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "doctor", "--json", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    return done.returncode, {c["name"]: Check(**c) for c in report["checks"]}


def test_the_doctor_checks_a_real_rendezvous_and_model(rendezvous: str, tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    code, checks = doctor("--rendezvous", rendezvous, "--model", str(model))
    assert code == 0, checks
    assert checks["rendezvous"].status == "ok" and checks["UDP"].status == "ok"
    assert checks["round trip"].status == "ok" and "ms to the rendezvous" in checks["round trip"].detail
    assert checks["NAT"].status in ("ok", "warn")  # loopback, one address: what can be told
    assert checks["llama.cpp"].status in ("ok", "warn") and "0.3.36" in checks["llama.cpp"].detail
    assert "; serving on " in checks["llama.cpp"].detail  # which devices, as ggml reports them
    assert checks["model"] == Check("model", "ok", "llama: Kafila can split it")


def test_the_doctor_says_what_to_do_when_nothing_answers(tmp_path: Path) -> None:
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_bytes(b"not a gguf file")
    code, checks = doctor("--rendezvous", "127.0.0.1:9", "--model", str(not_a_model))
    assert code == 1
    assert checks["rendezvous"].status == "fail" and "join line" in checks["rendezvous"].advice
    assert checks["model"].status == "fail" and "cannot read" in checks["model"].detail
    assert "GGUF model file" in checks["model"].advice


def test_a_gpu_that_llama_cpp_was_not_built_for_is_named_with_the_rebuild(tmp_path: Path) -> None:
    """nvidia-smi answers (here a stand-in on PATH) but the build cannot offload: the doctor, and
    `kafila join`, `kafila host` and `kafila probe` as they start, say the GPU sits idle, loudly,
    with the rebuild command on a line of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "300"}
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "doctor", "--json"], capture_output=True, text=True, timeout=120,
        check=False, env=env,
    )  # fmt: skip
    check = {c["name"]: Check(**c) for c in json.loads(done.stdout)["checks"]}["llama.cpp"]
    if llama().llama_supports_gpu_offload():  # a GPU build: nothing sits idle
        assert check.status == "ok", check
        return
    assert check.status == "warn" and "NVIDIA GPU sits idle" in check.detail, check
    command = rebuild_for_gpu("NVIDIA", str(llama().__version__))
    assert check.advice == command and command.startswith('CMAKE_ARGS="-DGGML_CUDA=on" python3 -m pip install')
    shown = subprocess.run(
        [sys.executable, "-m", "kafila", "doctor"], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert "GPU idle" in shown.stdout and command in [line.strip() for line in shown.stdout.splitlines()]
    joined = subprocess.run(
        [sys.executable, "-m", "kafila", "join", "7-crimson-harbor-lemon-tiger-orbit-cactus", "--rendezvous",
         "127.0.0.1:9"], capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    lines = [line.strip() for line in joined.stderr.splitlines()]
    assert "GPU idle" in joined.stderr and "NVIDIA GPU sits idle" in joined.stderr, joined.stderr
    assert command in lines, joined.stderr  # on a line of its own, to copy
    assert any("llama.cpp serves on CPU (" in line for line in lines), joined.stderr
    hosted = subprocess.run(
        [sys.executable, "-m", "kafila", "host", "--model", str(tmp_path / "absent.gguf")],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert hosted.returncode == 1 and "no model file" in hosted.stderr
    assert "GPU idle" in hosted.stderr and command in [line.strip() for line in hosted.stderr.splitlines()]
    probed = probe_until_measured(env)  # the warning comes with a result
    assert json.loads(probed.stdout)["probe"]["devices"]["idle_gpu"] == "NVIDIA"
    assert "GPU idle" in probed.stderr and command in [line.strip() for line in probed.stderr.splitlines()]


def probe_until_measured(env: dict[str, str], tries: int = 3) -> subprocess.CompletedProcess[str]:
    """`kafila probe --json` until it gives a result: a busy machine may refuse to be measured, and
    says so (each refusal must be that one), but not `tries` times in a row."""
    for _ in range(tries):
        probed = subprocess.run(
            [sys.executable, "-m", "kafila", "probe", "--json"], capture_output=True, text=True, timeout=180,
            check=False, env=env,
        )  # fmt: skip
        if probed.returncode == 0:
            return probed
        assert "too busy to measure" in probed.stdout + probed.stderr, (probed.stdout, probed.stderr)
    raise AssertionError(f"kafila probe refused {tries} times as too busy to measure")
