"""How large a link's datagrams may be: packetization-layer path MTU discovery (RFC 8899, DPLPMTUD,
as QUIC uses it: RFC 9000 §14.3), without I/O.

A ring's token crosses a link as a frame of a few KB: at QUIC's minimum of 1,200 bytes a
gemma-3-270m token's rows are three datagrams each way, at 1,452 (a 1,500-byte Ethernet MTU less
the IPv6 and UDP headers) two; each datagram costs aioquic's Python its framing, encryption and a
system call (docs/benchmarks.md, the per-token toll). No path is known to carry more than 1,200,
and a datagram larger than the path carries is lost without a word (the sockets forbid
fragmentation, `kafila.portability.forbid_fragmentation`). So a link starts at 1,200 and:

- probes a larger size with a datagram of exactly that size (a PING padded out); the size is used
  once the probe is acknowledged;
- a lost probe is tried again after `PROBE_AGAIN_S`, and after `MAX_PROBES` lost in a row not
  before `SEARCH_AGAIN_S`; a lost probe is no sign of congestion (RFC 9000 §14.4), and the link
  does not treat it as one;
- falls back to 1,200 when the path stops carrying the size it uses (a route that changed, a
  tunnel added): `BLACK_HOLE_LOSSES` datagrams above 1,200 lost in a row with none sent after
  them acknowledged, and searches again after `SEARCH_AGAIN_S`. QUIC resends what was lost, now
  in datagrams of 1,200.

`DatagramSizeSearch` is the rule alone: the link tells it of probes and of packets acknowledged
and lost, with the time; it says when to probe, what size, and the size to use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_DATAGRAM = 1200  # QUIC's minimum (RFC 9000 §14): every path that carries QUIC carries it
# Sizes tried in turn, each once the one before is acknowledged, up to the link's ceiling:
# 1,452 fits a 1,500-byte MTU under IPv6's and UDP's headers (and IPv4's with room).
PROBE_SIZES = (1452,)
MAX_PROBES = 3  # RFC 8899's MAX_PROBES: lost probes of one size before the search rests
PROBE_AGAIN_S = 1.0  # after a lost probe: one lost at random is tried again soon
# After a search that rested, or a fall back: RFC 8899's PMTU_RAISE_TIMER is 600 s; a link of a
# ring lives for hours, and one lost to a passing fault should not stay small for ten minutes.
SEARCH_AGAIN_S = 60.0
# Datagrams above the base lost in a row, none sent after them acknowledged: the path no longer
# carries the size (RFC 8899 §4.3, black hole detection). Three, as MAX_PROBES: a random loss
# seldom takes three in a row while the datagrams sent after them arrive.
BLACK_HOLE_LOSSES = 3


@dataclass
class DatagramSizeSearch:
    """The datagram size a link uses, and when to probe for a larger one.

    `ceiling` is the largest size to try (`LinkConfig.max_datagram_size`); at the base, the link
    never probes. Packet numbers are the link's own, rising with each packet it sends."""

    ceiling: int = PROBE_SIZES[-1]
    size: int = BASE_DATAGRAM
    fallbacks: int = 0  # times the path stopped carrying the size in use
    _probe: int | None = None  # the size of the probe in flight
    _lost_probes: int = 0  # of the next size, in a row
    _probe_at: float = 0.0  # no probe before this
    _largest_acked: int = -1  # the highest packet number above the base acknowledged
    _lost_in_a_row: int = 0  # above the base, each sent after `_largest_acked`
    _sizes: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.ceiling < BASE_DATAGRAM:
            raise ValueError(f"a datagram ceiling below QUIC's minimum of {BASE_DATAGRAM} bytes: {self.ceiling}")
        steps = [size for size in PROBE_SIZES if size < self.ceiling]
        self._sizes = (*steps, self.ceiling) if self.ceiling > BASE_DATAGRAM else ()

    def probe_due(self, now: float) -> int | None:
        """The size to probe now, or None: one in flight already, none left, or not yet time."""
        if self._probe is not None or now < self._probe_at:
            return None
        larger = [size for size in self._sizes if size > self.size]
        return larger[0] if larger else None

    def probe_sent(self, size: int) -> None:
        self._probe = size

    def probe_acked(self, size: int, packet_number: int) -> None:
        """The path carried `size`: use it, and try the next size up at once."""
        self._probe = None
        self._lost_probes = 0
        self.size = max(self.size, size)
        self.packet_acked(packet_number, size)

    def probe_lost(self, now: float) -> None:
        self._probe = None
        self._lost_probes += 1
        if self._lost_probes >= MAX_PROBES:
            self._lost_probes = 0
            self._probe_at = now + SEARCH_AGAIN_S
        else:
            self._probe_at = now + PROBE_AGAIN_S

    def packet_acked(self, packet_number: int, sent_bytes: int) -> None:
        """A packet arrived: one above the base shows that the path still carries such."""
        if sent_bytes > BASE_DATAGRAM and packet_number > self._largest_acked:
            self._largest_acked = packet_number
            self._lost_in_a_row = 0

    def packet_lost(self, packet_number: int, sent_bytes: int, now: float) -> None:
        """A packet (not a probe) was declared lost; enough above the base in a row, none acknowledged
        after them, and the link falls back to the base."""
        if sent_bytes <= BASE_DATAGRAM or packet_number < self._largest_acked:
            return
        self._lost_in_a_row += 1
        if self._lost_in_a_row >= BLACK_HOLE_LOSSES and self.size > BASE_DATAGRAM:
            self.size = BASE_DATAGRAM
            self.fallbacks += 1
            self._lost_in_a_row = 0
            self._lost_probes = 0
            self._probe_at = now + SEARCH_AGAIN_S
