"""Text from the network is shown, never obeyed: a member's name or error reaches the host's
terminal without its control characters and without being read as rich markup, and the session
code never reaches a route the API serves without its key. Against real `kafila host` and
`kafila join` processes, where the attack needs them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import openai
import pytest
from host_process import Host, running_host, start_member, stop, wait_ready
from tiny_models import write_tiny_model

from kafila.cli.errors import shown
from kafila.contracts import HostStatus
from kafila.network.session_codes import split_code
from kafila.untrusted import check_name, printable

KEY = "k-test"
COMMON = ("--context", "256", "--concurrency", "2", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
ESCAPES = "\x1b[2J\x1b]52;c;aGk=\x07"  # clear the screen, write the clipboard (OSC 52)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("untrusted") / "tiny.gguf", "llama", n_blocks=4)


def test_printable_keeps_words_and_drops_what_a_terminal_obeys() -> None:
    assert printable(f"rack{ESCAPES}-2") == "rack\ufffd[2J\ufffd]52;c;aGk=\ufffd-2"
    assert printable("a\tb\nc\u202ed") == "a b\ufffdc\ufffdd"  # a bidirectional override is no letter
    assert printable("one\ntwo", newlines=True) == "one\ntwo"
    assert printable("x" * 50, limit=10) == "x" * 9 + "…"
    assert shown("[/] [bold]") == "\\[/] \\[bold]"


@pytest.mark.parametrize("name", ["[/]", "rack[/b]", "Zoë's PC", "gpu-slice_3"])
def test_a_name_may_hold_any_printable_text(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "   ", " lead", "bell\x07", f"evil{ESCAPES}", "rtl\u202e", "x" * 81, "a\u2028b"])
def test_a_name_with_what_a_terminal_obeys_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        check_name(name)


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing answers there


def _join(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", "join", "7-crimson-harbor-lemon-tiger-orbit-cactus", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_join_with_a_name_rich_would_read_as_markup_says_it_plainly() -> None:
    result = _join("--name", "rack[/b]", "--rendezvous", _dead_address())
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "rack[/b]:" in result.stderr and "error:" in result.stderr


def test_join_with_a_name_holding_terminal_escapes_is_refused_in_one_line() -> None:
    result = _join("--name", f"evil{ESCAPES}", "--rendezvous", _dead_address())
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "printable characters only" in result.stderr and "\x1b" not in result.stderr


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    request = Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except HTTPError as error:
        return error.code, error.read().decode()


def _events_kept(host: Host, key: str | None) -> str:
    """The events the host kept, read from /events up to the comment that says they are all sent."""
    request = Request(f"{host.base_url}/events?after=0", headers={"Authorization": f"Bearer {key}"} if key else {})
    lines = []
    with urlopen(request, timeout=30) as stream:
        while (line := stream.readline().decode()) and not line.startswith(":"):
            lines.append(line)
    return "".join(lines)


def _open_routes(host: Host, key: str | None) -> dict[str, str]:
    """What the API shows of the forming session: /health (never keyed), /status, /events and a
    chat turned away with 503, each with the key where the host has one."""
    routes = {"/health": _get(f"{host.base_url}/health")[1], "/status": _get(f"{host.base_url}/status", key)[1]}
    routes["/events"] = _events_kept(host, key)
    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key=key or "none", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 503
    routes["503"] = refused.value.response.text
    return routes


@contextmanager
def _forming(model: Path, *extra: str) -> Iterator[tuple[Host, str, str]]:
    """A host waiting for its one member: the code and rendezvous it printed on its console."""
    with running_host("--model", model, "--members", "2", *COMMON, *extra, ready=False) as host:
        yield host, *host.join_line()


def test_the_session_code_is_on_no_route_without_the_key(model: Path) -> None:
    """No API key: everyone who reaches the port sees these routes, and none holds the code or its
    secret words, while the session forms and waits for its member."""
    with _forming(model) as (host, code, _):
        secret = split_code(code)[1]
        for route, body in _open_routes(host, None).items():
            assert secret not in body, (route, body)
        assert HostStatus.model_validate_json(_get(f"{host.base_url}/status")[1]).join is None


def test_a_member_named_as_markup_joins_and_the_key_s_holder_sees_the_code(model: Path, tmp_path: Path) -> None:
    """With an API key: /health (which needs none) and everything else but /status's `join` keep
    the code to themselves; the key's holder reads the join line, and `kafila status` shows it.
    Then a member named `[/]` (rich's closing tag) joins: the host prints its name as it is and
    serves."""
    with _forming(model, "--api-key", KEY) as (host, code, rendezvous):
        secret = split_code(code)[1]
        routes = _open_routes(host, KEY)
        join = json.loads(routes.pop("/status"))["join"]
        assert join is not None and code in join
        for route, body in routes.items():
            assert secret not in body, (route, body)
        status = subprocess.run(
            [sys.executable, "-m", "kafila", "status", "--url", host.base_url, "--api-key", KEY],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 0 and code in status.stdout + status.stderr, status.stdout + status.stderr

        member = start_member(code, rendezvous, "[/]", tmp_path / "cache", "--threads", "1")
        try:
            wait_ready(host)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
            reply = client.completions.create(model=client.models.list().data[0].id, prompt="the", max_tokens=4)
            assert reply.choices[0].finish_reason in ("length", "stop")
            assert "[/] loaded blocks" in host.output() and "Traceback" not in host.output(), host.output()
            names = [m["name"] for m in json.loads(_get(f"{host.base_url}/status", KEY)[1])["members"]]
            assert "[/]" in names
        finally:
            output = stop(member)
        assert "Traceback" not in output, output
