"""Two `LinkCore`s exchanging datagrams with injected time: no socket, no event loop, no clock
(after aioquic's tests/test_connection.py). The asyncio shell is tested on loopback in test_link."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kafila.network.identity import create_identity
from kafila.network.link import (
    Down,
    Event,
    LinkClosed,
    LinkConfig,
    LinkCore,
    LinkDead,
    LinkError,
    LinkOverBound,
    LinkRefused,
    Received,
    Rejected,
    Up,
)
from kafila.wire.frames import Frame, Kind

CONFIG = LinkConfig(idle_timeout_s=4.0, handshake_timeout_s=10.0)
DIALLER_AT, LISTENER_AT = ("10.0.0.1", 4000), ("10.0.0.2", 5000)
IDENTITIES = (create_identity("dialler"), create_identity("listener"))


class Pair:
    """A dialler and a listener, and the time, which only the test moves."""

    def __init__(self, dialler_pins: str | None = None, now: float = 0.0, config: LinkConfig = CONFIG) -> None:
        dialler, listener = IDENTITIES
        self.now = now
        self.dialler = LinkCore(dialler, dialler_pins or listener.fingerprint, LISTENER_AT, True, now, config)
        self.listener = LinkCore(listener, dialler.fingerprint, DIALLER_AT, False, now, config)

    def transfer(self, drop: bool = False, lost: Callable[[bytes], bool] = lambda _data: False) -> int:
        """Move datagrams both ways until neither side has any to send; how many moved. `lost`
        picks datagrams from the listener that never reach the dialler."""
        moved = 0
        while True:
            out = self.dialler.datagrams_to_send(self.now)
            back = self.listener.datagrams_to_send(self.now)
            if not out and not back:
                return moved
            moved += len(out) + len(back)
            if drop:
                continue
            for data, _ in out:
                self.listener.datagram_received(data, DIALLER_AT, self.now)
            for data, _ in back:
                if not lost(data):
                    self.dialler.datagram_received(data, LISTENER_AT, self.now)

    def advance(self, seconds: float, drop: bool = False, lost: Callable[[bytes], bool] = lambda _data: False) -> None:
        """Let `seconds` pass, running each side's timer when it falls due and exchanging what it sends."""
        end = self.now + seconds
        while True:
            due = [t for t in (self.dialler.timer(), self.listener.timer()) if t is not None and t <= end]
            if not due:
                break
            self.now = max(self.now, min(due))
            for core in (self.dialler, self.listener):
                timer = core.timer()
                if timer is not None and timer <= self.now:
                    core.handle_timer(self.now)
            self.transfer(drop, lost)
        self.now = end

    def settle(self) -> None:
        """Exchange what is queued, and what the ACK and retransmission timers then send."""
        self.transfer()
        self.advance(0.5)

    def up(self) -> Pair:
        """The handshake, to both sides up: the dialler hears the listener's hello once its ACK timers run."""
        self.transfer()
        self.advance(1.0)
        assert isinstance(next_event(self.dialler), Up) and isinstance(next_event(self.listener), Up)
        return self


def events(core: LinkCore) -> list[Event]:
    found = []
    while (event := core.next_event()) is not None:
        found.append(event)
    return found


def next_event(core: LinkCore) -> Event | None:
    return core.next_event()


def frames(core: LinkCore) -> list[Frame]:
    return [event.frame for event in events(core) if isinstance(event, Received)]


def down(core: LinkCore) -> LinkError:
    (event,) = [e for e in events(core) if isinstance(e, Down)]
    return event.error


@contextmanager
def no_events_from(*cores: LinkCore) -> Iterator[None]:
    yield
    for core in cores:
        assert events(core) == []


def test_a_handshake_pins_both_certificates_and_brings_both_sides_up() -> None:
    pair = Pair()
    assert not pair.dialler.is_up and not pair.listener.is_up
    pair.up()
    assert pair.dialler.is_up and pair.listener.is_up
    assert pair.dialler.rtt_ms is not None  # measured on the handshake, at time 0: no delay at all


def test_frames_arrive_in_order_both_ways_each_sequence_on_its_own_stream() -> None:
    pair = Pair().up()
    sent = [Frame(Kind.PING, sequence, position=position, payload=bytes([position]) * 300)
            for position in range(5) for sequence in (1, 2)]  # fmt: skip
    for frame in sent:
        pair.dialler.send_frame(frame)
    pair.settle()
    reply = Frame(Kind.PING, 1, payload=b"x" * 5000)  # more than one datagram
    pair.listener.send_frame(reply)
    pair.settle()
    got = frames(pair.listener)
    assert [f for f in got if f.sequence_id == 1] == [f for f in sent if f.sequence_id == 1]
    assert [f for f in got if f.sequence_id == 2] == [f for f in sent if f.sequence_id == 2]
    assert frames(pair.dialler) == [reply]


def test_a_cancel_whose_packet_is_lost_still_arrives_before_the_next_request_of_its_sequence() -> None:
    """A slot's CANCEL and the next request's rows on that slot keep their order when the CANCEL's
    packet is lost and sent again: a stage that ran them the other way round would drop the new
    request's cache (the NAT lab found it at 2% loss)."""
    pair = Pair().up()
    pair.dialler.send_frame(Frame(Kind.PING, 3, position=0, payload=b"old request"))
    pair.settle()
    assert [f.payload for f in frames(pair.listener)] == [b"old request"]
    pair.dialler.send_frame(Frame(Kind.CANCEL, 3))
    pair.dialler.datagrams_to_send(pair.now)  # the packet carrying the CANCEL is lost
    pair.dialler.send_frame(Frame(Kind.PING, 3, position=0, payload=b"new request"))
    pair.transfer()  # the new request's packet arrives first
    pair.advance(3.0)  # the loss is detected and the CANCEL sent again
    assert [f.kind for f in frames(pair.listener)] == [Kind.CANCEL, Kind.PING]


def test_a_peer_with_another_certificate_is_refused_on_both_sides() -> None:
    pair = Pair(dialler_pins=create_identity("impostor").fingerprint)
    pair.transfer()
    pair.advance(1.0)
    refused = down(pair.dialler)
    assert isinstance(refused, LinkRefused) and "expected" in str(refused)
    assert isinstance(down(pair.listener), LinkRefused)
    with pytest.raises(LinkRefused):
        pair.dialler.send_frame(Frame(Kind.PING, 0))


def test_pings_keep_a_quiet_link_up_and_silence_kills_it_within_the_idle_bound() -> None:
    pair = Pair().up()
    with no_events_from(pair.dialler, pair.listener):
        pair.advance(10 * CONFIG.idle_timeout_s)  # nothing to send, but pings go and come back
    assert pair.dialler.is_up and pair.listener.is_up
    cut = pair.now
    pair.advance(CONFIG.idle_timeout_s + 0.5, drop=True)  # the path goes dark
    for core in (pair.dialler, pair.listener):
        dead = down(core)
        assert isinstance(dead, LinkDead) and "nothing heard" in str(dead)
        assert not core.is_up
    assert pair.now - cut <= CONFIG.idle_timeout_s + 0.5


def test_a_listener_never_dialled_and_a_dialler_never_answered_give_up_after_the_handshake_bound() -> None:
    pair = Pair()
    pair.advance(CONFIG.handshake_timeout_s + 1, drop=True)
    unanswered, undialled = down(pair.dialler), down(pair.listener)
    assert isinstance(unanswered, LinkDead) and isinstance(undialled, LinkDead)
    assert "wait to be dialled" in str(undialled)


def test_a_goodbye_reaches_the_peer_at_once_with_its_reason() -> None:
    pair = Pair().up()
    pair.dialler.close(pair.now, "the session ended")
    pair.settle()
    closed = down(pair.listener)
    assert isinstance(closed, LinkClosed) and "the session ended" in str(closed)
    assert isinstance(down(pair.dialler), LinkClosed)


def test_a_malformed_stream_is_refused_alone_and_the_link_goes_on() -> None:
    pair = Pair().up()
    pair.dialler.send_raw(b"\xff" * 64, end=True)  # not a frame
    pair.settle()
    (rejected,) = events(pair.listener)
    assert isinstance(rejected, Rejected)
    (answer,) = frames(pair.dialler)  # the sender hears why, on that stream
    assert answer.kind is Kind.ERROR and answer.payload.decode() == rejected.reason
    pair.dialler.send_frame(Frame(Kind.PING, 7, payload=b"still there"))
    pair.settle()
    assert [f.payload for f in frames(pair.listener)] == [b"still there"]


def test_datagrams_that_are_not_quic_do_not_start_or_disturb_a_link() -> None:
    dialler, listener = IDENTITIES
    lonely = LinkCore(listener, dialler.fingerprint, DIALLER_AT, False, 0.0, CONFIG)
    for junk in (b"", b"\x00" * 10, b"\xc0" + b"\x01" * 1300):  # too short, not long-header, a bogus Initial
        lonely.datagram_received(junk, DIALLER_AT, 0.0)
    assert lonely.quic is None and lonely.datagrams_to_send(0.0) == [] and events(lonely) == []
    pair = Pair().up()
    pair.listener.datagram_received(b"\x40" + b"\x00" * 40, DIALLER_AT, pair.now)  # a garbled short header
    pair.transfer()
    assert pair.listener.is_up and events(pair.listener) == []


BOUNDED = CONFIG.model_copy(update={"max_held_bytes": 1 << 20})


def test_frames_count_against_the_bound_until_released_and_one_past_it_sends_the_peer_away() -> None:
    """aioquic grants credit as fast as a peer sends: what bounds the peer is what it makes us hold."""
    pair = Pair(config=BOUNDED).up()
    frame = Frame(Kind.PING, 9, payload=b"z" * (100 << 10))
    for _ in range(10):
        pair.dialler.send_frame(frame)
    pair.settle()
    got = frames(pair.listener)
    assert len(got) == 10 and pair.listener.held_bytes == 10 * frame.wire_bytes  # 1,024,320: within
    for taken in got[:5]:  # the application took five: room for five more
        pair.listener.release(taken.wire_bytes)
    for _ in range(5):
        pair.dialler.send_frame(frame)
    pair.settle()
    assert len(frames(pair.listener)) == 5 and pair.listener.is_up
    pair.dialler.send_frame(frame)  # 11 unread: past 1 MiB
    pair.settle()
    refused = down(pair.listener)
    assert isinstance(refused, LinkOverBound) and "past the 1,048,576-byte bound" in str(refused)
    told = down(pair.dialler)
    assert isinstance(told, LinkOverBound) and "sent away by peer" in str(told)


def test_frames_that_never_finish_count_too_and_a_refused_stream_stops_counting() -> None:
    """A peer that starts many large frames and finishes none holds our memory just the same."""
    pair = Pair(config=BOUNDED).up()
    started = Frame(Kind.PING, 3, payload=b"p" * (8 << 20)).encode()[: 300 << 10]  # 8 MiB declared, 300 KiB sent
    pair.dialler.send_raw(started)
    pair.settle()
    assert pair.listener.held_bytes == 300 << 10 and events(pair.listener) == []
    pair.dialler.send_raw(b"\xff" * (200 << 10))  # not a frame: refused, and nothing of it is kept
    pair.settle()
    assert [type(e) for e in events(pair.listener)] == [Rejected]
    assert pair.listener.held_bytes == 300 << 10
    for _ in range(3):
        pair.dialler.send_raw(started)
    pair.settle()
    assert isinstance(down(pair.listener), LinkOverBound)  # four unfinished frames of 300 KiB: past 1 MiB


def test_a_peers_goodbye_is_reported_by_the_datagram_that_carries_it_and_outlasts_the_idle_bound() -> None:
    """aioquic reports a CONNECTION_CLOSE only when draining ends, three probe timeouts after it
    arrived: a member flooding its link saw round trips of 0.2 to 0.7 s, so 3.5 to 10 s, and its
    own idle bound (2 s) came first. It learned its link was dead, not that it was sent away."""
    pair = Pair().up()
    pair.dialler.close(pair.now, "the session ended")
    pair.transfer()  # the goodbye crosses; no timer runs
    closed = down(pair.listener)
    assert isinstance(closed, LinkClosed) and "the session ended" in str(closed)
    assert not pair.listener.is_up
    pair.advance(2 * CONFIG.idle_timeout_s, drop=True)  # draining ends, and the idle bound passes
    assert events(pair.listener) == [] and pair.listener.error is closed


def test_a_goodbye_lost_on_the_way_is_said_again_to_a_peer_that_keeps_sending() -> None:
    """aioquic sends its CONNECTION_CLOSE once: a flooding member whose copy was lost (0.5% of
    datagrams on a lossy home line) heard nothing more and learned only from its idle bound
    that its link was gone. The side that closed answers the peer's datagrams with it again."""
    pair = Pair(config=BOUNDED).up()
    goodbyes: list[bytes] = []

    def first_goodbye_lost(data: bytes) -> bool:
        assert pair.listener.quic is not None
        if data in pair.listener.quic.goodbye:
            goodbyes.append(data)
            return len(goodbyes) == 1
        return False

    frame, start = Frame(Kind.PING, 9, payload=b"z" * (100 << 10)), pair.now
    for _ in range(40):  # the dialler sends on while it knows nothing, as a flooding member does
        if pair.dialler.error is not None:
            break
        pair.dialler.send_frame(frame)
        pair.advance(0.05, lost=first_goodbye_lost)
    assert isinstance(down(pair.listener), LinkOverBound)
    told = down(pair.dialler)
    assert isinstance(told, LinkOverBound) and "sent away by peer" in str(told)
    assert len(goodbyes) >= 2  # the lost one, and one again
    assert pair.now - start < CONFIG.idle_timeout_s  # not the idle bound's news


def test_a_closed_link_answers_a_flood_with_its_goodbye_a_few_times_and_only_while_closing() -> None:
    """Saying goodbye again must not amplify a flood: the 1st, 2nd, 4th ... datagram is answered,
    and nothing once the closing period ends."""
    pair = Pair().up()
    pair.dialler.close(pair.now, "bye")
    assert pair.dialler.quic is not None
    goodbye = [data for data, _address in pair.dialler.datagrams_to_send(pair.now)]  # lost on the way
    assert list(pair.dialler.quic.goodbye) == goodbye
    answers = 0
    for _ in range(1000):
        pair.dialler.datagram_received(b"\x40" + b"\x00" * 40, LISTENER_AT, pair.now)
        answers += len(pair.dialler.datagrams_to_send(pair.now))
    assert answers == 10 * len(goodbye)  # for datagrams 1, 2, 4, ... 512
    pair.advance(CONFIG.idle_timeout_s, drop=True)  # the closing period ends
    pair.dialler.datagram_received(b"\x40" + b"\x00" * 40, LISTENER_AT, pair.now)
    assert pair.dialler.datagrams_to_send(pair.now) == []
