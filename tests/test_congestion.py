"""The "rate" congestion controller (kafila.network.congestion): its rules on their own, then real
aioquic connections carrying a stage-sized stream over a simulated home path (a 20 MB/s line, a
round trip of 40 or 100 ms, loss at random; a router's deep buffer; the relay's 8 MB/s policer),
on a simulated clock."""

from __future__ import annotations

from collections import deque

import pytest
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.tls import Epoch
from quic_path_sim import PathModel, simulate_transfer

from kafila.network.congestion import (
    LOSS_MIN_PACKETS,
    MIN_RTT_WINDOW_S,
    NAME,
    PROBE_RTT_GAIN,
    PROBE_RTT_S,
    RateCongestionControl,
)
from kafila.network.link import LinkConfig

PACKET = 1200
LINE = 20e6  # bytes a second: a home's 20 MB/s line
SPACING = 1e-4  # seconds between the packets of `packets`: a 12 MB/s bottleneck


def packets(count: int, first: int, sent_time: float) -> list[QuicSentPacket]:
    return [
        QuicSentPacket(
            epoch=Epoch.ONE_RTT,
            in_flight=True,
            is_ack_eliciting=True,
            is_crypto_packet=False,
            packet_number=first + i,
            packet_type=QuicPacketType.ONE_RTT,
            sent_time=sent_time + i * SPACING,
            sent_bytes=PACKET,
        )
        for i in range(count)
    ]


class HandPath:
    """A transfer by hand through `control`: a packet whenever the window has room, through a
    bottleneck that passes one every SPACING (12 MB/s) and queues the rest, then the path's round
    trip of the moment; so a sample is that round trip and the wait in the queue."""

    def __init__(self, control: RateCongestionControl) -> None:
        self.control = control
        self.now = 0.0
        self.flight: deque[tuple[float, QuicSentPacket]] = deque()  # (when acknowledged, packet)
        self.departed = 0.0  # when the bottleneck passed the latest packet
        self.samples: list[float] = []  # every round trip sampled

    def carry(self, seconds: float, rtt: float) -> None:
        until = self.now + seconds
        while self.now < until:
            if self.control.bytes_in_flight + PACKET <= self.control.congestion_window:
                (packet,) = packets(1, 0, self.now)
                self.control.on_packet_sent(packet=packet)
                self.departed = max(self.now, self.departed) + SPACING
                self.flight.append((self.departed + rtt, packet))
            else:
                acked, packet = self.flight.popleft()
                self.now = max(self.now, acked)
                sample = self.now - (packet.sent_time or 0.0)
                self.samples.append(sample)
                self.control.on_packet_acked(now=self.now, packet=packet)
                self.control.on_rtt_measurement(now=self.now, rtt=sample)


def past_startup(base_rtt: float) -> HandPath:
    path = HandPath(RateCongestionControl(max_datagram_size=PACKET))
    while path.control.startup:
        path.carry(base_rtt, base_rtt)
    path.carry(1.0, base_rtt)
    return path


def test_the_queue_a_full_window_keeps_is_under_a_round_trip_and_the_pace_stays_the_rate() -> None:
    """The window is at most 1.5 x the rate x the round trip without a queue, and 20 ms of the rate:
    a sender that fills it keeps a queue at the bottleneck under a round trip (40 ms; the window of
    rate x smoothed round trip kept the queue its startup built), and its pace (aioquic's window /
    smoothed round trip) is the rate: the cap does not slow it."""
    path = past_startup(0.04)
    control = path.control
    assert 11e6 < control.bandwidth < 14e6  # the 12 MB/s of SPACING
    path.samples.clear()
    path.carry(3.0, 0.04)
    steady = path.samples[len(path.samples) // 2 :]
    assert max(steady) < 0.04 + 0.045  # a round trip, and the window's EXTRA_PACKETS
    assert control.congestion_window < 2 * control.bandwidth * 0.04 + 5 * PACKET
    assert control.congestion_window / control.smoothed_rtt >= 0.95 * control.bandwidth


def test_a_round_trip_that_stays_up_under_the_cap_is_the_paths_and_the_rate_survives_it() -> None:
    """Round trips that stay ten times the smallest while the cap holds the pace under the rate are
    no queue of the sender's (a busy machine, a longer route): a probe takes them as the path's,
    and the rate's estimate does not shrink round after round with the capped window."""
    path = past_startup(0.04)
    control = path.control
    rate = control.bandwidth
    path.carry(5.0, 0.4)
    while control.probing_rtt:  # it also probes when a queue it built reaches the cap
        path.carry(0.01, 0.4)
    assert control.min_rtt == pytest.approx(0.4, rel=0.01)
    assert control.bandwidth > 0.8 * rate
    assert control.congestion_window / control.smoothed_rtt >= 0.9 * control.bandwidth


def test_a_round_trip_that_ages_while_the_window_is_full_is_probed_again() -> None:
    """The round trip without a queue is the smallest of the last ten seconds. A transfer that
    fills its window hides it behind its own queue, so when it ages the sender drains for a round
    of at least PROBE_RTT_S at half the product, and takes the round trip it sees then: here the
    path's, grown from 40 to 60 ms (a new route), so the window's cap grows with it."""
    path = past_startup(0.04)
    control = path.control
    assert control.min_rtt == pytest.approx(0.04, rel=0.01)
    started = path.now
    while not control.probing_rtt:
        path.carry(0.01, 0.06)
        assert path.now - started < MIN_RTT_WINDOW_S + 1
    assert path.now - started > MIN_RTT_WINDOW_S - 1  # from the last 40 ms sample, in past_startup
    assert control.congestion_window <= PROBE_RTT_GAIN * control.bandwidth * 0.04 + 5 * PACKET
    probe = path.now
    while control.probing_rtt:
        path.carry(0.01, 0.06)
    assert path.now - probe >= PROBE_RTT_S
    assert control.min_rtt == pytest.approx(0.06, rel=0.01)
    path.carry(0.5, 0.06)
    assert control.congestion_window / control.smoothed_rtt >= 0.9 * control.bandwidth


def test_the_controller_is_registered_with_aioquic_and_a_link_can_ask_for_it() -> None:
    assert NAME == "rate"
    assert LinkConfig(congestion_control="rate").congestion_control == "rate"


def test_a_loss_at_random_costs_nothing_and_a_round_past_the_ceiling_ends_the_growth() -> None:
    """Reno halves its window at the first loss; here one lost packet in a hundred only adds
    nothing, and the window keeps growing by what is delivered. A round that loses a fifth of its
    packets (a policer, a queue overflowing) ends the growth: the window comes from the rate."""
    control = RateCongestionControl(max_datagram_size=PACKET)
    start = control.congestion_window
    sent = packets(100, 1, 0.0)
    for packet in sent:
        control.on_packet_sent(packet=packet)
    control.on_packets_lost(now=0.05, packets=sent[50:51])
    for packet in sent[:50] + sent[51:]:
        control.on_packet_acked(now=0.05, packet=packet)
        control.on_rtt_measurement(now=0.05, rtt=0.05)
    assert control.startup
    assert control.congestion_window == start + 99 * PACKET
    assert control.bytes_in_flight == 0
    burst = packets(100, 101, 0.05)
    for packet in burst:
        control.on_packet_sent(packet=packet)
    control.on_packets_lost(now=0.1, packets=burst[: LOSS_MIN_PACKETS + 12])
    assert not control.startup
    assert control.bandwidth > 0
    assert control.congestion_window < start + 199 * PACKET


@pytest.mark.parametrize(("rtt", "loss"), [(0.04, 0.005), (0.1, 0.005)])
def test_over_a_lossy_home_line_rate_reaches_the_line_where_reno_crawls(rtt: float, loss: float) -> None:
    """A 12 MB stream over 20 MB/s with 0.5% loss each way: reno's window stays near what the loss
    allows (under a tenth of the line); rate's is the path's: ten times reno's or more, and over a
    third of the line with its startup (about ten round trips of a 1.5 s transfer) counted."""
    line = PathModel(rate=LINE, delay_s=rtt / 2, loss=loss)
    size = 12 << 20
    reno = simulate_transfer(size, line, congestion_control="reno", time_limit_s=300)
    rate = simulate_transfer(size, line, congestion_control="rate", time_limit_s=300)
    assert reno.rate < 0.1 * LINE
    assert rate.rate > 0.35 * LINE
    assert rate.rate > 10 * reno.rate
    assert rate.lost > 0  # the loss was there for both


def test_through_the_relays_policer_rate_settles_under_the_budget() -> None:
    """The relay drops what passes its 8 MB/s budget (a 2 MB bucket) at once: rate backs off to it,
    without collapsing, and carries most of the budget."""
    policer = PathModel(rate=8e6, burst=2e6, delay_s=0.04)
    run = simulate_transfer(12 << 20, policer, congestion_control="rate", time_limit_s=300)
    assert run.rate > 0.6 * 8e6


DEEP_BUFFER_S = 1.0  # a home router's buffer: a second of its line


@pytest.mark.parametrize("loss", [0.0, 0.005])
def test_behind_a_deep_router_buffer_rate_keeps_a_queue_under_a_round_trip_at_the_lines_rate(loss: float) -> None:
    """A 16 MB stream over 20 MB/s, 40 ms, a second of buffer: the queue that rate's datagrams wait
    in over the transfer's second half (the delay it adds to a ring's tokens and to everything
    else the home sends) stays under a base round trip and a quarter (it was 68 ms with the window
    at rate x smoothed round trip), while it carries what reno does without loss and most of the
    line at 0.5% loss."""
    line = PathModel(rate=LINE, delay_s=0.02, loss=loss, queue_s=DEEP_BUFFER_S)
    size = 16 << 20
    rate = simulate_transfer(size, line, congestion_control="rate", time_limit_s=300)
    assert rate.queueing() < 1.25 * 0.04
    assert rate.dropped == 0
    if loss:
        assert rate.rate > 0.7 * LINE
    else:
        reno = simulate_transfer(size, line, congestion_control="reno", time_limit_s=300)
        assert rate.rate >= 0.98 * reno.rate


def test_when_the_line_slows_rate_does_not_fill_the_router_buffer() -> None:
    """Half a second into a 16 MB stream another machine of the home takes half of its 10 MB/s
    line. A window of rate x smoothed round trip grew with the queue it built (the rate's estimate
    is the best of ten rounds, the old line's) and filled the buffer's whole second, dropping
    thousands of packets; capped by the round trip without a queue, the queue stays under a quarter
    second and comes back under a base round trip once the estimate has aged, at reno's rate."""
    line = PathModel(rate=10e6, delay_s=0.02, queue_s=DEEP_BUFFER_S, slower_at_s=0.5, slower_rate=5e6)
    size = 16 << 20
    rate = simulate_transfer(size, line, congestion_control="rate", time_limit_s=300)
    reno = simulate_transfer(size, line, congestion_control="reno", time_limit_s=300)
    assert rate.dropped == 0
    assert max(wait for _, wait in rate.waits) < 0.25
    assert rate.queueing(after=(rate.seconds - 0.5) / rate.seconds) < 0.05
    assert rate.rate >= 0.98 * reno.rate
