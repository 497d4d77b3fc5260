"""QUIC links across the lab's NATs: direct where the punch worked, through the relay elsewhere.

For every ordered pair of NAT types, two agents signal through a real rendezvous (the
fingerprints they pin come from its introductions), punch, then open a mutually pinned QUIC
link on the same socket, directly or through a relay allocation the rendezvous grants, and
exchange 1,000 activation frames each way. The path taken must be the planner's prediction.
"""

from __future__ import annotations

import itertools

import pytest
from natlab_fixtures import NAT_TYPES, NatLab, lab_rendezvous, natlab, natlab_required  # noqa: F401
from natlab_punch_agent import peer_home, predicted_edge, punch_pair

from kafila.planner.types import EdgePrediction


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_link_takes_the_predicted_path_and_carries_frames(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    a: str,
    b: str,
) -> None:
    lab_b = peer_home(natlab, a, b)
    outcome = punch_pair(natlab, *lab_rendezvous, a, lab_b, frames=1000)
    want = "direct" if predicted_edge(a, b) is EdgePrediction.DIRECT else "relayed"
    assert outcome["links"] == [want, want], f"{a} -> {b}: predicted {want}, links {outcome['links']}"
    assert outcome["frames_ok"] is True
