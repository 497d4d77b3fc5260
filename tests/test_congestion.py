"""The "rate" congestion controller (kafila.network.congestion): its rules on their own, then real
aioquic connections carrying a stage-sized stream over a simulated home path (a 20 MB/s line, a
round trip of 40 or 100 ms, loss at random; the relay's 8 MB/s policer), on a simulated clock."""

from __future__ import annotations

import pytest
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.tls import Epoch
from quic_path_sim import PathModel, simulate_transfer

from kafila.network.congestion import LOSS_MIN_PACKETS, NAME, RateCongestionControl
from kafila.network.link import LinkConfig

PACKET = 1200
LINE = 20e6  # bytes a second: a home's 20 MB/s line


def packets(count: int, first: int, sent_time: float) -> list[QuicSentPacket]:
    return [
        QuicSentPacket(
            epoch=Epoch.ONE_RTT,
            in_flight=True,
            is_ack_eliciting=True,
            is_crypto_packet=False,
            packet_number=first + i,
            packet_type=QuicPacketType.ONE_RTT,
            sent_time=sent_time + i * 1e-4,
            sent_bytes=PACKET,
        )
        for i in range(count)
    ]


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
