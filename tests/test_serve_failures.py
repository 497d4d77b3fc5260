"""`kafila host` when things go wrong: a stage killed mid-stream, and a session too big to hold."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

import openai
import pytest
from host_process import running_host
from tiny_gguf import write_other_family
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.llama.model import ContextSettings


def health(base_url: str) -> int:
    try:
        with urlopen(f"{base_url}/health", timeout=5) as response:
            return int(response.status)
    except HTTPError as error:
        return int(error.code)
    except (URLError, OSError):
        return 0


def test_a_killed_stage_pauses_the_stream_which_goes_on_when_the_host_serves_again(tmp_path: Path) -> None:
    """A local stage process dies under a greedy stream: the stream pauses while the host takes
    every block itself, then goes on where it stopped, to the answer an unbroken run gives."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    args = ("--model", model, "--division", "2,2", "--context", "256", "--threads", "1")
    with running_host(*args) as host:
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        (worker,) = host.workers()
        os.kill(worker, signal.SIGSTOP)  # freeze the stage, so the request is surely in flight when it dies
        greedy = {"max_tokens": 100, "temperature": 0}
        stream = client.completions.create(model="tiny", prompt="hello world", stream=True, **greedy)
        os.kill(worker, signal.SIGKILL)  # the response has begun: its headers are here
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        engine = open_engine(model, [4], ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1))
        try:
            assert text == generate(engine, "hello world", 100, SamplingSettings()).text
        finally:
            engine.close()

        deadline = time.monotonic() + 60
        while health(host.base_url) != 200:
            assert time.monotonic() < deadline, host.output()
            time.sleep(0.2)
        assert host.workers() == []  # the host now holds every block itself
        assert "replanned" in host.output()


def test_a_session_too_big_for_this_machine_is_refused_naming_it(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    result = subprocess.run(
        [sys.executable, "-m", "kafila", "host", "--model", str(model), "--context", "1048576", "--concurrency", "64"],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "'this machine' cannot hold" in result.stderr and "short by" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_family_that_cannot_be_split_is_refused_before_a_session_code_is_printed(tmp_path: Path) -> None:
    """With members to come, the host would have to cut the model: a family the slicer cannot
    cut is refused at once, naming it and those supported, and nobody is told a code to join."""
    model = write_other_family(tmp_path / "mamba.gguf", "mamba")
    result = subprocess.run(
        [sys.executable, "-m", "kafila", "host", "--model", str(model), "--members", "2", "--port", "0"],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "'mamba' is not supported for splitting; supported: " in result.stderr and "qwen3moe" in result.stderr
    assert "session code" not in result.stdout + result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "/nonexistent.gguf"), "no model file"),
        (("--division", "1,1"), "covers 2 blocks"),
    ],
)
def test_bad_host_arguments_fail_in_one_line(args: tuple[str, ...], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kafila", "host", *args], check=False, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_is_refused_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kafila", "host", "--port", str(port)], check=False, capture_output=True, text=True,
            timeout=120, env={**os.environ, "COLUMNS": "300"},
        )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_a_rendezvous_port_in_use_is_refused_saying_how_to_take_free_ones(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            api_port = free.getsockname()[1]
        command = [
            sys.executable, "-m", "kafila", "host", "--model", str(model), "--members", "2", "--port", str(api_port),
            "--rendezvous-port", str(port), "--stun-port", "0", "--discovery-port", "0",
        ]  # fmt: skip
        result = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"}
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(rf"the embedded rendezvous cannot listen on \S+ \(port {port}", result.stderr), result.stderr
    assert "--rendezvous-port 0" in result.stderr and "Traceback" not in result.stderr


def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_slot(tmp_path: Path) -> None:
    """A non-streamed request whose client goes away is cancelled, not generated to its end for
    nobody: its slot is free at once, and it never counts as finished. (4000 tokens would take
    this host seconds; the client hangs up after a fraction of one.)"""
    import json

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    with running_host("--model", model, "--context", "4096", "--concurrency", "1", "--threads", "1") as host:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0}).encode()
        port = int(host.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as connection:
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            connection.sendall(head.encode() + body)
            deadline = time.monotonic() + 10
            while status(host.base_url)["running"] != 1:  # it is generating
                assert time.monotonic() < deadline, status(host.base_url)
                time.sleep(0.02)
        deadline = time.monotonic() + 10
        while status(host.base_url)["running"] != 0:
            assert time.monotonic() < deadline, "the abandoned request still holds its slot"
            time.sleep(0.05)
        assert status(host.base_url)["requests"] == {"finished": 0, "failed": 0}  # cancelled, not finished
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=3).usage.completion_tokens == 3  # type: ignore[union-attr]


def status(base_url: str) -> dict[str, object]:
    import json

    with urlopen(f"{base_url}/status", timeout=5) as response:
        return dict(json.loads(response.read()))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", "is not an address"),
        ("http://127.0.0.1:1", "no kafila host answers"),
    ],
)
def test_kafila_status_says_what_is_wrong_with_its_url(url: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kafila", "status", "--url", url], check=False, capture_output=True, text=True,
        timeout=60, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr


WIDE = {**os.environ, "COLUMNS": "400"}


def incidents_when_any(base_url: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """/status's incidents once there is one, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        with urlopen(f"{base_url}/status", timeout=10) as response:
            found: list[dict[str, Any]] = json.loads(response.read())["incidents"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_stage_process_killed_by_a_signal_is_named_in_the_hosts_error(tmp_path: Path) -> None:
    """A stage's native crash is told as one: which stage, which signal, the CPU features llama.cpp
    reported, the likely cause and the stage's last lines (faulthandler's traceback among them)."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    args = ("--model", model, "--division", "2,2", "--context", "256", "--threads", "1")
    with running_host(*args) as host:
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        (worker,) = host.workers()
        os.kill(worker, signal.SIGSEGV)
        with contextlib.suppress(openai.APIError):  # this request finds the ring broken
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        (incident,) = incidents_when_any(host.base_url)
        assert incident["what"] == "a stage failed"
        detail = incident["detail"]
        assert "the stage process holding blocks 0-1 died with SIGSEGV" in detail
        assert "CPU features" in detail and "Likely cause" in detail and "KAFILA_LLAMA_REPACK" in detail
        assert "Fatal Python error: Segmentation fault" in detail  # the stage's own last lines
        assert detail in host.output()  # the person at the host is told the same
        command = [sys.executable, "-m", "kafila", "status", "--url", host.base_url]
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True, env=WIDE).stdout
        assert "a stage failed:" in shown and "died with SIGSEGV" in shown
