"""The command line's edges, each against the real `kafila` process: a malformed code, a rendezvous
that is nowhere, a port already taken, an empty API key, options that contradict each other,
`kafila status` against a keyed host, a chat template that raises, Ctrl-C with a stream in flight,
and requests held for a new ring past `--resume-within`. Each ends in one clear line (or a clean
exit), never a traceback or a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from host_process import (
    Host,
    running_host,
    seeded_cache,
    serving_past,
    start_member,
    status_of,
    stop,
    until_status,
    wait_ready,
)
from tiny_models import write_tiny_model, write_wide_model
from waiting import until

CODE = "7-crimson-harbor-lemon-tiger-orbit-cactus"
KEY = "sk-edges-0123456789"
WIDE = {"COLUMNS": "300"}  # one line stays one line however long


def kafila(
    *args: str | Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", *map(str, args)], capture_output=True, text=True, timeout=timeout,
        check=False, env={**os.environ, **WIDE, **(env or {})},
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one `error:` line a failed command printed on stderr, after checking it failed cleanly."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("edges") / "tiny.gguf", "llama", n_blocks=4)


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """HOST:PORT of a TCP port that takes connections into its backlog and never answers: a
    rendezvous that hangs, rather than one that refuses."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing answers there


# --- kafila join ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("not-a-code", "is not a session code: it looks like 7-crimson-harbor-lemon-tiger-orbit-cactus"),
        ("", "an empty code is not a session code"),
        ("7-crimson", "is not a session code"),
        (f"{CODE}-extra", "the secret half of the code has 5 words, not 4"),
        ("7-crimson-harbor-lemon-tiger-orbit-zzzz", "'zzzz' is not among the code's words"),
    ],
)  # fmt: skip
def test_join_with_a_malformed_code_says_what_a_code_looks_like(code: str, said: str, tmp_path: Path) -> None:
    """Refused before anything is measured or any rendezvous is asked (there is none here)."""
    done = kafila("join", code, "--rendezvous", closed_port(), env={"KAFILA_CACHE": str(tmp_path / "cache")})
    assert said in one_error_line(done)
    assert not (tmp_path / "cache" / "probe.json").exists()  # refused before the device was measured


def test_join_with_a_rendezvous_that_is_nowhere_says_so_in_one_line(silent_listener: str, tmp_path: Path) -> None:
    """A port nobody listens on, a name that does not resolve, and a port that takes the connection
    but never answers: each a one-line error naming the address, the last within the bounded wait
    for an answer (5 s), not a hang."""
    env = {"KAFILA_CACHE": str(seeded_cache(tmp_path / "cache"))}
    for address, why in [
        (closed_port(), "Connection refused"),
        ("nowhere.invalid:8470", ""),
        (silent_listener, "timed out"),
    ]:
        started = time.monotonic()
        line = one_error_line(kafila("join", CODE, "--rendezvous", address, "--name", "m", env=env))
        assert f"m: no kafila rendezvous answers at {address}" in line and why in line, line
        assert time.monotonic() - started < 60
    for bad in ("127.0.0.1:99999", ":", "127.0.0.1:"):
        assert "expected HOST:PORT" in one_error_line(kafila("join", CODE, "--rendezvous", bad, env=env))


# --- kafila rendezvous ---------------------------------------------------------------------------


def test_a_rendezvous_on_a_port_in_use_says_which_and_exits() -> None:
    """Its signalling port taken by another TCP listener, or its STUN port by another UDP socket:
    one line naming the port, exit 1, nothing printed on stdout (no READY for a waiter to trust)."""
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        taken_tcp, taken_udp = tcp.getsockname()[1], udp.getsockname()[1]
        common = ("rendezvous", "--host", "127.0.0.1")
        for args, port in [
            (("--http-port", str(taken_tcp), "--stun-port", "0"), taken_tcp),
            (("--http-port", "0", "--stun-port", str(taken_udp)), taken_udp),
        ]:
            done = kafila(*common, *args, timeout=60)
            line = one_error_line(done)
            assert "cannot bind the rendezvous's sockets" in line and "in use" in line, line
            assert str(port) in line, line
            assert done.stdout == ""


# --- kafila doctor -------------------------------------------------------------------------------


def test_the_doctor_s_table_fails_a_rendezvous_that_is_nowhere(silent_listener: str) -> None:
    """The table a person reads (test_doctor checks the JSON against a refusing port): a name that
    does not resolve and a port that never answers each fail the rendezvous row, with what to do,
    exit 1, within the bounded wait."""
    for address in ("nowhere.invalid:8470", silent_listener):
        started = time.monotonic()
        done = kafila("doctor", "--rendezvous", address)
        assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
        row = next(line for line in done.stdout.splitlines() if "rendezvous" in line and "fail" in line)
        assert address in row, done.stdout
        assert "join line" in done.stdout  # the advice: where the address comes from
        assert time.monotonic() - started < 60
    done = kafila("doctor", "--rendezvous", "nowhere:port", "--json")
    assert done.returncode == 1 and json.loads(done.stdout)["error"].startswith("bad --rendezvous")


# --- kafila host: refusals before anything loads ---------------------------------------------------


def test_an_empty_api_key_is_refused_rather_than_serving_without_one(model: Path) -> None:
    """`--api-key ""` (say `--api-key "$KEY"` with KEY unset) would serve /v1 to anyone: refused,
    saying how to serve without a key. (An empty KAFILA_API_KEY is another matter: click counts an
    empty variable as unset, so that host serves without a key; not tested here.)"""
    for empty in ("", "   "):
        line = one_error_line(kafila("host", "--model", model, "--api-key", empty, "--port", "0"))
        assert "--api-key is empty" in line and "leave --api-key out" in line, line


def test_members_with_local_stages_is_refused_in_one_line(model: Path) -> None:
    """`--stages` splits the model on this machine; with `--members` the planner divides it."""
    for split in (("--stages", "2"), ("--division", "2,2")):
        line = one_error_line(kafila("host", "--model", model, "--members", "2", *split, "--port", "0"))
        assert "--stages and --division split the model on this machine" in line, line
        assert "with --members the planner divides it" in line, line


# --- a keyed host whose chat template raises ---------------------------------------------------------

RAISING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported by this template') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """A host with an API key serving a model whose chat template raises on a system message."""
    path = tmp_path_factory.mktemp("keyed") / "tiny.gguf"
    write_tiny_model(path, "llama", n_blocks=2, chat_template=RAISING_TEMPLATE)
    args = ("--model", path, "--context", "256", "--concurrency", "2", "--threads", "1")
    with running_host(*args, api_key=KEY) as host:
        yield host


def test_kafila_status_against_a_keyed_host(keyed: Host) -> None:
    """Without the key, or with a wrong one: one line saying the host answered 401 and what to do,
    as a JSON error with --json. With it: the tables, and with --json /status exactly as it came."""
    url = ("--url", keyed.base_url)
    for key in ((), ("--api-key", "sk-wrong")):
        line = one_error_line(kafila("status", *url, *key, env={"KAFILA_API_KEY": ""}))
        assert f"{keyed.base_url} answered 401" in line and "--api-key" in line, line
        done = kafila("status", *url, *key, "--json", env={"KAFILA_API_KEY": ""})
        assert done.returncode == 1 and "answered 401" in json.loads(done.stdout)["error"], done.stdout
    assert "sk-wrong" not in line  # the key given is not echoed
    shown = kafila("status", *url, "--api-key", KEY)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "tiny: ready" in shown.stdout, shown.stdout
    from_env = kafila("status", *url, "--json", env={"KAFILA_API_KEY": KEY})
    assert from_env.returncode == 0, from_env.stderr
    as_json = json.loads(from_env.stdout)
    direct = _status_with_key(keyed)
    assert as_json["model"] == direct["model"] == "tiny" and as_json["ready"] is True
    assert as_json.keys() == direct.keys()


def _status_with_key(host: Host) -> dict[str, Any]:
    from urllib.request import Request, urlopen

    request = Request(f"{host.base_url}/status", headers={"Authorization": f"Bearer {KEY}"})
    with urlopen(request, timeout=10) as response:
        status: dict[str, Any] = json.loads(response.read())
    return status


def test_a_chat_template_that_raises_is_a_400_with_its_reason(keyed: Host) -> None:
    """The template's own message, as a 400 on `messages`, streamed or not; the host goes on serving
    the messages its template takes."""
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    refused = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=refused, max_tokens=4, stream=stream)  # type: ignore[call-overload]
        assert error.value.status_code == 400
        assert "System role not supported by this template" in error.value.message, error.value.message
        assert "chat template rejected the messages" in error.value.message
        assert isinstance(error.value.body, dict) and error.value.body.get("param") == "messages", error.value.body
    taken = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert taken.choices[0].finish_reason in ("length", "stop")
    assert "Traceback" not in keyed.output(), keyed.output()


# --- Ctrl-C with a stream in flight ----------------------------------------------------------------


def test_ctrl_c_with_a_stream_in_flight_ends_the_stream_and_the_host_cleanly(model: Path) -> None:
    """SIGINT to a host serving on two local stages while a long stream runs: the stream ends at
    once with an error saying the host is shutting down, rather than hanging or running on; the
    host exits 0 without a traceback, and its stage process is gone."""
    args = ("--model", model, "--stages", "2", "--context", "4096", "--concurrency", "2", "--threads", "1")
    with running_host(*args) as host:
        workers = host.workers()
        assert workers, host.output()  # a stage in a process of its own, beside the host's
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = iter(
            client.completions.create(model="tiny", prompt="the", max_tokens=4000, temperature=0, stream=True)
        )
        first = next(stream)
        assert first.choices and first.choices[0].text is not None
        host.process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError) as ended:  # not its 4000 tokens: the host ends it
            for _chunk in stream:
                pass
        # the host's reason, or, where the connection closed before it could be sent, that
        assert isinstance(ended.value, openai.APIConnectionError) or "the host is shutting down" in str(ended.value)
        assert host.process.wait(timeout=60) == 0, host.output()
        assert "Traceback" not in host.output(), host.output()
        until(lambda: not any(map(running, workers)), "the stage processes to end", 30)


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie left for an init that does not reap has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --- --resume-within running out ---------------------------------------------------------------------


def test_requests_held_for_a_new_ring_fail_once_resume_within_passes(tmp_path: Path) -> None:
    """A ring of three with `--resume-within 1` serves a model of about 4 MB a block, so that the
    replan after a member is lost sends the member left a stage file of some 30 MB, which takes
    seconds. A stream runs; a member leaves (Ctrl-C): the host holds the stream for the new ring, and
    once the window has passed with none serving, the stream ends with the error saying so. The
    replan goes on, and the new ring answers whole."""
    model = write_wide_model(tmp_path / "wide.gguf", n_blocks=16)
    common = ("--context", "4096", "--concurrency", "2", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
    args = ("--model", model, "--members", "3", *common, "--resume-within", "1", "--no-rebalance")
    members: list[subprocess.Popen[str]] = []
    try:
        with running_host(*args, ready=False) as host:
            code, rendezvous = host.join_line()
            members += [
                start_member(code, rendezvous, f"member-{i}", tmp_path / f"cache-{i}", "--threads", "1")
                for i in range(2)
            ]
            wait_ready(host)
            epoch = status_of(host)["epoch"]
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
            stream = iter(
                client.completions.create(model="wide", prompt="the", max_tokens=3000, temperature=0, stream=True)
            )
            next(stream)
            members[1].send_signal(signal.SIGINT)  # it leaves, saying so: the host knows at once
            killed = time.monotonic()
            with pytest.raises(openai.APIError) as error:
                for _chunk in stream:
                    pass
            assert "the ring broke, and no new ring served within 1 s" in str(error.value), error.value
            assert time.monotonic() - killed >= 1.0  # held for the window, not failed at once
            until_status(host, serving_past(epoch), "the replan to serve", timeout=180)
            done = client.completions.create(model="wide", prompt="the", max_tokens=8, temperature=0)
            assert done.usage is not None and done.usage.completion_tokens == 8
            assert "Traceback" not in host.output(), host.output()
    finally:
        for member in members:
            stop(member)
