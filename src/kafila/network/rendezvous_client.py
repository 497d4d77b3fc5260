"""A member's side of rendezvous signalling: one long-lived outbound WebSocket.

`RendezvousClient.open` (the host) and `RendezvousClient.join` (everyone else) return once the
rendezvous has answered, or raise `RendezvousError` with its code and message. After that the
client keeps the member list current and the connection alive with pings.

The rendezvous is untrusted, so nothing it sends can grow the client's memory without bound:
messages are at most MAX_MESSAGE_BYTES, a signal is kept only from a member of the session (at
most MAX_PENDING_SIGNALS each), a pong only for a ping in flight, a refusal only for a request
made, and no message is queued for a reader that does not exist.

`verify_members` (the host) and `verify_host` (a joiner) then run the trust exchange of
`kafila.network.pake` over `signal` messages and return the roster of fingerprints that the
session code vouches for: the ones to pin, rather than those the rendezvous reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self
from urllib.parse import urlsplit

import websockets
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from kafila.contracts import MAX_MEMBERS, FleetDevice
from kafila.network.identity import normalize_fingerprint
from kafila.network.pake import (
    Exchange,
    PeerRefused,
    Role,
    RosterMismatch,
    TrustError,
    abort_message,
    check_roster,
)
from kafila.network.rendezvous import (
    SERVER_MESSAGE,
    Ended,
    Error,
    Joined,
    JoinSession,
    Leave,
    LeaveReason,
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
    Remove,
    Renew,
    ServerMessage,
    SignalFrom,
    SignalTo,
    Wire,
)
from kafila.network.session_codes import channel_part, split_code

MAX_MESSAGE_BYTES = 128 << 10  # the largest legitimate message, a ready list of 32 members, is under 64 KiB
REMOVE_WAIT_S = 5.0  # for the rendezvous to confirm that a removed member left
MAX_REFUSALS_LOGGED = 5  # refusals that concern no request in flight: logged, the first few only
MAX_PENDING_SIGNALS = 64  # signals kept per sender until read; a flood past this is dropped
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
        # Once filled, the session ends after this long with no join, signal, relay traffic or renew.
        self.idle_expiry_s = first.idle_expiry_s if isinstance(first, Opened) else None
        self.members: dict[str, MemberInfo] = {m.member_id: m for m in getattr(first, "members", [])}
        self.ready: Ready | None = None
        self.ended: Ended | None = None
        self.grants: dict[str, RelayGranted] = {}
        self._relay_errors: dict[str, Error] = {}  # for relays requested, until read
        self._signals: dict[str, deque[str]] = {}  # from members, until read
        self._signal_errors: dict[str, Error] = {}  # for signals sent, until read
        self.departed: dict[str, LeaveReason] = {}  # members that left, and why (at most the member ids there are)
        self.roster_changed: Callable[[], None] = lambda: None  # told when a member joins or leaves
        self._asked: set[str] = set()  # peers this member signalled, asked a relay to, or removed
        self._removals_refused: set[str] = set()
        self._changes = 0  # messages received so far: what `_wait_change` watches
        self._refusals_logged = 0
        self._pings: dict[int, float | None] = {}  # nonce → when its pong came, for pings in flight
        self._nonces = itertools.count(1)
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
        capability: FleetDevice,
        fingerprint: str,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
        ping_interval: float | None = 30.0,
        open_token: str | None = None,
    ) -> Self:
        """Open a session as its host; `client.code` is what the others type. `open_token`: the
        rendezvous's own, where its operator set one."""
        request = OpenSession(
            type="open",
            model=model,
            expected_members=expected_members,
            capability=capability,
            candidates=list(candidates),
            fingerprint=fingerprint,
            open_token=open_token,
        )
        return await cls._start(url, request, Opened, timeout, ping_interval)

    @classmethod
    async def join(
        cls,
        url: str,
        code: str,
        *,
        capability: FleetDevice,
        fingerprint: str,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
        ping_interval: float | None = 30.0,
    ) -> Self:
        """Join a session by its code; `client.members` then holds everyone already in it.

        `code` may be the full code: only its channel half is sent, never the secret half.
        """
        request = JoinSession(
            type="join",
            code=channel_part(code),
            capability=capability,
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
                self._changes += 1
                if isinstance(message, MemberJoined | MemberLeft | Ready):
                    self.roster_changed()
                async with self._changed:
                    self._changed.notify_all()
        except ConnectionClosed:
            pass
        finally:
            self._closed = True
            async with self._changed:
                self._changed.notify_all()

    def _apply(self, message: ServerMessage) -> None:
        if isinstance(message, MemberJoined):
            if message.member.member_id in self.members or len(self.members) < MAX_MEMBERS:
                self.members[message.member.member_id] = message.member
        elif isinstance(message, Ready):
            self.ready = message
            self.members = {m.member_id: m for m in message.members}
        elif isinstance(message, MemberLeft):
            if self.members.pop(message.member_id, None) is not None:
                self.departed[message.member_id] = message.reason
            self.grants.pop(message.member_id, None)
        elif isinstance(message, RelayGranted):
            if message.peer in self.members:
                self.grants[message.peer] = message
                self._relay_errors.pop(message.peer, None)
        elif isinstance(message, SignalFrom):
            if message.peer not in self.members:
                log.debug("dropped a signal from %s, not a member of this session", message.peer)
                return
            pending = self._signals.setdefault(message.peer, deque())
            if len(pending) < MAX_PENDING_SIGNALS:
                pending.append(message.body)
            else:
                log.warning("dropped a signal from %s: %d already unread", message.peer, len(pending))
        elif isinstance(message, Pong) and message.nonce is not None:
            if message.nonce in self._pings:
                self._pings[message.nonce] = time.monotonic()
        elif isinstance(message, Ended):
            self.ended = message
        elif isinstance(message, Error):
            if message.peer is None or message.peer not in self._asked:
                self._refusals_logged += 1
                if self._refusals_logged <= MAX_REFUSALS_LOGGED:
                    log.warning("the rendezvous refused something: %s", message.message[:200])
            elif message.request == "relay_request":
                self._relay_errors[message.peer] = message
            elif message.request == "signal":
                self._signal_errors[message.peer] = message
            elif message.request == "remove":
                self._removals_refused.add(message.peer)  # not a member (any more): nothing to wait for

    async def _until(self, done: Callable[[], bool], timeout: float | None) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: done() or self._closed)

    async def wait_ready(self, timeout: float | None = None) -> Ready:
        """The final member list, once the session has all its members."""
        await self._until(lambda: self.ready is not None, timeout)
        if self.ready is None:
            raise RendezvousClosed(ended=self.ended)
        return self.ready

    async def _wait_change(self, seen: int, timeout: float | None) -> None:
        """Until a message arrives after the `seen`-th (or the connection closes); TimeoutError after `timeout`."""
        await self._until(lambda: self._changes != seen, timeout)

    async def wait_for_left(self, member: str, timeout: float | None = None) -> LeaveReason:
        """Until `member` has left the session; why it left."""
        await self._until(lambda: member in self.departed, timeout)
        if member not in self.departed:
            raise RendezvousClosed(ended=self.ended)
        return self.departed[member]

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
        self._asked.add(peer)
        await self._send(RelayRequest(type="relay_request", token=self.token, peer=peer))
        await self._until(lambda: peer in self.grants or peer in self._relay_errors, timeout)
        if peer in self.grants:
            return self.grants[peer]
        refusal = self._relay_errors.get(peer)
        if refusal is not None:
            raise RendezvousError(refusal.code.value, refusal.message, refusal.retry_after_s)
        raise RendezvousClosed(ended=self.ended)

    async def send_signal(self, peer: str, body: str) -> None:
        """An opaque message (printable ASCII, at most 4096 characters) to another member of the session."""
        self._signal_errors.pop(peer, None)
        self._asked.add(peer)
        await self._send(SignalTo(type="signal", token=self.token, peer=peer, body=body))

    def take_signals(self, peer: str) -> list[str]:
        """Every signal from `peer` received and not yet taken, oldest first."""
        pending = self._signals.pop(peer, None)
        return list(pending) if pending else []

    async def next_signal(self, peer: str, timeout: float | None = None) -> str:
        """The next signal from `peer`.

        `RendezvousError` if the rendezvous refused a signal to `peer` (not a member of this
        session) or `peer` left; `RendezvousClosed` when the connection ends; TimeoutError after
        `timeout`. Signals `peer` sent before leaving are still returned first.
        """
        await self._until(
            lambda: bool(self._signals.get(peer)) or peer in self._signal_errors or peer in self.departed, timeout
        )
        pending = self._signals.get(peer)
        if pending:
            body = pending.popleft()
            if not pending:
                del self._signals[peer]
            return body
        refusal = self._signal_errors.pop(peer, None)
        if refusal is not None:
            raise RendezvousError(refusal.code.value, refusal.message, refusal.retry_after_s)
        if self._closed:
            raise RendezvousClosed(ended=self.ended)
        raise RendezvousError("member_left", f"{peer} left the session")

    def relay_address(self, grant: RelayGranted) -> tuple[str, int]:
        """Where to send relay datagrams: the grant's host, or the host this client reached."""
        host = grant.host if grant.host is not None else urlsplit(self.url).hostname
        return (host or "127.0.0.1"), grant.port

    async def ping(self, timeout: float | None = 10.0) -> float:
        """Round-trip time to the rendezvous in seconds (also keeps the connection alive)."""
        nonce = next(self._nonces)
        started = time.monotonic()
        self._pings[nonce] = None
        try:
            await self._send(Ping(type="ping", token=self.token, nonce=nonce))
            await self._until(lambda: self._pings[nonce] is not None, timeout)
            answered = self._pings[nonce]
        finally:
            del self._pings[nonce]
        if answered is None:
            raise RendezvousClosed(ended=self.ended)
        return answered - started

    async def _ping_forever(self, interval: float) -> None:
        with contextlib.suppress(RendezvousClosed):
            while not self._closed:
                await asyncio.sleep(interval)
                await self._send(Ping(type="ping", token=self.token))

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait_closed(self, timeout: float | None = None) -> Ended | None:
        """Until the connection ends; how the session ended, if the rendezvous said."""
        await self._until(lambda: self._closed, timeout)
        return self.ended

    async def remove(self, member: str) -> None:
        """As the host: send `member` away at the rendezvous; its seat is free for another joiner.
        Returns once the rendezvous has said it left (or the connection ended)."""
        self._asked.add(member)
        self._removals_refused.discard(member)
        await self._send(Remove(type="remove", token=self.token, member=member))
        with contextlib.suppress(TimeoutError):
            await self._until(lambda: member in self.departed or member in self._removals_refused, REMOVE_WAIT_S)

    async def renew(self) -> None:
        """As the host: tell the rendezvous the filled session is still wanted (pings do not)."""
        await self._send(Renew(type="renew", token=self.token))

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


# ---------------------------------------------------------------------------------------------
# The trust exchange (`kafila.network.pake`) over signals


class TrustTimeout(TrustError):
    """The other side did not complete its part of the trust exchange in time."""


CLOSED_DRAIN_S = 2.0  # how long a closing connection may take to deliver what it still had


class LeftUnproven(TrustError):
    """A joiner that began the exchange left before proving the code: a possible guess."""

    def __init__(self, message: str, member: str) -> None:
        super().__init__(message, member)
        self.guess = True


def _counted(error: TrustError, exchange: Exchange) -> TrustError:
    """`error`, marked as a possible guess (`TrustError.guess`) where the joiner began the
    exchange (its SPAKE2 message came) and did not prove the code, however it ended: a wrong
    secret, garbage, an abort, silence. The host counts each against its budget
    (`session.core.GUESS_BUDGET`): a guesser learns nothing before proving, and every try costs."""
    error.guess = error.guess or exchange.at_stake
    return error


class ProvenButRefused(TrustError):
    """A newcomer proved the code, then the exchange failed (it refused the member list, or went
    silent): no guess at the secret, so no reason to stop admitting others."""


def _check_session(client: RendezvousClient, code: str, *, host: bool) -> None:
    channel, _ = split_code(code)
    if channel != client.code:
        raise ValueError(f"the code's channel half is {channel}, but this session's is {client.code}")
    if (client.member_id == client.host_id) != host:
        raise ValueError("verify_members is the host's side, verify_host a joiner's")


async def _exchange_until(
    client: RendezvousClient, exchange: Exchange, done: Callable[[], bool], timeout: float | None, late: str
) -> None:
    """Answer the peer's trust messages until `done()`; TrustTimeout ("`late` within N s") after `timeout`."""
    peer = exchange.peer_id
    try:
        async with asyncio.timeout(timeout):
            while not done():
                for reply in exchange.receive(await client.next_signal(peer)):
                    await client.send_signal(peer, reply)
    except TimeoutError:
        raise TrustTimeout(f"{late} within {timeout} s", peer) from None


async def send_abort(client: RendezvousClient, peers: Sequence[str], error: TrustError) -> None:
    """Best effort: tell each peer why, so it does not wait for a timeout."""
    body = abort_message(error)
    for peer in peers:
        with contextlib.suppress(RendezvousError, ValidationError):
            await client.send_signal(peer, body)


async def verify_host(
    client: RendezvousClient,
    code: str,
    fingerprint: str,
    *,
    exchange_timeout: float = 30.0,
    ready_timeout: float | None = None,
) -> dict[str, str]:
    """A joiner's side: prove the full `code` with the host, then take the host's roster.

    Returns member id → certificate fingerprint for every member, checked against what the
    rendezvous reported. `fingerprint` is this member's own. The host must confirm within
    `exchange_timeout`; the roster comes once the session is full, within `ready_timeout`
    (None: as long as the session lives). Raises a `TrustError` (the host is told why), or
    `RendezvousError` / `RendezvousClosed` if the session itself fails.
    """
    _check_session(client, code, host=False)
    host_id = client.host_id
    host = client.members.get(host_id)
    if host is None:
        error = RosterMismatch(f"the rendezvous did not introduce the host ({host_id}) to this member", host_id)
        await send_abort(client, [host_id], error)
        raise error
    exchange = Exchange(
        Role.JOINER,
        code,
        host_id=host_id,
        joiner_id=client.member_id,
        own_fingerprint=normalize_fingerprint(fingerprint),
        peer_fingerprint=host.fingerprint,
    )

    async def drive(done: Callable[[], bool], timeout: float | None, what: str) -> None:
        await _exchange_until(client, exchange, done, timeout, f"the host ({host_id}) did not {what}")

    try:
        await client.send_signal(host_id, exchange.start())
        await drive(lambda: exchange.confirmed, exchange_timeout, "prove the session code")
        await drive(lambda: exchange.roster is not None, ready_timeout, "send the verified member list")
        try:
            await client.wait_ready(exchange_timeout)
        except TimeoutError:
            raise TrustTimeout("the rendezvous sent the host's roster but never said the session is ready") from None
        assert exchange.roster is not None
        roster = check_roster(  # against the members as they are now: a seat may have changed hands since `ready`
            exchange.roster,
            {m.member_id: m.fingerprint for m in client.members.values()},
            host_id=host_id,
            host_fingerprint=exchange.peer_fingerprint,
            self_id=client.member_id,
            self_fingerprint=exchange.own_fingerprint,
        )
        await client.send_signal(host_id, exchange.accept())
        return roster
    except TrustError as error:
        if not isinstance(error, PeerRefused):  # the host already knows
            await send_abort(client, [host_id], error)
        raise
    except RendezvousClosed:
        # A host that turns a joiner away tells it why, then frees its seat, which closes this
        # connection: perhaps before this side's first message went out. Its reason is then a
        # signal already here, read once the connection has delivered all it had.
        with contextlib.suppress(TimeoutError):
            await client.wait_closed(CLOSED_DRAIN_S)
        for body in client.take_signals(host_id):
            exchange.receive(body)  # the host's abort raises PeerRefused, saying why
        raise


async def verify_members(
    client: RendezvousClient,
    code: str,
    fingerprint: str,
    *,
    exchange_timeout: float = 30.0,
    ready_timeout: float | None = None,
    refused: Callable[[str, TrustError], None] = lambda _member, _error: None,
) -> dict[str, str]:
    """The host's side: prove the full `code` to each joiner as it arrives and check its fingerprint;
    once as many joiners as the session expects have proved it, send each the roster, and return
    it once every one of them has accepted it.

    Each joiner must confirm within `exchange_timeout` of being introduced, and accept the roster
    within `exchange_timeout` of its sending; the session must fill within `ready_timeout` (None:
    as long as it lives). A joiner that fails its part (a wrong code, garbage, silence, an abort,
    a fingerprint other than the rendezvous reported) is told why, removed at the rendezvous so
    that its seat is free again, and reported to `refused`; the session goes on forming with the
    same code. `refused` may raise to end the forming: an error marked `guess` (a joiner began the
    exchange and did not prove the code, however it ended, leaving included) may be a guess at
    the secret, which the caller counts against its budget (`session.core.GUESS_BUDGET`). A
    joiner that leaves is forgotten, its seat free (reported to `refused` first if it left with a
    guess at stake); one that leaves after the roster went is left out of what is returned, and
    one that joins after it is left for the host to admit as a newcomer.
    """
    _check_session(client, code, host=True)
    own = normalize_fingerprint(fingerprint)
    loop = asyncio.get_running_loop()
    give_up = None if ready_timeout is None else loop.time() + ready_timeout
    exchanges: dict[str, Exchange] = {}
    deadlines: dict[str, float] = {}
    roster: dict[str, str] | None = None  # once sent

    async def drop(member_id: str, error: TrustError) -> None:
        exchange = exchanges.pop(member_id, None)
        deadlines.pop(member_id, None)
        if exchange is not None:
            error = _counted(error, exchange)
        if not isinstance(error, PeerRefused):  # it told us; otherwise it hears why
            await send_abort(client, [member_id], error)
        try:
            refused(member_id, error)  # while the rendezvous still lists it, by name
        finally:
            with contextlib.suppress(RendezvousError):
                await client.remove(member_id)

    try:
        while True:
            seen = client._changes
            if roster is None:
                for member_id, info in list(client.members.items()):
                    if member_id == client.member_id or member_id in exchanges:
                        continue
                    exchange = Exchange(
                        Role.HOST,
                        code,
                        host_id=client.member_id,
                        joiner_id=member_id,
                        own_fingerprint=own,
                        peer_fingerprint=info.fingerprint,
                    )
                    exchanges[member_id] = exchange
                    deadlines[member_id] = loop.time() + exchange_timeout
                    await client.send_signal(member_id, exchange.start())
            for member_id, exchange in list(exchanges.items()):
                if member_id not in client.members:  # it left: its seat is free again
                    exchanges.pop(member_id)
                    deadlines.pop(member_id, None)
                    if exchange.at_stake:  # it left with a guess at stake
                        refused(member_id, LeftUnproven(f"member {member_id} left before proving the code", member_id))
                    continue
                try:
                    for body in client.take_signals(member_id):
                        for reply in exchange.receive(body):
                            await client.send_signal(member_id, reply)
                    refusal = client._signal_errors.pop(member_id, None)
                    if refusal is not None and member_id in client.members:  # one that left is told by member_left
                        raise TrustError(
                            f"the rendezvous introduced member {member_id} but will not carry messages to it "
                            f"({refusal.message}), so it cannot prove the session code: refused",
                            member_id,
                        )
                except TrustError as error:
                    await drop(member_id, error)
                    continue
                if exchange.accepted if roster is not None else exchange.confirmed:
                    deadlines.pop(member_id, None)
            if client.closed:
                raise RendezvousClosed(ended=client.ended)
            joiners = list(exchanges)
            if roster is None:
                full = client.ready is not None and len(joiners) >= client.expected_members - 1
                if full and all(exchanges[m].confirmed for m in joiners):
                    roster = {client.member_id: own} | {m: exchanges[m].peer_fingerprint for m in joiners}
                    for member_id in joiners:
                        await client.send_signal(member_id, exchanges[member_id].seal_roster(roster))
                        deadlines[member_id] = loop.time() + exchange_timeout
                    continue  # acceptances may already be here
            elif all(exchanges[m].accepted for m in joiners):
                return {client.member_id: own} | {m: roster[m] for m in joiners}
            now = loop.time()
            for member_id in sorted(m for m, deadline in deadlines.items() if deadline <= now):
                what = "accept the member list" if roster is not None else "prove the session code"
                await drop(member_id, TrustTimeout(f"member {member_id} did not {what} within {exchange_timeout} s"))
            if roster is None and give_up is not None and now >= give_up:
                raise TrustTimeout(f"the session did not fill within {ready_timeout} s")
            wake = min([*deadlines.values(), *([give_up] if give_up is not None else [])], default=None)
            with contextlib.suppress(TimeoutError):
                await client._wait_change(seen, None if wake is None else max(0.0, wake - now))
    except TrustError as error:
        await send_abort(client, list(exchanges), error)
        raise


async def verify_newcomer(
    client: RendezvousClient,
    code: str,
    fingerprint: str,
    member_id: str,
    trusted: Mapping[str, str],
    *,
    exchange_timeout: float = 30.0,
) -> str:
    """The host's side for a member that takes a seat another left while the session runs: the
    exchange of `verify_members` with this one joiner, whose roster lists the host, the members
    verified earlier (`trusted`, id → fingerprint) that the rendezvous still lists, and itself.

    Returns the fingerprint the newcomer proved. Raises a `TrustError` (the newcomer is told
    why): `ProvenButRefused` once it had proved the code; one marked `guess` once it had begun
    the exchange and did not prove it, however that ended (leaving included): a possible guess at
    the secret, which the caller counts against its budget (`session.core.GUESS_BUDGET`).
    `RendezvousError` if the newcomer leaves before it began.
    """
    _check_session(client, code, host=True)
    info = client.members.get(member_id)
    if info is None:
        raise RendezvousError("member_left", f"{member_id} left before the trust exchange began")
    exchange = Exchange(
        Role.HOST,
        code,
        host_id=client.member_id,
        joiner_id=member_id,
        own_fingerprint=normalize_fingerprint(fingerprint),
        peer_fingerprint=info.fingerprint,
    )

    async def drive(done: Callable[[], bool], what: str) -> None:
        await _exchange_until(client, exchange, done, exchange_timeout, f"member {member_id} did not {what}")

    try:
        await client.send_signal(member_id, exchange.start())
        await drive(lambda: exchange.confirmed, "prove the session code")
        here = {m: trusted[m] for m in client.members if m in trusted and m not in (client.member_id, member_id)}
        roster = {client.member_id: exchange.own_fingerprint, **here, member_id: exchange.peer_fingerprint}
        await client.send_signal(member_id, exchange.seal_roster(roster))
        await drive(lambda: exchange.accepted, "accept the member list")
        return exchange.peer_fingerprint
    except TrustError as error:
        if not isinstance(error, PeerRefused):  # the newcomer already knows
            await send_abort(client, [member_id], error)
        if exchange.confirmed:
            raise ProvenButRefused(str(error), member_id) from error
        raise _counted(error, exchange) from error
    except RendezvousError as error:  # it left mid-exchange
        if exchange.at_stake:
            raise LeftUnproven(f"member {member_id} left before proving the code: {error}", member_id) from error
        raise
