"""Hole punching between every ordered pair of NAT types, in the lab, against the planner's prediction.

Each side runs as a real process in its home's host namespace. They learn their reflexive
addresses from a real `kafila rendezvous`, exchange candidates, start together (the later one
waits out the difference in their round trips) and punch with low-TTL priming. The outcome is
compared with the planner's rule and written to docs/nat-matrix.md.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from natlab_fixtures import NAT_BEHAVIOUR, NAT_TYPES, PUBLIC_ADDRESSES, NatLab, natlab, natlab_required  # noqa: F401

from kafila.planner.reachability import predict_edge
from kafila.planner.types import EdgePrediction, Mapping, NatBehaviour

AGENT = str(Path(__file__).with_name("natlab_punch_agent.py"))
RESULTS: dict[tuple[str, str], dict] = {}
RENDEZVOUS: list[subprocess.Popen] = []


@pytest.fixture(scope="module")
def stun_address(natlab: NatLab) -> Iterator[str]:  # noqa: F811
    primary, alternate = PUBLIC_ADDRESSES
    process = natlab.run_public(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", primary, "--alt-address", alternate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    ready = process.stdout.readline().split()
    assert ready and ready[0] == "READY"
    RENDEZVOUS.append(process)
    yield ready[1]
    process.terminate()
    process.wait(timeout=10)


def predicted(a: str, b: str) -> EdgePrediction:
    behaviour = {
        nat: NatBehaviour(mapping=Mapping(NAT_BEHAVIOUR[nat][0]), filtering=Mapping(NAT_BEHAVIOUR[nat][1]))
        for nat in (a, b)
    }
    return predict_edge(behaviour[a], behaviour[b])


def punch_pair(lab: NatLab, stun: str, a: str, b: str) -> dict:
    session = os.urandom(8).hex()
    agents = [
        lab.run_home(
            lab.homes[nat],
            [sys.executable, AGENT, "--stun", stun, "--session", session, "--timeout", "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for nat in (a, b)
    ]
    try:
        hello = []
        for agent in agents:
            line = agent.stdout.readline()  # type: ignore[union-attr]
            if not line:
                agent.kill()
                alive = "alive" if RENDEZVOUS[-1].poll() is None else f"dead ({RENDEZVOUS[-1].returncode})"
                raise AssertionError(f"agent failed (rendezvous {alive}): {agent.stderr.read()}")  # type: ignore[union-attr]
            hello.append(json.loads(line))
        slowest = max(h["rtt_s"] for h in hello)
        for agent, own, peer in ((agents[0], hello[0], hello[1]), (agents[1], hello[1], hello[0])):
            message = {"candidates": peer["candidates"], "delay_s": (slowest - own["rtt_s"]) / 2}
            agent.stdin.write(json.dumps(message) + "\n")  # type: ignore[union-attr]
            agent.stdin.flush()  # type: ignore[union-attr]
        outcomes = []
        for agent in agents:
            out, err = agent.communicate(timeout=30)
            assert agent.returncode == 0, err
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    direct = all(o["path"] is not None for o in outcomes)
    return {"direct": direct, "seconds": max(o["seconds"] for o in outcomes)}


@pytest.mark.parametrize(("a", "b"), list(itertools.product(NAT_TYPES, repeat=2)))
def test_punch_matches_the_prediction(natlab: NatLab, stun_address: str, a: str, b: str) -> None:  # noqa: F811
    lab_b = b
    if a == b:  # two homes of the same type: add a second one on first use
        lab_b = f"{b}-2"
        if lab_b not in natlab.homes:
            natlab.add_home(lab_b, b)
    outcome = punch_pair(natlab, stun_address, a, lab_b)
    expected = predicted(a, b)
    RESULTS[(a, b)] = {**outcome, "predicted": expected.value}
    observed = EdgePrediction.DIRECT if outcome["direct"] else EdgePrediction.RELAYED
    assert observed is expected, f"{a} -> {b}: predicted {expected.value}, punched {observed.value}"
