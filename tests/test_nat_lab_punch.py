"""Hole punching between every ordered pair of NAT types, in the lab, against the planner's prediction.

Each side runs as a real process in its home's host namespace. They learn their reflexive
addresses from a real `kafila rendezvous` and exchange candidates through its signalling (one
opens a session, the other joins with the code), start together on `ready` (the nearer one
waits out half the difference in round trips) and punch with low-TTL priming. The outcome is
compared with the planner's rule.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator

import pytest
from natlab_fixtures import NAT_BEHAVIOUR, NAT_TYPES, PUBLIC_ADDRESSES, NatLab, natlab, natlab_required  # noqa: F401
from natlab_punch_agent import punch_pair

from kafila.planner.reachability import predict_edge
from kafila.planner.types import EdgePrediction, Mapping, NatBehaviour


@pytest.fixture(scope="module")
def rendezvous(natlab: NatLab) -> Iterator[tuple[str, str]]:  # noqa: F811
    """A real `kafila rendezvous` in the public namespace: (STUN address, HTTP address)."""
    primary, alternate = PUBLIC_ADDRESSES
    process = natlab.run_public(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", primary, "--alt-address", alternate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    ready, http = process.stdout.readline().split(), process.stdout.readline().split()
    assert ready and ready[0] == "READY" and http and http[0] == "HTTP"
    yield ready[1], http[1]
    process.terminate()
    process.wait(timeout=10)


def predicted(a: str, b: str) -> EdgePrediction:
    behaviour = {
        nat: NatBehaviour(mapping=Mapping(NAT_BEHAVIOUR[nat][0]), filtering=Mapping(NAT_BEHAVIOUR[nat][1]))
        for nat in (a, b)
    }
    return predict_edge(behaviour[a], behaviour[b])


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_punch_matches_the_prediction(natlab: NatLab, rendezvous: tuple[str, str], a: str, b: str) -> None:  # noqa: F811
    lab_b = b
    if a == b:  # two homes of the same type: add a second one on first use
        lab_b = f"{b}-2"
        if lab_b not in natlab.homes:
            natlab.add_home(lab_b, b)
    outcome = punch_pair(natlab, *rendezvous, a, lab_b)
    expected = predicted(a, b)
    observed = EdgePrediction.DIRECT if outcome["direct"] else EdgePrediction.RELAYED
    assert observed is expected, f"{a} -> {b}: predicted {expected.value}, punched {observed.value}"
