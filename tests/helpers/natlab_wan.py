"""The NAT lab's WAN: a user-space delay line for each home's uplink.

This kernel has no `netem` qdisc and no NFQUEUE (shared/notes/wan-delay.md), so a home's link
to the internet gets its delay, jitter, loss and rate here. The lab's public namespace routes
every packet that crosses home N's link, in either direction, into a TUN device `wanN`
(policy routing, `NatLab.set_wan`); this process reads it, holds it as the link would, and
writes it back into the same device, from where the kernel routes it on. A packet from one
home to another crosses both homes' lines, as on the internet.

`WanLine` is the pure core (when does this packet leave, or is it lost), tested with injected
time and randomness; `DepartureQueue` hands packets out at their times in the order they came;
`serve` is the asyncio shell, run inside the public namespace as `python natlab_wan.py`, driven
by one JSON line per command on stdin, answered on stdout (`echo` and `ping` measure a lab's
round trips, `udp_echo` and `udp_ping`):

    {"home": 1, "address": "198.51.100.6", "delay_ms": 20, "jitter_ms": 0, "loss": 0.0,
     "rate_mbit": 0, "down": false}   →   {"ok": true, "tun": "wan1"}
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_QUEUE_S = (
    0.5  # a packet that would wait longer than this for the link's rate is dropped, as a router's buffer drops it
)
MAX_PACKET = 65_535
MAX_EARLY_S = 0.003  # the most a packet is scheduled ahead of its departure, to make up for late timers


@dataclass(frozen=True)
class WanLink:
    """One home's uplink as the internet would give it; the same each way."""

    delay_ms: float = 0.0  # one way, across this link only
    jitter_ms: float = 0.0  # uniform ± around the delay; packets stay in order
    loss: float = 0.0  # the chance that a packet is lost, each way
    rate_mbit: float = 0.0  # 0: unlimited
    down: bool = False  # the link is gone (a laptop's lid): every packet is lost

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_mbit < 0:
            raise ValueError("delay, jitter and rate are never negative")
        if self.jitter_ms > self.delay_ms:
            raise ValueError("jitter larger than the delay would send packets back in time")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError("loss is a probability, from 0 to 1")


@dataclass
class _Direction:
    link_free_at: float = 0.0  # when the link has sent what is queued (the rate's queue)
    last_out: float = 0.0  # the latest departure given: packets never overtake each other


@dataclass
class WanLine:
    """When each packet crossing one link leaves it: pure, with the time and randomness given."""

    link: WanLink = field(default_factory=WanLink)
    rng: random.Random = field(default_factory=random.Random)
    directions: dict[bool, _Direction] = field(default_factory=lambda: {True: _Direction(), False: _Direction()})
    dropped: int = 0
    passed: int = 0

    def departure(self, now: float, size: int, inbound: bool) -> float | None:
        """When a packet of `size` bytes that reached the line at `now` leaves it; None if lost."""
        link = self.link
        if link.down or (link.loss > 0 and self.rng.random() < link.loss):
            self.dropped += 1
            return None
        way = self.directions[inbound]
        sent = now
        if link.rate_mbit > 0:
            start = max(now, way.link_free_at)
            if start - now > MAX_QUEUE_S:
                self.dropped += 1
                return None
            sent = start + size * 8 / (link.rate_mbit * 1e6)
            way.link_free_at = sent
        jitter = self.rng.uniform(-link.jitter_ms, link.jitter_ms) if link.jitter_ms else 0.0
        out = max(sent + (link.delay_ms + jitter) / 1000, way.last_out)
        way.last_out = out
        self.passed += 1
        return out


@dataclass
class DepartureQueue:
    """Packets waiting on a line, handed out in the order they came in.

    One timer per packet would not do: asyncio's timer heap is not stable, so packets read in one
    burst (the same departure time) left in a shuffled order. QUIC takes a packet overtaken by
    three later ones as lost, so the line made spurious losses, and reno halved its window for
    each (a stage file crawled at 1 to 2 MB/s over an 80 ms round trip). Times pushed never
    decrease (`WanLine` never lets a packet overtake), so a FIFO is in time order.
    """

    waiting: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)

    def push(self, at: float, packet: bytes) -> bool:
        """Queue a packet to leave at `at`; True if it is now the first (the caller sets a timer)."""
        if self.waiting and at < self.waiting[-1][0]:
            raise ValueError("a packet may not be scheduled before one queued ahead of it")
        self.waiting.append((at, packet))
        return len(self.waiting) == 1

    def due(self, now: float) -> list[tuple[float, bytes]]:
        """The packets whose time has come, in order, with their times."""
        out = []
        while self.waiting and self.waiting[0][0] <= now:
            out.append(self.waiting.popleft())
        return out

    @property
    def next_at(self) -> float | None:
        return self.waiting[0][0] if self.waiting else None


def destination(packet: bytes) -> str | None:
    """An IPv4 packet's destination address (the lab is IPv4 only)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return None
    return socket.inet_ntoa(packet[16:20])


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class _Tun:
    """One home's TUN device and line: packets in, each written back at its departure time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, address: str, line: WanLine) -> None:
        self.loop, self.name, self.address, self.line = loop, name, address, line
        self.fd = open_tun(name)
        # The loop wakes a timer late (epoll rounds its wait up to a millisecond, and a busy
        # machine adds more): each packet is scheduled this much before its departure, learnt
        # from how late the timers have been, so a 10 ms line holds 10 ms and not 11.
        self.early = 0.0
        self.last_scheduled = 0.0  # never before an earlier packet's: packets keep their order
        self.queue = DepartureQueue()
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        while True:
            try:
                packet = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            now = self.loop.time()
            leaves = self.line.departure(now, len(packet), inbound=destination(packet) == self.address)
            if leaves is not None:
                scheduled = self.last_scheduled = max(now, leaves - self.early, self.last_scheduled)
                if self.queue.push(scheduled, packet):
                    self.loop.call_at(scheduled, self._write)

    def _write(self) -> None:
        now = self.loop.time()
        for scheduled, packet in self.queue.due(now):
            self.early = min(MAX_EARLY_S, 0.9 * self.early + 0.1 * (now - scheduled))
            try:
                os.write(self.fd, packet)
            except OSError:  # the kernel would not take it back (a full queue): lost, as on a link
                self.line.dropped += 1
        if (next_at := self.queue.next_at) is not None:
            self.loop.call_at(next_at, self._write)


async def serve() -> None:
    """Read commands from stdin, one JSON object a line; answer each on stdout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tuns: dict[int, _Tun] = {}
    while line := await reader.readline():
        answer: dict[str, object]
        try:
            request = json.loads(line)
            home = int(request.pop("home"))
            address = str(request.pop("address"))
            if request.pop("stats", False):
                tun = tuns[home]
                answer = {"ok": True, "passed": tun.line.passed, "dropped": tun.line.dropped}
            else:
                link = WanLink(**request)
                if home not in tuns:
                    tuns[home] = _Tun(loop, f"wan{home}", address, WanLine(link))
                tuns[home].line.link = link
                answer = {"ok": True, "tun": tuns[home].name}
        except Exception as error:  # a bad command is answered, never fatal
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def udp_echo(host: str, port: int, open_toward: tuple[str, int] | None = None) -> None:
    """Answer every datagram with itself (the far end of `udp_ping`), until killed. Behind a cone
    NAT, one datagram `open_toward` somewhere first makes the mapping that lets pings in."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, port))
        if open_toward is not None:
            sock.sendto(b"open", open_toward)
        print(json.dumps({"ready": sock.getsockname()[1]}), flush=True)
        while True:
            data, source = sock.recvfrom(MAX_PACKET)
            sock.sendto(data, source)


def udp_ping(host: str, port: int, count: int, interval_s: float, timeout_s: float = 2.0) -> dict[str, object]:
    """Round trips of `count` numbered datagrams, one every `interval_s`: the measured ones, in
    ms, and how many never came back."""
    rtts: dict[int, float] = {}
    sent: dict[int, float] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        deadline = None
        number = 0
        while True:
            now = time.monotonic()
            if number < count and (not sent or now >= sent[number - 1] + interval_s):
                sent[number] = now
                sock.sendto(struct.pack("!I", number), (host, port))
                number += 1
            if number == count and deadline is None:
                deadline = now + timeout_s
            if deadline is not None and (now >= deadline or len(rtts) == count):
                break
            wait = interval_s if number < count else max(0.0, deadline - now) if deadline else interval_s
            if select.select([sock], [], [], min(wait, 0.05))[0]:
                with contextlib.suppress(BlockingIOError):
                    while True:
                        data = sock.recv(MAX_PACKET)
                        (echoed,) = struct.unpack("!I", data[:4])
                        if echoed in sent and echoed not in rtts:
                            rtts[echoed] = (time.monotonic() - sent[echoed]) * 1000
    return {"rtt_ms": [rtts[n] for n in sorted(rtts)], "lost": count - len(rtts)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"]:
        toward = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else None
        udp_echo(sys.argv[2], int(sys.argv[3]), toward)
    elif sys.argv[1:2] == ["ping"]:
        host, port, count, interval = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(udp_ping(host, port, count, interval)))
    else:
        asyncio.run(serve())
