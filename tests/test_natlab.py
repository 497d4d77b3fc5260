"""The NAT lab (tests/helpers/natlab.py): each home's NAT shows its RFC 4787 signature, and teardown
leaves nothing behind.

Plain UDP sockets in the lab's namespaces, driven through `UdpAgent`; every wait is bounded.
Skipped, with the reason, where the lab cannot run (needs root, iproute2, nftables, conntrack).
"""

from __future__ import annotations

import subprocess
import sys

import natlab as natlab_module
import pytest
from natlab_fixtures import (  # noqa: F401  (natlab and natlab_required are fixtures)
    NAT_BEHAVIOUR,
    NAT_TYPES,
    Home,
    LabBroken,
    NatLab,
    NatObservation,
    lab_unavailable_reason,
    list_namespaces,
    natlab,
    natlab_required,
    nft_ruleset,
    probe_nat,
)
from waiting import line_from

# Unsolicited packets to a fresh socket's mapping, which contacted one public endpoint only.
EXPECTED_DELIVERY = {
    "full-cone": {"same": True, "other-port": True, "other-address": True},
    "restricted-cone": {"same": True, "other-port": True, "other-address": False},
    "port-restricted": {"same": True, "other-port": False, "other-address": False},
    "symmetric": {"same": True, "other-port": False, "other-address": False},
}


@pytest.fixture(scope="module")
def observed(natlab: NatLab) -> dict[str, NatObservation]:  # noqa: F811
    """Each home probed once (about a second each), shared by the signature tests."""
    return {nat: probe_nat(natlab, natlab.homes[nat]) for nat in NAT_TYPES}


@pytest.mark.parametrize("nat", NAT_TYPES)
def test_mapping_signature(natlab: NatLab, observed: dict[str, NatObservation], nat: str) -> None:  # noqa: F811
    seen = observed[nat]
    home = natlab.homes[nat]
    assert {address for address, _ in seen.mapped.values()} == {home.public_address}
    ports = {key: port for key, (_, port) in seen.mapped.items()}
    if nat == "symmetric":
        # A new port per destination: both another address and another port get their own.
        assert ports["other-address"] != ports["first"]
        assert ports["other-port"] != ports["first"]
    else:
        # One external endpoint for every destination, and Linux keeps the host's port.
        assert set(ports.values()) == {seen.local[1]}
    assert seen.mapping == NAT_BEHAVIOUR[nat][0]


@pytest.mark.parametrize("nat", NAT_TYPES)
def test_filtering_signature(observed: dict[str, NatObservation], nat: str) -> None:
    seen = observed[nat]
    assert seen.delivered == EXPECTED_DELIVERY[nat]
    assert seen.filtering == NAT_BEHAVIOUR[nat][1]


def test_homes_reach_each_other_through_the_internet(natlab: NatLab) -> None:  # noqa: F811
    """A host behind a port-restricted NAT reaches a full-cone host's mapping, and hears back."""
    cone, other = natlab.homes["full-cone"], natlab.homes["port-restricted"]
    with natlab.udp_agent(cone.host_ns) as a, natlab.udp_agent(other.host_ns) as b:
        sa, (_, port_a) = a.bind()
        a.send(sa, (natlab.public_addresses[0], 9), "open")  # opens the cone's mapping
        sb, _ = b.bind()
        got = None
        for _ in range(3):
            b.send(sb, (cone.public_address, port_a), "hello")  # mapping: the port is preserved
            got = a.recv(sa, timeout=1.0)
            if got is not None:
                break
        assert got is not None
        assert got[0] == "hello"
        assert got[1][0] == other.public_address
        a.send(sa, got[1], "welcome")
        back = b.recv(sb, timeout=3.0)
        assert back == ("welcome", (cone.public_address, port_a))


def test_two_hosts_share_a_home(natlab: NatLab) -> None:  # noqa: F811
    """The same-LAN case: hosts talk directly on the LAN and share the router's public address."""
    home = natlab.add_home("samelan", "port-restricted")
    second = natlab.add_host(home)
    assert [h.address for h in home.hosts] == ["192.0.2.82", "192.0.2.83"]
    with natlab.udp_agent(home.host_ns) as a, natlab.udp_agent(second.namespace) as b:
        sa, (_, port_a) = a.bind()
        sb, _ = b.bind()
        b.send(sb, (home.host_address, port_a), "neighbour")
        got = a.recv(sa, timeout=3.0)
        assert got is not None
        assert got[1][0] == second.address  # no NAT between neighbours
    seen = probe_nat(natlab, home, host=1)
    assert seen.mapped["first"][0] == home.public_address


def _lab_namespaces(lab_id: str) -> list[str]:
    return [name for name in list_namespaces() if name.startswith(lab_id + "-")]


def test_teardown_on_exception_removes_namespaces_and_processes(natlab_required: None) -> None:  # noqa: F811
    with pytest.raises(RuntimeError, match="boom"), NatLab() as lab:
        home = lab.add_home("one", "symmetric")
        sleepers = [lab.run_public(["sleep", "60"]), lab.run_home(home, ["sleep", "60"])]
        assert len(_lab_namespaces(lab.lab_id)) == 3
        raise RuntimeError("boom")
    assert _lab_namespaces(lab.lab_id) == []
    assert all(proc.poll() is not None for proc in sleepers)


def test_teardown_on_normal_exit_and_twice(natlab_required: None) -> None:  # noqa: F811
    with NatLab(prefix="kt") as lab:
        lab.add_home("one", "full-cone")
        out = lab.exec(lab.homes["one"].router_ns, ["sysctl", "-n", "net.ipv4.ip_forward"])
        assert out.strip() == "1"
        assert lab.exec(lab.homes["one"].router_ns, ["conntrack", "-C"]).strip().isdigit()
    assert _lab_namespaces(lab.lab_id) == []
    lab.close()  # idempotent


def test_run_refuses_foreign_namespaces(natlab: NatLab) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="not a namespace"):
        natlab.run("not-a-lab-namespace", ["true"], stdout=subprocess.DEVNULL)


# TCP both ways between a home and the internet (the home dials: nothing reaches it unasked). The
# public side listens and says its port; it sends N bytes, or receives; the receiving side times the
# bytes from the first to the end and prints "count seconds".
_TIMED = r"""
import socket, sys, time
def receive(connection):
    first, got = None, 0
    while chunk := connection.recv(1 << 16):
        first = first or time.monotonic()
        got += len(chunk)
    print(got, time.monotonic() - first, flush=True)
role, address, port, n_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role.startswith("listen"):
    server = socket.create_server((address, 0))
    print(server.getsockname()[1], flush=True)
    connection, _ = server.accept()
else:
    connection = socket.create_connection((address, port))
if role.endswith("send"):
    connection.sendall(bytes(n_bytes))
    connection.close()
else:
    receive(connection)
"""


def timed_rate(lab: NatLab, home: Home, n_bytes: int, up: bool) -> float:
    """Bytes a second of `n_bytes` sent over TCP from the home's host to the internet (`up`) or back."""
    address = lab.public_addresses[0]
    public = "listen-receive" if up else "listen-send"
    server = lab.run_public(
        [sys.executable, "-c", _TIMED, public, address, "0", str(n_bytes)], stdout=subprocess.PIPE, text=True
    )
    port = line_from(server.stdout, "the public side's port").strip()
    client = lab.run_home(
        home,
        [sys.executable, "-c", _TIMED, "dial-send" if up else "dial-receive", address, port, str(n_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    got, seconds = line_from((server if up else client).stdout, "the receiver's count").split()
    assert int(got) == n_bytes
    return n_bytes / float(seconds)


def test_a_shaped_home_has_its_own_uplink_and_downlink_rates(natlab: NatLab) -> None:  # noqa: F811
    """`shape` caps each way of a home's line at its own rate, in the kernel (tbf), and 0 lifts it."""
    home = natlab.homes["full-cone"]
    natlab.shape(home, up_bytes_s=1e6, down_bytes_s=4e6)
    try:
        up = timed_rate(natlab, home, 2_000_000, up=True)
        down = timed_rate(natlab, home, 8_000_000, up=False)
    finally:
        natlab.shape(home, up_bytes_s=0, down_bytes_s=0)
    assert 0.6e6 < up < 1.1e6 and 2.4e6 < down < 4.4e6, (up, down)
    assert "tbf" not in natlab.exec(home.router_ns, ["tc", "qdisc", "show", "dev", "wan"])
    assert "tbf" not in natlab.exec(natlab.public_ns, ["tc", "qdisc", "show", "dev", f"home{home.index}"])
    with pytest.raises(ValueError, match="never negative"):
        natlab.shape(home, up_bytes_s=-1, down_bytes_s=0)


def test_unknown_nat_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown NAT type"):
        nft_ruleset("cone-ish")


def test_unavailable_reason_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFILA_NO_NATLAB", "1")
    lab_unavailable_reason.cache_clear()
    try:
        assert lab_unavailable_reason() == "NAT lab disabled by KAFILA_NO_NATLAB"
    finally:
        lab_unavailable_reason.cache_clear()


def test_a_ruleset_of_the_labs_own_that_is_refused_is_a_failure_not_a_skip(
    natlab_required: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This machine has nftables NAT (natlab_required passed), so when nft refuses the lab's own
    ruleset, the lab is wrong: the check raises rather than naming a reason to skip."""
    real = natlab_module.nft_ruleset
    monkeypatch.setattr(natlab_module, "nft_ruleset", lambda nat: real(nat).replace("masquerade", "masqerade"))
    lab_unavailable_reason.cache_clear()
    try:
        with pytest.raises(LabBroken, match=r"(?s)its own full-cone ruleset failed .*masqerade"):
            lab_unavailable_reason()
    finally:
        lab_unavailable_reason.cache_clear()
