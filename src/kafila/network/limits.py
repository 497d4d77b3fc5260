"""Rates and counts by source address, for everything the open internet can reach: the
rendezvous's HTTP side, STUN, LAN discovery and the relay."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


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
