"""LAN discovery: `kafila join CODE` finds, without `--rendezvous`, the host holding CODE's channel.

A joiner broadcasts a request naming the code's channel (`7-crimson-harbor`, never the secret
half) and a random nonce; a host's embedded rendezvous that holds a live session with that
channel answers with the nonce and its HTTP port, and the joiner reads the rendezvous's address
from where the answer came from. Nothing here is authenticated, and nothing needs to be: the
channel is public, and a wrong or lying rendezvous still cannot pass the SPAKE2 exchange over
the secret half (`kafila.network.pake`).

Wire format (UDP, one datagram each way): `MAGIC`, a version byte, then one compact JSON object.

    request  {"type": "find", "channel": "7-crimson-harbor", "nonce": "<32 hex>"}, padded with
             spaces to at least MIN_REQUEST_BYTES, so an answer is never larger than the request
             that caused it (a spoofed request gains an attacker nothing);
    answer   {"type": "here", "nonce": "<the request's>", "http_port": 8470, "host": null}; `host`
             is set only when the rendezvous listens on one address rather than all of them.

As with the rest of `kafila.network`, the core is sans-IO (bytes and the time in, bytes out;
garbage is ignored, never raised) and the asyncio shell is thin: `DiscoveryServer` answers on
the well-known port, `discover` asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kafila.network.limits import RateByAddress
from kafila.network.session_codes import is_well_formed
from kafila.portability import ignore_udp_connection_resets

DEFAULT_DISCOVERY_PORT = 8470  # UDP; the same number as the rendezvous's TCP signalling port
DEFAULT_DISCOVERY_TIMEOUT_S = 5.0
MAGIC = b"KFD"
VERSION = 1
MAX_DATAGRAM_BYTES = 512
MIN_REQUEST_BYTES = 160  # requests are padded to this; every answer is smaller
ROUND_OFFSETS_S = (0.0, 0.3, 0.8, 1.6, 2.6, 3.8)  # when a discovery (re)sends, from its start
BROADCAST = "255.255.255.255"
LOOPBACK_BROADCAST = "127.255.255.255"  # every wildcard-bound responder on this machine hears it
MAX_INTERFACE_BROADCASTS = 16
LAN_GRACE_S = 0.2  # how long a loopback answer waits for the same host's answer from its LAN address
log = logging.getLogger("kafila.discovery")


class DiscoveryError(ConnectionError):
    """Nobody on this network answered for the channel; the message says what to do instead."""


# ---------------------------------------------------------------------------------------------
# Wire types


def _channel(text: str) -> str:
    if not is_well_formed(text):
        raise ValueError("not a channel code")
    return text


def _ip(text: str) -> str:
    return str(ipaddress.ip_address(text))


Channel = Annotated[str, Field(min_length=5, max_length=64), AfterValidator(_channel)]
DiscoveryNonce = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


class FindRequest(_Wire):
    type: Literal["find"] = "find"
    channel: Channel
    nonce: DiscoveryNonce


class HereAnswer(_Wire):
    type: Literal["here"] = "here"
    nonce: DiscoveryNonce
    http_port: Annotated[int, Field(ge=1, le=65535)]
    host: Annotated[str, Field(max_length=45), AfterValidator(_ip)] | None = None


_MESSAGE: TypeAdapter[FindRequest | HereAnswer] = TypeAdapter(
    Annotated[FindRequest | HereAnswer, Field(discriminator="type")]
)


def _encode(message: _Wire, pad_to: int = 0) -> bytes:
    body = MAGIC + bytes([VERSION]) + message.model_dump_json().encode()
    return body.ljust(pad_to, b" ")  # trailing whitespace is valid JSON


def _decode(data: bytes) -> FindRequest | HereAnswer | None:
    """One message, or None for anything else: too long, wrong magic or version, bad JSON or fields."""
    if len(data) > MAX_DATAGRAM_BYTES or not data.startswith(MAGIC) or len(data) <= len(MAGIC):
        return None
    if data[len(MAGIC)] != VERSION:
        return None
    try:
        return _MESSAGE.validate_json(data[len(MAGIC) + 1 :])
    except (ValidationError, ValueError, UnicodeError, RecursionError):
        return None


def new_nonce() -> str:
    return secrets.token_hex(16)


def encode_request(channel: str, nonce: str) -> bytes:
    """A request for `channel` (the public half of a code only); ValueError if it is not one."""
    try:
        request = FindRequest(channel=channel, nonce=nonce)
    except ValidationError:
        raise ValueError(f"{channel!r} is not a session channel (like 7-crimson-harbor)") from None
    return _encode(request, MIN_REQUEST_BYTES)


def decode_request(data: bytes) -> FindRequest | None:
    message = _decode(data)
    if not isinstance(message, FindRequest) or len(data) < MIN_REQUEST_BYTES:
        return None
    return message


def encode_answer(nonce: str, http_port: int, host: str | None = None) -> bytes:
    return _encode(HereAnswer(nonce=nonce, http_port=http_port, host=host))


def decode_answer(data: bytes, nonce: str, source_ip: str) -> tuple[str, int] | None:
    """The rendezvous (ip, http_port) an answer to our `nonce` names, or None for anything else."""
    message = _decode(data)
    if not isinstance(message, HereAnswer) or not secrets.compare_digest(message.nonce, nonce):
        return None
    return (message.host or source_ip, message.http_port)


# ---------------------------------------------------------------------------------------------
# The responder's core


@dataclass(frozen=True)
class DiscoveryLimits:
    requests_per_s: float = 4.0  # per source address, sustained: a joiner sends about 20 in 4 s
    burst: float = 24.0
    max_tracked_ips: int = 4096


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


class DiscoveryResponder:
    """Answers requests for channels `holds` says are live. Sans-IO: a datagram and the time in,
    the answer (or None) out; nothing a sender does makes it raise.

    `host` is the address the rendezvous listens on, None for all of them. A rendezvous on one
    address names it in the answer (the joiner would otherwise dial the address the answer left
    from); one on loopback answers only this machine, since nobody else could reach it.
    """

    def __init__(
        self,
        holds: Callable[[str], bool],
        http_port: int,
        host: str | None = None,
        limits: DiscoveryLimits | None = None,
    ) -> None:
        self.holds, self.http_port = holds, http_port
        self.host = None if host in (None, "", "0.0.0.0", "::") else _ip(host)
        self.local_only = self.host is not None and _is_loopback(self.host)
        self.limits = limits or DiscoveryLimits()
        self._rates = RateByAddress(self.limits.requests_per_s, self.limits.burst, self.limits.max_tracked_ips)
        self.answered = 0
        self.ignored = 0

    def datagram_received(self, data: bytes, source_ip: str, now: float) -> bytes | None:
        try:
            answer = self._answer(data, source_ip, now)
        except Exception:  # a bug here must cost one datagram, not the rendezvous
            log.exception("discovery: a request failed")
            answer = None
        if answer is None:
            self.ignored += 1
        else:
            self.answered += 1
        return answer

    def _answer(self, data: bytes, source_ip: str, now: float) -> bytes | None:
        if len(data) > MAX_DATAGRAM_BYTES or not data.startswith(MAGIC):
            return None
        if self.local_only and not _is_loopback(source_ip):
            return None
        if not self._rates.allow(source_ip, now):
            return None
        request = decode_request(data)
        if request is None or not self.holds(request.channel):
            return None
        return encode_answer(request.nonce, self.http_port, self.host)


# ---------------------------------------------------------------------------------------------
# Sockets


def _udp_socket(port: int, *, shared: bool) -> socket.socket:
    """An IPv4 UDP socket on all addresses (broadcasts reach only those), allowed to broadcast.

    `shared`: several hosts on one machine may each bind the well-known port. Broadcasts reach
    all of them; a unicast datagram reaches one, which is why `discover` broadcasts on loopback too.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind(("0.0.0.0", port))
        ignore_udp_connection_resets(sock)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.on_datagram(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:  # an unreachable broadcast, an ICMP error
        log.debug("discovery socket: %s", exc)


class DiscoveryServer:
    """The responder on its UDP port, for as long as its rendezvous runs."""

    def __init__(self, responder: DiscoveryResponder, clock: Callable[[], float] = time.monotonic) -> None:
        self.responder, self.clock = responder, clock
        self._protocol = _Datagrams(self._received)

    @classmethod
    async def start(
        cls,
        responder: DiscoveryResponder,
        port: int = DEFAULT_DISCOVERY_PORT,
        clock: Callable[[], float] = time.monotonic,
    ) -> DiscoveryServer:
        """Listen on `port` of every IPv4 address (0: any free port); OSError if it cannot be bound."""
        server = cls(responder, clock)
        sock = _udp_socket(port, shared=True)
        try:
            await asyncio.get_running_loop().create_datagram_endpoint(lambda: server._protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        return server

    @property
    def port(self) -> int:
        assert self._protocol.transport is not None, "start() the server first"
        return int(self._protocol.transport.get_extra_info("sockname")[1])

    def _received(self, data: bytes, source: tuple[str, int]) -> None:
        answer = self.responder.datagram_received(data, source[0], self.clock())
        if answer is not None and self._protocol.transport is not None:
            self._protocol.transport.sendto(answer, source)

    def close(self) -> None:
        if self._protocol.transport is not None:
            self._protocol.transport.close()


def parse_route_broadcasts(route_table: str) -> list[str]:
    """Broadcast addresses of the directly connected IPv4 subnets in a Linux /proc/net/route."""
    found: list[str] = []
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        try:
            destination, gateway, flags, mask = (int(fields[i], 16) for i in (1, 2, 3, 7))
        except (IndexError, ValueError):
            continue
        if gateway != 0 or not flags & 1 or mask in (0, 0xFFFFFFFF):  # RTF_UP, on-link, a real subnet
            continue
        broadcast = socket.inet_ntoa(struct.pack("<I", (destination | ~mask) & 0xFFFFFFFF))  # host byte order
        if not broadcast.startswith("127.") and broadcast not in found:
            found.append(broadcast)
    return found[:MAX_INTERFACE_BROADCASTS]


def default_destinations() -> list[str]:
    """Where a request goes: the limited broadcast, each subnet's own broadcast (for interfaces
    the default route does not leave by), loopback broadcast (every host on this machine), and
    loopback unicast (for systems where loopback does not broadcast)."""
    try:
        subnets = parse_route_broadcasts(Path("/proc/net/route").read_text())
    except OSError:  # not Linux: the limited broadcast still covers the default interface
        subnets = []
    return list(dict.fromkeys([BROADCAST, *subnets, LOOPBACK_BROADCAST, "127.0.0.1"]))


async def discover(
    channel: str,
    port: int = DEFAULT_DISCOVERY_PORT,
    timeout: float = DEFAULT_DISCOVERY_TIMEOUT_S,
    destinations: Iterable[str] | None = None,
) -> tuple[str, int]:
    """The (ip, http_port) of the rendezvous on this network that holds `channel`.

    Sends only the channel, never the secret half of a code. Resends a few times within
    `timeout`, then raises DiscoveryError. The first valid answer to our nonce wins, except that
    one from loopback waits `LAN_GRACE_S` for the same host's answer from its LAN address.
    """
    nonce = new_nonce()
    request = encode_request(channel, nonce)
    targets = list(dict.fromkeys(destinations if destinations is not None else default_destinations()))
    loop = asyncio.get_running_loop()
    found: asyncio.Future[tuple[str, int]] = loop.create_future()
    local: list[tuple[str, int]] = []

    def settle(answer: tuple[str, int]) -> None:
        if not found.done():
            found.set_result(answer)

    def received(data: bytes, source: tuple[str, int]) -> None:
        answer = decode_answer(data, nonce, source[0])
        if answer is None or found.done():
            return
        if _is_loopback(answer[0]):  # this machine: as its own host does, prefer its LAN address
            local.append(answer)
            loop.call_later(LAN_GRACE_S, settle, answer)
        else:
            settle(answer)

    try:
        sock = _udp_socket(0, shared=False)
    except OSError as error:
        raise DiscoveryError(f"cannot look for the host: no UDP socket ({error.strerror or error})") from None
    protocol = _Datagrams(received)
    try:
        transport, _ = await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
    except BaseException:
        sock.close()
        raise
    started = loop.time()
    try:
        for offset in ROUND_OFFSETS_S:
            if offset >= timeout:
                break
            await asyncio.wait([found], timeout=max(0.0, started + offset - loop.time()))
            if found.done():
                return found.result()
            for target in targets:
                with contextlib.suppress(OSError):  # an unreachable network costs only its own send
                    transport.sendto(request, (target, port))
        await asyncio.wait([found], timeout=max(0.0, started + timeout - loop.time()))
        if found.done():
            return found.result()
        if local:
            return local[0]
    finally:
        transport.close()
        if not found.done():
            found.cancel()
    raise DiscoveryError(
        f"no host on this network has session {channel}; pass --rendezvous HOST:PORT as the host printed it"
    )
