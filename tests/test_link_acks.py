"""When a link acknowledges (`LinkConfig.ack_hold_s`), with two `LinkCore`s over a simulated path
and injected time: a ring's frame answered within the hold carries the ACK back with the answer,
and no datagram goes for the ACK alone; rows answered on another link (a ring of three machines)
have their ACK go with that answer, not 1 ms into the compute, and the sender sees no more
round trip, no probe timeout, no slower recovery and the same window for it; anything else
keeps aioquic's pace; a gap is acknowledged at once; an ACK that waited is neither round trip
nor a rise of the path's queue to the sender; and a token's rows leave without arming aioquic's
pacer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from aioquic.quic.congestion.base import K_INITIAL_WINDOW
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


def one_way_wire(config: LinkConfig) -> Wire:
    """An up pair whose listener has answered one token's rows on another link, as the first
    member of a ring of three answers the host's rows with its own, to the next member."""
    wire = Wire(Pair(config=config).up())
    wire.run(0.1)  # the handshake's last ACKs
    one_way(wire, 1)
    return wire


def one_way(wire: Wire, count: int, compute_s: float = 0.003, ring_s: float = 0.012) -> list[float]:
    """Rows one way: the dialler sends a token's rows, the listener computes for `compute_s` and
    answers on another link (`LinkCore.answered`), the rest of the ring takes `ring_s`. When each
    token's rows arrived whole, from its sending."""
    pair, arrived = wire.pair, []
    for position in range(count):
        sent = pair.now
        pair.dialler.send_frame(rows(position))
        wire.send()
        came: list[Frame] = []
        while not came:
            wire.run(0.0001)
            came = frames(pair.listener)
        assert [f.position for f in came] == [position]
        arrived.append(pair.now - sent)
        wire.run(compute_s)
        if pair.listener.answered(pair.now):
            wire.send()
        wire.run(ring_s)
    return arrived


def test_rows_answered_on_another_link_have_their_ack_go_with_that_answer() -> None:
    """On a ring of three machines each link carries rows one way: the first member answers the
    host's rows with its own, to the next member. Their ACK waits for that answer and goes with
    it, while the member is awake to send anyway, not alone 1 ms into its compute (aioquic's
    pace, which had it land on the member's cores as its stage decoded: docs/benchmarks.md,
    issue 38's pricing). One ACK a token either way."""
    held, paced = one_way_wire(HOLDING), one_way_wire(AIOQUIC_PACE)
    for wire, before_answer in ((held, 0), (paced, 1)):
        pair = wire.pair
        for position in range(20):
            start = len(wire.sent["listener"])
            pair.dialler.send_frame(rows(position))
            wire.send()
            wire.run(ONE_WAY_S + 0.003)  # the rows arrive; the member computes
            assert [f.position for f in frames(pair.listener)] == [position]
            assert wire.alone("listener", start) == before_answer
            assert pair.listener.answered(pair.now) is (before_answer == 0)
            wire.send()
            assert len(wire.sent["listener"]) - start == wire.alone("listener", start) == 1
            wire.run(0.012)
            assert len(wire.sent["listener"]) - start == 1


def test_an_answer_on_another_link_slower_than_the_hold_finds_the_ack_gone_when_the_hold_ended() -> None:
    wire = one_way_wire(HOLDING)
    pair = wire.pair
    pair.dialler.send_frame(rows(1))
    wire.send()
    before = len(wire.sent["listener"])
    wire.run(ONE_WAY_S + HOLDING.ack_hold_s - 0.002)
    assert len(wire.sent["listener"]) == before  # still waiting for the answer
    wire.run(0.004)
    assert wire.alone("listener", before) == 1
    assert not pair.listener.answered(pair.now)  # nothing left to send with the answer
    wire.send()
    assert len(wire.sent["listener"]) == before + 1


@pytest.mark.parametrize("compute_s", [0.003, 0.018, 0.030])
def test_rows_one_way_with_held_acks_need_no_probe_nor_retransmission(compute_s: float) -> None:
    """The held ACK comes within the hold (20 ms), which the sender's probe timeout allows for
    (its smoothed round trip, four deviations, and the 25 ms max_ack_delay that aioquic
    announces, RFC 9002 §6.2.1): an answer that takes 3 ms, nearly the hold, or longer than it,
    and the sender sends each token's three datagrams once, nothing more."""
    wire = one_way_wire(HOLDING)
    before = {side: len(sent) for side, sent in wire.sent.items()}
    one_way(wire, 30, compute_s=compute_s)
    assert len(wire.sent["dialler"]) - before["dialler"] == 3 * 30
    assert len(wire.sent["listener"]) - before["listener"] == wire.alone("listener", before["listener"]) == 30


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_a_loss_on_a_one_way_link_is_recovered_as_soon_as_at_aioquics_pace(lost: int) -> None:
    """A token's first, second or last datagram lost: a gap is acknowledged at once, so the sender
    learns of the loss and sends it again before the answer (first or second lost), and a last
    datagram lost leaves the two before it ending no frame, acknowledged at aioquic's pace as
    before: the frame arrives whole as soon as with aioquic's pace, and the rows after it too."""
    arrived = {}
    for name, config in (("held", HOLDING), ("paced", AIOQUIC_PACE)):
        wire = one_way_wire(config)
        wire.lost = {len(wire.sent["dialler"]) + lost}
        arrived[name] = one_way(wire, 3, compute_s=0.003)
    assert arrived["held"] == arrived["paced"], arrived
    assert arrived["held"][0] > 2 * ONE_WAY_S + 0.0005  # it was lost: sent again


def test_a_held_ack_on_a_one_way_link_is_not_round_trip_nor_a_rising_queue() -> None:
    """The ACK waits for the member's compute, which grows from 4 to 16 ms (a machine growing
    busy), and says so in its ACK delay: the sender's smoothed round trip stays the 0.4 ms path's,
    as with aioquic's pace, and reno stays in slow start, its window growing by what each ACK
    acknowledges."""
    reno = HOLDING.model_copy(update={"congestion_control": "reno"})
    seen = {}
    for name, config in (("held", reno), ("paced", reno.model_copy(update={"ack_hold_s": 0.0}))):
        wire = one_way_wire(config)
        for token in range(40):
            one_way(wire, 1, compute_s=0.004 + 0.0003 * token)
        host = wire.pair.dialler
        assert host.quic is not None
        seen[name] = (host.rtt_ms, host.quic._loss._cc.ssthresh, host.quic._loss._cc.congestion_window)
    rtt_ms, ssthresh, window = seen["held"]
    assert rtt_ms is not None and rtt_ms == pytest.approx(seen["paced"][0], abs=0.02)  # the delay's 8 µs steps
    assert ssthresh is None and window > K_INITIAL_WINDOW * BASE_DATAGRAM
    assert seen["held"][1:] == seen["paced"][1:]


def test_a_prefill_one_way_grows_the_window_as_at_aioquics_pace() -> None:
    """A long prompt's chunks (64 rows, 137 datagrams each) cross a link one way: all but a chunk's
    last datagram end no frame, and ACK_EVERY bounds what waits, so the sender's window ("rate",
    the default) and each chunk's time across are as with aioquic's pace."""
    seen = {}
    for name, config in (("held", HOLDING), ("paced", AIOQUIC_PACE)):
        wire = one_way_wire(config)
        pair, arrived, windows = wire.pair, [], []
        for index in range(6):
            sent = pair.now
            chunk = np.full((64, 640), index, dtype=np.float32)
            pair.dialler.send_frame(Frame.of_hidden(Kind.PREFILL, 1, 64 * index, chunk))
            wire.send()
            came: list[Frame] = []
            while not came:
                wire.run(0.0001)
                came = frames(pair.listener)
            arrived.append(round(pair.now - sent, 6))
            wire.run(0.010)
            if pair.listener.answered(pair.now):
                wire.send()
            wire.run(0.002)
            assert pair.dialler.quic is not None
            windows.append(pair.dialler.quic._loss._cc.congestion_window)
        seen[name] = (arrived, windows)
    assert seen["held"] == seen["paced"]
    assert max(seen["held"][1]) > 10 * K_INITIAL_WINDOW * BASE_DATAGRAM


def test_rows_this_side_does_not_answer_keep_aioquics_pace() -> None:
    """Rows that this side never answers on any link (`LinkCore.answered` not called: it sends no
    ring frames) have nothing to wait for, so their ACKs keep aioquic's pace."""
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
