"""Windows fallbacks, tested on Linux by forcing the condition each one handles (`kafila.portability`).

An event loop whose `add_signal_handler` raises NotImplementedError is what every loop on Windows
is; a socket with `ioctl` is what a Windows socket is. Linux reports an ICMP port unreachable on a
connected UDP socket as ConnectionRefusedError, which stands in for Windows' ConnectionResetError.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from waiting import line_from

from kafila.network.link import DatagramDemux
from kafila.portability import (
    SIO_UDP_CONNRESET,
    forbid_fragmentation,
    ignore_udp_connection_resets,
    loop_factory,
    open_udp_endpoint,
    reuse_listening_address,
    run,
    signals_handled,
)

WAIT = 10.0  # the bound on any one await here
WINDOWS_SIO_UDP_CONNRESET = 0x9800000C  # _WSAIOW(IOC_VENDOR, 12), as winsock's mswsock.h defines it


class NoSignalHandlersLoop(asyncio.SelectorEventLoop):
    """A real selector loop that, as on Windows, cannot install signal handlers."""

    def add_signal_handler(self, sig: int, callback: Callable[..., object], *args: Any) -> None:
        raise NotImplementedError

    def remove_signal_handler(self, sig: int) -> bool:
        raise NotImplementedError


def wakeup_fd() -> int:
    """The process's signal wake-up fd, left as it was."""
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    return current


# --- event loops ----------------------------------------------------------------------------


def test_windows_runs_selector_loops_and_other_systems_asyncio_default() -> None:
    assert loop_factory("win32") is asyncio.SelectorEventLoop
    assert loop_factory("linux") is None
    assert loop_factory("darwin") is None


def test_run_returns_the_result_on_a_fresh_loop() -> None:
    async def main() -> str:
        return type(asyncio.get_running_loop()).__name__

    assert run(main()) == type(asyncio.new_event_loop()).__name__


def test_a_selector_loop_as_windows_gets_serves_udp() -> None:
    """The loop `loop_factory("win32")` names carries datagrams both ways (here on Linux)."""

    async def main() -> bytes:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        class Echo(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                if not got.done():
                    got.set_result(data)

        transport, _ = await open_udp_endpoint(Echo, ("127.0.0.1", 0))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"over a selector loop", transport.get_extra_info("sockname"))
            try:
                return await asyncio.wait_for(got, WAIT)
            finally:
                transport.close()

    factory = loop_factory("win32")
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), asyncio.SelectorEventLoop)
        assert runner.run(main()) == b"over a selector loop"


# --- signals --------------------------------------------------------------------------------


def test_without_add_signal_handler_a_signal_reaches_the_handler_through_the_loop() -> None:
    loop_thread = threading.get_ident()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        fd_before = wakeup_fd()
        heard: list[tuple[int, int, bool]] = []
        both = asyncio.Event()

        def handler(signum: int) -> None:
            heard.append((signum, threading.get_ident(), asyncio.get_running_loop() is loop))
            if len(heard) == 2:
                both.set()

        with signals_handled(loop, handler):
            assert signal.getsignal(signal.SIGINT) not in before  # the fallback's own handler
            assert wakeup_fd() not in (-1, fd_before)  # a select() blocked on Windows wakes for it
            signal.raise_signal(signal.SIGINT)
            assert heard == []  # not run inside the signal handler: passed to the loop
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(both.wait(), WAIT)
        assert heard == [(signal.SIGINT, loop_thread, True), (signal.SIGTERM, loop_thread, True)]
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        assert wakeup_fd() == fd_before

    with asyncio.Runner(loop_factory=NoSignalHandlersLoop) as runner:
        runner.run(main())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_signal_from_another_thread_wakes_a_loop_with_nothing_else_to_do() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        heard: asyncio.Future[int] = loop.create_future()
        waiting = threading.Event()

        def send() -> None:
            waiting.wait(WAIT)
            os.kill(os.getpid(), signal.SIGTERM)

        with signals_handled(loop, heard.set_result, [signal.SIGTERM]):
            sender = threading.Thread(target=send)
            sender.start()
            loop.call_soon(waiting.set)  # once the loop is about to block
            try:
                return await asyncio.wait_for(heard, WAIT)
            finally:
                sender.join()

    with asyncio.Runner(loop_factory=NoSignalHandlersLoop) as runner:
        assert runner.run(main()) == signal.SIGTERM


def test_where_the_loop_has_add_signal_handler_it_is_used_and_removed() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        heard: asyncio.Future[int] = loop.create_future()
        with signals_handled(loop, heard.set_result, [signal.SIGTERM]):
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
            signal.raise_signal(signal.SIGTERM)
            assert not heard.done()
            assert await asyncio.wait_for(heard, WAIT) == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    run(main())


def test_outside_the_main_thread_the_signals_stay_as_they_were() -> None:
    outcome: list[object] = []

    def in_thread() -> None:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            with signals_handled(loop, lambda _signum: None):
                outcome.append(signal.getsignal(signal.SIGTERM))

        try:
            with asyncio.Runner(loop_factory=NoSignalHandlersLoop) as runner:
                runner.run(main())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(WAIT)
    assert outcome == [signal.SIG_DFL]


# Runs `python -m kafila ARGS` with every event loop refusing `add_signal_handler`, as on Windows.
AS_ON_WINDOWS = """
import asyncio.unix_events, runpy, sys
def refuse(*args, **kwargs):
    raise NotImplementedError
asyncio.unix_events._UnixSelectorEventLoop.add_signal_handler = refuse
asyncio.unix_events._UnixSelectorEventLoop.remove_signal_handler = refuse
sys.argv = ["kafila", *sys.argv[1:]]
runpy.run_module("kafila", run_name="__main__")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_kafila_rendezvous_without_add_signal_handler_starts_and_ends_on_a_signal(signum: int) -> None:
    command = [sys.executable, "-c", AS_ON_WINDOWS, "rendezvous", "--host", "127.0.0.1", "--http-port", "0",
               "--stun-port", "0"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert line_from(process.stdout, "the rendezvous's READY line").startswith("READY ")
        # printed once the handlers are in
        assert line_from(process.stdout, "the rendezvous's HTTP line").startswith("HTTP ")
        process.send_signal(signum)
        _, errors = process.communicate(timeout=WAIT * 3)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, errors
    assert "Traceback" not in errors


# --- UDP ------------------------------------------------------------------------------------


class RecordsIoctl:
    """What a Windows socket is to the helper: something with `ioctl`."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[tuple[int, object]] = []
        self.fails = fails

    def ioctl(self, control: int, value: object) -> None:
        self.calls.append((control, value))
        if self.fails:
            raise OSError("not supported")


def test_connection_resets_are_switched_off_where_the_socket_has_ioctl() -> None:
    windows_socket = RecordsIoctl()
    ignore_udp_connection_resets(windows_socket, control=WINDOWS_SIO_UDP_CONNRESET)
    assert windows_socket.calls == [(WINDOWS_SIO_UDP_CONNRESET, False)]

    refuses = RecordsIoctl(fails=True)  # an old stack without the control: no error
    ignore_udp_connection_resets(refuses, control=WINDOWS_SIO_UDP_CONNRESET)
    assert refuses.calls == [(WINDOWS_SIO_UDP_CONNRESET, False)]

    no_such_control = RecordsIoctl()
    ignore_udp_connection_resets(no_such_control, control=None)
    assert no_such_control.calls == []


def test_on_a_real_socket_here_it_changes_nothing() -> None:
    assert SIO_UDP_CONNRESET is None  # Linux has no such report to switch off
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer,
    ):
        sock.bind(("127.0.0.1", 0))
        ignore_udp_connection_resets(sock)
        peer.sendto(b"still works", sock.getsockname())
        sock.settimeout(WAIT)
        assert sock.recvfrom(64)[0] == b"still works"


def test_open_udp_endpoint_refuses_a_taken_port_and_keeps_no_socket() -> None:
    async def main() -> None:
        transport, _ = await open_udp_endpoint(asyncio.DatagramProtocol, ("127.0.0.1", 0))
        try:
            open_before = os.listdir("/proc/self/fd")
            with pytest.raises(OSError):
                await open_udp_endpoint(asyncio.DatagramProtocol, transport.get_extra_info("sockname"))
            assert os.listdir("/proc/self/fd") == open_before
        finally:
            transport.close()

    run(main())


class RecordingDemux(DatagramDemux):
    """The demux itself, with the errors its socket reported kept for the test to see."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.errors: list[Exception] = []
        self.errored = asyncio.Event()

    def error_received(self, exc: Exception) -> None:
        self.errors.append(exc)
        self.errored.set()
        super().error_received(exc)


def test_a_demux_keeps_receiving_after_an_icmp_unreachable() -> None:
    """A real ICMP port unreachable, reported to the demux, then datagrams still arrive."""

    async def main() -> list[bytes]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as gone:  # a port nobody listens on
            gone.bind(("127.0.0.1", 0))
            closed_address = gone.getsockname()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.connect(closed_address)  # Linux reports ICMP errors on connected UDP sockets
        sock.setblocking(False)
        ignore_udp_connection_resets(sock)
        demux = await RecordingDemux.over(sock)
        received: asyncio.Queue[bytes] = asyncio.Queue()
        demux.register([1], lambda data, _source: received.put_nowait(data))
        got = []
        try:
            for round_ in range(2):  # and again after a second error
                demux.errored.clear()
                demux.sendto(b"\x01anyone?", closed_address)
                await asyncio.wait_for(demux.errored.wait(), WAIT)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as back:  # the port answers now
                    back.bind(closed_address)
                    back.sendto(b"\x01reply %d" % round_, demux.local_address)
                    got.append(await asyncio.wait_for(received.get(), WAIT))
            assert all(isinstance(error, ConnectionRefusedError) for error in demux.errors)
        finally:
            demux.close()
        return got

    assert run(main()) == [b"\x01reply 0", b"\x01reply 1"]


def test_a_demux_keeps_receiving_after_a_reported_connection_reset() -> None:
    """Windows' report of an unreachable port, delivered as it would be there."""

    async def main() -> bytes:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        demux = await DatagramDemux.over(sock)
        received: asyncio.Queue[bytes] = asyncio.Queue()
        demux.register([1], lambda data, _source: received.put_nowait(data))
        try:
            demux.error_received(ConnectionResetError(10054, "An existing connection was forcibly closed"))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
                peer.sendto(b"\x01after the reset", demux.local_address)
                return await asyncio.wait_for(received.get(), WAIT)
        finally:
            demux.close()

    assert run(main()) == b"\x01after the reset"


def test_listening_sockets_reuse_their_address_except_on_windows() -> None:
    for platform, expected in (("linux", True), ("darwin", True), ("win32", False)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            reuse_listening_address(sock, platform)
            assert bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)) is expected


def test_datagrams_leave_unfragmented_where_the_system_can_say_so() -> None:
    """A link probes larger datagrams only from a socket that forbids fragmentation: a probe that
    arrived in pieces would prove nothing of its path."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ipv4,
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as ipv6,
    ):
        assert forbid_fragmentation(ipv4, "linux") and ipv4.getsockopt(socket.IPPROTO_IP, 10) == 3  # PMTUDISC_PROBE
        assert forbid_fragmentation(ipv6, "linux") and ipv6.getsockopt(socket.IPPROTO_IPV6, 23) == 3
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as untouched:
        default = untouched.getsockopt(socket.IPPROTO_IP, 10)
        assert not forbid_fragmentation(untouched, "win32")  # no option named for it: the link keeps 1,200
        assert untouched.getsockopt(socket.IPPROTO_IP, 10) == default
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as stream:
        assert not forbid_fragmentation(stream, "linux")
