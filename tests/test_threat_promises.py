"""Smaller promises of the threat model (docs/protocol.md), each against the real part: a joiner
reads a rendezvous's `/v1/info` within a bound, whatever the answer; a client that hangs up on a
non-streamed request ends it without a traceback in the host's log; a join that finds the session
full (a squatter in the last seat) tries again until the seat is free; the API closes sockets that
never send their request and raises the host's descriptor limit."""

from __future__ import annotations

import asyncio
import http.server
import json
import resource
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from host_process import running_host, start_member, status_of, stop, until_status, wait_ready
from test_session_network import share_this_machines_probe
from tiny_models import write_tiny_model

from kafila.contracts import FleetDevice
from kafila.network.http_guard import MAX_OPEN_FILES
from kafila.network.rendezvous_client import RendezvousClient
from kafila.session.presence import INFO_TIMEOUT_S, MAX_INFO_BYTES, RendezvousUnreachable, rendezvous_endpoints


@contextmanager
def answering_info(body: bytes, length: int | None = None, drip_s: float = 0.0) -> Iterator[tuple[str, int]]:
    """A hostile stand-in for a rendezvous: `/v1/info` answers `body` (claiming `length` bytes),
    sleeping `drip_s` between its chunks of 1 KiB."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(length if length is not None else len(body)))
            self.end_headers()
            try:
                for at in range(0, len(body), 1024):
                    self.wfile.write(body[at : at + 1024])
                    self.wfile.flush()
                    time.sleep(drip_s)
            except OSError:  # the joiner stopped reading, as it should
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_rendezvous_info_is_read_whole_when_it_is_one() -> None:
    info = json.dumps({"session_path": "/v1/session", "stun_port": 3478}).encode()
    with answering_info(info) as address:
        url, stun = rendezvous_endpoints(address)
    assert url == f"ws://127.0.0.1:{address[1]}/v1/session" and stun == ("127.0.0.1", 3478)


@pytest.mark.parametrize(
    ("body", "length", "drip_s", "said"),
    [
        (b"{" + b" " * (4 << 20), 100 << 30, 0.0, "longer than 64 KiB"),  # claims 100 GB, sends 4 MB
        (b" " * (MAX_INFO_BYTES - 10), None, INFO_TIMEOUT_S / 40, "took more than"),  # drips
        (json.dumps({"session_path": "ws://elsewhere", "stun_port": 99999}).encode(), None, 0.0, "names no session"),
    ],
    ids=["huge", "dripped", "nonsense"],
)
def test_a_hostile_rendezvous_info_is_refused_in_bounded_time(
    body: bytes, length: int | None, drip_s: float, said: str
) -> None:
    with answering_info(body, length, drip_s) as address:
        started = time.monotonic()
        with pytest.raises(RendezvousUnreachable, match=said):
            rendezvous_endpoints(address)
    assert time.monotonic() - started < 3 * INFO_TIMEOUT_S


def test_a_client_that_hangs_up_on_a_whole_reply_ends_it_without_a_traceback(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    with running_host("--model", model, "--context", "2048", "--threads", "1") as host:
        body = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 1500, "temperature": 0}).encode()
        port = int(host.base_url.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                client.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                until_status(host, lambda status: status["running"] == 1, "generating the request")
            until_status(host, lambda status: status["running"] == 0, "the hung-up request ended")
        assert status_of(host)["requests"]["finished"] == 0  # all three ended early, none ran to its end
        output = host.output()
        assert "InvalidStateError" not in output and "Traceback" not in output, output


def test_a_join_refused_a_full_session_tries_again_and_gets_the_seat_a_squatter_held(tmp_path: Path) -> None:
    """Anyone with the code's public words can take the last seat and sit silent: the host sends
    it away once the exchange's time is up, and a real `kafila join` that found the session full
    meanwhile tries again, says so, and gets in; the session serves."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    common = ("--context", "256", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
    share_this_machines_probe(tmp_path, 1)  # the member joins at once, not after measuring itself
    env = {"KAFILA_TRUST_EXCHANGE_S": "12"}  # the squatter holds the seat this long: the member finds it full
    with running_host("--model", model, "--members", "2", *common, ready=False, env=env) as host:
        code, rendezvous = host.join_line()
        address, port = rendezvous.rsplit(":", 1)
        url, _ = rendezvous_endpoints((address, int(port)))

        async def squat() -> RendezvousClient:
            device = FleetDevice(name="squatter", memory_gib=8)
            return await RendezvousClient.join(url, code, capability=device, fingerprint="ab" * 32)

        loop = asyncio.new_event_loop()
        squatter = loop.run_until_complete(squat())  # holds the one free seat, says nothing
        member = start_member(code, rendezvous, "patient", tmp_path / "cache-0", "--threads", "1")
        try:
            assert loop.run_until_complete(squatter.wait_closed(30)) is None  # sent away when its time was up
            wait_ready(host)
            assert status_of(host)["failed_proofs"] == 0  # it never tried the secret: no guess
        finally:
            output = stop(member)
            loop.run_until_complete(squatter.close())
            loop.close()
        assert "could not join yet" in output and "session_full" not in output.split("could not join yet")[0], output
        assert "Traceback" not in output, output


# `kafila`, started with the common default of 1,024 open files (the hard limit as it is).
FEW_FILES = """
import resource, sys
from kafila.cli.app import main
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.argv = ["kafila", *sys.argv[1:]]
main()
"""


def _closed_by_the_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` (its end of file) within `within_s`."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_dripping_connections_to_the_api_are_closed_and_the_descriptor_limit_raised(tmp_path: Path) -> None:
    """A socket that never sends its request's headers, or drips them, is closed once the headers'
    time is up (1 s here), so idle sockets cannot exhaust the host's descriptors; the host raises
    its soft descriptor limit from 1,024 as far as the hard one allows; a real request still gets
    its answer."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    launcher = (sys.executable, "-c", FEW_FILES)
    env = {"KAFILA_API_HEADER_TIMEOUT_S": "1"}
    with running_host("--model", model, "--threads", "1", env=env, launcher=launcher) as host:
        limits = Path(f"/proc/{host.process.pid}/limits").read_text()
        soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        assert soft == min(MAX_OPEN_FILES, hard) if hard != resource.RLIM_INFINITY else soft == MAX_OPEN_FILES
        port = int(host.base_url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        dripping = socket.create_connection(("127.0.0.1", port), timeout=10)
        dripping.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        try:
            assert all(_closed_by_the_server(sock, 15) for sock in [*idle, dripping])
        finally:
            for sock in [*idle, dripping]:
                sock.close()
        assert status_of(host)["ready"] is True
