"""The rendezvous as a service: WebSocket signalling, STUN and the UDP relay in one event loop.

Each member holds one outbound WebSocket to `/v1/session` for the life of its session, which
is what lets a member behind a NAT hear about others at all. This module is the asyncio shell
around `kafila.network.rendezvous.Rendezvous`: it feeds the core frames, connection events and
the time, and carries out what the core answers (sends, closes, relay ports). uvicorn runs
inside the caller's event loop, with its own signal handling turned off, so the STUN sockets
and the relay live beside it and the caller decides when to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from kafila.network.discovery import DiscoveryResponder, DiscoveryServer
from kafila.network.http_guard import (
    HEADER_TIMEOUT_S,
    ConnectionGate,
    guarded_http,
    raise_open_file_limit,
)
from kafila.network.limits import address_group, is_loopback
from kafila.network.relay import RelayLimits, RelayServer
from kafila.network.rendezvous import (
    Close,
    ConnId,
    FreeRelay,
    Limits,
    OpenRelay,
    Output,
    Rendezvous,
    Send,
    encode,
)
from kafila.network.stun import StunServer
from kafila.portability import reuse_listening_address

DEFAULT_HTTP_PORT = 8470
SESSION_PATH = "/v1/session"
MAX_FRAME_BYTES = 1 << 20  # frames past this are cut off by the WebSocket layer (close 1009)
SEND_QUEUE = 256  # messages waiting for one slow member before it is dropped
SEND_TIMEOUT_S = 10.0
log = logging.getLogger("kafila.rendezvous.server")


@dataclass
class _Peer:
    websocket: WebSocket
    queue: asyncio.Queue[str | Close] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closing: bool = False


class RendezvousService:
    """Connects the sans-IO core to WebSockets, the relay and a clock."""

    def __init__(self, core: Rendezvous, relay: RelayServer, clock: Callable[[], float] = time.monotonic) -> None:
        self.core, self.relay, self.clock = core, relay, clock
        self._ids = itertools.count(1)
        self._peers: dict[ConnId, _Peer] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def serve(self, websocket: WebSocket) -> None:
        """One member connection, from accept to close. Nothing a client sends escapes as an exception."""
        await websocket.accept()
        conn = next(self._ids)
        peer = _Peer(websocket)
        self._peers[conn] = peer
        reader = asyncio.create_task(self._read(conn, peer))
        writer = asyncio.create_task(self._write(conn, peer))
        peer.tasks = [reader, writer]
        ip = websocket.client.host if websocket.client is not None else "unknown"
        local = websocket.scope.get("server")
        own_machine = is_loopback(ip) or (local is not None and ip == local[0])  # it reached us from our address
        self.dispatch(self.core.connect(conn, address_group(ip), self.clock(), own_machine))  # a /64 counts as one
        try:
            await asyncio.wait(peer.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in peer.tasks:
                task.cancel()
            await asyncio.gather(*peer.tasks, return_exceptions=True)
            self._peers.pop(conn, None)
            self.dispatch(self.core.disconnect(conn, self.clock()))
            with contextlib.suppress(Exception):
                await websocket.close()

    async def _read(self, conn: ConnId, peer: _Peer) -> None:
        try:
            while True:
                frame = await peer.websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    return
                text = frame.get("text")
                data: str | bytes = text if text is not None else (frame.get("bytes") or b"")
                self.dispatch(self.core.receive(conn, data, self.clock()))
        except (WebSocketDisconnect, RuntimeError):
            return
        except Exception:  # a bug here must cost one connection, not the service
            log.exception("connection %d failed", conn)

    async def _write(self, conn: ConnId, peer: _Peer) -> None:
        try:
            while True:
                item = await peer.queue.get()
                if isinstance(item, Close):
                    await asyncio.wait_for(peer.websocket.close(item.code, item.reason), SEND_TIMEOUT_S)
                    return
                await asyncio.wait_for(peer.websocket.send_text(item), SEND_TIMEOUT_S)
        except (TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            return
        except Exception:
            log.exception("connection %d: sending failed", conn)

    def dispatch(self, outputs: list[Output]) -> None:
        """Carry out what the core asked for."""
        for output in outputs:
            if isinstance(output, Send):
                peer = self._peers.get(output.conn)
                if peer is None or peer.closing:
                    continue
                if peer.queue.qsize() >= SEND_QUEUE:  # it does not read: stop writing to it
                    peer.closing = True
                    for task in peer.tasks:
                        task.cancel()
                    continue
                peer.queue.put_nowait(encode(output.message))
            elif isinstance(output, Close):
                peer = self._peers.get(output.conn)
                if peer is not None and not peer.closing:
                    peer.closing = True
                    peer.queue.put_nowait(output)
            elif isinstance(output, OpenRelay):
                self._spawn(self._open_relay(output))
            elif isinstance(output, FreeRelay):
                self.relay.free(output.relay_id)

    async def _open_relay(self, request: OpenRelay) -> None:
        try:
            port = await self.relay.open(request.relay_id, request.session_id, request.tokens)
        except (OSError, ValueError) as error:
            log.warning("relay %s: cannot bind a port: %s", request.relay_id, error)
            self.dispatch(self.core.relay_failed(request.relay_id, self.clock()))
            return
        self.dispatch(self.core.relay_opened(request.relay_id, port, self.clock()))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                now = self.clock()
                for relay_id in self.relay.core.take_used():
                    self.core.relay_used(relay_id, now)
                self.dispatch(self.core.tick(now))
            except Exception:
                log.exception("rendezvous tick failed")

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Tell every member the session is over, and give the goodbyes a moment to leave."""
        self.dispatch(self.core.shutdown(self.clock()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._peers:
                    await asyncio.sleep(0.02)
        for task in list(self._background):
            task.cancel()


def create_app(service: RendezvousService, stun_port: int | None = None) -> FastAPI:
    app = FastAPI(title="kafila rendezvous", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        """What a member needs beyond this address: where to ask STUN, so `kafila join` takes one address."""
        return {"session_path": SESSION_PATH, "stun_port": stun_port}

    @app.websocket(SESSION_PATH)
    async def session(websocket: WebSocket) -> None:
        await service.serve(websocket)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, **service.core.stats()}

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process that embeds it owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def install_signal_handlers(self) -> None:  # the name before uvicorn 0.29
        return


def _listen(host: str, port: int) -> socket.socket:
    options = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = options[0]
    sock = socket.socket(family, kind, proto)
    try:
        reuse_listening_address(sock)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class RendezvousHandle:
    """A running rendezvous; `await close()` stops all three services (and LAN discovery, if any)."""

    service: RendezvousService
    stun: StunServer
    relay: RelayServer
    http_address: tuple[str, int]
    _server: uvicorn.Server
    _serving: asyncio.Task[None]
    _ticking: asyncio.Task[None]
    gate: ConnectionGate  # connections counted before HTTP
    _closed: bool = False
    discovery: DiscoveryServer | None = None  # the LAN discovery responder, when started with a port

    @property
    def core(self) -> Rendezvous:
        return self.service.core

    @property
    def stun_address(self) -> tuple[str, int]:
        return self.stun.endpoints.address, self.stun.endpoints.port

    @property
    def url(self) -> str:
        """The signalling URL, with a wildcard bind address read as this machine."""
        host, port = self.http_address
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"ws://{f'[{host}]' if ':' in host else host}:{port}{SESSION_PATH}"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ticking.cancel()
        try:
            await self.service.shutdown()
            self._server.should_exit = True
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, SystemExit):
                await asyncio.wait_for(self._serving, 10)
        finally:
            if self.discovery is not None:
                self.discovery.close()
            self.relay.close()
            self.stun.close()


async def start_rendezvous(
    host: str = "0.0.0.0",
    http_port: int = DEFAULT_HTTP_PORT,
    stun_port: int = 3478,
    alt_port: int = 0,
    alt_address: str | None = None,
    *,
    relay_host: str | None = None,
    limits: Limits | None = None,
    relay_limits: RelayLimits | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    tick_interval: float = 1.0,
    discovery_port: int | None = None,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    open_token: str | None = None,
) -> RendezvousHandle:
    """Start STUN, WebSocket signalling and the relay on `host`; OSError if a port cannot be bound.

    A port of 0 picks a free one. `relay_host` is the address relay grants advertise; by default
    `host`, or, for a wildcard `host`, nothing (members then use the address they reached us on).
    `discovery_port` also answers LAN discovery (`kafila.network.discovery`) for the sessions
    held here, on that UDP port; one that cannot be bound costs a warning, not the rendezvous.
    Connections are capped per address (an IPv6 /64 is one) and in all before any HTTP is read,
    and a request's headers must arrive within `header_timeout_s` (`kafila.network.http_guard`).
    `open_token`: when set, only a host that gives it may open a session here.
    """
    limits = limits or Limits()
    raise_open_file_limit()
    gate = ConnectionGate(limits.max_connections_per_ip, limits.max_connections, limits.connections_per_network)
    try:
        stun = await StunServer.start(host, stun_port, alt_port, alt_address)
    except OSError as error:  # which socket, for the person told: errno and message alone name no port
        alternate = f" or its second port {alt_port}" if alt_port else ""
        raise OSError(error.errno, f"STUN's UDP port {stun_port}{alternate} on {host}: {error.strerror}") from error
    try:
        listener = _listen(host, http_port)
    except BaseException as error:
        stun.close()
        if isinstance(error, OSError):
            raise OSError(error.errno, f"the signalling TCP port {http_port} on {host}: {error.strerror}") from error
        raise
    advertised = relay_host if relay_host is not None else (None if host in ("0.0.0.0", "::", "") else host)
    relay = RelayServer(host, relay_limits, clock)
    core = Rendezvous(limits, rng, advertised, open_token)
    service = RendezvousService(core, relay, clock)
    config = uvicorn.Config(
        create_app(service, stun.endpoints.port),
        http=guarded_http(gate, header_timeout_s),
        lifespan="off",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        ws_max_size=MAX_FRAME_BYTES,
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=2,
    )
    server = _EmbeddedServer(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if serving.done():
                    raise OSError(f"the signalling server did not start: {serving.exception()!r}")
                await asyncio.sleep(0.01)
    except BaseException:
        server.should_exit = True
        serving.cancel()
        listener.close()
        stun.close()
        raise
    bound = listener.getsockname()
    ticking = asyncio.create_task(service.tick_forever(tick_interval))
    handle = RendezvousHandle(service, stun, relay, (str(bound[0]), int(bound[1])), server, serving, ticking, gate)
    if discovery_port is not None:
        handle.discovery = await _start_discovery(core, handle.http_address, discovery_port, clock)
    return handle


async def _start_discovery(
    core: Rendezvous, http_address: tuple[str, int], port: int, clock: Callable[[], float]
) -> DiscoveryServer | None:
    """LAN discovery is a convenience: members can still be given the address, so failing to
    bind it (another program on the port) is a warning, not a rendezvous that will not start."""
    try:
        responder = DiscoveryResponder(core.holds, http_address[1], http_address[0])
        return await DiscoveryServer.start(responder, port, clock)
    except (OSError, ValueError) as error:
        log.warning("LAN discovery is off: cannot listen on UDP port %d (%s); members need --rendezvous", port, error)
        return None
