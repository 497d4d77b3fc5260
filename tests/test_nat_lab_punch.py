"""Hole punching between every ordered pair of NAT types, in the lab, against the planner's prediction.

Each side runs as a real process in its home's host namespace. They learn their reflexive
addresses from a real `kafila rendezvous` and exchange candidates through its signalling (one
opens a session, the other joins with the code), start together on `ready` (the nearer one
waits out half the difference in round trips) and punch with low-TTL priming. The outcome is
compared with the planner's rule.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from natlab_fixtures import NAT_BEHAVIOUR, NAT_TYPES, PUBLIC_ADDRESSES, NatLab, natlab, natlab_required  # noqa: F401

from kafila.planner.reachability import predict_edge
from kafila.planner.types import EdgePrediction, Mapping, NatBehaviour

AGENT = str(Path(__file__).resolve().parents[1] / "scripts" / "natlab_punch_agent.py")
RESULTS: dict[tuple[str, str], dict] = {}


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


def _line(agent: subprocess.Popen[str]) -> dict:
    line = agent.stdout.readline() if agent.stdout else ""
    if not line:
        agent.kill()
        raise AssertionError(f"agent failed: {agent.stderr.read() if agent.stderr else ''}")
    return json.loads(line)


def punch_pair(lab: NatLab, rendezvous: tuple[str, str], a: str, b: str) -> dict:
    """Both agents signal through the rendezvous: the first opens a session, the second joins it."""
    stun, http = rendezvous
    base = [sys.executable, AGENT, "--stun", stun, "--http", http, "--timeout", "4"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    host = lab.run_home(lab.homes[a], [*base, "--name", "a"], **pipes)
    agents = [host]
    try:
        code = _line(host)["code"]
        agents.append(lab.run_home(lab.homes[b], [*base, "--name", "b", "--code", code], **pipes))
        outcomes = [_line(agent) for agent in agents]
        for agent in agents:
            agent.wait(timeout=30)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    direct = all(o["path"] is not None for o in outcomes)
    return {
        "direct": direct,
        "seconds": max(o["seconds"] for o in outcomes),
        "introduction_s": max(o["introduction_s"] for o in outcomes),
    }


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_punch_matches_the_prediction(natlab: NatLab, rendezvous: tuple[str, str], a: str, b: str) -> None:  # noqa: F811
    lab_b = b
    if a == b:  # two homes of the same type: add a second one on first use
        lab_b = f"{b}-2"
        if lab_b not in natlab.homes:
            natlab.add_home(lab_b, b)
    outcome = punch_pair(natlab, rendezvous, a, lab_b)
    expected = predicted(a, b)
    RESULTS[(a, b)] = {**outcome, "predicted": expected.value}
    observed = EdgePrediction.DIRECT if outcome["direct"] else EdgePrediction.RELAYED
    assert observed is expected, f"{a} -> {b}: predicted {expected.value}, punched {observed.value}"
