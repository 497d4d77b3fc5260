"""`kafila nat` classifies every emulated NAT correctly, against a real `kafila rendezvous`.

Both run as real processes: the rendezvous in the lab's public namespace on its two addresses,
the classifier in each home's host namespace behind that home's nftables NAT.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from natlab_fixtures import NAT_BEHAVIOUR, NAT_TYPES, NatLab, lab_rendezvous, natlab, natlab_required  # noqa: F401

KAFILA = [sys.executable, "-m", "kafila"]


@pytest.mark.parametrize("nat", NAT_TYPES)
def test_each_nat_is_classified(natlab: NatLab, lab_rendezvous: tuple[str, str], nat: str) -> None:  # noqa: F811
    home = natlab.homes[nat]
    started = time.monotonic()
    result = natlab.run_home(
        home,
        [*KAFILA, "nat", "--rendezvous", lab_rendezvous[0], "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = result.communicate(timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, err
    report = json.loads(out)
    mapping, filtering, nat_class = NAT_BEHAVIOUR[nat]
    assert (report["mapping"], report["filtering"], report["class"]) == (mapping, filtering, nat_class)
    assert report["behind_nat"] is True
    assert report["mapped_address"].split(":")[0] == home.public_address
    print(f"{nat}: classified in {elapsed:.2f} s, rtt {report['rtt_ms']:.2f} ms")
