"""Rendezvous signalling: session codes, introductions, relay bookkeeping. Sans-IO.

A host opens a session and gets a code to read out; members join with it. The rendezvous
introduces them (capability, candidate addresses, key fingerprint), tells everyone when the
expected count is reached (and admits a newcomer to a seat a member has left), and forwards
opaque `signal`s between members of a session (the trust exchange of `kafila.network.pake`,
which keeps members from having to believe the fingerprints it reports). It never sees the
session's data, which flows member to member over QUIC, or through the relay as ciphertext.

`Rendezvous` does no I/O and reads no clock: the shell hands it connection events, raw message
text and the current time, and carries out the `Output`s it returns (send, close, open or free
a relay port). Every refusal is an `error` message, never an exception: the shell cannot be
crashed by what a client sends.

Authentication is per connection: `open` or `join` binds a connection to one member of one
session, and every later message must also carry that member's token. A connection therefore
can only ever speak for its own member, in its own session.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from kafila.contracts import MAX_MEMBERS, FleetDevice
from kafila.network.events import emit
from kafila.network.limits import RateByAddress, RecentByAddress, TokenBucket, network_group
from kafila.network.relay import TOKEN_BYTES
from kafila.network.session_codes import new_code, normalise_code
from kafila.untrusted import check_name

PROTOCOL_VERSION = 1
MAX_CANDIDATES = 8
MAX_ERROR_MESSAGE = 1000  # characters of a refusal's explanation kept
MAX_SIGNAL_BODY = 4096  # characters (printable ASCII, so bytes too) in a member-to-member signal
log = logging.getLogger("kafila.rendezvous")

ConnId = int


# ---------------------------------------------------------------------------------------------
# Wire types


class Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


def _candidate(text: str) -> str:
    host, separator, port = text.rpartition(":")
    if not separator or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("a candidate is IP:PORT with a port from 1 to 65535")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError("a candidate's host must be an IPv4 or a bracketed IPv6 address") from None
    if (ip.version == 6) != bracketed:
        raise ValueError("a candidate's host must be an IPv4 or a bracketed IPv6 address")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def _unique(values: list[str]) -> list[str]:
    if len(set(values)) != len(values):
        raise ValueError("candidates must not repeat")
    return values


Candidate = Annotated[str, Field(min_length=3, max_length=64), AfterValidator(_candidate)]
Candidates = Annotated[list[Candidate], Field(max_length=MAX_CANDIDATES), AfterValidator(_unique)]
Fingerprint = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$"), AfterValidator(str.lower)]
MemberId = Annotated[str, Field(pattern=r"^m[1-9][0-9]{0,3}$")]
MemberToken = Annotated[str, Field(min_length=16, max_length=128)]
ModelId = Annotated[str, Field(min_length=1, max_length=256)]
MemberCount = Annotated[int, Field(ge=2, le=MAX_MEMBERS)]
Nonce = Annotated[int, Field(ge=0, le=2**53)]
# Opaque to the rendezvous; printable ASCII, so its size in bytes is its length and logs stay clean.
SignalBody = Annotated[str, Field(min_length=1, max_length=MAX_SIGNAL_BODY, pattern=r"^[\x20-\x7e]*$")]


# client → rendezvous


class OpenSession(Wire):
    """A host opens a session for a model and says how many members, itself included, to expect."""

    type: Literal["open"]
    version: Literal[1] = 1
    model: ModelId
    expected_members: MemberCount
    capability: FleetDevice
    candidates: Candidates
    fingerprint: Fingerprint
    open_token: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # a public rendezvous's own


class JoinSession(Wire):
    type: Literal["join"]
    version: Literal[1] = 1
    code: Annotated[str, Field(min_length=1, max_length=64)]
    capability: FleetDevice
    candidates: Candidates
    fingerprint: Fingerprint


class RelayRequest(Wire):
    """Ask for a relay to `peer`; it is granted once `peer` has asked for one to this member too."""

    type: Literal["relay_request"]
    token: MemberToken
    peer: MemberId


class SignalTo(Wire):
    """An opaque message for another member of this session (the trust exchange runs over these)."""

    type: Literal["signal"]
    token: MemberToken
    peer: MemberId
    body: SignalBody


class Ping(Wire):
    type: Literal["ping"]
    token: MemberToken
    nonce: Nonce | None = None


class Leave(Wire):
    type: Literal["leave"]
    token: MemberToken


class Renew(Wire):
    """The host says its filled session is still wanted (for rejoins), though nothing else moves."""

    type: Literal["renew"]
    token: MemberToken


class Remove(Wire):
    """The host sends a member away (it failed the code's proof, or its part): its seat is free."""

    type: Literal["remove"]
    token: MemberToken
    member: MemberId


ClientMessage = Annotated[
    OpenSession | JoinSession | RelayRequest | SignalTo | Ping | Leave | Remove | Renew, Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[ClientMessage] = TypeAdapter(ClientMessage)


# rendezvous → client


class MemberInfo(Wire):
    """What every member learns of every other: enough to plan the ring and to dial and pin it."""

    member_id: MemberId
    name: Annotated[str, Field(min_length=1, max_length=80), AfterValidator(check_name)]  # the device's, made unique
    host: bool
    capability: FleetDevice
    candidates: Candidates
    fingerprint: Fingerprint


class Opened(Wire):
    type: Literal["opened"] = "opened"
    code: Annotated[str, Field(max_length=64)]
    member_id: MemberId
    token: MemberToken
    model: ModelId
    expected_members: MemberCount
    expires_in_s: float
    idle_expiry_s: float | None = None  # once filled, it ends after this long with nothing but pings


class Joined(Wire):
    type: Literal["joined"] = "joined"
    code: Annotated[str, Field(max_length=64)]
    member_id: MemberId
    token: MemberToken
    model: ModelId
    expected_members: MemberCount
    host: MemberId
    members: Annotated[list[MemberInfo], Field(max_length=MAX_MEMBERS)]  # everyone now in it, this member included


class MemberJoined(Wire):
    type: Literal["member_joined"] = "member_joined"
    member: MemberInfo
    count: int
    expected_members: MemberCount


class Ready(Wire):
    """Sent once to every member when the expected count is reached: the member list. A member
    that later takes a seat another left gets its own, listing who is in the session then."""

    type: Literal["ready"] = "ready"
    host: MemberId
    members: Annotated[list[MemberInfo], Field(max_length=MAX_MEMBERS)]


class LeaveReason(StrEnum):
    LEFT = "left"
    REMOVED = "removed"  # by the host
    DISCONNECTED = "disconnected"
    TIMED_OUT = "timed_out"
    PROTOCOL_ERROR = "protocol_error"


class MemberLeft(Wire):
    """A member is gone; any relay it shared with others is freed."""

    type: Literal["member_left"] = "member_left"
    member_id: MemberId
    reason: LeaveReason


class RelayGranted(Wire):
    """`host` None means the address this member reached the rendezvous on."""

    type: Literal["relay_granted"] = "relay_granted"
    relay_id: Annotated[str, Field(max_length=64)]
    peer: MemberId
    host: Annotated[str, Field(max_length=255)] | None
    port: Annotated[int, Field(ge=1, le=65535)]
    relay_token: Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * TOKEN_BYTES}}}$")]


class SignalFrom(Wire):
    """A `signal` from `peer`, forwarded verbatim: the rendezvous vouches only for who sent it."""

    type: Literal["signal"] = "signal"
    peer: MemberId
    body: SignalBody


class EndReason(StrEnum):
    HOST_LEFT = "host_left"
    EXPIRED = "expired"
    LIFETIME = "lifetime"
    IDLE = "idle"
    SHUTDOWN = "shutdown"


class Ended(Wire):
    type: Literal["ended"] = "ended"
    reason: EndReason


class ErrorCode(StrEnum):
    MALFORMED = "malformed"
    INVALID_MESSAGE = "invalid_message"
    TOO_LARGE = "too_large"
    TOO_MANY_MESSAGES = "too_many_messages"
    UNKNOWN_CODE = "unknown_code"
    CODE_EXPIRED = "code_expired"
    SESSION_FULL = "session_full"
    SESSION_ENDED = "session_ended"
    RATE_LIMITED = "rate_limited"
    TOO_MANY_SESSIONS = "too_many_sessions"
    SERVER_BUSY = "server_busy"
    NAME_TAKEN = "name_taken"
    ALREADY_JOINED = "already_joined"
    NOT_JOINED = "not_joined"
    BAD_TOKEN = "bad_token"
    OPEN_TOKEN = "open_token"
    NOT_READY = "not_ready"
    UNKNOWN_PEER = "unknown_peer"
    NOT_HOST = "not_host"
    RELAY_LIMIT = "relay_limit"
    RELAY_FAILED = "relay_failed"


class Error(Wire):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: Annotated[str, BeforeValidator(lambda text: text[:MAX_ERROR_MESSAGE] if isinstance(text, str) else text)]
    request: Annotated[str, Field(max_length=64)] | None = None  # the type of the message refused, when readable
    peer: MemberId | None = None  # for relay errors: the edge's other member
    retry_after_s: int | None = None


class Pong(Wire):
    type: Literal["pong"] = "pong"
    nonce: Nonce | None = None


ServerMessage = Annotated[
    Opened | Joined | MemberJoined | Ready | MemberLeft | RelayGranted | SignalFrom | Ended | Error | Pong,
    Field(discriminator="type"),
]
SERVER_MESSAGE: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


class SignalError(Exception):
    """A refusal, turned into an `error` message; `strike` marks misbehaviour, not bad luck."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        strike: bool = False,
        retry_after_s: int | None = None,
        peer: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.strike = code, message, strike
        self.retry_after_s, self.peer = retry_after_s, peer
        self.request: str | None = None

    def as_message(self) -> Error:
        return Error(
            code=self.code, message=self.message, request=self.request, peer=self.peer, retry_after_s=self.retry_after_s
        )


def _summary(error: ValidationError) -> str:
    """Where and what, never the input (which may hold a token)."""
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'message'}: {e['msg']}" for e in error.errors()[:3]]
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_client_message(data: str | bytes, max_bytes: int) -> ClientMessage:
    """One client message from a WebSocket text frame; `SignalError` for anything else."""
    if isinstance(data, bytes | bytearray | memoryview):
        raise SignalError(ErrorCode.MALFORMED, "send JSON in text frames, not binary", strike=True)
    if len(data) > max_bytes or len(data.encode("utf-8", "surrogatepass")) > max_bytes:
        raise SignalError(ErrorCode.TOO_LARGE, f"a message is at most {max_bytes} bytes", strike=True)
    try:
        return CLIENT_MESSAGE.validate_json(data)
    except ValidationError as error:
        if any(e["type"] == "json_invalid" for e in error.errors()):
            raise SignalError(ErrorCode.MALFORMED, "not valid JSON", strike=True) from None
        raise SignalError(ErrorCode.INVALID_MESSAGE, _summary(error), strike=True) from None
    except (ValueError, TypeError, UnicodeError, RecursionError):
        raise SignalError(ErrorCode.MALFORMED, "not valid JSON", strike=True) from None


def encode(message: Wire) -> str:
    return message.model_dump_json()


# ---------------------------------------------------------------------------------------------
# What the shell must do


@dataclass(frozen=True)
class Send:
    conn: ConnId
    message: Wire


@dataclass(frozen=True)
class Close:
    """Close the connection after sending what is queued for it; the core has already forgotten it."""

    conn: ConnId
    code: int
    reason: str


@dataclass(frozen=True)
class OpenRelay:
    """Bind a UDP port for this allocation, then call `relay_opened` (or `relay_failed`)."""

    relay_id: str
    session_id: str
    tokens: tuple[bytes, bytes]


@dataclass(frozen=True)
class FreeRelay:
    relay_id: str


Output = Send | Close | OpenRelay | FreeRelay

CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_TRY_LATER = 1000, 1001, 1008, 1013


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 1000
    max_sessions_per_ip: int = 20
    max_members: int = MAX_MEMBERS
    max_message_bytes: int = 16 * 1024
    max_connections: int = 4096
    max_connections_per_ip: int = 64
    # One network (an IPv6 /56, an IPv4 /24) holds at most this many connections and sessions
    # (None: an eighth of all, or the per-address cap if higher), so that the many addresses of
    # one network cannot fill the whole rendezvous.
    max_connections_per_network: int | None = None
    max_sessions_per_network: int | None = None
    code_ttl_s: float = 600.0  # a session that fills no further for this long expires
    session_lifetime_s: float = 24 * 3600.0
    session_idle_s: float = 3600.0  # a filled session with no join, signal, relay traffic or renew ends
    idle_timeout_s: float = 120.0  # without any message from a member; pings count
    hello_timeout_s: float = 30.0  # from connecting to `open` or `join`
    join_failures: int = 10  # failed joins per source address per window
    join_failure_window_s: float = 60.0
    # A seat held and not kept: removed by the host, or left within `short_hold_s` of joining.
    # An address that did so this many times in one session in the window is refused joins to that
    # session until it falls out (other sessions, a crashed member's own among them, are not its).
    short_hold_s: float = 120.0
    short_holds: int = 3
    short_hold_window_s: float = 600.0
    opens_per_hour: float = 60.0  # per address, sustained, with a burst of `open_burst`
    open_burst: float = 30.0
    relays_per_member: int = 2  # a session may hold this many × its expected members relays
    max_relays: int = 2000
    max_strikes: int = 5  # bad messages before a connection is closed
    message_rate: float = 20.0  # messages a second per connection, sustained
    message_burst: float = 40.0
    tombstone_s: float = 3600.0  # how long an ended code is remembered, to say why it fails
    max_tombstones: int = 10_000
    max_tracked_ips: int = 65_536

    @property
    def connections_per_network(self) -> int:
        return self.max_connections_per_network or max(self.max_connections_per_ip, self.max_connections // 8)

    @property
    def sessions_per_network(self) -> int:
        return self.max_sessions_per_network or max(self.max_sessions_per_ip, self.max_sessions // 8)


@dataclass
class _Connection:
    conn: ConnId
    ip: str
    connected_at: float
    last_seen: float
    bucket: TokenBucket
    strikes: int = 0
    session_id: str | None = None
    member_id: str | None = None
    own_machine: bool = False  # from the machine the rendezvous runs on


@dataclass
class _Member:
    member_id: str
    token: str
    conn: ConnId
    info: MemberInfo
    joined_at: float


@dataclass
class _RelayEdge:
    relay_id: str
    session_id: str
    members: tuple[str, str]
    tokens: tuple[bytes, bytes]
    port: int | None = None


@dataclass
class _Session:
    session_id: str
    code: str
    model: str
    expected: int
    host_id: str
    ip: str
    opened_at: float
    code_deadline: float
    active_at: float  # the last join, signal, relay request or traffic, or the host's renew
    members: dict[str, _Member] = field(default_factory=dict)
    next_index: int = 1
    ready: bool = False
    relay_wants: set[tuple[str, str]] = field(default_factory=set)
    relays: dict[frozenset[str], str] = field(default_factory=dict)  # edge → relay id


def _seat_holder(session: _Session, connection: _Connection) -> str:
    """Who a seat not kept is counted against: an address, in one session."""
    return f"{session.session_id} {connection.ip}"


class Rendezvous:
    """All sessions of one rendezvous. Call `connect`, `receive`, `disconnect`, `tick`."""

    def __init__(
        self,
        limits: Limits | None = None,
        rng: random.Random | None = None,
        relay_host: str | None = None,
        open_token: str | None = None,
    ) -> None:
        """`open_token`: when set, only an `open` that gives it starts a session (a public
        rendezvous limiting who may use it); joining needs only a code."""
        self.limits = limits or Limits()
        self.open_token = open_token
        self.rng = rng if rng is not None else random.SystemRandom()
        self.relay_host = relay_host
        self.sessions: dict[str, _Session] = {}
        self.by_code: dict[str, str] = {}
        self.tombstones: dict[str, tuple[ErrorCode, float]] = {}
        self.connections: dict[ConnId, _Connection] = {}
        self.failures = RecentByAddress(self.limits.join_failure_window_s, self.limits.max_tracked_ips)
        self.short_holds = RecentByAddress(self.limits.short_hold_window_s, self.limits.max_tracked_ips)
        limits = self.limits
        self.opens = RateByAddress(limits.opens_per_hour / 3600, limits.open_burst, limits.max_tracked_ips)
        self.relays: dict[str, _RelayEdge] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=1024)
        self._per_ip: dict[str, int] = {}
        self._per_network: dict[str, int] = {}

    def holds(self, channel: str) -> bool:
        """Whether a live session has this channel: what LAN discovery may answer for. Read-only."""
        return normalise_code(channel) in self.by_code

    # -- connections ---------------------------------------------------------------------------

    def connect(self, conn: ConnId, ip: str, now: float, own_machine: bool = False) -> list[Output]:
        """A connection from `ip` (an address group); `own_machine`: from the machine this runs on."""
        if conn in self.connections:
            raise ValueError(f"connection {conn} is already open")
        same_ip, network = self._per_ip.get(ip, 0), network_group(ip)
        same_network = self._per_network.get(network, 0)
        if (
            len(self.connections) >= self.limits.max_connections
            or same_ip >= self.limits.max_connections_per_ip
            or same_network >= self.limits.connections_per_network
        ):
            self._event("connection_refused", ip=ip, connections=len(self.connections))
            busy = Error(code=ErrorCode.SERVER_BUSY, message="the rendezvous has too many connections; retry later")
            return [Send(conn, busy), Close(conn, CLOSE_TRY_LATER, "server busy")]
        bucket = TokenBucket(self.limits.message_rate, self.limits.message_burst)
        self.connections[conn] = _Connection(conn, ip, now, now, bucket, own_machine=own_machine)
        self._per_ip[ip] = same_ip + 1
        self._per_network[network] = same_network + 1
        return []

    def receive(self, conn: ConnId, data: str | bytes, now: float) -> list[Output]:
        """One frame from a connection. Never raises: every refusal is an `error` message."""
        connection = self.connections.get(conn)
        if connection is None:
            return []
        connection.last_seen = now
        request: str | None = None
        try:
            if not connection.bucket.take(1, now):
                raise SignalError(ErrorCode.TOO_MANY_MESSAGES, "slow down: too many messages", strike=True)
            message = parse_client_message(data, self.limits.max_message_bytes)
            request = message.type
            return self._handle(connection, message, now)
        except SignalError as refusal:
            refusal.request = request
            return self._refuse(connection, refusal, now)

    def disconnect(self, conn: ConnId, now: float) -> list[Output]:
        """The connection closed under us (or the shell closed it): its member leaves."""
        connection = self.connections.get(conn)
        if connection is None:
            return []
        return self._drop(connection, LeaveReason.DISCONNECTED, None, now)

    def tick(self, now: float) -> list[Output]:
        """Expire what is due: idle connections, unfilled codes, old or idle sessions, old rate-limit
        records. Pings keep a connection, not a session: a filled session must show a join, a
        signal, relay traffic or its host's renew."""
        outputs: list[Output] = []
        for connection in list(self.connections.values()):
            if connection.conn not in self.connections:
                continue
            if connection.member_id is None and now - connection.connected_at >= self.limits.hello_timeout_s:
                self._event("connection_timed_out", conn=connection.conn, ip=connection.ip, joined=False)
                outputs += self._drop(
                    connection, LeaveReason.TIMED_OUT, (CLOSE_GOING_AWAY, "no open or join in time"), now
                )
            elif connection.member_id is not None and now - connection.last_seen >= self.limits.idle_timeout_s:
                outputs += self._drop(connection, LeaveReason.TIMED_OUT, (CLOSE_GOING_AWAY, "idle"), now)
        for session in list(self.sessions.values()):
            if session.session_id not in self.sessions:
                continue
            if not session.ready and now >= session.code_deadline:
                outputs += self._end(session, EndReason.EXPIRED, now)
            elif now - session.opened_at >= self.limits.session_lifetime_s:
                outputs += self._end(session, EndReason.LIFETIME, now)
            elif session.ready and now - session.active_at >= self.limits.session_idle_s:
                outputs += self._end(session, EndReason.IDLE, now)
        self.failures.expire(now)
        self.short_holds.expire(now)
        for code in [c for c, (_, until) in self.tombstones.items() if until <= now]:
            del self.tombstones[code]
        return outputs

    def shutdown(self, now: float) -> list[Output]:
        """End every session and close every connection."""
        outputs: list[Output] = []
        for session in list(self.sessions.values()):
            outputs += self._end(session, EndReason.SHUTDOWN, now)
        for connection in list(self.connections.values()):
            outputs += self._drop(
                connection, LeaveReason.DISCONNECTED, (CLOSE_GOING_AWAY, "rendezvous shutting down"), now
            )
        return outputs

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self.sessions), "connections": len(self.connections), "relays": len(self.relays)}

    # -- relay callbacks -------------------------------------------------------------------------

    def relay_opened(self, relay_id: str, port: int, now: float) -> list[Output]:
        """The shell bound `port` for an `OpenRelay`: grant it to both members of the edge."""
        edge = self.relays.get(relay_id)
        if edge is None:  # the session or a member went while the port was being bound
            return [FreeRelay(relay_id)]
        edge.port = port
        session = self.sessions[edge.session_id]
        self._event("relay_granted", session=edge.session_id, relay=relay_id, members=list(edge.members), port=port)
        return [
            Send(session.members[member].conn, self._grant(edge, side))
            for side, member in enumerate(edge.members)
            if member in session.members
        ]

    def relay_used(self, relay_id: str, now: float) -> None:
        """The shell saw `relay_id` forward traffic since its last report: its session is active."""
        edge = self.relays.get(relay_id)
        if edge is not None and edge.session_id in self.sessions:
            self.sessions[edge.session_id].active_at = now

    def relay_failed(self, relay_id: str, now: float) -> list[Output]:
        edge = self.relays.pop(relay_id, None)
        if edge is None:
            return []
        session = self.sessions[edge.session_id]
        session.relays.pop(frozenset(edge.members), None)
        self._event("relay_failed", session=edge.session_id, relay=relay_id)
        outputs: list[Output] = []
        for side, member in enumerate(edge.members):
            if member in session.members:
                refusal = Error(
                    code=ErrorCode.RELAY_FAILED,
                    message="the rendezvous could not open a relay port; try again",
                    request="relay_request",
                    peer=edge.members[1 - side],
                )
                outputs.append(Send(session.members[member].conn, refusal))
        return outputs

    # -- messages ---------------------------------------------------------------------------------

    def _handle(self, connection: _Connection, message: ClientMessage, now: float) -> list[Output]:
        if isinstance(message, OpenSession):
            return self._open(connection, message, now)
        if isinstance(message, JoinSession):
            return self._join(connection, message, now)
        session, member = self._authenticate(connection, message.token)
        if isinstance(message, Ping):
            return [Send(connection.conn, Pong(nonce=message.nonce))]
        if isinstance(message, Leave):
            return self._drop(connection, LeaveReason.LEFT, (CLOSE_NORMAL, "left"), now)
        if isinstance(message, Remove):
            return self._remove(session, member, message.member, now)
        if isinstance(message, Renew):
            return self._renew(session, member, now)
        session.active_at = now
        if isinstance(message, SignalTo):
            return self._signal(session, member, message)
        return self._relay_request(session, member, message.peer, now)

    def _authenticate(self, connection: _Connection, token: str) -> tuple[_Session, _Member]:
        if connection.member_id is None or connection.session_id is None:
            raise SignalError(ErrorCode.NOT_JOINED, "open or join a session first", strike=True)
        session = self.sessions[connection.session_id]
        member = session.members[connection.member_id]
        if not hmac.compare_digest(token.encode(), member.token.encode()):
            raise SignalError(ErrorCode.BAD_TOKEN, "this token is not this connection's member token", strike=True)
        return session, member

    def _open(self, connection: _Connection, message: OpenSession, now: float) -> list[Output]:
        if connection.member_id is not None:
            raise SignalError(ErrorCode.ALREADY_JOINED, "this connection is already in a session", strike=True)
        if self.open_token is not None and not hmac.compare_digest(
            (message.open_token or "").encode(), self.open_token.encode()
        ):
            raise SignalError(
                ErrorCode.OPEN_TOKEN,
                "this rendezvous opens sessions only with its open token: ask its operator, and pass it with "
                "--open-token",
                strike=True,
            )
        if message.expected_members > self.limits.max_members:
            raise SignalError(
                ErrorCode.INVALID_MESSAGE, f"a session has at most {self.limits.max_members} members", strike=True
            )
        if len(self.sessions) >= self.limits.max_sessions:
            raise SignalError(ErrorCode.TOO_MANY_SESSIONS, "the rendezvous is full; retry later", retry_after_s=60)
        if sum(1 for s in self.sessions.values() if s.ip == connection.ip) >= self.limits.max_sessions_per_ip:
            raise SignalError(ErrorCode.TOO_MANY_SESSIONS, "too many open sessions from this address; close one first")
        network = network_group(connection.ip)
        if sum(1 for s in self.sessions.values() if network_group(s.ip) == network) >= self.limits.sessions_per_network:
            raise SignalError(ErrorCode.TOO_MANY_SESSIONS, "too many open sessions from this network; close one first")
        if not self.opens.allow(connection.ip, now):
            wait = math.ceil(3600 / self.limits.opens_per_hour)
            self._event("open_rate_limited", ip=connection.ip, retry_after_s=wait)
            why = f"too many sessions opened from this address, retry in {wait} s"
            raise SignalError(ErrorCode.RATE_LIMITED, why, retry_after_s=wait)
        code = self._fresh_code()
        session_id = self._fresh_id("s-", self.sessions)
        session = _Session(
            session_id=session_id,
            code=code,
            model=message.model,
            expected=message.expected_members,
            host_id="m1",
            ip=connection.ip,
            opened_at=now,
            code_deadline=now + self.limits.code_ttl_s,
            active_at=now,
        )
        self.sessions[session_id] = session
        self.by_code[code] = session_id
        member = self._add_member(session, connection, message, now)
        self._event(
            "session_opened", session=session_id, member=member.member_id, ip=connection.ip, expected=session.expected
        )
        opened = Opened(
            code=code,
            member_id=member.member_id,
            token=member.token,
            model=session.model,
            expected_members=session.expected,
            expires_in_s=self.limits.code_ttl_s,
            idle_expiry_s=self.limits.session_idle_s,
        )
        return [Send(connection.conn, opened)]

    def _join(self, connection: _Connection, message: JoinSession, now: float) -> list[Output]:
        if connection.member_id is not None:
            raise SignalError(ErrorCode.ALREADY_JOINED, "this connection is already in a session", strike=True)
        wait_s = self.failures.wait_s(connection.ip, now, self.limits.join_failures)
        if wait_s > 0:
            wait = max(1, math.ceil(wait_s))
            self._event("join_rate_limited", ip=connection.ip, retry_after_s=wait)
            raise SignalError(ErrorCode.RATE_LIMITED, f"too many attempts, retry in {wait} s", retry_after_s=wait)
        code = normalise_code(message.code)
        session_id = self.by_code.get(code)
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None and not session.ready and now >= session.code_deadline:
            ended = self._end(session, EndReason.EXPIRED, now)
            refusal = self._join_failed(connection, code, now)
            refusal.request = "join"
            return ended + self._refuse(connection, refusal, now)
        if session is None:
            raise self._join_failed(connection, code, now)
        wait_s = self.short_holds.wait_s(_seat_holder(session, connection), now, self.limits.short_holds)
        if wait_s > 0:
            wait = max(1, math.ceil(wait_s))
            self._event("join_rate_limited", ip=connection.ip, retry_after_s=wait, reason="short_holds")
            raise SignalError(
                ErrorCode.RATE_LIMITED,
                f"this address took {self.limits.short_holds} seats of this session it did not keep in the "
                f"last {self.limits.short_hold_window_s / 60:.0f} minutes; retry in {wait} s",
                retry_after_s=wait,
            )
        if len(session.members) >= session.expected:
            self._record_failure(connection.ip, now, "session_full", session.session_id)
            raise SignalError(ErrorCode.SESSION_FULL, f"session {code} is full: its code admits no more members")
        if any(m.info.name == message.capability.name for m in session.members.values()):
            raise SignalError(
                ErrorCode.NAME_TAKEN,
                f"a member named {message.capability.name!r} is already in this session; pick another name",
            )
        member = self._add_member(session, connection, message, now)
        session.code_deadline = now + self.limits.code_ttl_s
        session.active_at = now
        self._event("member_joined", session=session.session_id, member=member.member_id, ip=connection.ip)
        members = [m.info for m in session.members.values()]
        joined = Joined(
            code=code,
            member_id=member.member_id,
            token=member.token,
            model=session.model,
            expected_members=session.expected,
            host=session.host_id,
            members=members,
        )
        outputs: list[Output] = [Send(connection.conn, joined)]
        announcement = MemberJoined(member=member.info, count=len(members), expected_members=session.expected)
        outputs += [Send(m.conn, announcement) for m in session.members.values() if m is not member]
        if session.ready:  # a seat a member left: the newcomer alone learns who is here
            self._event("member_rejoined", session=session.session_id, member=member.member_id)
            outputs.append(Send(connection.conn, Ready(host=session.host_id, members=members)))
        elif len(members) == session.expected:
            session.ready = True
            self._event("session_ready", session=session.session_id, members=len(members))
            ready = Ready(host=session.host_id, members=members)
            outputs += [Send(m.conn, ready) for m in session.members.values()]
        return outputs

    def _join_failed(self, connection: _Connection, code: str, now: float) -> SignalError:
        tomb = self.tombstones.get(code)
        if tomb is not None and tomb[1] > now and tomb[0] is ErrorCode.CODE_EXPIRED:
            reason, message = ErrorCode.CODE_EXPIRED, f"session code {code} has expired; ask the host for a new one"
        elif tomb is not None and tomb[1] > now:
            reason, message = ErrorCode.SESSION_ENDED, f"session {code} has ended; ask the host for a new code"
        else:
            reason = ErrorCode.UNKNOWN_CODE
            message = "no session has this code; check it with the host, or ask for a new one if the host has restarted"
        self._record_failure(connection.ip, now, reason.value, None)
        return SignalError(reason, message)

    def _signal(self, session: _Session, member: _Member, message: SignalTo) -> list[Output]:
        """Forward to a member of the same session only; the body is neither read nor logged."""
        target = session.members.get(message.peer)
        if target is None or target is member:
            raise SignalError(
                ErrorCode.UNKNOWN_PEER, f"{message.peer} is not another member of this session", peer=message.peer
            )
        return [Send(target.conn, SignalFrom(peer=member.member_id, body=message.body))]

    def _relay_request(self, session: _Session, member: _Member, peer: str, now: float) -> list[Output]:
        me = member.member_id
        if not session.ready:
            raise SignalError(ErrorCode.NOT_READY, "relays are granted once the session is ready", peer=peer)
        if peer == me or peer not in session.members:
            raise SignalError(ErrorCode.UNKNOWN_PEER, f"{peer} is not another member of this session", peer=peer)
        edge_key = frozenset((me, peer))
        relay_id = session.relays.get(edge_key)
        if relay_id is not None:
            edge = self.relays[relay_id]
            if edge.port is None:  # being bound: the grant comes to both
                return []
            return [Send(member.conn, self._grant(edge, edge.members.index(me)))]
        session.relay_wants.add((me, peer))
        if (peer, me) not in session.relay_wants:
            self._event("relay_requested", session=session.session_id, member=me, peer=peer)
            return []
        session.relay_wants -= {(me, peer), (peer, me)}
        cap = self.limits.relays_per_member * session.expected
        if len(session.relays) >= cap or len(self.relays) >= self.limits.max_relays:
            self._event("relay_refused", session=session.session_id, members=[peer, me], relays=len(session.relays))
            if len(session.relays) >= cap:
                text = f"no more relays: a session holds at most {cap}"
            else:
                text = "the rendezvous has no relay capacity left; retry later"
            return [
                Send(session.members[a].conn, Error(code=ErrorCode.RELAY_LIMIT, message=text, request=request, peer=b))
                for a, b, request in ((peer, me, "relay_request"), (me, peer, "relay_request"))
            ]
        relay_id = self._fresh_id("r-", self.relays)
        tokens = (self.rng.randbytes(TOKEN_BYTES), self.rng.randbytes(TOKEN_BYTES))
        while tokens[0] == tokens[1]:
            tokens = (tokens[0], self.rng.randbytes(TOKEN_BYTES))
        edge = _RelayEdge(relay_id, session.session_id, (peer, me), tokens)
        self.relays[relay_id] = edge
        session.relays[edge_key] = relay_id
        self._event("relay_allocating", session=session.session_id, relay=relay_id, members=[peer, me])
        return [OpenRelay(relay_id, session.session_id, tokens)]

    def _grant(self, edge: _RelayEdge, side: int) -> RelayGranted:
        assert edge.port is not None
        return RelayGranted(
            relay_id=edge.relay_id,
            peer=edge.members[1 - side],
            host=self.relay_host,
            port=edge.port,
            relay_token=edge.tokens[side].hex(),
        )

    # -- leaving and ending ----------------------------------------------------------------------

    def _drop(
        self, connection: _Connection, reason: LeaveReason, close: tuple[int, str] | None, now: float
    ) -> list[Output]:
        """Forget a connection; its member leaves its session (the host's leaving ends it)."""
        self._forget(connection.conn)
        outputs: list[Output] = [Close(connection.conn, *close)] if close is not None else []
        session = self.sessions.get(connection.session_id) if connection.session_id is not None else None
        if session is None or connection.member_id not in session.members:
            return outputs
        member = session.members.pop(connection.member_id)
        self._event("member_left", session=session.session_id, member=member.member_id, reason=reason.value)
        if member.member_id == session.host_id:
            return outputs + self._end(session, EndReason.HOST_LEFT, now)
        not_kept = reason is LeaveReason.REMOVED or now - member.joined_at < self.limits.short_hold_s
        if not_kept and not connection.own_machine:  # the rendezvous's own machine: the host's own members
            self.short_holds.add(_seat_holder(session, connection), now)  # a silent holder's, often
        outputs += self._free_relays(session, member.member_id)
        session.relay_wants = {w for w in session.relay_wants if member.member_id not in w}
        notice = MemberLeft(member_id=member.member_id, reason=reason)
        return outputs + [Send(m.conn, notice) for m in session.members.values()]

    def _remove(self, session: _Session, by: _Member, member_id: str, now: float) -> list[Output]:
        """Only the host's own connection (its token proves it) may send a member away."""
        if by.member_id != session.host_id:
            raise SignalError(ErrorCode.NOT_HOST, "only the session's host removes members", strike=True)
        target = session.members.get(member_id)
        if target is None or member_id == session.host_id:
            raise SignalError(
                ErrorCode.UNKNOWN_PEER, f"{member_id} is not another member of this session", peer=member_id
            )
        connection = self.connections.get(target.conn)
        if connection is None:
            return []
        return self._drop(connection, LeaveReason.REMOVED, (CLOSE_POLICY, "removed by the host"), now)

    def _renew(self, session: _Session, by: _Member, now: float) -> list[Output]:
        if by.member_id != session.host_id:
            raise SignalError(ErrorCode.NOT_HOST, "only the session's host renews it", strike=True)
        session.active_at = now
        return []

    def _end(self, session: _Session, reason: EndReason, now: float) -> list[Output]:
        self.sessions.pop(session.session_id, None)
        self.by_code.pop(session.code, None)
        tomb = ErrorCode.CODE_EXPIRED if reason is EndReason.EXPIRED else ErrorCode.SESSION_ENDED
        self.tombstones[session.code] = (tomb, now + self.limits.tombstone_s)
        while len(self.tombstones) > self.limits.max_tombstones:
            del self.tombstones[next(iter(self.tombstones))]
        self._event("session_ended", session=session.session_id, reason=reason.value, members=len(session.members))
        outputs = self._free_relays(session, None)
        close_code = CLOSE_GOING_AWAY if reason is EndReason.SHUTDOWN else CLOSE_NORMAL
        for member in session.members.values():
            outputs += [Send(member.conn, Ended(reason=reason)), Close(member.conn, close_code, f"session {reason}")]
            self._forget(member.conn)
        session.members.clear()
        return outputs

    def _free_relays(self, session: _Session, member_id: str | None) -> list[Output]:
        outputs: list[Output] = []
        for edge_key, relay_id in list(session.relays.items()):
            if member_id is None or member_id in edge_key:
                del session.relays[edge_key]
                self.relays.pop(relay_id, None)
                self._event("relay_released", session=session.session_id, relay=relay_id)
                outputs.append(FreeRelay(relay_id))
        return outputs

    # -- helpers ---------------------------------------------------------------------------------

    def _refuse(self, connection: _Connection, refusal: SignalError, now: float) -> list[Output]:
        outputs: list[Output] = [Send(connection.conn, refusal.as_message())]
        if refusal.strike:
            connection.strikes += 1
        self._event(
            "message_refused",
            conn=connection.conn,
            ip=connection.ip,
            session=connection.session_id,
            member=connection.member_id,
            error=refusal.code.value,
            strikes=connection.strikes,
        )
        if connection.strikes >= self.limits.max_strikes and connection.conn in self.connections:
            outputs += self._drop(connection, LeaveReason.PROTOCOL_ERROR, (CLOSE_POLICY, "too many bad messages"), now)
        return outputs

    def _add_member(
        self, session: _Session, connection: _Connection, message: OpenSession | JoinSession, now: float
    ) -> _Member:
        member_id = f"m{session.next_index}"
        session.next_index += 1
        info = MemberInfo(
            member_id=member_id,
            name=message.capability.name,
            host=member_id == session.host_id,
            capability=message.capability,
            candidates=message.candidates,
            fingerprint=message.fingerprint,
        )
        member = _Member(member_id, self.rng.randbytes(24).hex(), connection.conn, info, now)
        session.members[member_id] = member
        connection.session_id, connection.member_id = session.session_id, member_id
        return member

    def _forget(self, conn: ConnId) -> None:
        connection = self.connections.pop(conn, None)
        if connection is not None:
            for counts, key in ((self._per_ip, connection.ip), (self._per_network, network_group(connection.ip))):
                left = counts.pop(key, 1) - 1
                if left > 0:
                    counts[key] = left

    def _record_failure(self, ip: str, now: float, reason: str, session_id: str | None) -> None:
        self._event("join_refused", ip=ip, reason=reason, session=session_id)
        self.failures.add(ip, now)

    def _fresh_code(self) -> str:
        for _ in range(64):
            code = new_code(self.rng)
            if code not in self.by_code and code not in self.tombstones:
                return code
        raise SignalError(ErrorCode.TOO_MANY_SESSIONS, "no free session code; retry later", retry_after_s=60)

    def _fresh_id(self, prefix: str, taken: dict[str, Any]) -> str:
        while True:
            candidate = prefix + self.rng.randbytes(6).hex()
            if candidate not in taken:
                return candidate

    def _event(self, event: str, **fields: Any) -> None:
        emit(log, event, self.events, **fields)
