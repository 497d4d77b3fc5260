"""A member's side of rendezvous signalling: one long-lived outbound WebSocket.

`RendezvousClient.open` (the host) and `RendezvousClient.join` (everyone else) return once the
rendezvous has answered, or raise `RendezvousError` with its code and message. After that the
client keeps the member list current, keeps the connection alive with pings, and hands every
message it receives to `events()` / `next_event()` for whoever wants the raw stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Self
from urllib.parse import urlsplit

import websockets
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from kafila.network.rendezvous import (
    SERVER_MESSAGE,
    Ended,
    Error,
    Joined,
    JoinSession,
    Leave,
    MemberInfo,
    MemberJoined,
    MemberLeft,
    Opened,
    OpenSession,
    Ping,
    Pong,
    Ready,
    RelayGranted,
    RelayRequest,
    ServerMessage,
    Wire,
)
from kafila.planner.fleet import FleetDevice

MAX_MESSAGE_BYTES = 4 << 20  # a ready list of 32 members is ~25 KB; leave room
log = logging.getLogger("kafila.rendezvous.client")


class RendezvousError(Exception):
    """The rendezvous refused something; `code` is its machine-readable reason."""

    def __init__(self, code: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class RendezvousClosed(RendezvousError):
    """The connection ended: the session ended, this member left, or the network went."""

    def __init__(self, message: str = "the rendezvous connection is closed", ended: Ended | None = None) -> None:
        super().__init__("closed", message)
        self.ended = ended


class RendezvousClient:
    """One member's signalling connection; build it with `open` or `join`."""

    def __init__(self, websocket: Any, first: Opened | Joined, url: str, ping_interval: float | None) -> None:
        self._ws = websocket
        self.url = url
        self.code = first.code
        self.member_id = first.member_id
        self.token = first.token
        self.model = first.model
        self.expected_members = first.expected_members
        self.host_id = first.member_id if isinstance(first, Opened) else first.host
        self.members: dict[str, MemberInfo] = {m.member_id: m for m in getattr(first, "members", [])}
        self.ready: Ready | None = None
        self.ended: Ended | None = None
        self.grants: dict[str, RelayGranted] = {}
        self.errors: list[Error] = []
        self._relay_errors: dict[str, Error] = {}
        self._pongs: dict[int, float] = {}
        self._nonces = itertools.count(1)
        self._events: asyncio.Queue[ServerMessage | None] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._closed = False
        self._receiver = asyncio.create_task(self._receive())
        self._keepalive = asyncio.create_task(self._ping_forever(ping_interval)) if ping_interval else None

    # -- starting --------------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        model: str,
        expected_members: int,
        capability: FleetDevice | dict[str, Any],
        fingerprint: str,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
        ping_interval: float | None = 30.0,
    ) -> Self:
        """Open a session as its host; `client.code` is what the others type."""
        request = OpenSession(
            type="open",
            model=model,
            expected_members=expected_members,
            capability=FleetDevice.model_validate(capability),
            candidates=list(candidates),
            fingerprint=fingerprint,
        )
        return await cls._start(url, request, Opened, timeout, ping_interval)

    @classmethod
    async def join(
        cls,
        url: str,
        code: str,
        *,
        capability: FleetDevice | dict[str, Any],
        fingerprint: str,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
        ping_interval: float | None = 30.0,
    ) -> Self:
        """Join a session by its code; `client.members` then holds everyone already in it."""
        request = JoinSession(
            type="join",
            code=code,
            capability=FleetDevice.model_validate(capability),
            candidates=list(candidates),
            fingerprint=fingerprint,
        )
        return await cls._start(url, request, Joined, timeout, ping_interval)

    @classmethod
    async def _start(
        cls, url: str, request: Wire, expected: type[Opened] | type[Joined], timeout: float, ping_interval: float | None
    ) -> Self:
        try:
            async with asyncio.timeout(timeout):
                websocket = await websockets.connect(url, max_size=MAX_MESSAGE_BYTES, compression=None)
        except (OSError, InvalidHandshake, TimeoutError) as error:
            raise RendezvousClosed(f"cannot reach the rendezvous at {url}: {error}") from error
        try:
            async with asyncio.timeout(timeout):
                await websocket.send(request.model_dump_json())
                answer = SERVER_MESSAGE.validate_json(await websocket.recv())
        except TimeoutError as error:
            await websocket.close()
            raise RendezvousClosed(f"the rendezvous did not answer within {timeout} s") from error
        except ConnectionClosed as error:
            raise RendezvousClosed(f"the rendezvous closed the connection: {error}") from error
        except ValidationError as error:
            await websocket.close()
            raise RendezvousClosed(f"the rendezvous sent something unreadable: {error.error_count()} errors") from None
        except BaseException:
            await websocket.close()
            raise
        if isinstance(answer, Error):
            await websocket.close()
            raise RendezvousError(answer.code.value, answer.message, answer.retry_after_s)
        if not isinstance(answer, expected):
            await websocket.close()
            raise RendezvousClosed(f"expected {expected.__name__}, got {answer.type}")
        return cls(websocket, answer, url, ping_interval)

    # -- events ----------------------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            async for raw in self._ws:
                try:
                    message = SERVER_MESSAGE.validate_json(raw)
                except ValidationError as error:
                    log.warning("unreadable message from the rendezvous (%d errors)", error.error_count())
                    continue
                self._apply(message)
                self._events.put_nowait(message)
                async with self._changed:
                    self._changed.notify_all()
        except ConnectionClosed:
            pass
        finally:
            self._closed = True
            self._events.put_nowait(None)
            async with self._changed:
                self._changed.notify_all()

    def _apply(self, message: ServerMessage) -> None:
        if isinstance(message, MemberJoined):
            self.members[message.member.member_id] = message.member
        elif isinstance(message, Ready):
            self.ready = message
            self.members = {m.member_id: m for m in message.members}
        elif isinstance(message, MemberLeft):
            self.members.pop(message.member_id, None)
            self.grants.pop(message.member_id, None)
        elif isinstance(message, RelayGranted):
            self.grants[message.peer] = message
            self._relay_errors.pop(message.peer, None)
        elif isinstance(message, Pong) and message.nonce is not None:
            self._pongs[message.nonce] = time.monotonic()
        elif isinstance(message, Ended):
            self.ended = message
        elif isinstance(message, Error):
            self.errors.append(message)
            if message.request == "relay_request" and message.peer is not None:
                self._relay_errors[message.peer] = message

    async def next_event(self, timeout: float | None = None) -> ServerMessage:
        """The next message received; `RendezvousClosed` once the connection is over and drained."""
        async with asyncio.timeout(timeout):
            message = await self._events.get()
        if message is None:
            self._events.put_nowait(None)  # every later call sees the end too
            raise RendezvousClosed(ended=self.ended)
        return message

    async def events(self) -> AsyncIterator[ServerMessage]:
        """Every message received, until the connection closes."""
        while True:
            try:
                yield await self.next_event()
            except RendezvousClosed:
                return

    async def _until(self, done: Callable[[], bool], timeout: float | None) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: done() or self._closed)

    async def wait_ready(self, timeout: float | None = None) -> Ready:
        """The final member list, once the session has all its members."""
        await self._until(lambda: self.ready is not None, timeout)
        if self.ready is None:
            raise RendezvousClosed(ended=self.ended)
        return self.ready

    async def wait_for_members(self, count: int, timeout: float | None = None) -> dict[str, MemberInfo]:
        await self._until(lambda: len(self.members) >= count, timeout)
        if len(self.members) < count:
            raise RendezvousClosed(ended=self.ended)
        return dict(self.members)

    # -- requests --------------------------------------------------------------------------------

    async def _send(self, message: Wire) -> None:
        if self._closed:
            raise RendezvousClosed(ended=self.ended)
        try:
            await self._ws.send(message.model_dump_json())
        except ConnectionClosed as error:
            raise RendezvousClosed(ended=self.ended) from error

    async def request_relay(self, peer: str, timeout: float | None = 10.0) -> RelayGranted:
        """A relay to `peer`; granted once `peer` has asked for one to this member as well."""
        if peer in self.grants:
            return self.grants[peer]
        self._relay_errors.pop(peer, None)
        await self._send(RelayRequest(type="relay_request", token=self.token, peer=peer))
        await self._until(lambda: peer in self.grants or peer in self._relay_errors, timeout)
        if peer in self.grants:
            return self.grants[peer]
        refusal = self._relay_errors.get(peer)
        if refusal is not None:
            raise RendezvousError(refusal.code.value, refusal.message, refusal.retry_after_s)
        raise RendezvousClosed(ended=self.ended)

    def relay_address(self, grant: RelayGranted) -> tuple[str, int]:
        """Where to send relay datagrams: the grant's host, or the host this client reached."""
        host = grant.host if grant.host is not None else urlsplit(self.url).hostname
        return (host or "127.0.0.1"), grant.port

    async def ping(self, timeout: float | None = 10.0) -> float:
        """Round-trip time to the rendezvous in seconds (also keeps the connection alive)."""
        nonce = next(self._nonces)
        started = time.monotonic()
        await self._send(Ping(type="ping", token=self.token, nonce=nonce))
        await self._until(lambda: nonce in self._pongs, timeout)
        if nonce not in self._pongs:
            raise RendezvousClosed(ended=self.ended)
        return self._pongs.pop(nonce) - started

    async def _ping_forever(self, interval: float) -> None:
        with contextlib.suppress(RendezvousClosed):
            while not self._closed:
                await asyncio.sleep(interval)
                await self._send(Ping(type="ping", token=self.token))

    @property
    def closed(self) -> bool:
        return self._closed

    async def leave(self) -> None:
        """Leave the session (as host: end it), then close."""
        with contextlib.suppress(RendezvousClosed):
            await self._send(Leave(type="leave", token=self.token))
        await self.close()

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._receiver, 5)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
