"""The rendezvous's STUN service and NAT classification, on loopback (no NAT: the lab tests NATs)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from aioice import stun
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import line_from, until_async

from kafila.contracts import Mapping, NatClass
from kafila.network.nat import (
    SILENCE_CAP_S,
    SILENCE_FLOOR_S,
    SILENCE_RTTS,
    classify,
    probe_nat,
    silence_window,
)
from kafila.network.stun import (
    ANSWER_BURST,
    ANSWERS_PER_S,
    CHANGE_IP,
    CHANGE_PORT,
    StunEndpoints,
    StunResponder,
    StunServer,
)
from kafila.portability import bind_udp_socket

EIM, ADM, APDM = Mapping.ENDPOINT_INDEPENDENT, Mapping.ADDRESS_DEPENDENT, Mapping.ADDRESS_AND_PORT_DEPENDENT
TWO = StunEndpoints("203.0.113.1", 3478, 3479, "203.0.113.2")
ONE = StunEndpoints("203.0.113.1", 3478, 3479)
CLIENT = ("198.51.100.7", 40000)


def request(change: int = 0) -> bytes:
    message = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
    if change:
        message.attributes["CHANGE-REQUEST"] = change
    return bytes(message)


def test_answers_to_one_source_are_rate_limited_so_spoofed_requests_amplify_little() -> None:
    """An answer is about 3× its request: a flood spoofing a victim's address gets the burst, then
    ANSWERS_PER_S a second, and other sources (an IPv6 /64 counts as one) are answered meanwhile."""
    responder = StunResponder(TWO)
    on = ("203.0.113.1", 3478)
    answered = sum(responder.handle(request(), CLIENT, on, 0.0) is not None for _ in range(1000))
    assert answered == ANSWER_BURST and responder.counts["rate_limited"] == 1000 - ANSWER_BURST
    assert responder.handle(request(), ("198.51.100.8", 40000), on, 0.0) is not None  # another source
    one_second_later = sum(responder.handle(request(), CLIENT, on, 1.0) is not None for _ in range(1000))
    assert one_second_later == ANSWERS_PER_S
    same_64 = [(f"2001:db8::{n:x}", 40000) for n in range(1, 1000)]
    assert sum(responder.handle(request(), source, on, 0.0) is not None for source in same_64) == ANSWER_BURST


@pytest.mark.parametrize(
    ("change", "reply_from"),
    [
        (0, ("203.0.113.1", 3478)),
        (CHANGE_PORT, ("203.0.113.1", 3479)),
        (CHANGE_IP, ("203.0.113.2", 3478)),
        (CHANGE_IP | CHANGE_PORT, ("203.0.113.2", 3479)),
    ],
)
def test_change_request_picks_the_reply_socket(change: int, reply_from: tuple[str, int]) -> None:
    answer = StunResponder(TWO).handle(request(change), CLIENT, ("203.0.113.1", 3478), 0.0)
    assert answer is not None
    payload, origin = answer
    response = stun.parse_message(payload)
    assert origin == reply_from
    assert response.message_class == stun.Class.RESPONSE
    assert response.attributes["XOR-MAPPED-ADDRESS"] == CLIENT
    assert response.attributes["RESPONSE-ORIGIN"] == reply_from
    assert response.attributes["OTHER-ADDRESS"] == ("203.0.113.2", 3479)


def test_one_address_never_claims_another() -> None:
    responder = StunResponder(ONE)
    answer = responder.handle(request(), CLIENT, ("203.0.113.1", 3478), 0.0)
    assert answer is not None and "OTHER-ADDRESS" not in stun.parse_message(answer[0]).attributes
    port_change = responder.handle(request(CHANGE_PORT), CLIENT, ("203.0.113.1", 3478), 0.0)
    assert port_change is not None and port_change[1] == ("203.0.113.1", 3479)
    refused = responder.handle(request(CHANGE_IP), CLIENT, ("203.0.113.1", 3478), 0.0)
    assert refused is not None
    error = stun.parse_message(refused[0])
    assert error.message_class == stun.Class.ERROR and error.error_code == 420


def test_only_binding_requests_are_answered() -> None:
    responder = StunResponder(TWO)
    response = stun.Message(stun.Method.BINDING, stun.Class.RESPONSE)
    allocate = stun.Message(stun.Method.ALLOCATE, stun.Class.REQUEST)
    for data in (bytes(response), bytes(allocate), b"", b"\x00\x01garbage", request()[:-1]):
        assert responder.handle(data, CLIENT, ("203.0.113.1", 3478), 0.0) is None
    assert responder.counts["answered"] == 0 and responder.counts["ignored"] == 5


def binding_request_header(data: bytes) -> bool:
    """Whether `data` passes RFC 5389's header rules for a Binding request (section 6): the top
    two bits zero, type 0x0001, and a length that is the rest, a multiple of 4. The magic cookie
    may be anything: an RFC 3489 client sends none, and a server may answer it (section 12).
    Written from the RFC, not aioice's parser: what fails these is no request to answer."""
    return (
        len(data) >= 20
        and data[0:2] == b"\x00\x01"
        and int.from_bytes(data[2:4], "big") == len(data) - 20
        and (len(data) - 20) % 4 == 0
    )


@st.composite
def datagrams(draw: st.DrawFn) -> bytes:
    """Random bytes, and real messages of every method and class (some asking for a change) cut,
    flipped or lengthened: the near misses a parser gets wrong."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=120))
    message = stun.Message(draw(st.sampled_from(list(stun.Method))), draw(st.sampled_from(list(stun.Class))))
    change = draw(st.sampled_from([0, CHANGE_PORT, CHANGE_IP, CHANGE_IP | CHANGE_PORT]))
    if change:
        message.attributes["CHANGE-REQUEST"] = change
    data = bytearray(bytes(message))
    for index, value in draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), max_size=3)):
        data[index] = value
    if draw(st.booleans()):
        data += draw(st.binary(min_size=1, max_size=12))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data) - 1))]
    return bytes(data)


@given(datagrams())
@settings(max_examples=400)
def test_random_datagrams_are_rejected_cleanly_or_answered_properly(data: bytes) -> None:
    """Clean: no exception, exactly one count moved; whatever is no Binding request by the RFC's
    header rules is ignored, unanswered; and an answer is a Binding success for that request's
    transaction, naming the client, from the endpoint its flags ask for."""
    responder = StunResponder(TWO)
    answer = responder.handle(data, CLIENT, ("203.0.113.1", 3478), 0.0)
    moved = {name: count for name, count in responder.counts.items() if count}
    if answer is None:
        assert moved == {"ignored": 1}, (data, moved)
        return
    assert binding_request_header(data), data
    assert moved == {"answered": 1}, (data, moved)
    payload, origin = answer
    response = stun.parse_message(payload)
    assert (response.message_method, response.message_class) == (stun.Method.BINDING, stun.Class.RESPONSE)
    assert response.transaction_id == data[8:20]
    assert response.attributes["XOR-MAPPED-ADDRESS"] == CLIENT
    flags = stun.parse_message(data).attributes.get("CHANGE-REQUEST", 0)
    expected = ("203.0.113.2" if flags & CHANGE_IP else "203.0.113.1", 3479 if flags & CHANGE_PORT else 3478)
    assert origin == expected == response.attributes["RESPONSE-ORIGIN"]


@pytest.mark.parametrize(
    ("mapping", "filtering", "expected"),
    [
        (EIM, EIM, NatClass.PERMISSIVE),
        (EIM, ADM, NatClass.ORDINARY),
        (EIM, APDM, NatClass.ORDINARY),
        (ADM, EIM, NatClass.RESTRICTIVE),
        (APDM, APDM, NatClass.RESTRICTIVE),
        (APDM, None, NatClass.RESTRICTIVE),
        (EIM, None, None),
        (None, APDM, None),
    ],
)
def test_classes(mapping: Mapping | None, filtering: Mapping | None, expected: NatClass | None) -> None:
    assert classify(mapping, filtering) is expected


def probe_on_loopback(alt_address: str | None) -> dict:
    """`kafila nat`'s report against a real STUN server on loopback, with or without a second address."""

    async def run() -> dict:
        server = await StunServer.start("127.0.0.1", 0, 0, alt_address)
        try:
            report = await probe_nat((server.endpoints.address, server.endpoints.port), bind_host="127.0.0.1")
        finally:
            server.close()
        return report.as_output()

    return asyncio.run(run())


def test_loopback_with_two_addresses_is_open_internet() -> None:
    report = probe_on_loopback("127.0.0.2")
    assert (report["mapping"], report["filtering"], report["class"]) == (EIM.value, EIM.value, "permissive")
    assert report["behind_nat"] is False and report["mapped_address"] == report["local_address"]
    assert report["rtt_ms"] > 0 and report["notes"] == []


def test_loopback_with_one_address_says_what_it_cannot_tell() -> None:
    report = probe_on_loopback(None)
    assert report["mapping"] is None and report["filtering"] is None and report["class"] is None
    assert any("--alt-address" in note for note in report["notes"])


def test_silence_is_waited_for_a_few_of_the_slowest_round_trips() -> None:
    """A filtering test takes silence for a filter after SILENCE_RTTS of the slowest measured round
    trips: never less than the floor (a busy machine's scheduling), never more than the fixed
    three tries of before."""
    assert silence_window([0.3, 0.5, 2.0]) == SILENCE_FLOOR_S
    assert silence_window([]) == SILENCE_FLOOR_S
    assert silence_window([40.0, 180.0, 60.0]) == pytest.approx(SILENCE_RTTS * 0.180)
    assert silence_window([5000.0]) == SILENCE_CAP_S


@dataclass
class ShapedStun:
    """The rendezvous's STUN core (`StunResponder`) on loopback's two addresses, behind a shell that
    shapes what a client behind some NAT would see: every answer `delay_s` late (a long path), the
    first copy of every change request lost (`lose_first_change`), or no answer to a change
    request ever coming in (`silent_changes`: a NAT that filters)."""

    delay_s: float = 0.0
    lose_first_change: bool = False
    silent_changes: bool = False
    changes_seen: set[bytes] = field(default_factory=set)
    transports: dict[tuple[str, int], asyncio.DatagramTransport] = field(default_factory=dict)

    async def start(self) -> tuple[str, int]:
        first = await bind_udp_socket(("127.0.0.1", 0))
        second = await bind_udp_socket(("127.0.0.1", 0))
        ports = (first.getsockname()[1], second.getsockname()[1])
        sockets = {("127.0.0.1", ports[0]): first, ("127.0.0.1", ports[1]): second}
        for port in ports:
            sockets[("127.0.0.2", port)] = await bind_udp_socket(("127.0.0.2", port))
        responder = StunResponder(StunEndpoints("127.0.0.1", ports[0], ports[1], "127.0.0.2"))
        loop = asyncio.get_running_loop()
        for local, sock in sockets.items():
            self.transports[local], _ = await loop.create_datagram_endpoint(
                lambda local=local: ShapedEndpoint(self, responder, local), sock=sock
            )
        return "127.0.0.1", ports[0]

    def received(self, responder: StunResponder, data: bytes, source: tuple[str, int], local: tuple[str, int]) -> None:
        message = stun.parse_message(data)
        if "CHANGE-REQUEST" in message.attributes:
            if self.silent_changes:
                return
            if self.lose_first_change and message.transaction_id not in self.changes_seen:
                self.changes_seen.add(message.transaction_id)
                return
        answer = responder.handle(data, source, local, time.monotonic())
        if answer is not None:
            payload, reply_from = answer
            asyncio.get_running_loop().call_later(self.delay_s, self.transports[reply_from].sendto, payload, source)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


class ShapedEndpoint(asyncio.DatagramProtocol):
    """One of `ShapedStun`'s four endpoints: what arrives goes to its shell."""

    def __init__(self, shaped: ShapedStun, responder: StunResponder, local: tuple[str, int]) -> None:
        self.shaped, self.responder, self.local = shaped, responder, local

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.shaped.received(self.responder, data, addr, self.local)


def probe_shaped(shaped: ShapedStun) -> tuple[dict, float]:
    """`kafila nat`'s report against `shaped`, and the seconds the tests took."""

    async def run() -> tuple[dict, float]:
        target = await shaped.start()
        try:
            started = time.monotonic()
            report = await probe_nat(target, bind_host="127.0.0.1")
            return report.as_output(), time.monotonic() - started
        finally:
            shaped.close()

    return asyncio.run(run())


def test_a_filter_costs_the_silence_window_not_three_tries() -> None:
    """Behind a NAT that filters, no reply from another address or port gets in: that silence is
    classified as address-and-port-dependent filtering once the window is out, well before the
    3.5 s of three tries (the round trips here are a fraction of a millisecond)."""
    report, took = probe_shaped(ShapedStun(silent_changes=True))
    assert (report["mapping"], report["filtering"], report["class"]) == (EIM.value, APDM.value, "ordinary")
    assert SILENCE_FLOOR_S <= took < SILENCE_CAP_S - 1.0, took


def test_a_lost_request_is_sent_again_within_the_window() -> None:
    """The first copy of each change request is lost: the copy sent again within the window is
    answered, so an open path is not taken for a filter."""
    report, _ = probe_shaped(ShapedStun(lose_first_change=True))
    assert (report["mapping"], report["filtering"], report["class"]) == (EIM.value, EIM.value, "permissive")


def test_a_long_path_waits_longer_than_the_floor() -> None:
    """Every answer 200 ms late (a path of that round trip): the window grows with the measured
    round trips, so the late replies from another address still count and the path is open."""
    report, _ = probe_shaped(ShapedStun(delay_s=0.2))
    assert report["rtt_ms"] >= 200
    assert (report["mapping"], report["filtering"], report["class"]) == (EIM.value, EIM.value, "permissive")
    silent, silent_took = probe_shaped(ShapedStun(delay_s=0.2, silent_changes=True))
    assert silent["filtering"] == APDM.value
    assert silent_took >= 5 * 0.2 + SILENCE_RTTS * 0.2  # the round trips, then the window they set


def test_server_survives_garbage_and_keeps_answering() -> None:
    async def run() -> str:
        server = await StunServer.start("127.0.0.1", 0, 0, "127.0.0.2")
        try:
            target = (server.endpoints.address, server.endpoints.port)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for data in (
                    b"\x00" * 20,
                    b"\x01\x01\x00\x08" + b"\x21\x12\xa4\x42" + b"x" * 12,
                    os.urandom(600),
                    b"\xff" * 40,
                ):
                    sock.sendto(data, target)
            report = await probe_nat(target, bind_host="127.0.0.1")
        finally:
            server.close()
        return str(report.nat_class)

    assert asyncio.run(run()) == "permissive"


def kafila(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_cli_rendezvous_and_nat_together() -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kafila",
            "rendezvous",
            "--host",
            "127.0.0.1",
            "--stun-port",
            "0",
            "--alt-address",
            "127.0.0.2",
            "--http-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ready = line_from(server.stdout, "the rendezvous's READY line").split()
        assert ready[0] == "READY"
        result = kafila("nat", "--rendezvous", ready[1], "--bind", "127.0.0.1", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["class"] == "permissive"
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert server.returncode == 0


@pytest.mark.parametrize(
    ("target", "message"),
    [("127.0.0.1:9", "no STUN answer"), ("nowhere:port", "expected HOST:PORT"), ("host:0", "port from 1 to 65535")],
)
def test_cli_nat_errors_are_one_clear_line(target: str, message: str) -> None:
    result = kafila("nat", "--rendezvous", target, "--json", timeout=30)
    assert result.returncode == 1 and message in json.loads(result.stdout)["error"]


FLOOD = """
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.2", 0))
sock.setblocking(False)
request = bytes.fromhex(sys.argv[3])
print("flooding", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(1000):
        try:
            sock.sendto(request, ("127.0.0.1", port))
        except BlockingIOError:
            pass
"""


def test_one_address_flooding_stun_does_not_keep_another_from_being_answered() -> None:
    """A process sending binding requests as fast as it can from one address: they are counted
    against its rate before they are parsed, read in STUN's own thread, and a member's requests
    from another address are all answered within a client's retries. Before, the flood was parsed
    first, on the event loop: the socket's buffer overflowed and 1 request in 5 was answered."""

    async def scenario() -> tuple[int, dict[str, int]]:
        server = await StunServer.start("127.0.0.1", 0, 0)
        port = server.endpoints.port
        flood = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FLOOD, str(port), "12", request().hex(), stdout=asyncio.subprocess.PIPE
        )
        assert flood.stdout is not None
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            await asyncio.wait_for(flood.stdout.readline(), 60)  # the flood has begun
            await until_async(lambda: server.responder.counts["rate_limited"] >= 50_000, "the flood in full spate", 10)
            client.bind(("127.0.0.3", 0))
            client.settimeout(0.5)
            answered = 0
            for _ in range(5):  # five requests, each tried up to four times, as a NAT probe does
                for _ in range(4):
                    await asyncio.to_thread(client.sendto, request(), ("127.0.0.1", port))
                    try:
                        await asyncio.to_thread(client.recvfrom, 2048)
                    except TimeoutError:
                        continue
                    answered += 1
                    break
            return answered, dict(server.responder.counts)
        finally:
            client.close()
            flood.kill()
            await flood.wait()
            server.close()

    answered, counts = asyncio.run(scenario())
    assert answered == 5, counts
