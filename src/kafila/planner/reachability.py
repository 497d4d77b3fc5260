"""Predict, from each member's own NAT behaviour, whether a ring edge can go direct.

The rule refines the paper's "direct only if one endpoint is permissive", which relays two
common pairs that do punch (see shared notes on NAT and QUIC): an edge is predicted relayed
only if one endpoint maps endpoint-dependently and the other either maps endpoint-dependently
too or filters by address and port. A member that reported nothing is read as the most common
home router: endpoint-independent mapping, address-and-port-dependent filtering.
"""

from __future__ import annotations

from kafila.contracts import NatBehaviour, NatClass
from kafila.planner.types import EdgePrediction

UNKNOWN_NAT = NatBehaviour.from_class(NatClass.ORDINARY)


def predict_edge(a: NatBehaviour | None, b: NatBehaviour | None) -> EdgePrediction:
    a = a or UNKNOWN_NAT
    b = b or UNKNOWN_NAT
    return EdgePrediction.RELAYED if a.cannot_punch(b) else EdgePrediction.DIRECT


def edge_cost_s(prediction: EdgePrediction, rtt_a: float, rtt_b: float) -> float:
    """A relayed edge costs both trips to the rendezvous; a direct one at least their difference."""
    if prediction is EdgePrediction.RELAYED:
        return rtt_a + rtt_b
    return abs(rtt_a - rtt_b)
