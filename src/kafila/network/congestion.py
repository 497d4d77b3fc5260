"""A congestion controller that sends at the path's measured delivery rate: loss does not halve it.

Reno and cubic take every lost packet for a full queue and halve their window. On a home path
that loses packets at random (Wi-Fi, a busy cable segment) that caps a transfer whatever the
line's rate: at 0.5% loss a window stays near 1.22/sqrt(0.005) ≈ 17 packets, 0.2 MB/s over a
100 ms round trip of a 20 MB/s line (docs/benchmarks.md, "Stage files over a lossy line").
Parallel streams cannot lift it: every stream of a link shares its connection's one window.

This controller (registered with aioquic as "rate") is a small BBR. It measures what the path
delivers (bytes acknowledged over the time they took, the best of the last ten round trips) and
keeps a window of that rate times the smoothed round trip. aioquic paces at window / smoothed
round trip, so the window sets the sending rate to the measured one, whatever the round trip
(a busy receiver's included). One round in eight asks a quarter more, to find a faster path,
and the next a quarter less, to drain what that queued. It starts as slow start does (the
window grows by what each acknowledgement delivers) and leaves that when round trips rise above
the smallest seen (`QUEUE_RISE`, the bottleneck's queue filling) or three rounds in a row no
longer deliver a quarter more. Losses it leaves to the rate, with one exception: a round that
loses more than `LOSS_CEILING` of its packets (a policer such as the relay's budget, a queue
that keeps overflowing) takes the estimate down to `LOSS_BACKOFF` of itself, once a round.

The smoothed round trip includes whatever queue the transfer built, so a window of rate × smoothed
round trip keeps any queue, and grows one: when the line slows (another machine of the home
sends), the estimate stays at the old rate for ten rounds, the round trip swells, and the window
with it, up to a deep router buffer's full second (docs/benchmarks.md, "The queue a transfer keeps").
So the window is also capped at `CWND_GAIN` × rate × the path's round trip without a queue, and
`QUEUE_ALLOWANCE_S` of the rate besides (timers, acknowledgements that come in bursts, a busy
machine's scheduling): the queue it keeps is at most about half a round trip and that allowance.
Under the cap aioquic's pace (window / smoothed round trip) falls below the rate while the queue is
deeper than that, which drains it, and is the rate's again once it is not. The round trip without
a queue is the smallest seen in the last `MIN_RTT_WINDOW_S`; when that ages while the sender fills
its window, one round of at least `PROBE_RTT_S` sends at most `PROBE_RTT_GAIN` of the product, to
empty the queue and see the path's round trip again, as BBR's probe-RTT does. It probes as well
when the cap has held the window `CAPPED_ROUNDS` rounds in a row: a round trip that stays up while
the pace is under the rate is not a queue (a busy machine, a longer route), and taken as the
path's, so that the cap does not starve the rate's estimate round after round.

Samples are judged by the packet they acknowledge: `delivered` (bytes acknowledged when it was
sent) and when, so that a sample spans at least one round trip of the path's own pace. A sample
lower than the estimate from a time the sender was not filling its window (an idle ring link
between frames) is ignored, so the window survives idle time, as reno's does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from aioquic.quic.congestion.base import K_INITIAL_WINDOW, QuicCongestionControl, register_congestion_control
from aioquic.quic.packet_builder import QuicSentPacket

NAME = "rate"
BANDWIDTH_ROUNDS = 10  # the estimate is the best delivery rate of this many measuring rounds
PROBE_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # the window's gain, one per round
FULL_GROWTH = 1.25  # startup ends when the rate has not grown by this much ...
FULL_ROUNDS = 3  # ... for this many rounds in a row
REGROWTH = 1.2  # a probing round that delivers this much more than the estimate: startup again
QUEUE_RISE = 2.0  # startup ends when round trips are this much above the smallest ...
QUEUE_RISE_S = 0.01  # ... and this much besides (timers, acknowledgement delay, a busy machine) ...
QUEUE_RISE_SAMPLES = 8  # ... this many in a row: the bottleneck's queue is filling
LOSS_CEILING = 0.05  # a round that loses more than this fraction of its packets ...
LOSS_MIN_PACKETS = 8  # ... and at least this many: the path is full ...
LOSS_BACKOFF = 0.85  # ... and the estimate comes down to this much of what that round delivered
EXTRA_PACKETS = 4  # the window's allowance over the product, for acknowledgements that come late
CWND_GAIN = 1.5  # the window is at most this many times the rate × the round trip without a queue ...
QUEUE_ALLOWANCE_S = 0.02  # ... and this long at the rate besides: the queue it keeps
MIN_RTT_WINDOW_S = 10.0  # the round trip without a queue is the smallest seen in this long ...
PROBE_RTT_S = 0.2  # ... and when it ages, the sender drains its queue for this long and a round ...
PROBE_RTT_GAIN = 0.5  # ... with a window of at most this many times the rate × that round trip
CAPPED_ROUNDS = 4  # a probe too when the cap has held the window this many rounds in a row


class _Sent(NamedTuple):  # a tuple: one is made for every packet sent
    delivered: int  # bytes acknowledged when the packet was sent
    delivered_time: float  # when the latest of those was acknowledged
    first_sent_time: float  # when the packet acknowledged then had been sent
    app_limited: bool  # the window was not full: the sender had less to send than it allowed


class RateCongestionControl(QuicCongestionControl):
    """Window = delivery rate × smoothed round trip × gain; see the module's docstring."""

    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._packet = max_datagram_size
        self._floor = K_INITIAL_WINDOW * max_datagram_size
        self._sent: dict[int, _Sent] = {}  # id() of each packet in flight
        self.delivered = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        self.startup = True
        self.rounds = 0
        self._round_end = 0  # `delivered` past which the current round ends
        self._round_best = 0.0
        self._round_acked = 0
        self._round_lost = 0
        self._backed_off = False  # in this round
        self._rates: deque[float] = deque(maxlen=BANDWIDTH_ROUNDS)  # each measuring round's best
        self._full_rate = 0.0
        self._full_rounds = 0
        self._rising = 0
        self.min_rtt = math.inf  # the smallest round trip of the last MIN_RTT_WINDOW_S: the path without a queue
        self._min_rtt_at = 0.0  # when it was seen
        self._window_min_rtt = math.inf  # the smallest since then: min_rtt when that ages on an idle link
        self.smoothed_rtt = 0.0
        self._phase = 0
        self.probing_rtt = False
        self._probe_rtt_until = 0.0  # the probe ends past this time ...
        self._probe_rtt_delivered = 0  # ... and once `delivered` reaches this: a round trip of it
        self._filling = False  # the latest packet sent found the window full: a transfer, not a ring
        self._capped_rounds = 0  # rounds in a row that ended with the window at its cap

    @property
    def bandwidth(self) -> float:
        """The path's delivery rate, bytes a second, as estimated (0 before the first sample)."""
        return max(self._rates, default=0.0)

    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        if not self.bytes_in_flight:  # idle until now: a sample starts from this packet
            self._delivered_time = self._first_sent_time = packet.sent_time or 0.0
        self.bytes_in_flight += packet.sent_bytes
        app_limited = self.bytes_in_flight + self._packet < self.congestion_window
        self._filling = not app_limited
        self._sent[id(packet)] = _Sent(self.delivered, self._delivered_time, self._first_sent_time, app_limited)

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        self.bytes_in_flight -= packet.sent_bytes
        sent = self._sent.pop(id(packet), None)
        self.delivered += packet.sent_bytes
        self._delivered_time = now
        self._first_sent_time = packet.sent_time or now
        self._round_acked += 1
        if self.startup:  # slow start: the window grows by what is delivered, doubling each round
            self.congestion_window += packet.sent_bytes
        if sent is None:
            return
        interval = max(now - sent.delivered_time, (packet.sent_time or now) - sent.first_sent_time)
        if interval > 0:
            rate = (self.delivered - sent.delivered) / interval
            if not sent.app_limited or rate >= self.bandwidth:
                self._round_best = max(self._round_best, rate)
        if sent.delivered >= self._round_end:
            self._next_round(now)
        self._set_window()

    def _next_round(self, now: float) -> None:
        self.rounds += 1
        before = self.bandwidth
        if self._round_best and not self._backed_off:
            self._rates.append(self._round_best)
        if not self.startup and self._phase == 0 and self.bandwidth >= REGROWTH * before:
            # The round that asked a quarter more got it: the path has room that a startup cut
            # short (round trips that wobble on a busy machine) left unused. Double again.
            self.startup, self._full_rate, self._full_rounds, self._rising = True, before, 0, 0
        elif self.startup and self._rates:
            if self.bandwidth >= FULL_GROWTH * self._full_rate:
                self._full_rate, self._full_rounds = self.bandwidth, 0
            else:
                self._full_rounds += 1
                if self._full_rounds >= FULL_ROUNDS:
                    self._leave_startup()
        elif not self.startup:
            self._phase = (self._phase + 1) % len(PROBE_GAINS)
            capped = self.bandwidth * self.smoothed_rtt > self.window_cap and not self.probing_rtt
            self._capped_rounds = self._capped_rounds + 1 if capped else 0
            if self._capped_rounds >= CAPPED_ROUNDS and self._filling:
                self._probe_rtt(now)
        self._round_end = self.delivered
        self._round_best = 0.0
        self._round_acked = self._round_lost = 0
        self._backed_off = False

    def _leave_startup(self) -> None:
        self.startup = False
        self._phase = 1  # begin with the round that asks less: drain what startup queued
        self._set_window()

    @property
    def window_cap(self) -> float:
        """The most the window holds outside startup: CWND_GAIN × the rate × the round trip
        without a queue, and QUEUE_ALLOWANCE_S of the rate (inf before the first samples)."""
        if not self._rates or math.isinf(self.min_rtt):
            return math.inf
        return self.bandwidth * (CWND_GAIN * self.min_rtt + QUEUE_ALLOWANCE_S)

    def _set_window(self) -> None:
        if self.startup or not self._rates or not self.smoothed_rtt:
            return
        if self.probing_rtt:
            window = PROBE_RTT_GAIN * self.bandwidth * self.min_rtt
        else:
            # The round that asks less drains what probing queued, down to the product at most:
            # under that the line would idle.
            window = PROBE_GAINS[self._phase] * self.bandwidth * self.smoothed_rtt
            window = min(max(window, self.bandwidth * self.min_rtt), self.window_cap)
        self.congestion_window = max(self._floor, int(window + EXTRA_PACKETS * self._packet))

    def _age_min_rtt(self, now: float, rtt: float) -> None:
        """Keep min_rtt the smallest of the last MIN_RTT_WINDOW_S; probe for it when it ages on a
        link whose window is full (its own queue hides the path's round trip), take the smallest
        since then on one that is not (it has no queue of its own to drain)."""
        self._window_min_rtt = min(self._window_min_rtt, rtt)
        if rtt <= self.min_rtt:
            self.min_rtt, self._min_rtt_at = rtt, now
        if self.probing_rtt:
            if now >= self._probe_rtt_until and self.delivered >= self._probe_rtt_delivered:
                self.probing_rtt = False
                self.min_rtt, self._min_rtt_at, self._window_min_rtt = self._window_min_rtt, now, math.inf
                self._set_window()
        elif now - self._min_rtt_at > MIN_RTT_WINDOW_S:
            if self._filling and not self.startup:
                self._probe_rtt(now)
            elif not self._filling:
                self.min_rtt, self._min_rtt_at, self._window_min_rtt = self._window_min_rtt, now, math.inf

    def _probe_rtt(self, now: float) -> None:
        self.probing_rtt, self._capped_rounds = True, 0
        self._probe_rtt_until = now + PROBE_RTT_S
        self._probe_rtt_delivered = self.delivered + self.bytes_in_flight
        self._window_min_rtt = math.inf
        self._set_window()

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        self.smoothed_rtt = 7 / 8 * self.smoothed_rtt + 1 / 8 * rtt if self.smoothed_rtt else rtt
        self._age_min_rtt(now, rtt)
        if not self.startup:
            self._set_window()
            return
        self._rising = self._rising + 1 if rtt > QUEUE_RISE * self.min_rtt + QUEUE_RISE_S else 0
        if self._rising >= QUEUE_RISE_SAMPLES:  # the bottleneck's queue is filling: the rate is found
            self._rates.append(self._round_best)
            self._leave_startup()

    def on_packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._sent.pop(id(packet), None)

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._sent.pop(id(packet), None)
            self._round_lost += 1
        lost, packets_seen = self._round_lost, self._round_acked + self._round_lost
        if self._backed_off or lost < LOSS_MIN_PACKETS or lost <= LOSS_CEILING * packets_seen:
            return
        # The path is full (a policer, a queue that keeps overflowing): ask less, by a step each
        # round that still loses as much. Loss at random never comes near the ceiling.
        backoff = LOSS_BACKOFF * self.bandwidth
        self._rates.clear()
        self._rates.append(backoff)
        self._backed_off = True
        self.startup = False
        self._phase = 2
        self._set_window()

    def on_persistent_congestion(self) -> None:
        """Nothing got through for several round trips: start again from what a new link has."""
        self._rates.clear()
        self.startup, self._full_rate, self._full_rounds, self._rising = True, 0.0, 0, 0
        self.congestion_window = self._floor

    def get_log_data(self) -> dict[str, float]:
        return {
            "cwnd": self.congestion_window,
            "bytes_in_flight": self.bytes_in_flight,
            "bandwidth": self.bandwidth,
            "min_rtt": self.min_rtt,
            "smoothed_rtt": self.smoothed_rtt,
            "probing_rtt": float(self.probing_rtt),
        }


register_congestion_control(NAME, RateCongestionControl)
