"""pytest fixtures for the NAT lab (natlab.py, beside this file).

conftest.py does not load these: a test module imports what it uses, e.g.
`from natlab_fixtures import NatLab, natlab  # noqa: F401`; the lab's names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from natlab import (
    NAT_BEHAVIOUR,
    NAT_TYPES,
    PUBLIC_ADDRESSES,
    Home,
    LabBroken,
    LabError,
    NatLab,
    NatObservation,
    UdpAgent,
    lab_unavailable_reason,
    list_namespaces,
    nft_ruleset,
    probe_nat,
    wan_unavailable_reason,
)

__all__ = [
    "NAT_BEHAVIOUR",
    "NAT_TYPES",
    "PUBLIC_ADDRESSES",
    "Home",
    "LabBroken",
    "LabError",
    "NatLab",
    "NatObservation",
    "UdpAgent",
    "lab_rendezvous",
    "lab_unavailable_reason",
    "list_namespaces",
    "natlab",
    "natlab_required",
    "natlab_wan_required",
    "nft_ruleset",
    "probe_nat",
]


@pytest.fixture(scope="session")
def natlab_required() -> None:
    """Skip, with the reason, where no lab can be built (not root, tools missing, no netns); under
    KAFILA_CI the skip fails (ci_guard). A lab that fails on a machine with all it needs raises
    LabBroken: an error everywhere."""
    reason = lab_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def natlab_wan_required() -> None:
    """Skip, with the reason, where the lab's WAN delay line cannot run (no TUN devices)."""
    reason = wan_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def natlab(natlab_required: None) -> Iterator[NatLab]:
    """A lab with one home per NAT type, each named after its type (`natlab.homes["symmetric"]`).

    Module scope: building costs about a second of a shared machine. Tests may add homes or
    hosts but must not change the four built here; every namespace goes at the module's end.
    """
    with NatLab() as lab:
        for nat in NAT_TYPES:
            lab.add_home(nat, nat)
        yield lab


@pytest.fixture(scope="module")
def lab_rendezvous(natlab: NatLab) -> Iterator[tuple[str, str]]:
    """A real `kafila rendezvous` in the lab's public namespace: (STUN address, HTTP address)."""
    from natlab_punch_agent import start_rendezvous

    process, stun, http = start_rendezvous(natlab)
    yield stun, http
    process.terminate()
    process.wait(timeout=10)
