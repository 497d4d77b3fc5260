"""When a link acknowledges (`LinkConfig.ack_hold_s`), with two `LinkCore`s over a simulated path
and injected time: a ring's frame answered within the hold carries the ACK back with the answer,
and no datagram goes for the ACK alone; anything else keeps aioquic's pace; a gap is
acknowledged at once; an ACK that waited is neither round trip nor a rise of the path's
queue to the sender; and a token's rows leave without arming aioquic's pacer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from test_link_core import DIALLER_AT, LISTENER_AT, Pair, frames

from kafila.network.datagram_size import BASE_DATAGRAM
from kafila.network.link import LinkConfig, LinkCore
from kafila.wire.frames import Frame, Kind

# At QUIC's minimum datagram, which these links never probe past: a token's rows are three
# datagrams (test_datagram_size.py has them raised to two).
HOLDING = LinkConfig(idle_timeout_s=4.0, handshake_timeout_s=10.0, ack_hold_s=0.020, max_datagram_size=BASE_DATAGRAM)
AIOQUIC_PACE = HOLDING.model_copy(update={"ack_hold_s": 0.0})
ACK_ALONE = 100  # bytes: a datagram this small carries no frame's data, only an ACK
ONE_WAY_S = 0.0002  # a LAN's path


def rows(position: int) -> Frame:
    """A token's hidden state as a ring sends it: 640 f32, three datagrams."""
    return Frame.of_hidden(Kind.DECODE, 1, position, np.full((1, 640), position, dtype=np.float32))


@dataclass
class Wire:
    """The pair's datagrams cross a path of ONE_WAY_S each way; time moves in steps of 0.1 ms,
    each side's timer runs when due, and every datagram sent is recorded by size."""

    pair: Pair
    one_way_s: float = ONE_WAY_S
    lost: set[int] = field(default_factory=set)  # indices of the dialler's datagrams that never arrive
    sent: dict[str, list[int]] = field(default_factory=lambda: {"dialler": [], "listener": []})
    flying: list[tuple[float, LinkCore, bytes, tuple[str, int]]] = field(default_factory=list)

    def send(self) -> None:
        pair = self.pair
        for name, core, to, source in (
            ("dialler", pair.dialler, pair.listener, DIALLER_AT),
            ("listener", pair.listener, pair.dialler, LISTENER_AT),
        ):
            for data, _ in core.datagrams_to_send(pair.now):
                if not (name == "dialler" and len(self.sent["dialler"]) in self.lost):
                    self.flying.append((pair.now + self.one_way_s, to, data, source))
                self.sent[name].append(len(data))

    def run(self, seconds: float) -> None:
        pair = self.pair
        end = pair.now + seconds
        while pair.now < end - 1e-9:
            pair.now += 0.0001
            due = [f for f in self.flying if f[0] <= pair.now + 1e-9]
            self.flying = [f for f in self.flying if f[0] > pair.now + 1e-9]
            for _, core, data, source in due:
                core.datagram_received(data, source, pair.now)
            for core in (pair.dialler, pair.listener):
                timer = core.timer()
                if timer is not None and timer <= pair.now:
                    core.handle_timer(pair.now)
            self.send()

    def alone(self, side: str, since: int = 0) -> int:
        """How many of a side's datagrams from its `since`-th on carried an ACK alone."""
        return sum(size < ACK_ALONE for size in self.sent[side][since:])


def trips(wire: Wire, count: int, compute_s: float = 0.008) -> list[Frame]:
    """A 2-machine ring's tokens: the host (the dialler) sends a token's rows, the member computes
    for `compute_s` and answers with its own, the host computes as long and sends the next."""
    answers = []
    for position in range(count):
        wire.pair.dialler.send_frame(rows(position))
        wire.send()
        wire.run(ONE_WAY_S + compute_s)
        (got,) = frames(wire.pair.listener)
        wire.pair.listener.send_frame(rows(got.position))
        wire.send()
        wire.run(ONE_WAY_S + compute_s)
        answers += frames(wire.pair.dialler)
    return answers


def ring_wire(config: LinkConfig) -> Wire:
    """An up pair that has carried one token each way: each side has answered the other."""
    pair = Pair(config=config).up()
    wire = Wire(pair)
    wire.run(0.1)  # the handshake's last ACKs
    trips(wire, 1)
    return wire


def test_a_ring_frame_answered_within_the_hold_carries_its_ack_back_and_none_goes_alone() -> None:
    held, paced = ring_wire(HOLDING), ring_wire(AIOQUIC_PACE)
    start = {name: {side: len(w.sent[side]) for side in w.sent} for name, w in (("held", held), ("paced", paced))}
    for wire in (held, paced):
        assert [f.position for f in trips(wire, 20)] == list(range(20))  # positions from 0 again: no matter
    assert held.alone("dialler", start["held"]["dialler"]) == 0
    assert held.alone("listener", start["held"]["listener"]) == 0
    assert paced.alone("dialler", start["paced"]["dialler"]) >= 19  # aioquic's: an ACK alone a frame
    assert paced.alone("listener", start["paced"]["listener"]) >= 19
    assert len(held.sent["dialler"]) - start["held"]["dialler"] == 3 * 20  # three datagrams a token, no more


def test_an_answer_slower_than_the_hold_is_acknowledged_alone_when_the_hold_ends() -> None:
    wire = ring_wire(HOLDING)
    wire.pair.dialler.send_frame(rows(0))
    wire.send()
    before = len(wire.sent["listener"])
    wire.run(ONE_WAY_S + HOLDING.ack_hold_s - 0.002)
    assert len(wire.sent["listener"]) == before  # still waiting for an answer to carry it
    wire.run(0.004)
    assert wire.alone("listener", before) == 1


def test_rows_that_cross_a_link_one_way_keep_aioquics_pace() -> None:
    """On a ring of three machines the host's rows go to the first member, whose answer goes on to
    the next: nothing comes back on that link to carry an ACK, so none waits for it."""
    pair = Pair(config=HOLDING).up()
    wire = Wire(pair)
    wire.run(0.1)
    before = len(wire.sent["listener"])
    for position in range(10):
        pair.dialler.send_frame(rows(position))
        wire.send()
        wire.run(ONE_WAY_S + 0.002)
        assert wire.alone("listener", before) == position + 1  # within aioquic's 1 ms, each
    assert [f.position for f in frames(pair.listener)] == list(range(10))


def test_frames_no_ring_answers_keep_aioquics_pace() -> None:
    """A control message (a PING frame on a sequence of its own) is acknowledged 1 ms after it
    comes, as aioquic does, not held for an answer that may never come."""
    wire = ring_wire(HOLDING)
    wire.pair.dialler.send_frame(Frame(Kind.PING, 7, payload=b'{"stages": []}'))
    wire.send()
    before = len(wire.sent["listener"])
    wire.run(ONE_WAY_S + 0.002)
    assert wire.alone("listener", before) == 1


def test_a_gap_in_the_packet_numbers_is_acknowledged_at_once() -> None:
    wire = ring_wire(HOLDING)
    wire.lost = {len(wire.sent["dialler"]) + 1}  # the frame's second datagram of three
    wire.pair.dialler.send_frame(rows(0))
    wire.send()
    before = len(wire.sent["listener"])
    wire.run(ONE_WAY_S + 0.0002)  # the first and third arrive: the third shows the gap
    assert wire.alone("listener", before) == 1
    wire.run(0.5)  # the lost datagram goes again; the frame arrives whole
    assert [f.position for f in frames(wire.pair.listener)] == [0]


def test_an_ack_that_waited_is_not_round_trip_nor_a_rising_queue() -> None:
    """aioquic subtracts a peer's ACK delay from a sample only above its least sample (floored at
    1 ms): over a 0.4 ms path, ACKs held 4 to 16 ms would read as that much round trip; and it
    hands the congestion controller the sample with the delay in, so reno would leave slow start
    as the member's compute grows (a machine growing busy), which is no queue on the path."""
    reno = HOLDING.model_copy(update={"congestion_control": "reno"})
    wire = ring_wire(reno)
    for token in range(40):
        trips(wire, 1, compute_s=0.004 + 0.0003 * token)
    host = wire.pair.dialler
    assert host.rtt_ms is not None and host.rtt_ms < 1.5
    assert host.quic is not None and host.quic._loss._cc.ssthresh is None  # still in slow start


def test_a_slow_handshake_does_not_keep_held_acks_in_the_round_trip() -> None:
    """A handshake taken while the path (or the machine) was slow leaves aioquic a least sample of
    several milliseconds, above which a held ACK's delay would never come off."""
    wire = Wire(Pair(config=HOLDING), one_way_s=0.002)
    wire.send()
    wire.run(0.2)  # the handshake over a 4 ms round trip
    assert wire.pair.dialler.is_up and wire.pair.listener.is_up
    wire.one_way_s = ONE_WAY_S
    trips(wire, 30)
    assert wire.pair.dialler.rtt_ms is not None and wire.pair.dialler.rtt_ms < 1.5


def test_a_tokens_rows_leave_at_once_and_arm_no_pacing_timer() -> None:
    """aioquic's pacer lets a quarter of the window go at once, here 2.5 of the 10 datagrams' window
    a ring's idle link keeps: a token's three rows went, and the empty bucket armed the pacer's
    timer for nothing, a wake-up a token on each side (213 in bench_hops' 200 tokens). The
    initial window goes at once instead (the burst RFC 9002 §7.7 allows)."""
    wire = ring_wire(HOLDING)
    for position in range(10):
        for core, source in ((wire.pair.dialler, DIALLER_AT), (wire.pair.listener, LISTENER_AT)):
            peer = wire.pair.listener if core is wire.pair.dialler else wire.pair.dialler
            core.send_frame(rows(position))
            at_once = core.datagrams_to_send(wire.pair.now)
            assert len(at_once) == 3, (position, [len(d) for d, _ in at_once])
            timer = core.timer()
            assert timer is not None and timer - wire.pair.now > 0.005, (position, timer - wire.pair.now)
            for data, _ in at_once:
                peer.datagram_received(data, source, wire.pair.now + ONE_WAY_S)
            wire.run(0.008)
        assert [f.position for f in frames(wire.pair.dialler)] == [position]
        assert [f.position for f in frames(wire.pair.listener)] == [position]
