"""What Kafila's event loops and UDP sockets need done differently on Windows, in one place.

Kafila is developed and tested on Linux. Each fallback here has been unit-tested there by forcing
the condition it handles; none has run on Windows (docs/runtime.md, "Windows and macOS").

- `run`: Kafila's event loops are selector loops on Windows. The default Proactor loop stops
  reading a UDP socket once an ICMP port unreachable is reported on it (CPython gh-127057), and
  punching LAN candidates provokes exactly that, so links would never come up.
- `ignore_udp_connection_resets`: Windows reports an ICMP port unreachable as a
  ConnectionResetError on the socket's next receive; every UDP socket Kafila binds turns that off.
- `forbid_fragmentation`: a link's datagrams leave with the don't-fragment bit (Linux and macOS
  name the option differently; elsewhere a link keeps QUIC's 1,200-byte minimum).
- `reuse_listening_address`: SO_REUSEADDR on a listening TCP socket, except on Windows, where it
  would let a second server take the same port.
- `signals_handled`: Ctrl-C and SIGTERM reach a handler on the event loop, also where the loop
  has no `add_signal_handler` (every loop on Windows).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
P = TypeVar("P", bound=asyncio.DatagramProtocol)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Windows' WSAIoctl code that switches off ICMP-unreachable reports on a UDP socket; absent elsewhere.
SIO_UDP_CONNRESET: int | None = getattr(socket, "SIO_UDP_CONNRESET", None)
# Don't-fragment options that Python's socket module does not name, as (level, option, value) for
# an IPv4 and an IPv6 socket: Linux's IP_MTU_DISCOVER and IPV6_MTU_DISCOVER set to PMTUDISC_PROBE
# (the DF bit, and no fragmenting by a size the kernel learned from ICMP: the link's own probes
# decide), macOS's IP_DONTFRAG and IPV6_DONTFRAG.
_DONT_FRAGMENT: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "linux": ((socket.IPPROTO_IP, 10, 3), (socket.IPPROTO_IPV6, 23, 3)),
    "darwin": ((socket.IPPROTO_IP, 28, 1), (socket.IPPROTO_IPV6, 62, 1)),
}


# ---------------------------------------------------------------------------------------------
# Event loops
# ---------------------------------------------------------------------------------------------


def loop_factory(platform: str = sys.platform) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop Kafila runs on `platform`: a selector loop on Windows, whose default
    Proactor loop stops reading a UDP socket after an ICMP unreachable (CPython gh-127057);
    elsewhere None, asyncio's own default."""
    return asyncio.SelectorEventLoop if platform == "win32" else None


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the loop `loop_factory` picks for this platform (`asyncio.run` takes a
    loop factory only from Python 3.12; Kafila supports 3.11)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


# ---------------------------------------------------------------------------------------------
# UDP sockets
# ---------------------------------------------------------------------------------------------


def ignore_udp_connection_resets(sock: Any, control: int | None = SIO_UDP_CONNRESET) -> None:
    """Stop Windows reporting an ICMP port unreachable as a ConnectionResetError on `sock`'s next
    receive; a no-op where the system has no such report (`control` is None or the socket has no
    `ioctl`). Call it on every UDP socket once bound."""
    ioctl = getattr(sock, "ioctl", None)
    if control is None or ioctl is None:
        return
    with contextlib.suppress(OSError):  # an old or unusual stack without it: the loop copes anyway
        ioctl(control, False)


def forbid_fragmentation(sock: Any, platform: str = sys.platform) -> bool:
    """Make `sock`'s datagrams leave with IP's don't-fragment bit (IPv6: unfragmented), so that one
    larger than its path carries is lost rather than arriving in pieces (RFC 9000 §14: QUIC's
    datagrams must not be fragmented). Whether that holds: False on a platform without the option
    or a socket that refuses it, where a link keeps to QUIC's minimum size."""
    options = _DONT_FRAGMENT.get(platform)
    if options is None or sock.type != socket.SOCK_DGRAM:
        return False
    ipv4, ipv6 = options
    try:
        if sock.family == socket.AF_INET:
            sock.setsockopt(*ipv4)
        elif sock.family == socket.AF_INET6:
            sock.setsockopt(*ipv6)
            with contextlib.suppress(OSError):  # IPv4 through a dual-stack socket, where it has one
                sock.setsockopt(*ipv4)
        else:
            return False
    except OSError:
        return False
    return True


def reuse_listening_address(sock: socket.socket, platform: str = sys.platform) -> None:
    """Let a restarted server listen again at once on its TCP port, as asyncio's own servers do
    on POSIX. Not on Windows, where SO_REUSEADDR would let a second server bind the same port
    while the first still listens (asyncio leaves it off there too)."""
    if platform != "win32":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


async def bind_udp_socket(local_addr: tuple[str, int]) -> socket.socket:
    """A non-blocking UDP socket bound to `local_addr`, with `ignore_udp_connection_resets`
    applied before its first datagram. OSError if no address of `local_addr` can be bound."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(*local_addr, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve {local_addr[0]}")
    failure: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.bind(address)
            ignore_udp_connection_resets(sock)
            return sock
        except OSError as error:
            sock.close()
            failure = error
        except BaseException:
            sock.close()
            raise
    assert failure is not None
    raise failure


async def open_udp_endpoint(
    factory: Callable[[], P], local_addr: tuple[str, int]
) -> tuple[asyncio.DatagramTransport, P]:
    """`create_datagram_endpoint(factory, local_addr=...)` on a socket from `bind_udp_socket`
    (asyncio's transport hides the socket's `ioctl`). OSError if `local_addr` cannot be bound."""
    sock = await bind_udp_socket(local_addr)
    try:
        return await asyncio.get_running_loop().create_datagram_endpoint(factory, sock=sock)
    except BaseException:
        sock.close()
        raise


# ---------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def signals_handled(
    loop: asyncio.AbstractEventLoop, handler: Callable[[int], object], signums: Iterable[int] = STOP_SIGNALS
) -> Iterator[None]:
    """While inside, each of `signums` calls `handler(signum)` on `loop`; on leaving, the handlers
    from before are back.

    `loop.add_signal_handler` where the loop has it; where it raises (NotImplementedError on
    every Windows loop, RuntimeError outside the main thread of some loops), `signal.signal` with
    a handler that passes the call to the loop by `call_soon_threadsafe`. A selector loop blocked
    in `select` is woken for it through `signal.set_wakeup_fd` on a socket pair of its own, as
    Unix loops do: otherwise Ctrl-C would wait for the loop's next timer. Must be entered on the
    loop's thread; a signal this thread cannot take is left as it was."""
    on_loop: list[int] = []
    previous: dict[int, Any] = {}

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to stop
            loop.call_soon_threadsafe(handler, signum)

    with contextlib.ExitStack() as undo:
        undo.callback(_restore, loop, on_loop, previous)
        for signum in signums:
            try:
                loop.add_signal_handler(signum, handler, signum)
                on_loop.append(signum)
            except (NotImplementedError, RuntimeError):
                with contextlib.suppress(ValueError, OSError):  # not the main thread: cannot be taken
                    previous[signum] = signal.signal(signum, forward)
        if previous:
            undo.enter_context(_wakeup_on_signal(loop))
        yield


def _restore(loop: asyncio.AbstractEventLoop, on_loop: list[int], previous: dict[int, Any]) -> None:
    for signum in on_loop:
        loop.remove_signal_handler(signum)
    for signum, old in previous.items():
        signal.signal(signum, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _wakeup_on_signal(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """A byte on a socket the loop reads whenever a signal arrives, so a loop blocked in `select`
    returns and the Python-level handler runs; nothing where the loop cannot watch a socket
    (Proactor loops wake themselves the same way) or the process's wake-up fd is not ours to set."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    watching = woken = False
    old = -1

    def drain() -> None:
        with contextlib.suppress(OSError):
            while reader.recv(4096):
                pass

    try:
        with contextlib.suppress(NotImplementedError):
            loop.add_reader(reader.fileno(), drain)
            watching = True
        if watching:
            with contextlib.suppress(ValueError):  # not the main thread
                old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
                woken = True
        yield
    finally:
        if woken:
            signal.set_wakeup_fd(old)
        if watching:
            loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
