"""The rendezvous's HTTP side on the open internet: connections bounded per address and in all,
and headers bounded in time, all before any HTTP is parsed.

Without this, 300 slowloris connections (one header line every 10 s) all stayed open, and 1,100
sockets from one address exhausted the process's descriptors, so a legitimate `open` timed out.
The rendezvous core's own limits (`Limits.max_connections_per_ip`) apply only after the
WebSocket upgrade, which a slow or idle socket never reaches.

`ConnectionGate` is the pure count. `GuardedHttp` is uvicorn's h11 protocol with the gate
consulted as a connection is made and a deadline for the request's headers; the rendezvous
server hands uvicorn a subclass bound to its own gate (`guarded_http`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kafila.network.limits import address_group, network_group

if sys.platform != "win32":  # Windows has no descriptor limit of this kind, nor the module
    import resource

HEADER_TIMEOUT_S = 10.0  # from connecting (or the last response) to a request's complete headers
MAX_OPEN_FILES = 16_384  # what the rendezvous raises its descriptor limit to, where the hard limit allows
log = logging.getLogger("kafila.rendezvous.http")


class Connection(Protocol):
    def is_closing(self) -> bool: ...


@dataclass
class ConnectionGate:
    """Open connections counted per address group, per network and in all; `admit` refuses past
    any cap. A network (`network_group`) holds at most `per_network` (None: no cap of its own), so
    one network's many addresses leave room for others.

    A connection is released when its HTTP protocol loses it, or, once upgraded to a WebSocket
    (whose protocol the gate never sees), found closing when a cap is reached."""

    per_address: int = 64
    total: int = 4096
    per_network: int | None = None
    _open: dict[Connection, str] = field(default_factory=dict)  # connection → its address group
    _per_group: dict[str, int] = field(default_factory=dict)
    _per_network: dict[str, int] = field(default_factory=dict)
    refused: int = 0

    def admit(self, connection: Connection, ip: str) -> bool:
        group = address_group(ip)
        if self._full(group):
            self._forget_closed()
            if self._full(group):
                self.refused += 1
                return False
        self._open[connection] = group
        self._per_group[group] = self._per_group.get(group, 0) + 1
        network = network_group(group)
        self._per_network[network] = self._per_network.get(network, 0) + 1
        return True

    def release(self, connection: Connection) -> None:
        group = self._open.pop(connection, None)
        if group is None:
            return
        for counts, key in ((self._per_group, group), (self._per_network, network_group(group))):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def _full(self, group: str) -> bool:
        return (
            len(self._open) >= self.total
            or self._per_group.get(group, 0) >= self.per_address
            or (self.per_network is not None and self._per_network.get(network_group(group), 0) >= self.per_network)
        )

    def _forget_closed(self) -> None:
        for connection in [c for c in self._open if c.is_closing()]:
            self.release(connection)

    @property
    def open(self) -> int:
        return len(self._open)


class GuardedHttp(H11Protocol):
    """uvicorn's h11 protocol, refusing a connection the gate will not admit and closing one whose
    request headers do not arrive within `header_timeout_s`. A connection upgraded to a WebSocket
    stays counted until its transport closes."""

    gate: ConnectionGate
    header_timeout_s: float = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._admitted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if not self.gate.admit(transport, ip):
            transport.abort()  # no HTTP answer: that would cost what the cap saves
            return
        self._admitted = True
        super().connection_made(transport)
        self._await_headers()

    def _await_headers(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        """No complete request headers in time: close (unless the connection has moved on, to a
        request being served or a WebSocket)."""
        transport = self.transport
        if transport.get_protocol() is self and not transport.is_closing() and self.conn.their_state is h11.IDLE:
            transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self._header_deadline is not None:
            self._header_deadline.cancel()  # the request's headers are in
            self._header_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()  # a kept-alive connection owes the next request's headers in time

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:  # refused at the door: nothing of HTTP was set up
            return
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self.gate.release(self.transport)
        super().connection_lost(exc)


def guarded_http(gate: ConnectionGate, header_timeout_s: float = HEADER_TIMEOUT_S) -> type[GuardedHttp]:
    """The h11 protocol class for one server, bound to its gate."""
    return type("GuardedHttpForServer", (GuardedHttp,), {"gate": gate, "header_timeout_s": header_timeout_s})


def raise_open_file_limit(wanted: int = MAX_OPEN_FILES) -> int:
    """Raise this process's descriptor limit toward `wanted`, as far as the hard limit allows; the
    limit in force after. The gate's caps are sized under it, so a flood meets a refusal, not
    EMFILE on the accepting socket. On Windows, which has no such limit, `wanted` itself."""
    if sys.platform == "win32":
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as error:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, error)
    return soft
