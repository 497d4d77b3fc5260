"""QUIC links across the lab's NATs: direct where the punch worked, through the relay elsewhere.

For every ordered pair of NAT types, two agents signal through a real rendezvous (the
fingerprints they pin come from its introductions), punch, then open a mutually pinned QUIC
link on the same socket, directly or through a relay allocation the rendezvous grants, and
exchange 1,000 activation frames each way. The path taken must be the planner's prediction.

A killed neighbour: on direct and relayed edges, one agent process is SIGKILLed right after
an exchange (no goodbye) and the survivor must report the broken link at its idle timeout
(issue 5's 5 s, which test_link.py holds on the link's own loop; here, seen across processes,
within twice the timeout).

A stage file over a lossy line: 0.25% lost on each home's line, 40 ms round trip, with the links'
default congestion controller, at several times what reno carried there.
"""

from __future__ import annotations

import itertools

import pytest
from natlab_fixtures import (  # noqa: F401
    NAT_TYPES,
    NatLab,
    lab_rendezvous,
    natlab,
    natlab_required,
    natlab_wan_required,
)
from natlab_punch_agent import LINK_DOWN_EXIT, kill_one, peer_home, predicted_edge, punch_pair, run_pair
from natlab_wan import WanLink

from kafila.network.datagram_size import MAX_PROBES, PROBE_AGAIN_S
from kafila.network.link import LinkConfig
from kafila.planner.types import EdgePrediction


def predicted_link(a: str, b: str) -> str:
    return "direct" if predicted_edge(a, b) is EdgePrediction.DIRECT else "relayed"


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_link_takes_the_predicted_path_and_carries_frames(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    a: str,
    b: str,
) -> None:
    lab_b = peer_home(natlab, a, b)
    outcome = punch_pair(natlab, *lab_rendezvous, a, lab_b, frames=1000)
    want = predicted_link(a, b)
    assert outcome["links"] == [want, want], f"{a} -> {b}: predicted {want}, links {outcome['links']}"
    assert outcome["frames_received"] == [1000, 1000]
    assert outcome["frames_ok"] is True


@pytest.mark.parametrize(
    ("a", "b"), [("port-restricted", "full-cone"), ("symmetric", "symmetric")], ids=["direct", "relayed"]
)
def test_a_path_with_a_small_mtu_keeps_quics_minimum_datagram_and_carries_every_frame(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    a: str,
    b: str,
) -> None:
    """A home whose uplink carries packets of 1,280 bytes (a tunnel's, or IPv6's minimum MTU): its
    links probe 1,452, the router drops each probe (the don't-fragment bit: it may not split it, nor
    may the sender's kernel, whatever size the router's ICMP answer told it), and they keep 1,200;
    every frame arrives. Beside it, the same pair of NATs on 1,500-byte
    uplinks raises both sides to 1,452."""
    narrow = f"mtu1280-{a.split('-')[0]}"
    if narrow not in natlab.homes:
        natlab.add_home(narrow, a)
        natlab.exec(natlab.homes[narrow].router_ns, ["ip", "link", "set", "wan", "mtu", "1280"])
    # Long enough for every probe the search tries before it rests: a kernel that split datagrams
    # by the size an ICMP message taught it would carry the second.
    settle = MAX_PROBES * PROBE_AGAIN_S + LinkConfig().ping_interval_s + 1
    outcome = punch_pair(natlab, *lab_rendezvous, narrow, peer_home(natlab, a, b), frames=300, settle=settle)
    want = predicted_link(a, b)
    assert outcome["links"] == [want, want] and outcome["frames_ok"] is True, outcome
    assert outcome["datagram_sizes"] == [1200, 1200], outcome["datagram_sizes"]
    wide = punch_pair(natlab, *lab_rendezvous, a, peer_home(natlab, a, b), frames=300)
    assert wide["links"] == [want, want] and wide["frames_ok"] is True
    assert wide["datagram_sizes"] == [1452, 1452], wide["datagram_sizes"]


@pytest.mark.parametrize(
    ("a", "b", "victim"),
    [
        ("port-restricted", "port-restricted", 1),  # direct
        ("full-cone", "symmetric", 0),  # direct, to a peer-reflexive address
        ("symmetric", "symmetric", 0),  # relayed
        ("port-restricted", "symmetric", 1),  # relayed
    ],
    ids=["direct-joiner-killed", "direct-host-killed", "relayed-host-killed", "relayed-joiner-killed"],
)
def test_a_killed_neighbour_is_reported_at_its_idle_timeout(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    a: str,
    b: str,
    victim: int,
) -> None:
    outcome = kill_one(natlab, *lab_rendezvous, a, peer_home(natlab, a, b), victim)
    want = predicted_link(a, b)
    assert outcome["links"] == [want, want] and outcome["frames_ok"] is True
    report = outcome["report"]
    assert report is not None, "the survivor never reported the broken link"
    assert report["down"] == "LinkDead" and "nothing heard" in report["reason"], report
    assert outcome["status"] == LINK_DOWN_EXIT
    # At the idle timeout (4 s), not at the relay's or QUIC's own, later ones or never. Seen from this
    # process across two others and a pipe, so with a generous allowance for a loaded machine:
    # issue 5's 5 s bound itself is held by test_link.py, as an order on the link's own loop.
    seconds = outcome["reported_s"]
    assert seconds >= LinkConfig().idle_timeout_s - 0.5, f"{want} edge: reported {seconds:.2f} s after the kill"
    assert seconds < 2 * LinkConfig().idle_timeout_s, f"{want} edge: reported {seconds:.2f} s after the kill"


def test_a_stage_file_crosses_a_lossy_line_at_several_times_what_reno_carried(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    natlab_wan_required: None,  # noqa: F811
) -> None:
    """A 16 MB stage file between two homes whose lines each lose 0.25% of packets at random and
    delay them 10 ms (a 40 ms round trip, about 0.5% lost on the path), with the links' default
    congestion controller. Reno halved its window at each loss and moved 0.4 to 0.5 MB/s here
    whatever the CPU (docs/benchmarks.md, "Stage files over a lossy line"); "rate" moved 5.2 to
    10.7 MB/s with the 2-core machine at a load of 4 to 8. The floor, 1.5 MB/s, is 3 times reno's."""
    a, b = "port-restricted", peer_home(natlab, "port-restricted", "port-restricted")
    homes = [natlab.homes[a], natlab.homes[b]]
    try:
        for home in homes:
            natlab.set_wan(home, WanLink(delay_ms=10, loss=0.0025))
        dropped_before = sum(natlab.wan_counts(home)[1] for home in homes)
        sender, receiver = run_pair(natlab, *lab_rendezvous, a, b, "--transfer", "16")
        dropped = sum(natlab.wan_counts(home)[1] for home in homes) - dropped_before
    finally:
        for home in homes:
            natlab.set_wan(home, WanLink())
    assert sender["link"] == receiver["link"] == "direct", (sender, receiver)
    sent = sender["transfer"]
    assert sent["bytes"] == 16 << 20 and "received_s" in receiver, (sender, receiver)  # whole, its sha256 checked
    assert dropped > 0  # the lines did lose packets
    rate = sent["bytes"] / sent["seconds"] / 1e6
    assert rate >= 1.5, f"{rate:.1f} MB/s over a lossy 40 ms path ({sent['lost_packets']} packets lost)"
