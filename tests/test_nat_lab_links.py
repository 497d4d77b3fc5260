"""QUIC links across the lab's NATs: direct where the punch worked, through the relay elsewhere.

For every ordered pair of NAT types, two agents signal through a real rendezvous (the
fingerprints they pin come from its introductions), punch, then open a mutually pinned QUIC
link on the same socket, directly or through a relay allocation the rendezvous grants, and
exchange 1,000 activation frames each way. The path taken must be the planner's prediction.

A killed neighbour: on direct and relayed edges, one agent process is SIGKILLed right after
an exchange (no goodbye) and the survivor must report the broken link at its idle timeout
(issue 5's 5 s, which test_link.py holds on the link's own loop; here, seen across processes,
within twice the timeout).
"""

from __future__ import annotations

import itertools

import pytest
from natlab_fixtures import NAT_TYPES, NatLab, lab_rendezvous, natlab, natlab_required  # noqa: F401
from natlab_punch_agent import LINK_DOWN_EXIT, kill_one, peer_home, predicted_edge, punch_pair

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
