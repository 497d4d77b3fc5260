"""Two real aioquic connections over a simulated path, on a simulated clock.

aioquic is sans-IO: a connection takes datagrams and the time, and gives datagrams and a timer.
So a bulk transfer can run between two real connections (real packets, real loss recovery,
the congestion controller under test) over a path that is a model: a bottleneck of a rate with
a tail-drop queue, a one-way delay and a random loss. No socket, no sleeping, and no CPU bound:
what it measures is what the protocol reaches on that path, which the NAT lab on a shared
2-vCPU machine cannot show at 20 MB/s (docs/benchmarks.md, "Stage files over a lossy line").
"""

from __future__ import annotations

import heapq
import math
import random
import ssl
from dataclasses import dataclass, field

from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived
from aioquic.quic.packet import pull_quic_header

from kafila.network.identity import create_identity

Address = tuple[str, int]
SENDER: Address = ("10.0.0.1", 4433)
RECEIVER: Address = ("10.0.0.2", 4433)


@dataclass(frozen=True)
class PathModel:
    """One direction of a path: a bottleneck of `rate` bytes/s (0: none) whose queue holds
    `queue_s` seconds of it (tail drop past that), then `delay_s` one way, and `loss` a chance
    that each packet is lost on the way, whatever the queue. With `burst`, the rate is a
    policer's instead (the relay's budget): a bucket of `burst` bytes filled at `rate`, and a
    packet that finds too little in it is dropped at once; nothing queues."""

    rate: float = 0.0
    delay_s: float = 0.0
    loss: float = 0.0
    queue_s: float = 0.1
    burst: float = 0.0
    batch_s: float = 0.0  # datagrams leave only at multiples of this (a Wi-Fi or cable uplink's slots)
    # From `slower_at_s` on the simulated clock, the bottleneck passes `slower_rate` bytes/s instead
    # (another machine of the home starts sending over the same line).
    slower_at_s: float = math.inf
    slower_rate: float = 0.0


@dataclass
class _Line:
    model: PathModel
    rng: random.Random
    free_at: float = 0.0  # when the bottleneck has sent what is queued
    tokens: float = 0.0  # the policer's bucket
    filled_at: float = 0.0
    dropped: int = 0
    lost: int = 0
    waits: list[tuple[float, float]] = field(default_factory=list)  # (when, how long it queued), each datagram

    def departure(self, now: float, size: int) -> float | None:
        """When a datagram sent now arrives at the far end, or None if it never does."""
        if self.model.rate and self.model.burst:
            self.tokens = min(self.model.burst, self.tokens + (now - self.filled_at) * self.model.rate)
            self.filled_at = now
            if self.tokens < size:
                self.dropped += 1
                return None
            self.tokens -= size
            leaves = now
        elif self.model.rate:
            start = max(self.free_at, now)
            if start - now > self.model.queue_s:
                self.dropped += 1
                return None
            rate = self.model.slower_rate if now >= self.model.slower_at_s else self.model.rate
            self.free_at = start + size / rate
            self.waits.append((now, start - now))
            leaves = self.free_at
        else:
            leaves = now
        if self.model.loss and self.rng.random() < self.model.loss:
            self.lost += 1
            return None
        if self.model.batch_s:
            leaves = math.ceil(leaves / self.model.batch_s) * self.model.batch_s
        return leaves + self.model.delay_s


@dataclass
class TransferRun:
    """What one simulated transfer gave."""

    bytes: int
    seconds: float  # simulated: from the first stream byte offered to the last received
    dropped: int  # at the bottleneck's queue
    lost: int  # at random
    windows: list[int] = field(default_factory=list)  # the sender's congestion window, sampled
    # Each datagram's wait in the forward bottleneck's queue: (when it came, from the first stream
    # byte offered, and seconds queued). The queueing delay a transfer adds to whatever shares the line.
    waits: list[tuple[float, float]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds

    def queueing(self, after: float = 0.5) -> float:
        """The mean wait in the bottleneck's queue of the datagrams sent past `after` of the
        transfer (its steady state, startup left out)."""
        steady = [wait for when, wait in self.waits if when >= after * self.seconds]
        return sum(steady) / len(steady) if steady else 0.0


def _configuration(is_client: bool, congestion_control: str, max_datagram_size: int) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=["sim"],
        verify_mode=ssl.CERT_NONE,
        congestion_control_algorithm=congestion_control,
        max_datagram_size=max_datagram_size,
        idle_timeout=600.0,
    )
    if not is_client:
        identity = create_identity("sim")
        configuration.certificate = identity.certificate
        configuration.private_key = identity.private_key
    return configuration


def simulate_transfer(
    size: int,
    forward: PathModel,
    backward: PathModel | None = None,
    *,
    congestion_control: str = "reno",
    max_datagram_size: int = 1200,
    seed: int = 1,
    time_limit_s: float = 600.0,
) -> TransferRun:
    """Send `size` bytes on one stream from a sender to a receiver over `forward` (the receiver's
    acknowledgements over `backward`, by default the same delay and loss with no bottleneck),
    after the handshake; return how long it took on the simulated clock."""
    rng = random.Random(seed)
    backward = backward or PathModel(delay_s=forward.delay_s, loss=forward.loss)
    lines = {RECEIVER: _Line(forward, rng), SENDER: _Line(backward, rng)}
    sender = QuicConnection(configuration=_configuration(True, congestion_control, max_datagram_size))
    sender.connect(RECEIVER, 0.0)
    first = sender.datagrams_to_send(0.0)[0][0]
    receiver = QuicConnection(
        configuration=_configuration(False, congestion_control, max_datagram_size),
        original_destination_connection_id=pull_quic_header(Buffer(data=first), host_cid_length=8).destination_cid,
    )
    ends = {SENDER: sender, RECEIVER: receiver}
    arrivals: list[tuple[float, int, Address, bytes]] = [(forward.delay_s, 0, RECEIVER, first)]  # the Initial
    order = 0
    now = 0.0
    heard = False
    received = 0
    started: float | None = None
    windows: list[int] = []
    next_sample = 0.0

    def flush(source: Address) -> None:
        nonlocal order
        if source == RECEIVER and not heard:
            return  # it has no path to answer on before the Initial reaches it
        for data, destination in ends[source].datagrams_to_send(now):
            at = lines[destination].departure(now, len(data))
            if at is not None:
                order += 1
                heapq.heappush(arrivals, (at, order, destination, data))

    while received < size:
        flush(SENDER)
        flush(RECEIVER)
        if started is None and sender._handshake_complete:  # aioquic sets it when the handshake is done
            started = now
            sender.send_stream_data(0, bytes(size), end_stream=True)
            flush(SENDER)
        timers = [t for t in (sender.get_timer(), receiver.get_timer()) if t is not None]
        upcoming = [*timers, arrivals[0][0]] if arrivals else timers
        if not upcoming:
            raise RuntimeError("the simulated transfer stalled: no packet in flight and no timer")
        now = max(now, min(upcoming))
        if now > time_limit_s:
            raise TimeoutError(f"the simulated transfer passed {time_limit_s} s with {received} of {size} bytes")
        while arrivals and arrivals[0][0] <= now:
            _, _, destination, data = heapq.heappop(arrivals)
            source = SENDER if destination == RECEIVER else RECEIVER
            ends[destination].receive_datagram(data, source, now)
            heard = heard or destination == RECEIVER
        for end in (sender, receiver):
            timer = end.get_timer()
            if timer is not None and timer <= now:
                end.handle_timer(now)
                if end.get_timer() == timer:
                    # aioquic's loss timer is a packet's sent time + a delay, and the loss it then
                    # checks is sent time <= now - that delay, which a rounding error can miss:
                    # a real clock moves on, this one would stay there
                    end.handle_timer(now + 1e-9)
        while (event := receiver.next_event()) is not None:
            if isinstance(event, StreamDataReceived):
                received += len(event.data)
        while sender.next_event() is not None:
            pass
        if started is not None and now >= next_sample:
            windows.append(sender._loss.congestion_window)  # aioquic's recovery: the sender's window
            next_sample = now + 0.05
    assert started is not None
    forward_line, backward_line = lines[RECEIVER], lines[SENDER]
    return TransferRun(
        size,
        now - started,
        forward_line.dropped + backward_line.dropped,
        forward_line.lost + backward_line.lost,
        windows,
        [(when - started, wait) for when, wait in forward_line.waits if when >= started],
    )
