"""Three members behind three different NATs bring up all their edges at once, in the lab.

Each member is a real process in its home's namespace, introduced by a real rendezvous. All
three call `connect_edges` together, so each member punches to both others on one socket at
the same time and relays what does not punch. Every edge must take the path the planner
predicts for its two NAT types, the same at both ends, and carry frames both ways.
"""

from __future__ import annotations

import itertools

import pytest
from natlab_edges_agent import connect_members
from natlab_fixtures import NatLab, lab_rendezvous, natlab, natlab_required  # noqa: F401
from natlab_punch_agent import peer_home, predicted_edge

from kafila.network.edges import PUNCH_TIMEOUT_S
from kafila.planner.types import EdgePrediction

FRAMES = 200


@pytest.mark.parametrize(
    "nats",
    [
        ("full-cone", "port-restricted", "symmetric"),  # one relayed edge, two direct
        ("symmetric", "restricted-cone", "full-cone"),  # the symmetric member punches to two peers at once
        ("symmetric", "port-restricted", "symmetric"),  # every edge relayed: two relays per member
    ],
    ids=["mixed", "all-direct", "all-relayed"],
)
def test_all_edges_take_the_predicted_paths(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    nats: tuple[str, str, str],
) -> None:
    homes: list[str] = []
    for nat in nats:
        homes.append(nat if nat not in homes else peer_home(natlab, nat, nat))
    outcomes = connect_members(natlab, *lab_rendezvous, homes, frames=FRAMES)
    errors = {home: o["error"] for home, o in outcomes.items() if "error" in o}
    assert not errors, errors
    for (a, nat_a), (b, nat_b) in itertools.permutations(zip(homes, nats, strict=True), 2):
        want = "direct" if predicted_edge(nat_a, nat_b) is EdgePrediction.DIRECT else "relayed"
        edge = outcomes[a]["edges"][b]
        assert edge["path"] == want, f"{a} -> {b}: predicted {want}, took {edge['path']}"
        assert edge["frames_received"] == FRAMES and edge["frames_ok"] is True, (a, b, edge)
    assert all(o["seconds"] < 10 for o in outcomes.values())
    # both ends of an edge whose NATs let no punch through go to the relay at once, without
    # waiting out the punch: a member whose every edge is relayed links in less than that wait
    for home, outcome in outcomes.items():
        if all(edge["path"] == "relayed" for edge in outcome["edges"].values()):
            assert outcome["seconds"] < PUNCH_TIMEOUT_S, (home, outcome["seconds"])
