"""A QUIC link between two ring neighbours, carrying activation frames.

Layers, sans-IO first as in aioquic itself:

- `DatagramDemux` owns a member's one UDP socket (the one STUN, punching and the relay binding
  already used, so the NAT mapping the peer knows is the one QUIC uses) and routes each
  datagram by its first byte: 0-3 STUN, 0x10-0x12 relay and punch, 64 and above QUIC (RFC 9000
  sets the fixed bit; aioquic never greases it). QUIC datagrams go to the link registered for
  the source address; other ranges go to whatever handler registered for them.
- `LinkCore` is the sans-IO link: datagrams, frames and the clock go in; datagrams, a timer and
  events (`Up`, `Received`, `Rejected`, `Down`) come out.
- `Link` is the asyncio shell: timers, futures and a receive queue; `open_link()` makes one.

Trust: each member has a fresh self-signed certificate (`kafila.network.identity`) and learns
the peer's SHA-256 fingerprint out of band. Both sides present certificates; neither verifies a
chain (`CERT_NONE`), and each compares the peer's fingerprint once the handshake completes
(aioquic still checks the handshake signature, so the peer holds the key). In TLS 1.3 the
client finishes before the server has seen the client's certificate, so the server's first
message, a hello on its first stream, is what makes the link up on the dialling side.

Streams: one bidirectional QUIC stream per sequence id and direction. The side that sends a
sequence's frames opens its stream on the first frame and keeps it until `finish()` or a
CANCEL. QUIC orders bytes within a stream but not across streams, so one stream per sequence
keeps each sequence in order while a lost packet of one sequence does not stall the others
(no head-of-line blocking between requests). A stream's reverse half carries only replies
about it: an ERROR frame when the receiver rejected what arrived. At most 128 sequences per
direction can be open at once (aioquic's stream limit); more wait until one finishes.

Bounds: aioquic grants flow-control credit as fast as a peer sends, so credit does not hold
a peer back. What a link holds of its peer's data instead has one bound, `max_held_bytes`:
frames still arriving in pieces, and frames delivered but not yet taken by the application
(`Link.receive`, or whoever took over releasing them: `Link.release`). A peer that makes the
link hold more is sent away (`LinkOverBound`, code OVER_BOUND) and learns why.

Liveness: QUIC PINGs (answered by ACKs) whenever nothing was heard for
min(keepalive, idle timeout / 3) seconds; they also refresh NAT mappings. A link that hears
nothing from its peer for `idle_timeout_s` is down (`LinkDead`), whatever aioquic's own idle
timer (which restarts on our own sends) would say.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion.base import K_GRANULARITY, K_INITIAL_WINDOW
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicFrameType, QuicPacketType, pull_quic_header
from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder, QuicSentPacket
from aioquic.quic.rangeset import RangeSet
from aioquic.quic.recovery import QuicPacketSpace
from cryptography.hazmat.primitives.serialization import Encoding
from pydantic import BaseModel, ConfigDict, Field

from kafila.network import congestion  # noqa: F401  (registers "rate" with aioquic)
from kafila.network.datagram_size import BASE_DATAGRAM, DatagramSizeSearch
from kafila.network.identity import Identity, fingerprint_of, normalize_fingerprint
from kafila.network.relay import HELLO_ACK, hello, parse_ack
from kafila.portability import forbid_fragmentation
from kafila.wire.frames import HIDDEN_KINDS, MAX_PAYLOAD, DType, Frame, FrameDecoder, FrameError, Kind

Address = tuple[str, int]
Handler = Callable[[bytes, Address], None]
log = logging.getLogger("kafila.link")

ALPN = "kafila-link/1"
STUN_BYTES = range(0, 4)
RELAY_PUNCH_BYTES = range(0x10, 0x13)
QUIC_BYTES = range(64, 256)
# Datagrams read from the socket per wake-up before the links answer (see `DatagramDemux`).
RECEIVE_BATCH = 16
# A link socket's receive buffer: what arrives while the process is busy elsewhere. The kernel's
# default (208 KiB, about 90 datagrams of 1,200 bytes) overflowed under a bulk transfer on a busy
# machine, and QUIC takes each overflowed datagram as congestion: over an 80 ms round trip reno
# then crawls. The kernel caps it at net.core.rmem_max (docs/benchmarks.md, "Stage files over a
# lab edge").
RECEIVE_BUFFER = 4 << 20
RECENT_REJECTIONS = 64  # a link keeps this many of its latest rejections, and counts them all
# Frames a ring answers at once, on the link they came by where the ring spans two machines: a
# stage's rows (the member answers with its own), the head's answer (the host sends the next
# wave), a CANCEL (it comes back). The ACK of a datagram that ends such frames waits for the
# answer to carry it (`LinkConfig.ack_hold_s`).
ANSWERED_KINDS = frozenset((*HIDDEN_KINDS, Kind.LOGITS, Kind.ROWS, Kind.CANCEL))
# An ACK waits for fewer of the peer's datagrams than this: well inside the 10 datagrams' window a
# sender starts with (and that "rate" keeps while a ring's traffic leaves it idle), so a held ACK
# never stops a sender; a token's rows of a hidden size up to about 900 in f32 fit.
ACK_EVERY = 4
# A link whose side answered the peer's ring frames within this long holds their ACKs for the next
# answer: on the same link on a ring of two machines; on a longer ring, where each link carries
# rows one way, on the link to the next machine (`LinkCore.answered`).
ANSWERING_S = 1.0

# Application error codes in CONNECTION_CLOSE and STOP_SENDING.
GOODBYE = 0
REFUSED = 0x4B01  # the peer's certificate is not the pinned one
DEAD = 0x4B02  # nothing heard from the peer for too long
REJECTED = 0x4B03  # STOP_SENDING: a stream carried a malformed frame
OVER_BOUND = 0x4B04  # the peer made us hold more of its data than the bound allows
HELLO = b'{"hello": 1}'


class LinkError(Exception):
    """Why a link is not (or no longer) up."""


class LinkRefused(LinkError):
    """The peer is not who it was expected to be, or it said the same of us."""


class LinkDead(LinkError):
    """Nothing heard from the peer within the bound: it crashed, or the path is gone."""


class LinkClosed(LinkError):
    """Closed on purpose, by either side, or its socket went away."""


class LinkOverBound(LinkError):
    """One side sent more than the other would hold unread: it was sent away."""


class LinkConfig(BaseModel):
    """Timings and sizes; defaults suit a ring over home connections."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    keepalive_s: float = Field(default=15.0, gt=0)  # NAT mappings live 30 s or less on many routers
    # Nothing heard this long: the link is dead. A neighbour that dies just after its last packet
    # is reported this long after; 4 s leaves a second of timer and scheduling slack under the
    # 5 s that issue 5 allows. Pings go every idle/3 = 1.3 s, so three lost in a row kill it.
    idle_timeout_s: float = Field(default=4.0, gt=0)
    handshake_timeout_s: float = Field(default=10.0, gt=0)  # also how long a listener waits to be dialled
    # The largest datagram the link probes its path for (`kafila.network.datagram_size`): it
    # starts at QUIC's 1,200, which any path carries, and uses more only once a probe of that size
    # is acknowledged. 1,452 fits a 1,500-byte MTU and makes a gemma-3-270m token's rows two
    # datagrams instead of three; 1,200: never probe.
    max_datagram_size: int = Field(default=1452, ge=BASE_DATAGRAM, le=65_000)
    # "rate" (kafila.network.congestion) sends at the path's measured delivery rate, so a loss at
    # random does not halve it; reno and cubic (aioquic's) do, which caps a stage file at 0.5%
    # loss near 0.2 MB/s over a 100 ms round trip, whatever the line (docs/benchmarks.md).
    congestion_control: Literal["reno", "cubic", "rate"] = "rate"
    # The peer's bytes this side holds at once: frames in pieces and frames not yet taken. One
    # frame of the largest size the protocol allows, and 64 MiB besides (a transfer's window and a
    # chunk, or a few waves of a ring's activations, with room to spare).
    max_held_bytes: int = Field(default=MAX_PAYLOAD + (64 << 20), ge=1 << 16)
    # How long the ACK of a datagram that ends whole ring frames (`ANSWERED_KINDS`), on a link
    # whose frames this side answers (`ANSWERING_S`), waits for the answer. aioquic sends every
    # ACK alone, 1 ms after the packet; on a ring the answer follows a stage's compute some
    # milliseconds later. On a ring of two machines it goes back on the same link and carries the
    # ACK, which saves a datagram each way and a wake-up to send it (docs/benchmarks.md, the
    # per-token toll); on a longer ring it goes on to the next machine, and the ACK goes with it,
    # not 1 ms into this side's decode. Below the 25 ms that aioquic announces as its
    # max_ack_delay (RFC 9000 §13.2.1), which the peer's probe timeout allows for. 0: aioquic's
    # own pace.
    ack_hold_s: float = Field(default=0.020, ge=0, lt=0.025)

    @property
    def ping_interval_s(self) -> float:
        """Ping often enough that a healthy idle link never looks dead."""
        return min(self.keepalive_s, self.idle_timeout_s / 3)


def should_dial(local_fingerprint: str, peer_fingerprint: str) -> bool:
    """QUIC has no simultaneous open: the member whose fingerprint sorts lower dials."""
    local, peer = normalize_fingerprint(local_fingerprint), normalize_fingerprint(peer_fingerprint)
    if local == peer:
        raise ValueError("a member cannot link to itself")
    return local < peer


def channel_of(data: bytes) -> str:
    """Name of the protocol a datagram belongs to, by its first byte (RFC 7983 style)."""
    if not data:
        return "empty"
    first = data[0]
    if first in STUN_BYTES:
        return "stun"
    if first in RELAY_PUNCH_BYTES:
        return "relay/punch"
    if first in QUIC_BYTES:
        return "quic"
    return "unknown"


def _address(addr: Any) -> Address:
    return (str(addr[0]), int(addr[1]))  # IPv6 addresses arrive as 4-tuples


# --- aioquic private hooks: the only code here that depends on aioquic internals. ---
# Verified on aioquic 1.7.2. aioquic has no public way for a server to request a client
# certificate, nor to read the peer's certificate (aioquic issue #541), so both live here, with
# a way to tell whether a server connection has decrypted anything from its peer yet, and ways
# to learn of the peer's goodbye when it arrives and to say ours again (RFC 9000 §10.2). aioquic
# also has no path-MTU discovery (its datagram size is fixed by its configuration): the size
# probes and the hooks on its congestion controller that tell the search what was lost live here.
class _MutualTLSConnection(QuicConnection):
    """A QuicConnection whose server side asks for the client's certificate."""

    goodbye: tuple[bytes, ...] = ()  # the datagrams that carried our CONNECTION_CLOSE

    def __init__(self, *, datagram_ceiling: int = BASE_DATAGRAM, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # aioquic sends every datagram at one size, set once from its configuration (1,200 here);
        # this search raises it once the path carried a probe of more, and lowers it again.
        self.datagram_size = DatagramSizeSearch(ceiling=datagram_ceiling)
        self._size_probes: set[int] = set()  # packet numbers of the size probes in flight
        self._now = 0.0  # the time aioquic was last given
        # The 1-RTT packet space, looked up once for the spaces aioquic made (an Enum key hashes in
        # Python: several lookups a datagram otherwise).
        self._spaces_seen: dict[tls.Epoch, QuicPacketSpace] | None = None
        self._one_rtt_space: QuicPacketSpace | None = None
        cc = self._loss._cc
        self._cc_packet_acked, cc.on_packet_acked = cc.on_packet_acked, self._packet_acked  # type: ignore[method-assign]
        self._cc_packets_lost, cc.on_packets_lost = cc.on_packets_lost, self._packets_lost  # type: ignore[method-assign]
        self._cc_packets_expired, cc.on_packets_expired = cc.on_packets_expired, self._packets_expired  # type: ignore[method-assign]
        self._loss_ack_received = self._loss.on_ack_received
        self._loss.on_ack_received = self._ack_received  # type: ignore[method-assign]
        self._cc_rtt_measured = self._loss._cc.on_rtt_measurement
        self._loss._cc.on_rtt_measurement = self._rtt_measured  # type: ignore[method-assign]
        self._pacer_rate_set = self._loss._pacer.update_rate
        self._loss._pacer.update_rate = self._pacing_rate_set  # type: ignore[method-assign,assignment]

    def _ack_received(self, *, ack_rangeset: RangeSet, ack_delay: float, now: float, space: QuicPacketSpace) -> None:
        """aioquic takes the peer's ACK delay off a round-trip sample only where what is left is at
        least its least sample, the least of samples that all had a delay in (floored at 1 ms,
        and the handshake's, taken on a busy machine, may be more): an ACK that waited for the
        answer (`LinkConfig.ack_hold_s`) would count whole as round trip, in the smoothed RTT
        that the planner reads as the edge's and the pacer paces by. The least sample goes down
        to what the delay leaves instead (RFC 9002 §5.3 subtracts it). A peer that overstates
        its delay (25 ms at most) can make its edge look quicker by as much, as a peer can
        overstate its stages' speed in its reports."""
        if len(ack_rangeset) and space is self._one_rtt() and ack_delay > 0:
            packet: QuicSentPacket | None = space.sent_packets.get(ack_rangeset.bounds().stop - 1)
            if packet is not None and packet.is_ack_eliciting and packet.sent_time is not None:
                left = now - packet.sent_time - min(ack_delay, self._loss.max_ack_delay)
                if 0 < left <= self._loss._rtt_min:
                    self._loss._rtt_min = left * 0.999  # below it: aioquic subtracts only from more
        self._loss_ack_received(ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space)

    def _rtt_measured(self, *, now: float, rtt: float) -> None:
        """The congestion controller's sample without the peer's ACK delay (aioquic passes it
        whole): reno leaves slow start, and "rate" its startup, where samples rise, and an ACK
        that waited for the answer is no rise of the path's queue."""
        self._cc_rtt_measured(now=now, rtt=min(rtt, self._loss._rtt_latest))

    def _pacing_rate_set(self, *, congestion_window: int, smoothed_rtt: float) -> None:
        """aioquic's pacer lets a quarter of the window go at once (2 datagrams at least): of the
        10 datagrams' window "rate" keeps while a ring's traffic leaves a link idle, 2.5. A
        token's rows (3 datagrams for a hidden size of 640 in f32) emptied it, and aioquic, which
        checks the pacer before it looks for more to send, armed the pacer's timer with nothing
        left to send: a wake-up a token on each side. The pacer lets the initial window go at
        once instead, the burst RFC 9002 §7.7 allows; the congestion window still bounds what
        is in flight."""
        self._pacer_rate_set(congestion_window=congestion_window, smoothed_rtt=smoothed_rtt)
        pacer = self._loss._pacer
        if pacer.packet_time is not None:
            pacer.bucket_max = max(pacer.bucket_max, K_INITIAL_WINDOW * pacer.packet_time)

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        self._now = now  # losses are found here and at the timer; their handlers are not told the time
        super().receive_datagram(data, addr, now)

    def handle_timer(self, now: float) -> None:
        self._now = now
        super().handle_timer(now)

    def _packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        if self._size_probes:
            self._size_probes.discard(packet.packet_number)
        if packet.sent_bytes > BASE_DATAGRAM:
            self.datagram_size.packet_acked(packet.packet_number, packet.sent_bytes)
        self._cc_packet_acked(now=now, packet=packet)

    def _packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        """Lost packets tell the size search whether the path still carries its size; a lost size
        probe is no sign of congestion (RFC 9000 §14.4): it only leaves the bytes in flight."""
        packets = list(packets)
        if self._size_probes:
            probes = [packet for packet in packets if packet.packet_number in self._size_probes]
            if probes:
                packets = [packet for packet in packets if packet.packet_number not in self._size_probes]
                self._size_probes.difference_update(packet.packet_number for packet in probes)
                self._cc_packets_expired(packets=probes)
        self._sized_lost(packets, now)
        if packets:
            self._cc_packets_lost(now=now, packets=packets)

    def _packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        """Packets aioquic sends again at a probe timeout, no ACK of them or of anything sent after
        them having come: where the path stopped carrying their size, nothing else tells."""
        packets = list(packets)
        if self._size_probes:
            self._size_probes.difference_update(packet.packet_number for packet in packets)
        self._sized_lost(packets, self._now)
        self._cc_packets_expired(packets=packets)

    def _sized_lost(self, packets: list[QuicSentPacket], now: float) -> None:
        for packet in packets:
            if packet.sent_bytes > BASE_DATAGRAM:
                self.datagram_size.packet_lost(packet.packet_number, packet.sent_bytes, now)
        self._use_size()

    def _use_size(self) -> None:
        """aioquic builds each datagram up to `_max_datagram_size` and paces by it."""
        size = self.datagram_size.size
        if size != self._max_datagram_size:
            self._max_datagram_size = size
            self._loss._pacer._max_datagram_size = size

    def _size_probe(self, size: int, now: float) -> list[tuple[bytes, Any]]:
        """A datagram of exactly `size` bytes: one packet of a PING padded out (RFC 9000 §14.4)."""
        assert self._version is not None  # the handshake is confirmed
        builder = QuicPacketBuilder(
            host_cid=self.host_cid,
            is_client=self._is_client,
            max_datagram_size=size,
            packet_number=self._packet_number,
            peer_cid=self._peer_cid.cid,
            quic_logger=self._quic_logger,
            spin_bit=self._spin_bit,
            version=self._version,
        )
        packet_number = builder.packet_number
        builder.start_packet(QuicPacketType.ONE_RTT, self._cryptos[tls.Epoch.ONE_RTT])
        padding = builder.start_frame(
            QuicFrameType.PING, handler=self._size_probe_delivered, handler_args=(size, packet_number)
        )
        padding.push_bytes(bytes(builder.remaining_buffer_space))  # PADDING frames are zeros
        self._size_probes.add(packet_number)
        self.datagram_size.probe_sent(size)
        return self._flush_builder(
            builder=builder, network_path=self._network_paths[0], peer_cid=self._peer_cid.cid, now=now
        )

    def _size_probe_delivered(self, delivery: QuicDeliveryState, size: int, packet_number: int) -> None:
        if delivery == QuicDeliveryState.ACKED:
            self.datagram_size.probe_acked(size, packet_number)
        else:
            self.datagram_size.probe_lost(self._now)
        self._use_size()

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def peer_certificate_der(self) -> bytes | None:
        certificate = self.tls._peer_certificate
        return None if certificate is None else certificate.public_bytes(Encoding.DER)

    def heard_peer(self) -> bool:
        """Whether a packet from the peer has decrypted yet (aioquic leaves its first flight then)."""
        return self._state != QuicConnectionState.FIRSTFLIGHT

    def _one_rtt(self) -> QuicPacketSpace | None:
        spaces = self._spaces
        if spaces is not self._spaces_seen:  # aioquic makes them once, at its start
            self._spaces_seen, self._one_rtt_space = spaces, spaces.get(tls.Epoch.ONE_RTT)
        return self._one_rtt_space

    def ack_due(self) -> float | None:
        """When aioquic sends its pending ACK of 1-RTT packets (alone, 1 ms after the first packet
        it acknowledges), or None: nothing waits for one."""
        space = self._one_rtt()
        return None if space is None else space.ack_at

    def ack_ranges(self) -> int:
        """How many ranges of packet numbers the pending ACK holds: a packet after a gap, or one
        that fills a gap, changes it."""
        space = self._one_rtt()
        return 0 if space is None else len(space.ack_queue)

    def ack_at(self, when: float) -> None:
        """Send the pending ACK at `when` (a time past: with the next datagram); none pending: nothing."""
        space = self._one_rtt()
        if space is not None and space.ack_at is not None:
            space.ack_at = when

    def peer_close(self) -> qe.ConnectionTerminated | None:
        """The peer's CONNECTION_CLOSE, as soon as it arrived. aioquic reports it only when its
        draining period ends, three probe timeouts later: a member flooding its link with "rate"
        saw round trips of 0.2 to 0.7 s on loopback, so 3.5 to 10 s, and its idle bound (2 s)
        came first: it learned that its link was dead, not that it was sent away and why."""
        return self._close_event if self._state == QuicConnectionState.DRAINING else None

    def closing(self) -> bool:
        """We closed the connection, and its closing period (three probe timeouts) has not ended."""
        return self._state == QuicConnectionState.CLOSING

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        closing = self._close_pending
        datagrams = super().datagrams_to_send(now)
        if closing:  # aioquic sends our CONNECTION_CLOSE alone, in this call's datagrams, and once
            self.goodbye = tuple(data for data, _ in datagrams)
        elif (
            self._handshake_confirmed
            and self._state == QuicConnectionState.CONNECTED
            and (size := self.datagram_size.probe_due(now)) is not None
        ):
            datagrams += self._size_probe(size, now)
        return datagrams


# --- events out of the core ---
@dataclass(frozen=True)
class Up:
    """Both sides have checked each other's certificate."""


@dataclass(frozen=True)
class Received:
    frame: Frame


@dataclass(frozen=True)
class Rejected:
    """We refused what the peer sent on a stream (and told it so); the link goes on."""

    stream_id: int
    reason: str


@dataclass(frozen=True)
class Down:
    error: LinkError


Event = Up | Received | Rejected | Down


@dataclass
class _Inbound:
    """A stream the peer opened: its frames, and the sequence it carries."""

    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    sequence_id: int | None = None
    rejected: bool = False


class LinkCore:
    """The link without I/O: feed it datagrams, frames and the time; drain datagrams and events."""

    def __init__(
        self,
        identity: Identity,
        peer_fingerprint: str,
        peer_address: Address,
        dial: bool,
        now: float,
        config: LinkConfig | None = None,
    ) -> None:
        self.config = config or LinkConfig()
        self.identity = identity
        self.peer_fingerprint = normalize_fingerprint(peer_fingerprint)
        self.peer_address = _address(peer_address)
        self.dial = dial
        self.is_up = False
        self.error: LinkError | None = None
        self._started = now
        self._last_heard: float | None = None
        self._last_ping = now
        self._ping_every = self.config.ping_interval_s
        self._ping_uid = 0
        self._verified = False  # we checked the peer's certificate
        self._events: deque[Event] = deque()
        self._outbound: dict[int, int] = {}  # sequence id -> our stream carrying it
        self._replies: dict[int, FrameDecoder] = {}  # our stream -> decoder of the peer's replies
        self._inbound: dict[int, _Inbound] = {}
        self._fin_sent: set[int] = set()
        self.held_bytes = 0  # the peer's bytes held: frames in pieces, and frames not yet `release`d
        self._acks_held = 0  # the peer's datagrams that the pending ACK answers
        self._answered_at: float | None = None  # when the latest peer datagram before our latest ring frame came
        self._held_since = now  # when the first of them came
        self._holding = False  # the pending ACK waits for this side's answer
        # Whether the stream data of the latest datagram ended whole ring frames, so that its ACK
        # can wait; None: it carried none.
        self._ack_waits: bool | None = None
        self._heard_closing = 0  # the peer's datagrams since we closed
        self._goodbye_again: list[bytes] = []
        self.quic: _MutualTLSConnection | None = None
        if dial:
            self.quic = _MutualTLSConnection(
                configuration=self._configuration(is_client=True), datagram_ceiling=self.config.max_datagram_size
            )
            self.quic.connect(self.peer_address, now)

    def _configuration(self, is_client: bool) -> QuicConfiguration:
        configuration = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            verify_mode=ssl.CERT_NONE,  # no chain to verify: we pin the fingerprint instead
            idle_timeout=2 * self.config.idle_timeout_s,  # a backstop; our own bound comes first
            max_datagram_size=BASE_DATAGRAM,  # larger once the path carried a probe of it
            congestion_control_algorithm=self.config.congestion_control,
            server_name="kafila" if is_client else None,
        )
        configuration.certificate = self.identity.certificate
        configuration.private_key = self.identity.private_key
        return configuration

    # --- inputs ---
    def datagram_received(self, data: bytes, address: Address, now: float) -> None:
        if self.error is not None:
            self._answer_while_closing()
            return
        if self.quic is None and not self._accept(data, now):
            return
        assert self.quic is not None
        self._last_heard = now
        if self.quic.ack_due() is None:  # the last ACK has gone: a new count
            self._acks_held = 0
        ranges, self._ack_waits = self.quic.ack_ranges(), None
        self.quic.receive_datagram(data, _address(address), now)
        if not self.dial and not self.quic.heard_peer():  # shaped like an Initial, but garbage: the
            self.quic = None  # connection it made would carry its bogus ids; wait for the real one
            return
        self._process(now)
        if self.error is None and self.quic is not None:
            self._pace_ack(now, ranges)

    def _accept(self, data: bytes, now: float) -> bool:
        """The listening side creates its connection from the dialler's first Initial packet."""
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=8)
        except ValueError:
            return False
        if header.packet_type != QuicPacketType.INITIAL or len(data) < 1200:
            return False
        self.quic = _MutualTLSConnection(
            configuration=self._configuration(is_client=False),
            original_destination_connection_id=header.destination_cid,
            datagram_ceiling=self.config.max_datagram_size,
        )
        return True

    def send_frame(self, frame: Frame) -> None:
        """Queue a frame on its sequence's stream. The stream lasts as long as the link: a sequence's
        frames, a CANCEL and the next request's rows after it, must arrive in the order they left,
        and only one stream keeps that order when a lost packet is sent again."""
        if self.error is not None:
            raise self.error
        if not self.is_up or self.quic is None:
            raise LinkError("the link is not up yet")
        self.quic.ack_at(0.0)  # a pending ACK goes with the frame, not in a datagram of its own
        if frame.kind in ANSWERED_KINDS:
            self._answered_at = self._last_heard
        stream_id = self._outbound.get(frame.sequence_id)
        if stream_id is None:
            stream_id = self.quic.get_next_available_stream_id()
            self._outbound[frame.sequence_id] = stream_id
            self._replies[stream_id] = FrameDecoder()
        try:  # the header, then the payload as it is: aioquic copies it into its buffer anyway
            self.quic.send_stream_data(stream_id, frame.header())
            if frame.payload:
                self.quic.send_stream_data(stream_id, frame.payload)
        except RuntimeError:  # the peer stopped this stream (it rejected something): use a new one
            del self._outbound[frame.sequence_id]
            self.send_frame(frame)

    def answered(self, now: float) -> bool:
        """This side sent ring frames on another link, which may answer what this one brought: on a
        ring of three machines or more each link carries rows one way, and a member's answer to
        its predecessor's rows goes on to its successor. An ACK held for that answer goes now,
        while this side is awake to send anyway, and not from a timer in the middle of its next
        decode; this link's later ring frames wait for the next answer (`_pace_ack`). Whether
        an ACK is to go (`datagrams_to_send`)."""
        if self.quic is None or not self.is_up:
            return False
        self._answered_at = self._last_heard
        if not self._holding or self.quic.ack_due() is None:
            return False
        self._holding = False
        self.quic.ack_at(now)
        return True

    def finish(self, sequence_id: int) -> None:
        """End a sequence's stream without a CANCEL: the sequence is done on this edge."""
        stream_id = self._outbound.pop(sequence_id, None)
        if stream_id is not None:
            self._end_stream(stream_id)

    def release(self, n_bytes: int) -> None:
        """The application took a delivered frame of `n_bytes` (`Frame.wire_bytes`): it no longer counts."""
        self.held_bytes = max(0, self.held_bytes - n_bytes)

    def send_raw(self, data: bytes, end: bool = False) -> int:
        """Write arbitrary bytes on a new stream (and end it if `end`): for tests and fault injection only."""
        if self.quic is None or not self.is_up:
            raise LinkError("the link is not up yet")
        stream_id = self.quic.get_next_available_stream_id()
        self._replies[stream_id] = FrameDecoder()
        self.quic.send_stream_data(stream_id, data, end_stream=end)
        if end:
            self._fin_sent.add(stream_id)
        return stream_id

    def close(self, now: float, reason: str = "goodbye") -> None:
        """Say goodbye: the peer learns at once instead of waiting for its idle bound."""
        if self.quic is not None:
            self.quic.close(error_code=GOODBYE, reason_phrase=reason)
        self._down(LinkClosed(f"closed locally: {reason}"))

    def send_away(self, error: LinkOverBound) -> None:
        """End the link because the peer sent more than we hold unread; it learns why."""
        self._fail(error, OVER_BOUND)

    def abort(self, error: LinkError) -> None:
        """Give up without a word to the peer (our socket is gone)."""
        self.quic = None  # nothing more to send, no timers to run
        self._down(error)

    def handle_timer(self, now: float) -> None:
        if self.error is not None:
            if self.quic is not None and (timer := self.quic.get_timer()) is not None and now >= timer:
                self.quic.handle_timer(now)  # finish sending the goodbye
            return
        if self.quic is not None:
            timer = self.quic.get_timer()
            if timer is not None and now >= timer:
                self.quic.handle_timer(now)
                self._process(now)
                if self.error is not None:
                    return
        if not self.is_up:
            if now >= self._started + self.config.handshake_timeout_s:
                what = "handshake" if self.quic is not None else "wait to be dialled"
                self._fail(LinkDead(f"{what} with {self._peer()} timed out"), DEAD)
            return
        assert self._last_heard is not None and self.quic is not None
        if now >= self._last_heard + self.config.idle_timeout_s:
            silent = now - self._last_heard
            self._fail(LinkDead(f"nothing heard from {self._peer()} for {silent:.1f} s"), DEAD)
            return
        if now >= max(self._last_heard, self._last_ping) + self._ping_every:
            self._ping_uid += 1
            self.quic.send_ping(self._ping_uid)
            self._last_ping = now

    # --- outputs ---
    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        if self.quic is None:
            return []
        # To the addresses aioquic was given, each one an `Address` already (`datagram_received`).
        datagrams: list[tuple[bytes, Address]] = self.quic.datagrams_to_send(now)
        if self._goodbye_again:
            again, self._goodbye_again = self._goodbye_again, []
            datagrams += [(data, self.peer_address) for data in again]
        return datagrams

    @property
    def datagram_size(self) -> int:
        """The size of the datagrams this link sends now: QUIC's 1,200 until its path carried more."""
        return BASE_DATAGRAM if self.quic is None else self.quic.datagram_size.size

    @property
    def rtt_ms(self) -> float | None:
        """aioquic's smoothed round-trip estimate (private, like the hooks above), once it has one."""
        recovery = getattr(self.quic, "_loss", None)
        if recovery is None or not getattr(recovery, "_rtt_initialized", False):
            return None
        return round(float(recovery._rtt_smoothed) * 1e3, 3)

    def timer(self) -> float | None:
        """When `handle_timer` must next run."""
        quic_timer = self.quic.get_timer() if self.quic is not None else None
        if self.error is not None:
            return quic_timer
        if not self.is_up:
            own = self._started + self.config.handshake_timeout_s
        else:
            assert self._last_heard is not None
            own = min(
                self._last_heard + self.config.idle_timeout_s,
                max(self._last_heard, self._last_ping) + self._ping_every,
            )
        return own if quic_timer is None else min(own, quic_timer)

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    # --- internals ---
    def _pace_ack(self, now: float, ranges_before: int) -> None:
        """When to acknowledge what just came (RFC 9000 §13.2). A datagram that ends whole ring
        frames (`ANSWERED_KINDS`), on a link whose frames this side answers (it did within
        ANSWERING_S), is answered soon: by data going back, which carries the ACK (`send_frame`),
        or on a longer ring by frames to the next machine, which send it (`answered`). Its ACK
        waits up to `ack_hold_s` for that, rather than going alone after aioquic's 1 ms and
        waking this side to send it, in the middle of its compute. Anything else (a frame still
        arriving, a stage file, a control message, the handshake, frames this side does not
        answer), or ACK_EVERY datagrams waiting, keeps aioquic's pace; a gap in the packet
        numbers is acknowledged at once, so that the peer learns of a loss sooner."""
        assert self.quic is not None
        self._holding = False
        due = self.quic.ack_due()
        if due is None or not self.is_up:  # nothing asks for an ACK, or the handshake's: aioquic's
            return
        if self._acks_held == 0:
            self._held_since = now
        self._acks_held += 1
        if ranges_before and self.quic.ack_ranges() != ranges_before:
            self.quic.ack_at(now)
        elif self._ack_waits is True and self._acks_held < ACK_EVERY and self._answering(now):
            self.quic.ack_at(self._held_since + self.config.ack_hold_s)
            self._holding = True
        else:
            self.quic.ack_at(min(due, self._held_since + K_GRANULARITY))

    def _answering(self, now: float) -> bool:
        answered = self._answered_at
        return self.config.ack_hold_s > 0 and answered is not None and now - answered <= ANSWERING_S

    def _peer(self) -> str:
        return f"{self.peer_address[0]}:{self.peer_address[1]}"

    def _local_stream(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.dial else 1)

    def _process(self, now: float) -> None:
        assert self.quic is not None
        while (event := self.quic.next_event()) is not None and self.error is None:
            if isinstance(event, qe.HandshakeCompleted):
                self._check_peer()
            elif isinstance(event, qe.StreamDataReceived):
                self._stream_data(event.stream_id, event.data, event.end_stream)
            elif isinstance(event, qe.StreamReset):
                self._stream_reset(event.stream_id)
            elif isinstance(event, qe.StopSendingReceived):
                self._stop_sending(event.stream_id)
            elif isinstance(event, qe.ConnectionTerminated):
                self._down(self._termination_error(event))
        if self.error is None and (goodbye := self.quic.peer_close()) is not None:
            self._down(self._termination_error(goodbye))  # now, not when aioquic's draining ends
        if self.error is None and self.held_bytes > self.config.max_held_bytes:
            held, bound = self.held_bytes, self.config.max_held_bytes
            why = f"{self._peer()} sent {held:,} bytes unread, past the {bound:,}-byte bound"
            self.send_away(LinkOverBound(why))

    def _check_peer(self) -> None:
        assert self.quic is not None
        der = self.quic.peer_certificate_der()
        if der is None:
            self._fail(LinkRefused(f"{self._peer()} presented no certificate"), REFUSED)
            return
        presented = fingerprint_of(der)
        if presented != self.peer_fingerprint:
            message = f"peer presented fingerprint {presented}, expected {self.peer_fingerprint}"
            self._fail(LinkRefused(message), REFUSED)
            return
        self._verified = True
        if not self.dial:  # the server has now checked the client: say so, which brings the client up
            hello = self.quic.get_next_available_stream_id()
            self.quic.send_stream_data(hello, Frame(Kind.PING, 0, payload=HELLO).encode(), end_stream=True)
            self._fin_sent.add(hello)
            self._replies[hello] = FrameDecoder()
            self._go_up()

    def _go_up(self) -> None:
        self.is_up = True
        self._events.append(Up())

    def _stream_data(self, stream_id: int, data: bytes, end: bool) -> None:
        if not self._verified or stream_id & 2:  # nothing before the pin check; no unidirectional streams
            return
        if not self.is_up:  # the dialler's first message from the server: its hello
            self._go_up()
        if self._local_stream(stream_id):
            self._ack_waits = False
            self._reply_data(stream_id, data, end)
            return
        inbound = self._inbound.setdefault(stream_id, _Inbound())
        if not inbound.rejected:
            try:
                frames = self._decode(inbound.decoder, data)
                answered = bool(frames) and all(f.kind in ANSWERED_KINDS for f in frames)
                self._ack_waits = self._ack_waits is not False and answered and not inbound.decoder.pending_bytes
                for frame in frames:
                    if inbound.sequence_id is None:
                        inbound.sequence_id = frame.sequence_id
                    elif frame.sequence_id != inbound.sequence_id:
                        raise FrameError(
                            f"frame of sequence {frame.sequence_id} on the stream of sequence {inbound.sequence_id}"
                        )
                    if self.dial and stream_id == 1 and frame.payload == HELLO:
                        self.release(frame.wire_bytes)
                        continue  # the server's hello is for the link, not the application
                    self._events.append(Received(frame))
            except FrameError as error:
                self._reject(stream_id, inbound, str(error))
        if end:
            if not inbound.rejected and inbound.decoder.pending_bytes:  # the sender hears of it too
                self._reject(stream_id, inbound, "stream ended inside a frame", stop=False)
            self._drop_inbound(stream_id)
            self._end_stream(stream_id)

    def _reply_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """The peer's answer on one of our streams: an ERROR frame, delivered like any frame."""
        decoder = self._replies.get(stream_id)
        if decoder is not None:
            try:
                for frame in self._decode(decoder, data):
                    if frame.kind is not Kind.ERROR:
                        raise FrameError(f"a {frame.kind.name} frame where only an ERROR reply may come")
                    self._events.append(Received(frame))
                if end and decoder.pending_bytes:
                    raise FrameError("stream ended inside a frame")
            except FrameError as error:  # stop reading this half; our frames on the other go on
                self._drop_replies(stream_id)
                if not end and self.quic is not None:
                    self.quic.stop_stream(stream_id, REJECTED)
                self._events.append(Rejected(stream_id, f"malformed reply: {error}"))
                log.warning("malformed reply on stream %d: %s", stream_id, error)
        if end:
            self._drop_replies(stream_id)
            for sequence_id, sid in list(self._outbound.items()):
                if sid == stream_id:  # the peer gave up on this stream: the next frame opens another
                    del self._outbound[sequence_id]
            self._end_stream(stream_id)

    def _decode(self, decoder: FrameDecoder, data: bytes) -> list[Frame]:
        """Feed a stream's decoder, counting what it now holds and what it delivers."""
        before = decoder.pending_bytes
        try:
            frames = decoder.feed(data)
        finally:
            self.held_bytes += decoder.pending_bytes - before
        self.held_bytes += sum(frame.wire_bytes for frame in frames)
        return frames

    def _drop_inbound(self, stream_id: int) -> None:
        inbound = self._inbound.pop(stream_id, None)
        if inbound is not None:
            self.release(inbound.decoder.pending_bytes)

    def _drop_replies(self, stream_id: int) -> None:
        decoder = self._replies.pop(stream_id, None)
        if decoder is not None:
            self.release(decoder.pending_bytes)

    def _reject(self, stream_id: int, inbound: _Inbound, reason: str, stop: bool = True) -> None:
        """Tell the sender with an ERROR frame on that stream, stop reading it (if `stop`), keep the link."""
        assert self.quic is not None
        inbound.rejected = True
        self.release(inbound.decoder.pending_bytes)  # nothing more of this stream is read
        inbound.decoder = FrameDecoder()
        error = Frame(Kind.ERROR, inbound.sequence_id or 0, dtype=DType.NONE, payload=reason.encode())
        if stream_id not in self._fin_sent:
            self.quic.send_stream_data(stream_id, error.encode(), end_stream=True)
            self._fin_sent.add(stream_id)
        if stop:
            self.quic.stop_stream(stream_id, REJECTED)
        self._events.append(Rejected(stream_id, reason))
        log.warning("rejected stream %d from %s: %s", stream_id, self._peer(), reason)

    def _stream_reset(self, stream_id: int) -> None:
        self._drop_inbound(stream_id)
        self._drop_replies(stream_id)
        for sequence_id, sid in list(self._outbound.items()):
            if sid == stream_id:  # our half is ended below: the sequence's next frame opens another
                del self._outbound[sequence_id]
        self._end_stream(stream_id)

    def _stop_sending(self, stream_id: int) -> None:
        """The peer rejected one of our streams; aioquic has reset it, so drop it from the map."""
        self._fin_sent.add(stream_id)
        for sequence_id, sid in list(self._outbound.items()):
            if sid == stream_id:
                del self._outbound[sequence_id]

    def _end_stream(self, stream_id: int) -> None:
        """Send our FIN once: a stream is freed (and its credit returned) when both halves end."""
        if stream_id not in self._fin_sent and self.quic is not None:
            self._fin_sent.add(stream_id)
            try:
                self.quic.send_stream_data(stream_id, b"", end_stream=True)
            except (RuntimeError, ValueError):
                pass  # already reset, or never opened on our side
        if stream_id not in self._inbound and stream_id not in self._replies:
            self._fin_sent.discard(stream_id)

    def _termination_error(self, event: qe.ConnectionTerminated) -> LinkError:
        reason = event.reason_phrase or "no reason given"
        if event.error_code == REFUSED:
            return LinkRefused(f"refused by peer: {reason}")
        if event.error_code == DEAD:
            return LinkDead(f"peer gave up on the link: {reason}")
        if event.error_code == OVER_BOUND:
            return LinkOverBound(f"sent away by peer: {reason}")
        if event.reason_phrase == "Idle timeout":
            return LinkDead(f"nothing heard from {self._peer()} (QUIC idle timeout)")
        if not self.is_up:  # a close during the handshake loses its reason (RFC 9000 §10.2.3)
            return LinkRefused(f"{self._peer()} closed the link during the handshake (code {event.error_code:#x})")
        if event.error_code == GOODBYE and event.frame_type is None:
            return LinkClosed(f"peer closed the link: {reason}")
        return LinkClosed(f"peer closed the link (code {event.error_code:#x}): {reason}")

    def _answer_while_closing(self) -> None:
        """A peer still sending after we closed has not heard our goodbye: say it again. aioquic
        sends its CONNECTION_CLOSE once; where that one datagram is lost (0.5% of them on a lossy
        home line) the peer learns from its idle bound that the link is gone, not why. The same
        datagram goes again (RFC 9000 §10.2.1 allows it) for the peer's 1st, 2nd, 4th, 8th ...
        datagram: a few answers to a flood, and none once our closing period ends."""
        if self.quic is None or not self.quic.closing() or not self.quic.goodbye:
            return
        self._heard_closing += 1
        if self._heard_closing & (self._heard_closing - 1) == 0:
            self._goodbye_again = list(self.quic.goodbye)

    def _fail(self, error: LinkError, code: int) -> None:
        if self.quic is not None:  # a no-op if aioquic is already closing
            self.quic.close(error_code=code, reason_phrase=str(error))
        self._down(error)

    def _down(self, error: LinkError) -> None:
        if self.error is None:
            self.error = error
            self.is_up = False
            self._events.append(Down(error))


class DatagramDemux(asyncio.DatagramProtocol):
    """Owns one UDP socket and routes datagrams by first byte; QUIC ones by source address too.

    Links attach for their peer's address; other protocols (STUN, relay binding, punch probes)
    register for their first-byte ranges. `tap`, if set, sees every datagram in and out.

    asyncio's datagram transport reads one datagram per turn of the event loop. When the demux
    owns the socket (`over`), each wake-up also reads whatever else is already queued, up to
    `RECEIVE_BATCH` datagrams, and only then lets each link that received some answer once:
    one `datagrams_to_send` (and one timer) per batch instead of per datagram, and no turn of
    the loop per datagram. A bulk receiver sees batches of about 14 (docs/benchmarks.md); an
    idle link sees batches of one, so latency is unchanged.
    """

    def __init__(
        self,
        tap: Callable[[str, bytes, Address], None] | None = None,
        member_links: dict[Link, None] | None = None,
    ) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.tap = tap
        self._handlers: dict[int, Handler] = {}
        self._links: dict[Address, Link] = {}
        # Every link of this member, over this socket and over its relayed edges' own (which share
        # the member socket's): ring frames sent on one may answer what another brought.
        self.member_links: dict[Link, None] = {} if member_links is None else member_links
        self._sock: Any = None  # the socket itself, to read a batch per wake-up (only with `over`)
        # Whether the socket's datagrams leave unfragmented: only then can a link learn from a probe
        # what its path carries (a fragmented one may arrive where its size could not).
        self.unfragmented = False
        self._fed: dict[Link, None] = {}  # links that received datagrams in this batch, in order
        self.dropped = 0  # datagrams nobody wanted
        self.closed = asyncio.get_running_loop().create_future()

    @classmethod
    async def over(
        cls,
        sock: Any,
        tap: Callable[[str, bytes, Address], None] | None = None,
        receive_buffer: int | None = RECEIVE_BUFFER,
        member_links: dict[Link, None] | None = None,
    ) -> DatagramDemux:
        """Take over a bound UDP socket, which may already have carried STUN or a punch, and
        grow its receive buffer to `receive_buffer` bytes (None: leave it as it is). A relayed
        edge's own socket shares its member's `member_links`."""
        if receive_buffer is not None:
            with contextlib.suppress(OSError):  # a platform that refuses keeps its default
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < receive_buffer:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_datagram_endpoint(lambda: cls(tap, member_links), sock=sock)
        protocol._sock = sock
        return protocol

    def register(self, first_bytes: Iterable[int], handler: Handler) -> None:
        for byte in first_bytes:
            if byte in QUIC_BYTES:
                raise ValueError("first bytes 64 and above are QUIC's")
            self._handlers[byte] = handler

    def unregister(self, first_bytes: Iterable[int]) -> None:
        for byte in first_bytes:
            self._handlers.pop(byte, None)

    @property
    def local_address(self) -> Address:
        assert self.transport is not None
        return _address(self.transport.get_extra_info("sockname"))

    def sendto(self, data: bytes, address: Address) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.tap is not None:
            self.tap("out", data, address)
        self.transport.sendto(data, address)

    def attach(self, address: Address, link: Link) -> None:
        address = _address(address)
        existing = self._links.get(address)
        if existing is not None and not existing.closed.done():  # a closed one may still be saying goodbye
            raise ValueError(f"a link to {address[0]}:{address[1]} already exists on this socket")
        self._links[address] = link
        self.member_links[link] = None

    def detach(self, address: Address, link: Link) -> None:
        if self._links.get(_address(address)) is link:
            del self._links[_address(address)]
        self.member_links.pop(link, None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.DatagramProtocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)
        sock = transport.get_extra_info("socket")
        self.unfragmented = sock is not None and forbid_fragmentation(sock)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            self._route(data, addr)
            sock, transport = self._sock, self.transport
            for _ in range(RECEIVE_BATCH - 1):  # the rest of the batch, if any is queued already
                if sock is None or transport is None or transport.is_closing():
                    break
                try:
                    data, addr = sock.recvfrom(65_536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    self.error_received(exc)
                    break
                self._route(data, addr)
        finally:
            while self._fed:  # each link that received something answers once for the whole batch
                link = next(iter(self._fed))
                del self._fed[link]
                link._transmit()

    def _route(self, data: bytes, addr: Any) -> None:
        address = _address(addr)
        if self.tap is not None:
            self.tap("in", data, address)
        if not data:
            self.dropped += 1
        elif data[0] in QUIC_BYTES:
            link = self._links.get(address)
            if link is None:
                self.dropped += 1
            else:
                link._feed(data, address)
                self._fed[link] = None
        elif (handler := self._handlers.get(data[0])) is not None:
            handler(data, address)
        else:
            self.dropped += 1

    def error_received(self, exc: Exception) -> None:
        log.debug("socket error: %s", exc)  # ICMP unreachable and the like: liveness decides

    def connection_lost(self, exc: Exception | None) -> None:
        for link in list(self._links.values()):
            link.abort(LinkClosed("the link's socket was closed"))
        if not self.closed.done():
            self.closed.set_result(None)


class Link:
    """The asyncio shell around `LinkCore`: one link to one neighbour over a shared socket."""

    def __init__(self, demux: DatagramDemux, core: LinkCore) -> None:
        self.demux = demux
        self.core = core
        self._loop = asyncio.get_running_loop()
        self._up: asyncio.Future[None] = self._loop.create_future()
        self.closed: asyncio.Future[LinkError] = self._loop.create_future()  # resolves to the reason
        self._queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._timer: asyncio.TimerHandle | None = None
        self.rejected: deque[Rejected] = deque(maxlen=RECENT_REJECTIONS)  # the latest, for a look
        self.rejections = 0  # all of them
        # Whether `receive` releases a frame's bytes; a reader that keeps frames for later (a
        # router's queues) turns it off and calls `release` once the frame is taken from it.
        self.release_on_receive = True
        self._sink: Callable[[Frame | None], None] | None = None  # where frames go instead (`deliver_to`)
        demux.attach(core.peer_address, self)

    @property
    def peer_address(self) -> Address:
        return self.core.peer_address

    async def wait_up(self) -> None:
        """Return once both sides have checked each other, or raise why they did not."""
        either: list[asyncio.Future[Any]] = [self._up, self.closed]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not self._up.done():
            raise self.closed.result()

    async def send(self, frame: Frame) -> None:
        """Send one frame on its sequence's stream."""
        self.send_now(frame)

    def send_now(self, frame: Frame) -> None:
        """`send`, from a plain callback on the loop: a frame is queued and sent at once, never awaited."""
        if self.closed.done():
            raise self.closed.result()
        self.core.send_frame(frame)
        self._transmit()
        if frame.kind in ANSWERED_KINDS:
            self._answered_elsewhere()

    def _answered_elsewhere(self) -> None:
        """The ring frame just sent may answer what another of this member's links brought (on a
        ring of three machines or more): their ACKs held for the answer go now, after it."""
        now = self._loop.time()
        for link in list(self.demux.member_links):
            if link is not self and link.core.answered(now):
                link._transmit()

    async def finish(self, sequence_id: int) -> None:
        self.core.finish(sequence_id)
        self._transmit()

    async def send_raw(self, data: bytes, end: bool = False) -> int:
        """Arbitrary bytes on a new stream, returning its id: for tests and fault injection only."""
        stream_id = self.core.send_raw(data, end)
        self._transmit()
        return stream_id

    async def receive(self) -> Frame:
        """The next frame from the peer; raises the link's error once it is down and drained."""
        frame = await self._queue.get()
        if frame is None:
            self._queue.put_nowait(None)  # keep later callers from blocking
            raise self.closed.result()
        if self.release_on_receive:
            self.core.release(frame.wire_bytes)
        return frame

    def deliver_to(self, sink: Callable[[Frame | None], None]) -> None:
        """Hand each frame to `sink` as it comes, on the loop, in the order it came, and None once
        the link is down: frames already queued first. A router sorts each frame where it is read
        without a task of its own between the link and its readers (one loop step a frame less);
        `sink` then owns releasing them (`release`) and must not block."""
        self.release_on_receive = False
        while not self._queue.empty():
            sink(self._queue.get_nowait())
        self._sink = sink

    def release(self, frame: Frame) -> None:
        """A frame taken from this link's reader is gone from memory: it no longer counts."""
        self.core.release(frame.wire_bytes)

    @property
    def held_bytes(self) -> int:
        return self.core.held_bytes

    async def frames(self) -> AsyncIterator[Frame]:
        """Every frame until the link goes down (then the iteration just ends)."""
        while True:
            try:
                yield await self.receive()
            except LinkError:
                return

    async def close(self, reason: str = "goodbye") -> None:
        if not self.closed.done():
            self.core.close(self._loop.time(), reason)
            self._transmit()

    def send_away(self, error: LinkOverBound) -> None:
        """End the link because the peer sent more than this side holds unread (a router's bound)."""
        self.core.send_away(error)
        self._transmit()

    def abort(self, error: LinkError) -> None:
        self.core.abort(error)
        self._after_events()

    # --- driven by the demux and the timer ---
    def datagram_received(self, data: bytes, address: Address) -> None:
        self._feed(data, address)
        self._transmit()

    def _feed(self, data: bytes, address: Address) -> None:
        """Take in one datagram; the demux calls `_transmit` once its batch is read."""
        self.core.datagram_received(data, address, self._loop.time())

    def _on_timer(self) -> None:
        self._timer = None
        self.core.handle_timer(self._loop.time())
        self._transmit()

    def _transmit(self) -> None:
        for data, address in self.core.datagrams_to_send(self._loop.time()):
            self.demux.sendto(data, address)
        self._after_events()
        when = self.core.timer()
        if self._timer is not None and self._timer.when() != when:  # most sends leave it where it was
            self._timer.cancel()
            self._timer = None
        if when is not None and self._timer is None:
            self._timer = self._loop.call_at(when, self._on_timer)

    def _after_events(self) -> None:
        while (event := self.core.next_event()) is not None:
            if isinstance(event, Up):
                if not self._up.done():
                    self._up.set_result(None)
            elif isinstance(event, Received):
                if self._sink is None:
                    self._queue.put_nowait(event.frame)
                else:
                    self._sink(event.frame)
            elif isinstance(event, Rejected):
                self.rejected.append(event)
                self.rejections += 1
            elif isinstance(event, Down):
                if not self.closed.done():
                    self.closed.set_result(event.error)
                    if self._sink is None:
                        self._queue.put_nowait(None)
                    else:
                        self._sink(None)
                    log.info("link to %s down: %s", self.core._peer(), event.error)
        if self.closed.done() and self.core.timer() is None:
            self.demux.detach(self.core.peer_address, self)


async def open_link(
    demux: DatagramDemux,
    peer_address: Address,
    local_identity: Identity,
    peer_fingerprint: str,
    dial: bool,
    config: LinkConfig | None = None,
) -> Link:
    """Bring up a pinned link to one neighbour over the member's shared socket.

    `dial` is normally `should_dial(ours, theirs)`; the other side listens for the dialler's
    Initial from `peer_address`. Raises `LinkRefused` if either side's pin fails and `LinkDead`
    if the handshake does not finish within `config.handshake_timeout_s`.
    """
    loop = asyncio.get_running_loop()
    if not demux.unfragmented:  # a probe that arrived in fragments would prove nothing
        config = (config or LinkConfig()).model_copy(update={"max_datagram_size": BASE_DATAGRAM})
    core = LinkCore(local_identity, peer_fingerprint, peer_address, dial, loop.time(), config)
    link = Link(demux, core)
    link._transmit()
    try:
        await link.wait_up()
    except BaseException:
        if not link.closed.done():
            await link.close("open_link gave up")
        raise
    return link


async def bind_relay(demux: DatagramDemux, relay: Address, token: bytes, timeout: float = 5.0) -> None:
    """Bind this member's socket to its end of a relay allocation, until the relay says both are.

    The binding datagram is repeated every 100 ms (it is also the relay's keep-alive) until the
    relay acknowledges both ends; a link opened to the relay's address afterwards is carried
    verbatim, so its TLS still runs end to end and the relay sees only ciphertext.
    """
    paired = asyncio.get_running_loop().create_future()

    def on_ack(data: bytes, source: Address) -> None:
        if source == relay and parse_ack(data) and not paired.done():
            paired.set_result(None)

    demux.register([HELLO_ACK], on_ack)
    deadline = time.monotonic() + timeout
    try:
        while not paired.done():
            if time.monotonic() >= deadline:
                raise LinkDead(f"the relay at {relay[0]}:{relay[1]} did not pair this edge within {timeout:.0f} s")
            demux.sendto(hello(token), relay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(paired), 0.1)
    finally:
        demux.unregister([HELLO_ACK])
