"""QUIC links across the lab's NATs: direct where the punch worked, through the relay elsewhere.

For every ordered pair of NAT types, two agents signal through a real rendezvous (the
fingerprints they pin come from its introductions), punch, then open a mutually pinned QUIC
link on the same socket, directly or through a relay allocation the rendezvous grants, and
exchange 1,000 activation frames each way. The path taken must be the planner's prediction.
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
    primary, alternate = PUBLIC_ADDRESSES
    process = natlab.run_public(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", primary, "--alt-address", alternate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    ready, http = process.stdout.readline().split(), process.stdout.readline().split()
    assert ready[0] == "READY" and http[0] == "HTTP"
    yield ready[1], http[1]
    process.terminate()
    process.wait(timeout=10)


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_link_takes_the_predicted_path_and_carries_frames(
    natlab: NatLab,  # noqa: F811
    rendezvous: tuple[str, str],
    a: str,
    b: str,
) -> None:
    lab_b = b
    if a == b:
        lab_b = f"{b}-2"
        if lab_b not in natlab.homes:
            natlab.add_home(lab_b, b)
    outcome = punch_pair(natlab, *rendezvous, a, lab_b, frames=1000)
    behaviour = [
        NatBehaviour(mapping=Mapping(NAT_BEHAVIOUR[n][0]), filtering=Mapping(NAT_BEHAVIOUR[n][1])) for n in (a, b)
    ]
    expected = predict_edge(*behaviour)
    want = "direct" if expected is EdgePrediction.DIRECT else "relayed"
    assert outcome["links"] == [want, want], f"{a} -> {b}: predicted {want}, links {outcome['links']}"
    assert outcome["frames_ok"] is True
