"""`kafila nat` classifies every emulated NAT correctly, against a real `kafila rendezvous`.

Both run as real processes: the rendezvous in the lab's public namespace on its two addresses,
the classifier in each home's host namespace behind that home's nftables NAT.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from natlab_fixtures import NAT_BEHAVIOUR, NAT_TYPES, PUBLIC_ADDRESSES, NatLab, natlab, natlab_required  # noqa: F401

KAFILA = [sys.executable, "-m", "kafila"]


@pytest.fixture(scope="module")
def rendezvous(natlab: NatLab) -> Iterator[str]:  # noqa: F811
    primary, alternate = PUBLIC_ADDRESSES
    process = natlab.run_public(
        [
            *KAFILA,
            "rendezvous",
            "--host",
            primary,
            "--stun-port",
            "3478",
            "--alt-address",
            alternate,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline().split()
    assert line and line[0] == "READY", process.stderr.read() if process.stderr else ""
    yield line[1]
    process.terminate()
    process.wait(timeout=10)


@pytest.mark.parametrize("nat", NAT_TYPES)
def test_each_nat_is_classified(natlab: NatLab, rendezvous: str, nat: str) -> None:  # noqa: F811
    home = natlab.homes[nat]
    started = time.monotonic()
    result = natlab.run_home(
        home,
        [*KAFILA, "nat", "--rendezvous", rendezvous, "--json"],
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
