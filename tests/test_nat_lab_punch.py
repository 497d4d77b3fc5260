"""Hole punching between every ordered pair of NAT types, in the lab, against the planner's prediction.

Each side runs as a real process in its home's host namespace. They learn their reflexive
addresses from a real `kafila rendezvous` and exchange candidates through its signalling (one
opens a session, the other joins with the code), start together on `ready` (the nearer one
waits out half the difference in round trips) and punch with low-TTL priming. The outcome is
compared with the planner's rule.
"""

from __future__ import annotations

import itertools

import pytest
from natlab_fixtures import NAT_TYPES, NatLab, lab_rendezvous, natlab, natlab_required  # noqa: F401
from natlab_punch_agent import peer_home, predicted_edge, punch_pair

from kafila.planner.types import EdgePrediction


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_punch_matches_the_prediction(
    natlab: NatLab,  # noqa: F811
    lab_rendezvous: tuple[str, str],  # noqa: F811
    a: str,
    b: str,
) -> None:
    lab_b = peer_home(natlab, a, b)
    outcome = punch_pair(natlab, *lab_rendezvous, a, lab_b)
    expected = predicted_edge(a, b)
    observed = EdgePrediction.DIRECT if outcome["direct"] else EdgePrediction.RELAYED
    assert observed is expected, f"{a} -> {b}: predicted {expected.value}, punched {observed.value}"
