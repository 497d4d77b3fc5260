"""Rendezvous signalling: the sans-IO core (fast, many cases) and the real WebSocket service on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import websockets
from host_process import running_rendezvous
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafila.contracts import FleetDevice
from kafila.network.relay import hello
from kafila.network.rendezvous import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    Close,
    Ended,
    EndReason,
    Error,
    ErrorCode,
    FreeRelay,
    Joined,
    LeaveReason,
    Limits,
    MemberJoined,
    MemberLeft,
    Opened,
    OpenRelay,
    Output,
    Pong,
    Ready,
    RelayGranted,
    Rendezvous,
    Send,
    SignalError,
    SignalFrom,
    Wire,
    parse_client_message,
)
from kafila.network.rendezvous_client import RendezvousClient, RendezvousError
from kafila.network.rendezvous_server import start_rendezvous
from kafila.network.session_codes import (
    ADJECTIVES,
    NOUNS,
    SECRET_BITS,
    SECRET_WORDS,
    CodeFormatError,
    channel_part,
    full_code,
    is_well_formed,
    new_secret,
    normalise_code,
    split_code,
)

FP = "AB" * 32  # upper case on purpose: the rendezvous stores fingerprints in lower case
T = TypeVar("T")


def capability(name: str) -> dict[str, Any]:
    return {"name": name, "memory_gib": 8.0, "bandwidth_gb_s": 50.0, "nat": "ordinary", "rtt_ms": 12.5}


def device(name: str) -> FleetDevice:
    return FleetDevice.model_validate(capability(name))


def open_message(expected: int = 3, name: str = "host", candidates: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "open",
        "model": "gemma-3-270m",
        "expected_members": expected,
        "capability": capability(name),
        "candidates": ["192.168.1.10:40000", "203.0.113.5:40000"] if candidates is None else candidates,
        "fingerprint": FP,
    }


def join_message(code: str, name: str, candidates: list[str] | None = None, fingerprint: str = FP) -> dict[str, Any]:
    return {
        "type": "join",
        "code": code,
        "capability": capability(name),
        "candidates": [f"10.0.0.{len(name)}:5000"] if candidates is None else candidates,
        "fingerprint": fingerprint,
    }


class World:
    """One core, a clock we move by hand, and every connection's inbox."""

    def __init__(self, limits: Limits | None = None, seed: int = 7) -> None:
        self.core = Rendezvous(limits, random.Random(seed), relay_host="192.0.2.9")
        self.now = 1_000.0
        self.next_conn = 1
        self.inbox: dict[int, list[Wire]] = {}
        self.closed: dict[int, Close] = {}
        self.opened: list[OpenRelay] = []
        self.freed: list[str] = []

    def route(self, outputs: list[Output]) -> list[Output]:
        for output in outputs:
            if isinstance(output, Send):
                assert output.conn not in self.closed, "a message after a close"
                self.inbox.setdefault(output.conn, []).append(output.message)
            elif isinstance(output, Close):
                self.closed[output.conn] = output
            elif isinstance(output, OpenRelay):
                self.opened.append(output)
            else:
                self.freed.append(output.relay_id)
        return outputs

    def connect(self, ip: str = "198.51.100.1", own_machine: bool = False) -> int:
        conn = self.next_conn
        self.next_conn += 1
        self.inbox[conn] = []
        self.route(self.core.connect(conn, ip, self.now, own_machine))
        return conn

    def send(self, conn: int, message: dict[str, Any] | str | bytes) -> list[Output]:
        data = json.dumps(message) if isinstance(message, dict) else message
        return self.route(self.core.receive(conn, data, self.now))

    def last(self, conn: int) -> Wire:
        return self.inbox[conn][-1]

    def of_type(self, conn: int, kind: type[T]) -> list[T]:
        return [m for m in self.inbox[conn] if isinstance(m, kind)]

    def open(self, expected: int = 3, ip: str = "198.51.100.1", name: str = "host") -> tuple[int, Opened]:
        conn = self.connect(ip)
        self.send(conn, open_message(expected, name))
        opened = self.last(conn)
        assert isinstance(opened, Opened), opened
        return conn, opened

    def join(self, code: str, name: str, ip: str = "198.51.100.2") -> tuple[int, Wire]:
        conn = self.connect(ip)
        self.send(conn, join_message(code, name))
        return conn, self.inbox[conn][0]

    def full_session(self, expected: int = 3) -> tuple[list[int], list[str]]:
        """Connections and tokens of a ready session, host first."""
        host, opened = self.open(expected)
        conns, tokens = [host], [opened.token]
        for index in range(1, expected):
            conn, joined = self.join(opened.code, f"member{index}", ip=f"198.51.100.{10 + index}")
            assert isinstance(joined, Joined)
            conns.append(conn)
            tokens.append(joined.token)
        return conns, tokens

    def error(self, conn: int) -> Error:
        message = self.last(conn)
        assert isinstance(message, Error), message
        return message


# -- codes -------------------------------------------------------------------------------------


def test_word_lists_are_big_distinct_and_plain() -> None:
    for words in (ADJECTIVES, NOUNS):
        assert len(words) >= 64 and len(set(words)) == len(words)
        assert all(w.isascii() and w.isalpha() and w.islower() for w in words)


def test_codes_are_well_formed_and_unique() -> None:
    world = World(Limits(max_sessions=600, max_sessions_per_ip=600, max_connections_per_ip=600, open_burst=600))
    codes = [world.open(2)[1].code for _ in range(500)]
    assert len(set(codes)) == 500
    for code in codes:
        number, adjective, noun = code.split("-")
        assert 2 <= int(number) <= 99 and adjective in ADJECTIVES and noun in NOUNS and is_well_formed(code)


def test_a_code_is_forgiving_about_case_and_separators() -> None:
    assert normalise_code("  7 Crimson_HARBOR ") == "7-crimson-harbor"
    world = World()
    _, opened = world.open()
    number, adjective, noun = opened.code.split("-")
    _, joined = world.join(f" {number} {adjective.upper()}  {noun} ", "m")
    assert isinstance(joined, Joined) and joined.code == opened.code


def test_the_secret_half_is_four_words_of_2048_and_never_part_of_the_channel() -> None:
    assert len(set(SECRET_WORDS)) == 2048 and SECRET_BITS == 44 >= 40
    assert len({word[:4] for word in SECRET_WORDS}) == 2048  # told apart by their first four letters
    rng = random.Random(3)
    secrets = {new_secret(rng) for _ in range(2000)}
    assert len(secrets) == 2000 and all(len(secret.split("-")) == 4 for secret in secrets)
    for secret in list(secrets)[:50]:
        code = full_code("7-crimson-harbor", secret)
        assert split_code(code) == ("7-crimson-harbor", secret) and channel_part(code) == "7-crimson-harbor"
    spoken = " 7 Crimson_HARBOR  Lemon.TIGER orbit  cactus "
    assert split_code(spoken) == ("7-crimson-harbor", "lemon-tiger-orbit-cactus")
    assert channel_part("7-crimson-harbor") == "7-crimson-harbor"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("7-crimson-harbor", "only the first half"),
        ("7-crimson-harbor-lemon", "has 1 word, not 4"),
        ("7-crimson-harbor-lemon-tiger-orbit-cactus-zebra", "has 5 words, not 4"),
        ("7-crimson-harbor-lemon-tiger-orbit-zebu", "'zebu' is not among the code's words"),
        ("7-crimson-harbor-otter-tiger-orbit-zebu", "'otter', 'zebu' are not among the code's words"),
        ("7-harbor-crimson-lemon-tiger-orbit-cactus", "is not a session code"),
        ("1-crimson-harbor-lemon-tiger-orbit-cactus", "is not a session code"),
        ("", "an empty code is not a session code"),
    ],
)
def test_a_malformed_full_code_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(CodeFormatError) as caught:
        split_code(text)
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError)


# -- joining -----------------------------------------------------------------------------------


def test_wrong_code_is_a_clear_error_and_the_connection_may_retry() -> None:
    world = World()
    _, opened = world.open()
    conn, answer = world.join("2-nothing-here", "m")
    assert isinstance(answer, Error) and answer.code is ErrorCode.UNKNOWN_CODE and answer.request == "join"
    assert "no session has this code" in answer.message
    assert conn not in world.closed
    world.send(conn, join_message(opened.code, "m"))
    assert isinstance(world.last(conn), Joined)


def test_expired_code_is_a_distinct_error() -> None:
    world = World()
    host, opened = world.open()
    world.now += 601  # ten minutes and a second, nobody joined
    _, answer = world.join(opened.code, "late")
    assert isinstance(answer, Error) and answer.code is ErrorCode.CODE_EXPIRED
    assert "expired" in answer.message and opened.code in answer.message
    assert world.of_type(host, Ended) == [Ended(reason=EndReason.EXPIRED)] and host in world.closed
    _, again = world.join(opened.code, "later")
    assert isinstance(again, Error) and again.code is ErrorCode.CODE_EXPIRED
    _, wrong = world.join("3-calm-river", "other")
    assert isinstance(wrong, Error) and wrong.code is ErrorCode.UNKNOWN_CODE and wrong.message != answer.message


def test_tick_expires_an_unfilled_session_and_each_join_renews_the_code() -> None:
    world = World(Limits(idle_timeout_s=10**6))
    host, opened = world.open(expected=3)
    world.now += 500
    joiner, _ = world.join(opened.code, "a")
    world.now += 500  # 1000 s after opening, but 500 s after the last join
    world.route(world.core.tick(world.now))
    assert not world.of_type(host, Ended)
    world.now += 101
    world.route(world.core.tick(world.now))
    for conn in (host, joiner):
        assert world.of_type(conn, Ended) == [Ended(reason=EndReason.EXPIRED)] and conn in world.closed
    assert world.core.sessions == {} and world.core.connections == {}


def test_guessing_is_rate_limited_per_address_and_recovers() -> None:
    world = World()
    _, opened = world.open(expected=4)
    guesser = world.connect("203.0.113.66")
    for index in range(10):
        world.send(guesser, join_message(f"{index + 2}-calm-river", "g"))
        assert world.error(guesser).code is ErrorCode.UNKNOWN_CODE
    world.now += 5
    world.send(guesser, join_message(opened.code, "g"))  # even the right code, while locked out
    refusal = world.error(guesser)
    assert refusal.code is ErrorCode.RATE_LIMITED and refusal.retry_after_s == 55
    assert refusal.message == "too many attempts, retry in 55 s"
    _, other = world.join(opened.code, "elsewhere", ip="203.0.113.67")  # another address is not affected
    assert isinstance(other, Joined)
    world.now += 56
    world.send(guesser, join_message(opened.code, "g"))
    assert isinstance(world.last(guesser), Joined)


def test_full_session_refuses_ready_comes_at_the_expected_count_and_a_left_seat_admits_one() -> None:
    world = World()
    host, opened = world.open(expected=3)
    first, _ = world.join(opened.code, "a")
    assert not world.of_type(host, Ready) and not world.of_type(first, Ready)
    second, _ = world.join(opened.code, "b")
    for conn in (host, first, second):
        ready = world.of_type(conn, Ready)
        assert len(ready) == 1 and [m.member_id for m in ready[0].members] == ["m1", "m2", "m3"]
        assert ready[0].host == "m1"
    _, late = world.join(opened.code, "c")
    assert isinstance(late, Error) and late.code is ErrorCode.SESSION_FULL and "full" in late.message
    world.send(first, {"type": "leave", "token": world.inbox[first][0].token})  # type: ignore[attr-defined]
    # A seat a member left admits one newcomer (the host decides whether to trust it): it gets
    # its own ready with who is here now; the others hear it joined, and no second ready.
    newcomer, joined = world.join(opened.code, "d")
    assert isinstance(joined, Joined) and joined.member_id == "m4"
    (own,) = world.of_type(newcomer, Ready)
    assert [m.member_id for m in own.members] == ["m1", "m3", "m4"] and own.host == "m1"
    assert world.of_type(host, MemberJoined)[-1].member.member_id == "m4"
    assert len(world.of_type(host, Ready)) == 1 and len(world.of_type(second, Ready)) == 1
    _, full = world.join(opened.code, "e")
    assert isinstance(full, Error) and full.code is ErrorCode.SESSION_FULL


def test_introductions_carry_capability_candidates_and_fingerprints() -> None:
    world = World()
    host, opened = world.open(expected=2)
    conn = world.connect("198.51.100.2")
    world.send(conn, join_message(opened.code, "laptop", ["[2001:db8::1]:6000", "10.1.2.3:6001"], "cd" * 32))
    joined = world.inbox[conn][0]
    assert isinstance(joined, Joined) and joined.host == "m1" and joined.model == "gemma-3-270m"
    by_id = {m.member_id: m for m in joined.members}
    assert by_id["m1"].candidates == ["192.168.1.10:40000", "203.0.113.5:40000"] and by_id["m1"].host
    assert by_id["m1"].fingerprint == "ab" * 32 and by_id["m1"].capability.bandwidth_gb_s == 50.0
    announced = world.of_type(host, MemberJoined)[0]
    assert announced.member.name == "laptop" and announced.member.fingerprint == "cd" * 32
    assert announced.member.candidates == ["[2001:db8::1]:6000", "10.1.2.3:6001"] and announced.count == 2


def test_names_must_be_unique_within_a_session() -> None:
    world = World()
    _, opened = world.open()
    _, answer = world.join(opened.code, "host")
    assert isinstance(answer, Error) and answer.code is ErrorCode.NAME_TAKEN


# -- authentication and isolation ----------------------------------------------------------------


def test_a_member_cannot_act_on_another_session() -> None:
    world = World()
    (_, a_member, _), a_tokens = world.full_session(3)
    (b_host, b_member, b_third), b_tokens = world.full_session(3)
    before = {conn: len(world.inbox[conn]) for conn in (b_host, b_member, b_third)}
    for message in (
        {"type": "ping", "token": b_tokens[1]},
        {"type": "relay_request", "token": b_tokens[1], "peer": "m1"},
        {"type": "leave", "token": b_tokens[0]},
    ):
        world.send(a_member, message)
        assert world.error(a_member).code is ErrorCode.BAD_TOKEN
    world.send(a_member, {"type": "relay_request", "token": a_tokens[1], "peer": "m9"})
    assert world.error(a_member).code is ErrorCode.UNKNOWN_PEER
    world.send(a_member, join_message(world.inbox[b_host][0].code, "x"))  # type: ignore[attr-defined]
    assert world.error(a_member).code is ErrorCode.ALREADY_JOINED
    assert {conn: len(world.inbox[conn]) for conn in before} == before  # session B heard nothing
    assert len(world.core.sessions) == 2 and all(len(s.members) == 3 for s in world.core.sessions.values())


def test_messages_before_joining_are_refused() -> None:
    world = World()
    conn = world.connect()
    for message in (
        {"type": "ping", "token": "x" * 48},
        {"type": "leave", "token": "x" * 48},
        {"type": "relay_request", "token": "x" * 48, "peer": "m1"},
    ):
        world.send(conn, message)
        assert world.error(conn).code is ErrorCode.NOT_JOINED


def test_ping_answers_pong_with_the_nonce() -> None:
    world = World()
    host, opened = world.open()
    world.send(host, {"type": "ping", "token": opened.token, "nonce": 42})
    assert world.last(host) == Pong(nonce=42)


# -- signals between members ------------------------------------------------------------------


def test_a_signal_reaches_only_its_member_with_the_sender_named() -> None:
    world = World()
    (host, first, second), tokens = world.full_session(3)
    before = {conn: len(world.inbox[conn]) for conn in (host, second)}
    world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": '{"kind": "pake"}'})
    assert world.last(host) == SignalFrom(peer="m2", body='{"kind": "pake"}')
    assert len(world.inbox[second]) == before[second] and len(world.inbox[host]) == before[host] + 1
    assert not world.of_type(first, SignalFrom) and not world.of_type(first, Error)
    wire = json.loads(world.last(host).model_dump_json())
    assert wire == {"type": "signal", "peer": "m2", "body": '{"kind": "pake"}'}


def test_signals_flow_before_the_session_is_ready() -> None:
    world = World()
    host, opened = world.open(expected=3)
    conn, joined = world.join(opened.code, "a")
    world.send(conn, {"type": "signal", "token": joined.token, "peer": "m1", "body": "x"})  # type: ignore[attr-defined]
    assert world.last(host) == SignalFrom(peer="m2", body="x")
    world.send(host, {"type": "signal", "token": opened.token, "peer": "m2", "body": "y"})
    assert world.last(conn) == SignalFrom(peer="m1", body="y")


def test_a_signal_to_no_member_of_this_session_is_a_clear_error() -> None:
    world = World()
    (a_host, a_member), a_tokens = world.full_session(2)
    (b_host, _, b_third), _ = world.full_session(3)
    before = {conn: len(world.inbox[conn]) for conn in (b_host, b_third)}
    for peer in ("m3", "m2", "m9"):  # m3 exists only in the other session; m2 is the sender itself
        world.send(a_member, {"type": "signal", "token": a_tokens[1], "peer": peer, "body": "x"})
        refusal = world.error(a_member)
        assert refusal.code is ErrorCode.UNKNOWN_PEER and refusal.peer == peer and refusal.request == "signal"
        assert f"{peer} is not another member of this session" in refusal.message
    assert {conn: len(world.inbox[conn]) for conn in before} == before
    assert a_member not in world.closed  # a member that left meanwhile is bad luck, not misbehaviour
    world.send(a_member, {"type": "signal", "token": a_tokens[0], "peer": "m1", "body": "x"})
    assert world.error(a_member).code is ErrorCode.BAD_TOKEN
    stranger = world.connect()
    world.send(stranger, {"type": "signal", "token": "x" * 48, "peer": "m1", "body": "x"})
    assert world.error(stranger).code is ErrorCode.NOT_JOINED
    assert not world.of_type(a_host, SignalFrom)


@pytest.mark.parametrize(
    "body",
    ["", "x" * 4097, "line\nbreak", "\u00e9t\u00e9", "\u0000"],
)
def test_signal_bodies_are_bounded_printable_ascii(body: str) -> None:
    world = World()
    (host, first), tokens = world.full_session(2)
    world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": body})
    refusal = world.error(first)
    assert refusal.code is ErrorCode.INVALID_MESSAGE and "body" in refusal.message
    assert not world.of_type(host, SignalFrom)
    world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": "~" * 4096})
    assert world.last(host) == SignalFrom(peer="m2", body="~" * 4096)


def test_signal_floods_are_refused() -> None:
    world = World()
    (host, first), tokens = world.full_session(2)
    for _ in range(39):  # the burst is 40 messages, and `join` was one
        world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": "x"})
    world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": "x"})
    assert world.error(first).code is ErrorCode.TOO_MANY_MESSAGES
    assert len(world.of_type(host, SignalFrom)) == 39


# -- leaving -----------------------------------------------------------------------------------


def test_a_member_leaving_is_announced_and_the_session_goes_on() -> None:
    world = World()
    (host, first, second), tokens = world.full_session(3)
    world.send(first, {"type": "leave", "token": tokens[1]})
    assert world.closed[first].code == CLOSE_NORMAL
    for conn in (host, second):
        assert world.last(conn) == MemberLeft(member_id="m2", reason=LeaveReason.LEFT)
    world.route(world.core.disconnect(second, world.now))
    assert world.last(host) == MemberLeft(member_id="m3", reason=LeaveReason.DISCONNECTED)
    assert len(world.core.sessions) == 1


def test_the_host_leaving_ends_the_session() -> None:
    world = World()
    (host, first, second), tokens = world.full_session(3)
    code = world.inbox[host][0].code  # type: ignore[attr-defined]
    world.send(host, {"type": "leave", "token": tokens[0]})
    for conn in (first, second):
        assert world.of_type(conn, Ended) == [Ended(reason=EndReason.HOST_LEFT)] and conn in world.closed
    assert world.core.sessions == {} and world.core.connections == {}
    _, answer = world.join(code, "late")
    assert isinstance(answer, Error) and answer.code is ErrorCode.SESSION_ENDED


def test_idle_members_time_out_and_pings_keep_them() -> None:
    world = World()
    (host, first, second), tokens = world.full_session(3)
    for _ in range(3):
        world.now += 60
        world.send(host, {"type": "ping", "token": tokens[0]})
        world.send(first, {"type": "ping", "token": tokens[1]})
        world.route(world.core.tick(world.now))
    assert second in world.closed and first not in world.closed and host not in world.closed
    assert MemberLeft(member_id="m3", reason=LeaveReason.TIMED_OUT) in world.inbox[host]


def test_connections_that_never_open_or_join_are_closed() -> None:
    world = World()
    conn = world.connect()
    world.now += 29
    world.route(world.core.tick(world.now))
    assert conn not in world.closed
    world.now += 2
    world.route(world.core.tick(world.now))
    assert conn in world.closed and world.core.connections == {}


def test_sessions_have_a_lifetime() -> None:
    world = World(Limits(session_lifetime_s=3600, idle_timeout_s=10**6))
    (host, *_), _ = world.full_session(2)
    world.now += 3601
    world.route(world.core.tick(world.now))
    assert world.of_type(host, Ended) == [Ended(reason=EndReason.LIFETIME)]


def test_a_filled_session_with_only_pings_ends_idle_and_joins_signals_relays_or_renewals_keep_it() -> None:
    limits = Limits(session_idle_s=600, idle_timeout_s=10**6, code_ttl_s=10**6)
    world = World(limits)
    (host, first, second), tokens = world.full_session(3)
    assert world.of_type(host, Opened)[0].idle_expiry_s == 600

    def later(seconds: float) -> None:
        world.now += seconds
        for conn, token in zip((host, first, second), tokens, strict=True):
            if conn not in world.closed:
                world.send(conn, {"type": "ping", "token": token})
        world.route(world.core.tick(world.now))

    later(500)
    world.send(first, {"type": "signal", "token": tokens[1], "peer": "m1", "body": "hello"})
    later(500)  # 1000 s since the join, 500 since the signal
    world.send(second, {"type": "renew", "token": tokens[2]})  # only the host renews
    assert world.error(second).code is ErrorCode.NOT_HOST
    world.send(host, {"type": "renew", "token": tokens[0]})
    later(500)
    world.send(first, {"type": "relay_request", "token": tokens[1], "peer": "m3"})
    world.send(second, {"type": "relay_request", "token": tokens[2], "peer": "m2"})
    (request,) = world.opened
    world.route(world.core.relay_opened(request.relay_id, 40_000, world.now))
    for _ in range(3):  # the relay forwards: the shell reports it each tick
        later(500)
        world.core.relay_used(request.relay_id, world.now)
    assert not world.of_type(host, Ended)
    later(599)
    assert not world.of_type(host, Ended)
    later(2)  # pings all along, nothing else for 601 s
    assert world.of_type(host, Ended) == [Ended(reason=EndReason.IDLE)]
    assert all(conn in world.closed for conn in (host, first, second)) and world.core.sessions == {}
    assert world.freed == [request.relay_id]


def test_an_unfilled_session_is_not_ended_as_idle_but_by_its_code() -> None:
    world = World(Limits(session_idle_s=60, code_ttl_s=600, idle_timeout_s=10**6))
    host, opened = world.open(expected=3)
    world.join(opened.code, "a")
    world.now += 300
    world.route(world.core.tick(world.now))
    assert not world.of_type(host, Ended)
    world.now += 301
    world.route(world.core.tick(world.now))
    assert world.of_type(host, Ended) == [Ended(reason=EndReason.EXPIRED)]


# -- limits and garbage ------------------------------------------------------------------------


def test_message_size_is_bounded() -> None:
    world = World()
    conn = world.connect()
    world.send(conn, json.dumps(open_message() | {"model": "x" * 20_000}))
    assert world.error(conn).code is ErrorCode.TOO_LARGE
    world.send(conn, "é" * 9000)  # 9000 characters, 18000 bytes
    assert world.error(conn).code is ErrorCode.TOO_LARGE


def test_session_and_member_counts_are_bounded() -> None:
    world = World(Limits(max_sessions=3, max_sessions_per_ip=2))
    world.open(ip="198.51.100.1")
    world.open(ip="198.51.100.1")
    conn = world.connect("198.51.100.1")
    world.send(conn, open_message())
    assert world.error(conn).code is ErrorCode.TOO_MANY_SESSIONS and "this address" in world.error(conn).message
    world.open(ip="203.0.113.2")  # another network: this one's share (2 sessions) is taken
    conn = world.connect("192.0.2.3")
    world.send(conn, open_message())
    assert world.error(conn).code is ErrorCode.TOO_MANY_SESSIONS and world.error(conn).retry_after_s == 60
    for expected in (1, 33):
        world.send(conn, open_message(expected))
        assert world.error(conn).code is ErrorCode.INVALID_MESSAGE and "expected_members" in world.error(conn).message


def test_connection_count_is_bounded() -> None:
    world = World(Limits(max_connections=3, max_connections_per_ip=2))
    a, b = world.connect("198.51.100.1"), world.connect("198.51.100.1")
    c = world.connect("198.51.100.1")
    assert world.error(c).code is ErrorCode.SERVER_BUSY and c in world.closed
    world.connect("198.51.100.2")
    d = world.connect("198.51.100.3")
    assert d in world.closed and a not in world.closed and b not in world.closed


def test_the_addresses_of_one_network_cannot_fill_the_rendezvous() -> None:
    """64 addresses of one IPv6 /58 used to take all 4,096 connections (legitimate joins: 1 of 15)
    and all 1,000 sessions (legitimate opens: 0 of 18). One network now holds an eighth of each."""
    world = World(Limits(idle_timeout_s=10**6, hello_timeout_s=10**6))
    attackers = [f"2001:db8:0:{i:x}::/64" for i in range(64)]  # how the shell names each /64: one /58
    for ip in attackers:
        for _ in range(64):
            world.connect(ip)
    assert len(world.core.connections) == 512  # 4,096 / 8
    assert world.connect("198.51.100.7") not in world.closed  # a member elsewhere still gets in
    world = World(Limits(idle_timeout_s=10**6, hello_timeout_s=10**6))
    opened = 0
    for ip in attackers[:50]:
        for _ in range(20):
            conn = world.connect(ip)
            world.send(conn, open_message())
            opened += isinstance(world.last(conn), Opened)
    assert opened == 125 == len(world.core.sessions)  # 1,000 / 8
    world.open(ip="198.51.100.7")  # a legitimate host elsewhere opens


def test_opening_sessions_is_rate_limited_per_address() -> None:
    world = World(Limits(opens_per_hour=30, open_burst=10, max_sessions_per_ip=100))
    for _ in range(10):
        world.open(ip="2001:db8::/64")
    conn = world.connect("2001:db8::/64")
    world.send(conn, open_message())
    refusal = world.error(conn)
    assert refusal.code is ErrorCode.RATE_LIMITED and refusal.retry_after_s == 120 and "opened" in refusal.message
    world.now += 120  # one more an address may open every two minutes
    world.open(ip="2001:db8::/64")
    world.open(ip="2001:db8:1::/64")  # others open meanwhile


@pytest.mark.parametrize("how", ["removed", "left"])
def test_a_seat_held_and_not_kept_three_times_refuses_the_address_its_next_join(how: str) -> None:
    """A silent joiner with the public words used to hold a forming session's free seat forever,
    rejoining each time the host removed it (15 of 15 honest joins got session_full)."""
    world = World(Limits(idle_timeout_s=10**6))
    host, opened = world.open(expected=2)
    holder_ip, honest_ip = "203.0.113.66", "198.51.100.20"
    for _ in range(3):
        conn, joined = world.join(opened.code, "holder", ip=holder_ip)
        assert isinstance(joined, Joined), joined
        world.now += 25  # silent, then sent away (or gone) before proving anything
        if how == "removed":
            world.send(host, {"type": "remove", "token": opened.token, "member": joined.member_id})
        else:
            world.send(conn, {"type": "leave", "token": joined.token})
        assert joined.member_id not in world.core.sessions[world.core.by_code[opened.code]].members
    conn, refusal = world.join(opened.code, "holder", ip=holder_ip)
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.RATE_LIMITED, refusal
    assert "seats of this session it did not keep" in refusal.message and 0 < (refusal.retry_after_s or 0) <= 600
    _, elsewhere = world.open(expected=2, ip="198.51.100.99")
    _, other = world.join(elsewhere.code, "holder", ip=holder_ip)
    assert isinstance(other, Joined)  # counted in this session only: a crashed member's own session is another
    _, honest = world.join(opened.code, "laptop", ip=honest_ip)
    assert isinstance(honest, Joined)  # the seat is the honest member's
    world.now += 600
    _, ended = world.join(opened.code, "holder", ip=holder_ip)
    assert isinstance(ended, Error) and ended.code is ErrorCode.SESSION_FULL  # its holds have expired


def test_seats_this_machine_takes_and_gives_up_are_never_held_against_it() -> None:
    """The rendezvous's own machine (an embedded rendezvous's host: the demo's members, a test's
    joiners) shares its address with nobody: a seat it gives up quickly says nothing of a stranger."""
    world = World(Limits(idle_timeout_s=10**6))
    host, opened = world.open(expected=2)
    for _ in range(5):
        conn = world.connect("192.0.2.2", own_machine=True)
        world.send(conn, join_message(opened.code, "local"))
        joined = world.inbox[conn][0]
        assert isinstance(joined, Joined), joined
        world.send(host, {"type": "remove", "token": opened.token, "member": joined.member_id})


def test_a_seat_kept_past_the_short_hold_costs_nothing_when_it_ends() -> None:
    world = World(Limits(idle_timeout_s=10**6, session_idle_s=10**6))
    _, opened = world.open(expected=3)
    for _ in range(5):
        conn, joined = world.join(opened.code, "laptop", ip="198.51.100.30")
        assert isinstance(joined, Joined), joined
        world.now += 121
        world.send(conn, {"type": "leave", "token": joined.token})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"candidates": [f"10.0.0.{i}:5000" for i in range(9)]}, "candidates"),
        ({"candidates": ["10.0.0.1:5000", "10.0.0.1:5000"]}, "candidates"),
        ({"candidates": ["example.com:5000"]}, "candidates"),
        ({"candidates": ["::1:5000"]}, "candidates"),
        ({"candidates": ["10.0.0.1:0"]}, "candidates"),
        ({"fingerprint": "ab" * 31}, "fingerprint"),
        ({"fingerprint": "zz" * 32}, "fingerprint"),
        ({"capability": {"name": "x", "memory_gib": -1}}, "capability"),
        ({"capability": {"name": "x", "memory_gib": 1, "gpu": True}}, "capability"),
        ({"expected_members": "3"}, "expected_members"),
        ({"extra": 1}, "extra"),
    ],
)
def test_invalid_open_messages_say_which_field(change: dict[str, Any], field: str) -> None:
    world = World()
    conn = world.connect()
    world.send(conn, open_message() | change)
    refusal = world.error(conn)
    assert refusal.code is ErrorCode.INVALID_MESSAGE and field in refusal.message and refusal.request is None


def test_garbage_strikes_close_the_connection_and_the_member_leaves() -> None:
    world = World()
    (host, first, _), _ = world.full_session(3)
    garbage: list[str | bytes] = ["not json", b"\x00\x01binary", "[]", '{"type": "dance"}', "{" * 5000]
    for index, data in enumerate(garbage):
        world.send(first, data)
        assert world.inbox[first][-1].type == "error"  # type: ignore[attr-defined]
        assert (first in world.closed) == (index == len(garbage) - 1)
    assert world.closed[first].code == CLOSE_POLICY
    assert world.last(host) == MemberLeft(member_id="m2", reason=LeaveReason.PROTOCOL_ERROR)
    assert [e.code for e in world.of_type(first, Error)] == [
        ErrorCode.MALFORMED,
        ErrorCode.MALFORMED,
        ErrorCode.INVALID_MESSAGE,
        ErrorCode.INVALID_MESSAGE,
        ErrorCode.MALFORMED,
    ]


def test_message_floods_are_refused() -> None:
    world = World()
    host, opened = world.open()
    for _ in range(40):
        world.send(host, {"type": "ping", "token": opened.token})
    world.send(host, {"type": "ping", "token": opened.token})
    assert world.error(host).code is ErrorCode.TOO_MANY_MESSAGES
    world.now += 1
    world.send(host, {"type": "ping", "token": opened.token})
    assert isinstance(world.last(host), Pong)


# -- relay bookkeeping -------------------------------------------------------------------------


def test_relay_is_allocated_when_both_ends_ask_and_granted_to_both() -> None:
    world = World()
    host, opened = world.open(expected=3)
    first, joined = world.join(opened.code, "a")
    world.send(first, {"type": "relay_request", "token": joined.token, "peer": "m1"})  # type: ignore[attr-defined]
    assert world.error(first).code is ErrorCode.NOT_READY
    second, third_joined = world.join(opened.code, "b")
    tokens = [opened.token, joined.token, third_joined.token]  # type: ignore[attr-defined]
    world.send(first, {"type": "relay_request", "token": tokens[1], "peer": "m3"})
    assert world.opened == []
    world.send(second, {"type": "relay_request", "token": tokens[2], "peer": "m2"})
    (request,) = world.opened
    assert len(set(request.tokens)) == 2 and all(len(t) == 16 for t in request.tokens)
    world.route(world.core.relay_opened(request.relay_id, 40_001, world.now))
    to_first, to_second = world.last(first), world.last(second)
    assert isinstance(to_first, RelayGranted) and isinstance(to_second, RelayGranted)
    assert (to_first.peer, to_second.peer) == ("m3", "m2") and to_first.port == to_second.port == 40_001
    assert to_first.host == "192.0.2.9" and to_first.relay_id == to_second.relay_id == request.relay_id
    assert {to_first.relay_token, to_second.relay_token} == {t.hex() for t in request.tokens}
    world.send(first, {"type": "relay_request", "token": tokens[1], "peer": "m3"})  # asking again: same grant
    assert world.last(first) == to_first and len(world.opened) == 1
    assert not world.of_type(host, RelayGranted)
    world.send(second, {"type": "leave", "token": tokens[2]})
    assert world.freed == [request.relay_id] and world.core.relays == {}


def test_relays_are_bounded_and_freed_when_the_session_ends() -> None:
    world = World(Limits(relays_per_member=1))
    conns, tokens = world.full_session(4)  # 6 possible edges, 4 relays allowed
    edges = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]
    for a, b in edges:
        world.send(conns[a], {"type": "relay_request", "token": tokens[a], "peer": f"m{b + 1}"})
        world.send(conns[b], {"type": "relay_request", "token": tokens[b], "peer": f"m{a + 1}"})
    assert len(world.opened) == 4
    assert world.error(conns[0]).code is ErrorCode.RELAY_LIMIT and world.error(conns[2]).code is ErrorCode.RELAY_LIMIT
    assert world.error(conns[0]).peer == "m3" and world.error(conns[2]).peer == "m1"
    late = world.opened[-1].relay_id
    world.send(conns[0], {"type": "leave", "token": tokens[0]})  # the host: the session ends
    assert sorted(world.freed) == sorted(r.relay_id for r in world.opened)
    assert world.core.relay_opened(late, 40_000, world.now) == [FreeRelay(late)]  # bound too late: give it back


def test_a_relay_that_cannot_bind_is_an_error_to_both() -> None:
    world = World()
    conns, tokens = world.full_session(2)
    world.send(conns[0], {"type": "relay_request", "token": tokens[0], "peer": "m2"})
    world.send(conns[1], {"type": "relay_request", "token": tokens[1], "peer": "m1"})
    world.route(world.core.relay_failed(world.opened[0].relay_id, world.now))
    assert world.error(conns[0]).code is ErrorCode.RELAY_FAILED and world.error(conns[0]).peer == "m2"
    assert world.error(conns[1]).code is ErrorCode.RELAY_FAILED and world.core.relays == {}


# -- logs --------------------------------------------------------------------------------------


def test_log_events_never_contain_tokens_or_codes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kafila")
    world = World()
    conns, tokens = world.full_session(3)
    code = world.inbox[conns[0]][0].code  # type: ignore[attr-defined]
    world.send(conns[1], {"type": "relay_request", "token": tokens[1], "peer": "m3"})
    world.send(conns[2], {"type": "relay_request", "token": tokens[2], "peer": "m2"})
    world.route(world.core.relay_opened(world.opened[0].relay_id, 40_000, world.now))
    world.send(conns[1], {"type": "ping", "token": tokens[2]})  # a wrong token is logged as refused, not shown
    world.send(conns[2], {"type": "leave", "token": tokens[2]})
    world.send(conns[0], {"type": "leave", "token": tokens[0]})
    secrets = [*tokens, code, *(t.hex() for t in world.opened[0].tokens)]
    records = [r for r in caplog.records if r.name.startswith("kafila")]
    events = [r.kafila_event for r in records]  # type: ignore[attr-defined]
    names = {e["event"] for e in events}
    assert {"session_opened", "member_joined", "session_ready", "relay_granted", "member_left"} <= names
    assert {"message_refused", "session_ended"} <= names and events == list(world.core.events)
    for record in records:
        text = record.getMessage() + json.dumps(record.kafila_event)  # type: ignore[attr-defined]
        assert json.loads(record.getMessage()) == record.kafila_event  # type: ignore[attr-defined]
        for secret in secrets:
            assert secret not in text


# -- garbage in, errors out --------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
near_messages = st.fixed_dictionaries(
    {"type": st.sampled_from(["open", "join", "ping", "leave", "relay_request", "signal", "opened", ""])},
    optional={
        "token": st.just("<TOKEN>") | st.text(max_size=60) | st.integers(),
        "code": st.text(max_size=30) | json_values,
        "peer": st.sampled_from(["m1", "m2", "m99", "x"]) | json_values,
        "nonce": st.integers() | json_values,
        "model": st.text(max_size=10),
        "expected_members": st.integers(-3, 40) | json_values,
        "capability": st.fixed_dictionaries({"name": st.text(max_size=5), "memory_gib": st.floats()}) | json_values,
        "candidates": st.lists(st.text(max_size=25), max_size=10) | json_values,
        "fingerprint": st.text(alphabet="0123456789abcdefABCDEFg", min_size=60, max_size=66),
        "body": st.text(max_size=40) | json_values,
    },
)
member_messages = st.one_of(
    st.builds(lambda n: {"type": "ping", "token": "<TOKEN>", "nonce": n}, st.integers(0, 10)),
    st.builds(lambda p: {"type": "relay_request", "token": "<TOKEN>", "peer": p}, st.sampled_from(["m1", "m2", "m3"])),
    st.just({"type": "leave", "token": "<TOKEN>"}),
    st.builds(
        lambda p, b: {"type": "signal", "token": "<TOKEN>", "peer": p, "body": b},
        st.sampled_from(["m1", "m2", "m3", "m4"]),
        st.text(max_size=30),
    ),
)
frames = (
    st.just("PAIR")
    | member_messages.map(json.dumps)
    | st.binary(max_size=64)
    | st.text(max_size=64)
    | json_values.map(json.dumps)
    | near_messages.map(json.dumps)
    | st.builds(lambda n: "[" * n, st.integers(0, 3000))
)


@given(frames)
@settings(max_examples=400, deadline=None)
def test_parsing_garbage_raises_only_signal_errors(data: str | bytes) -> None:
    try:
        parse_client_message(data, 16 * 1024)
    except SignalError as refusal:
        assert refusal.strike and refusal.message


@given(st.lists(st.tuples(st.integers(0, 3), frames, st.floats(0, 200)), max_size=25))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_core_never_raises_on_any_sequence_of_frames(steps: list[tuple[int, str | bytes, float]]) -> None:
    world = World()
    conns, tokens = world.full_session(3)
    conns.append(world.connect("203.0.113.1"))
    for index, frame, advance in steps:
        world.now += advance
        data = frame
        if data == "PAIR" and index < 3:  # both ends of an edge ask: a relay is allocated
            peer = (index + 1) % 3
            data = json.dumps({"type": "relay_request", "token": "<TOKEN>", "peer": f"m{peer + 1}"})
            reverse = {"type": "relay_request", "token": tokens[peer], "peer": f"m{index + 1}"}
            world.route(world.core.receive(conns[peer], json.dumps(reverse), world.now))
        if isinstance(data, str) and index < 3:  # the placeholder becomes this member's real token
            data = data.replace('"<TOKEN>"', f'"{tokens[index]}"')
        before = len(world.opened)
        world.route(world.core.receive(conns[index], data, world.now))
        for allocation in world.opened[before:]:
            if advance > 100:
                world.route(world.core.relay_failed(allocation.relay_id, world.now))
            else:
                world.route(world.core.relay_opened(allocation.relay_id, 40_000, world.now))
        world.route(world.core.tick(world.now))
    for message in (m for inbox in world.inbox.values() for m in inbox):
        assert isinstance(message, Wire)


# -- the real service over WebSockets ---------------------------------------------------------


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 15) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


async def join(url: str, code: str, name: str, **options: Any) -> RendezvousClient:
    return await RendezvousClient.join(url, code, capability=device(name), fingerprint=FP, **options)


def test_service_introduces_members_and_says_ready() -> None:
    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            host = await RendezvousClient.open(
                handle.url,
                model="m",
                expected_members=3,
                capability=device("host"),
                fingerprint=FP,
                candidates=["127.0.0.1:4000"],
            )
            first = await join(handle.url, host.code, "first", candidates=["127.0.0.1:4001"])
            assert set(first.members) == {"m1", "m2"} and first.members["m1"].candidates == ["127.0.0.1:4000"]
            second = await join(handle.url, host.code, "second")
            readies = await asyncio.gather(*(c.wait_ready(5) for c in (host, first, second)))
            assert all([m.name for m in r.members] == ["host", "first", "second"] for r in readies)
            assert host.members["m2"].candidates == ["127.0.0.1:4001"]
            assert 0 < await second.ping() < 2
            await first.leave()
            await host.wait_for_left("m2", 2)
            assert host.departed == {"m2": LeaveReason.LEFT} and "m2" not in host.members
            await host.leave()
            assert await second.wait_closed(2) == Ended(reason=EndReason.HOST_LEFT)
        finally:
            await handle.close()

    run(scenario())


def test_service_carries_signals_and_joining_with_the_full_code_sends_only_its_channel() -> None:
    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=device("h"), fingerprint=FP
            )
            member = await join(handle.url, f"{host.code}-lemon-tiger-orbit-cactus", "m")
            assert member.code == host.code and set(member.members) == {"m1", "m2"}
            await member.send_signal("m1", "hello")
            await member.send_signal("m1", "again")
            assert await host.next_signal("m2", 2) == "hello" and await host.next_signal("m2", 2) == "again"
            assert host.take_signals("m2") == []
            await host.send_signal("m2", "back")
            assert await member.next_signal("m1", 2) == "back"
            await host.send_signal("m9", "anyone?")
            with pytest.raises(RendezvousError) as refusal:
                await host.next_signal("m9", 2)
            assert refusal.value.code == "unknown_peer" and "m9 is not another member" in refusal.value.message
            with pytest.raises(TimeoutError):
                await host.next_signal("m2", 0.2)
            await member.send_signal("m1", "bye")
            await member.leave()
            assert await host.next_signal("m2", 2) == "bye"  # what it said before leaving comes first
            with pytest.raises(RendezvousError, match="member_left: m2 left the session"):
                await host.next_signal("m2", 2)
            await host.close()
        finally:
            await handle.close()

    run(scenario())


def test_service_refuses_a_wrong_code_quickly() -> None:
    async def scenario() -> float:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            started = time.monotonic()
            with pytest.raises(RendezvousError) as refusal:
                await join(handle.url, "42-no-such", "x", timeout=2)
            assert refusal.value.code == "unknown_code" and "no session has this code" in refusal.value.message
            return time.monotonic() - started
        finally:
            await handle.close()

    assert run(scenario()) < 2


def test_service_answers_garbage_and_keeps_serving_others() -> None:
    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=device("h"), fingerprint=FP
            )
            async with websockets.connect(handle.url) as raw:
                garbage: list[tuple[str | bytes, str]] = [
                    ("not json", "malformed"),
                    ("x" * 100_000, "too_large"),
                    ('{"type": "open", "expected_members": "three"}', "invalid_message"),
                    (b"\x00\xff", "malformed"),
                ]
                for frame, code in garbage:
                    await raw.send(frame)
                    answer = json.loads(await asyncio.wait_for(raw.recv(), 2))
                    assert (answer["type"], answer["code"]) == ("error", code)
                await raw.send("[1, 2")
                assert json.loads(await asyncio.wait_for(raw.recv(), 2))["code"] == "malformed"
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(raw.recv(), 2)
                assert raw.close_code == CLOSE_POLICY
            async with websockets.connect(handle.url, max_size=None) as huge:
                await huge.send("y" * (2 << 20))  # past the WebSocket layer's limit: cut off there
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(huge.recv(), 2)
            assert await host.ping() < 2
            member = await join(handle.url, host.code, "m")
            assert (await member.wait_ready(2)).host == "m1"
            assert handle.core.stats()["sessions"] == 1
        finally:
            await handle.close()

    run(scenario())


def test_a_rendezvous_with_an_open_token_opens_sessions_only_for_hosts_that_give_it() -> None:
    world = World()
    world.core.open_token = "lighthouse-keeper"
    for token in (None, "", "lighthouse", "lighthouse-keeper!"):
        conn = world.connect()
        world.send(conn, open_message() | ({"open_token": token} if token is not None else {}))
        refusal = world.last(conn)
        assert isinstance(refusal, Error) and refusal.code in (ErrorCode.OPEN_TOKEN, ErrorCode.INVALID_MESSAGE)
    conn = world.connect()
    world.send(conn, open_message() | {"open_token": "lighthouse-keeper"})
    opened = world.last(conn)
    assert isinstance(opened, Opened)
    _, joined = world.join(opened.code, "member")  # joining needs the code only
    assert isinstance(joined, Joined)

    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0, open_token="lighthouse-keeper")
        try:
            with pytest.raises(RendezvousError) as refused:
                await RendezvousClient.open(handle.url, model="m", expected_members=2, capability=device("h"),
                                            fingerprint=FP)  # fmt: skip
            assert refused.value.code == "open_token" and "--open-token" in refused.value.message
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=device("h"), fingerprint=FP,
                open_token="lighthouse-keeper",
            )  # fmt: skip
            await host.close()
        finally:
            await handle.close()

    run(scenario())


def test_the_host_alone_can_remove_a_member_and_its_seat_is_free_again() -> None:
    world = World()
    conns, tokens = world.full_session(3)
    host, first, second = conns
    world.send(first, {"type": "remove", "token": tokens[1], "member": "m3"})  # not the host
    refusal = world.last(first)
    assert isinstance(refusal, Error) and refusal.code == ErrorCode.NOT_HOST
    assert second not in world.closed
    world.send(host, {"type": "remove", "token": tokens[0], "member": "m9"})
    unknown = world.last(host)
    assert isinstance(unknown, Error) and unknown.code == ErrorCode.UNKNOWN_PEER
    world.send(host, {"type": "remove", "token": tokens[0], "member": "m1"})  # itself: no
    assert isinstance(world.last(host), Error)
    world.send(host, {"type": "remove", "token": tokens[0], "member": "m3"})
    assert world.closed[second].code == CLOSE_POLICY
    assert world.last(host) == MemberLeft(member_id="m3", reason=LeaveReason.REMOVED)
    assert world.last(first) == MemberLeft(member_id="m3", reason=LeaveReason.REMOVED)
    code = next(iter(world.core.by_code))
    _, joined = world.join(code, "newcomer", ip="198.51.100.40")  # the seat it held
    assert isinstance(joined, Joined)

    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        try:
            host_client = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=device("h"), fingerprint=FP
            )
            member = await join(handle.url, host_client.code, "m")
            await host_client.wait_ready(5)
            await host_client.remove(member.member_id)
            assert host_client.departed == {member.member_id: LeaveReason.REMOVED}
            assert await member.wait_closed(5) is None and member.closed
            await host_client.close()
        finally:
            await handle.close()

    run(scenario())


def test_service_ends_an_idle_session_and_counts_relay_traffic_and_renewals_as_life() -> None:
    """Real sockets: datagrams through a real relay port keep a session; so does the host's renew;
    pings alone do not."""

    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0, limits=Limits(session_idle_s=1.5), tick_interval=0.1)
        try:
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=3, capability=device("h"), fingerprint=FP, ping_interval=0.2
            )
            assert host.idle_expiry_s == 1.5
            a = await join(handle.url, host.code, "a", ping_interval=0.2)
            b = await join(handle.url, host.code, "b", ping_interval=0.2)
            grant_a, grant_b = await asyncio.gather(a.request_relay(b.member_id, 5), b.request_relay(a.member_id, 5))
            loop = asyncio.get_running_loop()
            ends = []
            for grant, client in ((grant_a, a), (grant_b, b)):
                transport, _ = await loop.create_datagram_endpoint(
                    asyncio.DatagramProtocol, remote_addr=client.relay_address(grant)
                )
                transport.sendto(hello(bytes.fromhex(grant.relay_token)))
                ends.append(transport)
            started = time.monotonic()
            while time.monotonic() - started < 3.0:  # twice the idle expiry, with traffic all along
                ends[0].sendto(b"activation bytes")
                await asyncio.sleep(0.1)
            assert not host.closed
            for end in ends:
                end.close()
            started = time.monotonic()
            while time.monotonic() - started < 3.0:  # no traffic now; the host's renewals keep it
                await host.renew()
                await asyncio.sleep(0.3)
            assert not host.closed
            assert await host.wait_closed(5) == Ended(reason=EndReason.IDLE)  # pings alone
            assert await a.wait_closed(2) == Ended(reason=EndReason.IDLE)
        finally:
            await handle.close()

    run(scenario())


def test_service_shutdown_tells_members() -> None:
    async def scenario() -> None:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        host = await RendezvousClient.open(
            handle.url, model="m", expected_members=2, capability=device("h"), fingerprint=FP
        )
        await handle.close()
        assert await host.wait_closed(2) == Ended(reason=EndReason.SHUTDOWN)

    run(scenario())


def test_cli_rendezvous_prints_ready_then_http_and_serves_sessions() -> None:
    with running_rendezvous() as rendezvous:  # READY, then HTTP; a clean exit on SIGTERM

        async def scenario() -> None:
            url = f"ws://{rendezvous.address}/v1/session"
            host = await RendezvousClient.open(
                url, model="m", expected_members=2, capability=device("h"), fingerprint=FP
            )
            member = await join(url, host.code, "m")
            assert (await host.wait_ready(5)).members[1].name == "m"
            await member.close()
            await host.close()

        run(scenario())
