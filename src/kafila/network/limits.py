"""Rates and counts by source address, for everything the open internet can reach: the
rendezvous's HTTP side, STUN, LAN discovery and the relay."""

from __future__ import annotations

import functools
import ipaddress
from collections import deque
from dataclasses import dataclass, field


@functools.lru_cache(maxsize=4096)  # on every datagram of a flood: one parse per source, not per datagram
def address_group(ip: str) -> str:
    """The unit every per-address limit counts: an IPv4 address, or an IPv6 /64 (one home or
    host gets a whole /64, so counting single IPv6 addresses limits nothing). An IPv4 address
    mapped into IPv6 counts as itself; anything unreadable as one group of its own text."""
    try:
        address = ipaddress.ip_address(ip.strip("[]").split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def network_group(group: str) -> str:
    """The network an address group sits in, for caps that leave room for other networks: an
    IPv6 /56 (what one provider hands a home; its /64s are cheap to hold by the hundred), or an
    IPv4 /24. Anything unreadable is a network of its own text."""
    network = _network(group)
    if network is None:
        return group
    prefix = 56 if network.version == 6 else 24
    return str(network.supernet(new_prefix=prefix)) if network.prefixlen > prefix else str(network)


def is_loopback(group: str) -> bool:
    """Whether an address group (`address_group`) is this machine's own loopback."""
    network = _network(group)
    if network is None:
        return False
    return network.is_loopback or (network.version == 6 and ipaddress.ip_address("::1") in network)


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """An address or address group as a network (an address is a network of one); None if unreadable."""
    try:
        return ipaddress.ip_network(text.strip("[]").split("%", 1)[0], strict=False)
    except ValueError:
        return None


@dataclass
class TokenBucket:
    """`rate` units a second, at most `burst` saved up; starts full."""

    rate: float
    burst: float
    level: float = -1.0
    at: float | None = None

    def take(self, amount: float, now: float) -> bool:
        if self.at is None:
            self.level, self.at = self.burst, now
        self.level = min(self.burst, self.level + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        if amount > self.level:
            return False
        self.level -= amount
        return True


@dataclass
class RateByAddress:
    """A token bucket per source address; past `max_tracked` addresses the least recently seen
    is forgotten first, so a flood of spoofed sources costs bounded memory."""

    rate: float  # units a second, sustained
    burst: float
    max_tracked: int
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)

    def allow(self, address: str, now: float, amount: float = 1.0) -> bool:
        bucket = self._buckets.pop(address, None)  # re-inserted last: the oldest go first
        if bucket is None:
            while len(self._buckets) >= self.max_tracked:
                del self._buckets[next(iter(self._buckets))]
            bucket = TokenBucket(self.rate, self.burst)
        self._buckets[address] = bucket
        return bucket.take(amount, now)

    @property
    def tracked(self) -> int:
        return len(self._buckets)


@dataclass
class RecentByAddress:
    """When each of an address's recent events happened, within a sliding window; past
    `max_tracked` addresses the longest tracked is forgotten first (bounded memory)."""

    window_s: float
    max_tracked: int
    _times: dict[str, deque[float]] = field(default_factory=dict)

    def recent(self, address: str, now: float) -> deque[float]:
        """The address's events still inside the window, oldest first (read-only)."""
        times = self._times.get(address)
        if times is None:
            return deque()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._times[address]
        return times

    def add(self, address: str, now: float) -> None:
        times = self._times.get(address)
        if times is None:
            while len(self._times) >= self.max_tracked:
                del self._times[next(iter(self._times))]
            times = self._times[address] = deque()
        times.append(now)

    def wait_s(self, address: str, now: float, allowed: int) -> float:
        """How long until the address has fewer than `allowed` events in the window (0: now)."""
        times = self.recent(address, now)
        if len(times) < allowed:
            return 0.0
        return times[len(times) - allowed] + self.window_s - now

    def expire(self, now: float) -> None:
        for address in list(self._times):
            self.recent(address, now)
