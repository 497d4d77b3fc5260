"""How large a link's datagrams may be (`kafila.network.datagram_size`, RFC 8899 as QUIC uses it).

The rule alone, with injected time: a link starts at QUIC's 1,200 bytes, uses a larger size only
once a probe of it is acknowledged, rests its search after three lost probes, and falls back
when the path stops carrying the size. Then two `LinkCore`s (real aioquic connections) over a
simulated path with injected time: a path that carries 1,500-byte packets raises both sides to
1,452 and a token's rows go in two datagrams; a path that carries 1,280 keeps 1,200 and every
frame arrives, its lost probes no congestion; a path that stops carrying 1,452 on a live link
falls back, and what was lost arrives in datagrams of 1,200.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_link_acks import ACK_ALONE, rows
from test_link_core import Pair, frames

from kafila.network.datagram_size import (
    BASE_DATAGRAM,
    BLACK_HOLE_LOSSES,
    MAX_PROBES,
    PROBE_AGAIN_S,
    SEARCH_AGAIN_S,
    DatagramSizeSearch,
)
from kafila.network.link import LinkConfig, LinkCore
from kafila.wire.frames import Frame, Kind

ETHERNET = 1452  # what a 1,500-byte MTU carries under IPv6's and UDP's headers
CONFIG = LinkConfig(idle_timeout_s=4.0, handshake_timeout_s=10.0)
RENO = CONFIG.model_copy(update={"congestion_control": "reno"})


# --- the rule ---------------------------------------------------------------------------------


def test_a_search_starts_at_quics_minimum_and_uses_a_size_once_its_probe_is_acknowledged() -> None:
    search = DatagramSizeSearch(ceiling=ETHERNET)
    assert search.size == BASE_DATAGRAM
    assert search.probe_due(0.0) == ETHERNET
    search.probe_sent(ETHERNET)
    assert search.size == BASE_DATAGRAM and search.probe_due(0.5) is None  # one probe in flight at a time
    search.probe_acked(ETHERNET, packet_number=7)
    assert search.size == ETHERNET
    assert search.probe_due(0.6) is None  # nothing larger to try


def test_sizes_are_tried_in_turn_up_to_the_ceiling() -> None:
    search = DatagramSizeSearch(ceiling=9000)
    assert search.probe_due(0.0) == ETHERNET
    search.probe_sent(ETHERNET)
    search.probe_acked(ETHERNET, 3)
    assert search.probe_due(0.0) == 9000  # the next at once
    search.probe_sent(9000)
    search.probe_lost(1.0)
    assert search.size == ETHERNET  # a lost probe lowers nothing


def test_a_ceiling_at_the_minimum_never_probes_and_one_below_is_refused() -> None:
    assert DatagramSizeSearch(ceiling=BASE_DATAGRAM).probe_due(0.0) is None
    with pytest.raises(ValueError, match="below QUIC's minimum"):
        DatagramSizeSearch(ceiling=1000)


def test_lost_probes_are_tried_again_then_the_search_rests() -> None:
    search = DatagramSizeSearch(ceiling=ETHERNET)
    now = 0.0
    for _ in range(MAX_PROBES - 1):
        assert search.probe_due(now) == ETHERNET
        search.probe_sent(ETHERNET)
        search.probe_lost(now)
        assert search.probe_due(now + PROBE_AGAIN_S - 0.01) is None
        now += PROBE_AGAIN_S
    search.probe_sent(ETHERNET)
    search.probe_lost(now)  # the third in a row
    assert search.size == BASE_DATAGRAM
    assert search.probe_due(now + SEARCH_AGAIN_S - 0.01) is None
    assert search.probe_due(now + SEARCH_AGAIN_S) == ETHERNET


def raised() -> DatagramSizeSearch:
    search = DatagramSizeSearch(ceiling=ETHERNET)
    search.probe_sent(ETHERNET)
    search.probe_acked(ETHERNET, packet_number=10)
    return search


def test_large_packets_lost_in_a_row_with_none_after_them_acknowledged_fall_back() -> None:
    search = raised()
    for number in range(11, 11 + BLACK_HOLE_LOSSES - 1):
        search.packet_acked(number + 100, 300)  # small ones still arrive: the path is up
        search.packet_lost(number, ETHERNET, now=5.0)
    assert search.size == ETHERNET
    search.packet_lost(11 + BLACK_HOLE_LOSSES, ETHERNET, now=5.0)
    assert search.size == BASE_DATAGRAM and search.fallbacks == 1
    assert search.probe_due(5.0 + SEARCH_AGAIN_S - 0.01) is None
    assert search.probe_due(5.0 + SEARCH_AGAIN_S) == ETHERNET  # and searches again later


def test_losses_the_path_carried_past_are_no_black_hole() -> None:
    """A burst lost in a queue while the large packets sent after it arrive: random loss."""
    search = raised()
    search.packet_acked(20, ETHERNET)
    for number in range(11, 11 + 2 * BLACK_HOLE_LOSSES):
        search.packet_lost(number, ETHERNET, now=5.0)
    assert search.size == ETHERNET
    for number in (21, 22):  # two lost after the latest acknowledged, then one arrives
        search.packet_lost(number, ETHERNET, now=5.0)
    search.packet_acked(23, ETHERNET)
    search.packet_lost(24, ETHERNET, now=5.0)
    search.packet_lost(BASE_DATAGRAM, BASE_DATAGRAM, now=5.0)  # small ones never count
    assert search.size == ETHERNET and search.fallbacks == 0


# --- two real aioquic connections over a simulated path --------------------------------------


class Path(Pair):
    """A pair whose path carries datagrams of at most `carries` bytes either way; larger ones are
    lost without a word (a router's MTU under the don't-fragment bit). Counts what each side sent."""

    def __init__(self, carries: int, config: LinkConfig = CONFIG) -> None:
        super().__init__(config=config)
        self.carries = carries
        self.sent: dict[str, list[int]] = {"dialler": [], "listener": []}
        for side, core in (("dialler", self.dialler), ("listener", self.listener)):
            core.datagrams_to_send = self._narrowed(core.datagrams_to_send, self.sent[side])  # type: ignore[method-assign]

    def _narrowed(
        self, send: Callable[[float], list[tuple[bytes, tuple[str, int]]]], sent: list[int]
    ) -> Callable[[float], list[tuple[bytes, tuple[str, int]]]]:
        def carried(now: float) -> list[tuple[bytes, tuple[str, int]]]:
            datagrams = send(now)
            sent.extend(len(data) for data, _ in datagrams)
            return [(data, to) for data, to in datagrams if len(data) <= self.carries]

        return carried

    def advance(self, seconds: float, drop: bool = False, lost: object = None) -> None:
        """As `Pair.advance`, but each timer runs a microsecond after it falls due, as on a real
        clock: aioquic's loss timer, run at exactly its time, can find nothing lost (its sum and
        difference of floats) and stay where it was."""
        end = self.now + seconds
        while due := [t for t in (self.dialler.timer(), self.listener.timer()) if t is not None and t <= end]:
            self.now = max(self.now, min(due) + 1e-6)
            for core in (self.dialler, self.listener):
                timer = core.timer()
                if timer is not None and timer <= self.now:
                    core.handle_timer(self.now)
            self.transfer()
        self.now = end


def token(path: Path, position: int, compute_s: float = 0.008) -> tuple[list[int], list[int]]:
    """A 2-machine ring's token: rows each way, `compute_s` on each side; the sizes of the datagrams
    with data (not an ACK alone) each side sent."""
    sent = {side: len(path.sent[side]) for side in path.sent}
    path.dialler.send_frame(rows(position))
    path.transfer()
    path.advance(compute_s)
    (got,) = frames(path.listener)
    path.listener.send_frame(rows(got.position))
    path.transfer()
    path.advance(compute_s)
    assert [f.position for f in frames(path.dialler)] == [position]
    out, back = path.sent["dialler"][sent["dialler"] :], path.sent["listener"][sent["listener"] :]
    return [size for size in out if size > ACK_ALONE], [size for size in back if size > ACK_ALONE]


def up(carries: int, config: LinkConfig = CONFIG) -> Path:
    path = Path(carries, config)
    path.up()
    path.advance(0.1)
    return path


def window(core: LinkCore) -> int:
    assert core.quic is not None
    return int(core.quic._loss.congestion_window)


def test_a_path_that_carries_1500_byte_packets_raises_both_sides_and_a_tokens_rows_go_in_two() -> None:
    path = up(carries=1500)
    assert path.dialler.datagram_size == path.listener.datagram_size == ETHERNET
    for position in range(5):
        out, back = token(path, position)
        assert max(out) == max(back) == ETHERNET and len(out) == len(back) == 2, (out, back)  # 2,592 bytes


def test_a_path_that_carries_only_1280_keeps_the_minimum_and_every_frame_arrives() -> None:
    path = up(carries=1280, config=RENO)  # whose window only a loss lowers
    windows = (window(path.dialler), window(path.listener))
    for position in range(3):
        out, back = token(path, position)  # a probe may go beside a token's rows
        rows_out, rows_back = [s for s in out if s != ETHERNET], [s for s in back if s != ETHERNET]
        assert max(rows_out + rows_back) <= BASE_DATAGRAM and len(rows_out) == len(rows_back) == 3, (out, back)
    path.advance(MAX_PROBES * PROBE_AGAIN_S + 1)  # the probes tried again, and lost, while idle
    assert path.dialler.datagram_size == path.listener.datagram_size == BASE_DATAGRAM
    probes = [size for size in path.sent["dialler"] + path.sent["listener"] if size > BASE_DATAGRAM]
    assert probes == [ETHERNET] * (2 * MAX_PROBES), probes  # each side's, no more: the search rests
    assert window(path.dialler) >= windows[0] and window(path.listener) >= windows[1]  # lost probes: no congestion
    out, back = token(path, 3)
    assert max(out + back) <= BASE_DATAGRAM


def test_a_path_that_stops_carrying_the_size_falls_back_and_what_was_lost_arrives() -> None:
    path = up(carries=1500)
    assert path.dialler.datagram_size == ETHERNET
    path.carries = 1280  # a route changed under the live link
    big = np.arange(40 * 640, dtype=np.float32).reshape(40, 640)  # a prompt's rows: 72 datagrams of 1,452
    path.dialler.send_frame(Frame.of_hidden(Kind.PREFILL, 2, 0, big))
    path.transfer()
    path.advance(3.0)
    (got,) = frames(path.listener)
    assert np.array_equal(got.hidden_states(), big)
    assert path.dialler.datagram_size == BASE_DATAGRAM
    token(path, 0, compute_s=1.0)  # the answer's first datagram lost until the member falls back too
    for core in (path.dialler, path.listener):
        assert core.quic is not None and core.quic.datagram_size.fallbacks == 1
        assert core.datagram_size == BASE_DATAGRAM
    out, back = token(path, 1)
    assert max(out + back) <= BASE_DATAGRAM and len(out) == len(back) == 3
