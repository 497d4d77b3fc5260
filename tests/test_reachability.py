"""The edge rule, over every pair of RFC 4787 behaviours and the three classes."""

from __future__ import annotations

import itertools

import pytest

from kafila.contracts import Mapping, NatBehaviour, NatClass
from kafila.planner.reachability import edge_cost_s, predict_edge
from kafila.planner.types import EdgePrediction

EIM, ADM, APDM = Mapping.ENDPOINT_INDEPENDENT, Mapping.ADDRESS_DEPENDENT, Mapping.ADDRESS_AND_PORT_DEPENDENT
BEHAVIOURS = [NatBehaviour(mapping=m, filtering=f) for m in Mapping for f in Mapping]


def expected(a: NatBehaviour, b: NatBehaviour) -> EdgePrediction:
    a_symmetric = a.mapping is not EIM
    b_symmetric = b.mapping is not EIM
    a_strict = a.filtering is APDM
    b_strict = b.filtering is APDM
    relayed = (a_symmetric and (b_symmetric or b_strict)) or (b_symmetric and (a_symmetric or a_strict))
    return EdgePrediction.RELAYED if relayed else EdgePrediction.DIRECT


@pytest.mark.parametrize(("a", "b"), list(itertools.product(BEHAVIOURS, repeat=2)))
def test_every_behaviour_pair(a: NatBehaviour, b: NatBehaviour) -> None:
    assert predict_edge(a, b) is expected(a, b)
    assert predict_edge(a, b) is predict_edge(b, a)
    # the links skip the punch for exactly the pairs the planner relays (network/edges.py)
    assert a.cannot_punch(b) is b.cannot_punch(a) is (expected(a, b) is EdgePrediction.RELAYED)


CLASS_TABLE = {
    (NatClass.PERMISSIVE, NatClass.PERMISSIVE): EdgePrediction.DIRECT,
    (NatClass.PERMISSIVE, NatClass.ORDINARY): EdgePrediction.DIRECT,
    (NatClass.PERMISSIVE, NatClass.RESTRICTIVE): EdgePrediction.DIRECT,
    (NatClass.ORDINARY, NatClass.ORDINARY): EdgePrediction.DIRECT,  # the paper relays this; it punches
    (NatClass.ORDINARY, NatClass.RESTRICTIVE): EdgePrediction.RELAYED,  # filtering unknown: assume strict
    (NatClass.RESTRICTIVE, NatClass.RESTRICTIVE): EdgePrediction.RELAYED,
}


@pytest.mark.parametrize(("pair", "prediction"), CLASS_TABLE.items())
def test_classes(pair: tuple[NatClass, NatClass], prediction: EdgePrediction) -> None:
    a, b = (NatBehaviour.from_class(c) for c in pair)
    assert predict_edge(a, b) is prediction
    assert predict_edge(b, a) is prediction


def test_address_dependent_filtering_against_symmetric_goes_direct() -> None:
    """The second case the paper's rule relays but which punches in practice."""
    restricted_cone = NatBehaviour(mapping=EIM, filtering=ADM)
    symmetric = NatBehaviour(mapping=APDM, filtering=APDM)
    assert predict_edge(restricted_cone, symmetric) is EdgePrediction.DIRECT


def test_unknown_nat_is_read_as_ordinary() -> None:
    symmetric = NatBehaviour.from_class(NatClass.RESTRICTIVE)
    assert predict_edge(None, symmetric) is EdgePrediction.RELAYED
    assert predict_edge(None, None) is EdgePrediction.DIRECT


def test_edge_costs() -> None:
    assert edge_cost_s(EdgePrediction.RELAYED, 0.08, 0.115) == pytest.approx(0.195)
    assert edge_cost_s(EdgePrediction.DIRECT, 0.08, 0.115) == pytest.approx(0.035)
