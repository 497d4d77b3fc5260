"""NAT lab: homes behind real Linux NATs, built from network namespaces, veth pairs and nftables.

Kafila must connect machines behind home NATs, so its traversal code is tested against real
kernel NAT rather than mocks. A lab is one "public" namespace that routes between the homes
and holds the rendezvous host's two addresses, standing for the internet, plus, per home, a NAT router
namespace and one or more host namespaces on the router's LAN. Each router's nftables ruleset
makes it behave as one RFC 4787 NAT type (the configurations verified in
shared/notes/nat-and-quic.md). Everything a lab builds is a namespace whose name starts with
its unique id, so teardown deletes those namespaces (and with them every veth) and nothing else.

Address plan (documentation ranges only):
    public namespace, a router (the internet is routed, not one switch: a home's packets
    to another home cross a hop outside both NATs, where TTL-2 "priming" packets die):
        203.0.113.1, 203.0.113.2         the rendezvous host's two addresses (on a bridge
                                         with no ports, "internet")
        198.51.100.(4N+1)/30, "homeN"    the ISP side of home N's link
    home N (N = 1, 2, ... in the order added, at most 15):
        router WAN "wan"                 198.51.100.(4N+2)/30, default via 198.51.100.(4N+1)
        router LAN bridge "lan"          192.0.2.(16N+1)/28
        host k (k = 1, 2, ...), "eth0"   192.0.2.(16N+1+k)/28, default via the router

Usage:
    with NatLab() as lab:
        home = lab.add_home("alice", "port-restricted")
        server = lab.run_public(["python3", "server.py"])
        client = lab.run_home(home, ["python3", "client.py"])

CLI: `python tests/helpers/natlab.py demo` builds the four homes, prints them, probes each NAT and
tears down; `up` builds and leaves the lab running; `down` deletes every lab namespace left
behind (by `up` or by a crashed run). Needs root, iproute2, nftables and conntrack
(`apt-get install -y iproute2 nftables conntrack`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from natlab_wan import WanLink

NAT_TYPES = ("full-cone", "restricted-cone", "port-restricted", "symmetric")

# What each NAT type must look like to an RFC 5780 probe: (mapping, filtering, class), in the
# words of kafila.planner.types.Mapping and NatClass, so tests can compare kafila's own report.
NAT_BEHAVIOUR: dict[str, tuple[str, str, str]] = {
    "full-cone": ("endpoint-independent", "endpoint-independent", "permissive"),
    "restricted-cone": ("endpoint-independent", "address-dependent", "ordinary"),
    "port-restricted": ("endpoint-independent", "address-and-port-dependent", "ordinary"),
    "symmetric": ("address-and-port-dependent", "address-and-port-dependent", "restrictive"),
}

PUBLIC_ADDRESSES = ("203.0.113.1", "203.0.113.2")
MAX_HOMES = 15  # 192.0.2.0/24 holds fifteen /28 LANs after the first
MAX_HOSTS_PER_HOME = 13
MAPPING_TIMEOUT_S = 120  # cone DNAT and filter entries live this long after the host's last packet
COMMAND_TIMEOUT_S = 20.0  # no lab command may hang a test run
DISABLE_ENV = "KAFILA_NO_NATLAB"

# Where br_netfilter is loaded (it is here), bridged frames also cross the namespace's IP
# hooks and conntrack: the internet bridge and the home LANs must be plain switches.
_NO_BRIDGE_NETFILTER = "f=/proc/sys/net/bridge/bridge-nf-call-iptables; if [ -e $f ]; then echo 0 > $f; fi"
_ROUTER_SYSCTLS = f"sysctl -qw net.ipv4.ip_forward=1; {_NO_BRIDGE_NETFILTER}"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,19}$")


class LabError(RuntimeError):
    """A lab command failed; the message carries the command and its stderr."""


class LabTimeout(LabError):
    """A lab command ran past COMMAND_TIMEOUT_S: a slow or stuck machine, never a missing feature."""


class LabBroken(LabError):
    """The lab failed on a machine that has everything it needs (its own ruleset was refused, or a
    command hung): a failure wherever it happens, never a reason to skip."""


@dataclass
class Host:
    """One machine in a home: its namespace and LAN address."""

    namespace: str
    address: str


@dataclass
class Home:
    """A NAT router namespace and the hosts on its LAN."""

    name: str
    nat: str
    index: int
    router_ns: str
    public_address: str  # the router's WAN address: what the internet sees
    gateway: str  # the router's LAN address
    hosts: list[Host] = field(default_factory=list)

    @property
    def host(self) -> Host:
        """The first host: most tests need only one."""
        return self.hosts[0]

    @property
    def host_ns(self) -> str:
        return self.hosts[0].namespace

    @property
    def host_address(self) -> str:
        return self.hosts[0].address


def _run(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command with a bounded time; raise LabError with its stderr when it fails."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LabTimeout(f"timed out after {COMMAND_TIMEOUT_S} s: {' '.join(argv)}") from exc
    except OSError as exc:
        raise LabError(f"cannot run {argv[0]}: {exc}") from exc
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _ip_batch(namespace: str, commands: list[str]) -> None:
    """Many `ip` commands in one process: the machine is shared, processes are not free."""
    _run(["ip", "-n", namespace, "-batch", "-"], stdin="\n".join(commands) + "\n")


def _ns_exec(namespace: str, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return _run(["ip", "netns", "exec", namespace, *argv], stdin=stdin)


SHAPED_QUEUE_S = 0.1  # what a shaped link queues before it drops: a home router's buffer


def _token_bucket(rate_bytes_s: float) -> list[str]:
    """The `tc qdisc` arguments for a link of this rate in bytes a second: a bucket of 10 ms of the
    rate (a 64 KiB offloaded segment at least) and SHAPED_QUEUE_S of queue."""
    if rate_bytes_s <= 0:
        raise ValueError("a shaped link's rate is above zero")
    burst = max(64 << 10, int(rate_bytes_s / 100))
    return [
        "tbf",
        "rate",
        f"{int(rate_bytes_s * 8)}bit",
        "burst",
        str(burst),
        "latency",
        f"{int(SHAPED_QUEUE_S * 1e3)}ms",
    ]


@functools.cache
def wan_unavailable_reason() -> str | None:
    """None when the lab's WAN delay line (natlab_wan.py) can run here, else why not: it needs a
    lab and TUN devices."""
    reason = lab_unavailable_reason()
    if reason is not None:
        return reason
    if not os.path.exists("/dev/net/tun"):
        return "NAT lab WAN links need TUN devices, and this machine has no /dev/net/tun"
    probe = f"kl{secrets.token_hex(3)}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "tuntap", "add", "dev", "wan0", "mode", "tun"])
        return None
    except LabTimeout as exc:
        raise LabBroken(f"NAT lab: a TUN device's set-up hung: {exc}") from exc
    except LabError as exc:
        return f"NAT lab WAN links need TUN devices (/dev/net/tun): {exc}"
    finally:
        _delete_namespace(probe)


def ask_json_line(proc: subprocess.Popen[bytes], request: dict[str, Any], timeout: float, who: str) -> dict[str, Any]:
    """One JSON request line to a helper process, and its one-line answer, bounded in time; LabError
    when it does not answer in time, has exited, or answers with an error."""
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    stdin.write((json.dumps(request) + "\n").encode())
    stdin.flush()
    if not select.select([stdout], [], [], timeout)[0]:
        raise LabError(f"{who} did not answer {request.get('op', request)}")
    line = stdout.readline()
    if not line:
        raise LabError(f"{who} exited ({proc.poll()}) on {request.get('op', request)}")
    answer: dict[str, Any] = json.loads(line)
    if "error" in answer:
        raise LabError(f"{who} refused {request.get('op', request)}: {answer['error']}")
    return answer


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list` prints "name (id: N)")."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL whatever still runs inside a lab namespace: it would keep the namespace alive."""
    done = _run(["ip", "netns", "pids", namespace], check=False)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    _run(["ip", "netns", "delete", namespace], check=False)


def nft_ruleset(nat: str) -> str:
    """The router's nftables ruleset for one NAT type (see the module's notes on each).

    full-cone: masquerade, plus DNAT of any inbound UDP to the host that last sent from that
        port (a dynamic map), so anyone may reach a mapping: endpoint-independent filtering.
    restricted-cone: as full-cone, but a new inbound flow is dropped unless the host has sent
        from that port to that remote address (a dynamic set): address-dependent filtering.
    port-restricted: plain masquerade. Linux keeps the source port when free and reuses one
        mapping per socket, and conntrack only admits replies: address-and-port-dependent
        filtering. Unsolicited packets reach the router itself, which answers ICMP unreachable.
    symmetric: `masquerade fully-random`: a new random port per destination.

    The cone DNAT assumes port preservation (external port == host port), which holds unless
    two hosts of one home bind the same port.
    """
    if nat not in NAT_TYPES:
        raise ValueError(f"unknown NAT type {nat!r}; expected one of {NAT_TYPES}")
    masquerade = "masquerade fully-random" if nat == "symmetric" else "masquerade"
    cone, restricted, t = nat in ("full-cone", "restricted-cone"), nat == "restricted-cone", MAPPING_TIMEOUT_S
    lines = ["table ip natlab {"]
    if cone:
        lines.append(f"  map hosts {{ type inet_service : ipv4_addr; flags dynamic, timeout; timeout {t}s; }}")
    if restricted:
        lines.append(f"  set contacted {{ type inet_service . ipv4_addr; flags dynamic, timeout; timeout {t}s; }}")
    if cone:
        lines += [
            # A filter-type chain sees every packet (nat chains see a flow's first only), so the
            # entries are refreshed for as long as the host keeps sending.
            "  chain probe_track { type filter hook prerouting priority mangle; policy accept;",
            '    iifname "lan" meta l4proto udp update @hosts { udp sport : ip saddr }',
            *(['    iifname "lan" meta l4proto udp update @contacted { udp sport . ip daddr }'] if restricted else []),
            "  }",
            "  chain inbound { type nat hook prerouting priority dstnat; policy accept;",
            '    iifname "wan" meta l4proto udp dnat to udp dport map @hosts',
            "  }",
        ]
    if restricted:
        lines += [
            "  chain forward { type filter hook forward priority filter; policy accept;",
            '    iifname "wan" ct state new ct status dnat meta l4proto udp udp dport . ip saddr != @contacted drop',
            "  }",
        ]
    lines += [
        "  chain outbound { type nat hook postrouting priority srcnat; policy accept;",
        f'    oifname "wan" {masquerade}',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


# What the lab needs of the kernel, in the plainest nftables: a NAT table with masquerade (plain
# and fully random), a dynamic set and map updated from the packet path, and conntrack's state and
# status. Where this is refused, the machine lacks something; where it passes and the lab's own
# rulesets (nft_ruleset) are refused, the rulesets are wrong.
_NFT_CAPABILITIES = """table ip kafila_capabilities {
  set seen { type inet_service . ipv4_addr; flags dynamic, timeout; timeout 10s; }
  map owner { type inet_service : ipv4_addr; flags dynamic, timeout; timeout 10s; }
  chain probe_track { type filter hook prerouting priority mangle; policy accept;
    meta l4proto udp update @seen { udp sport . ip saddr }
    meta l4proto udp update @owner { udp sport : ip saddr }
  }
  chain probe_dnat { type nat hook prerouting priority dstnat; policy accept;
    meta l4proto udp dnat to udp dport map @owner
  }
  chain probe_filter { type filter hook forward priority filter; policy accept;
    ct state new ct status dnat accept
  }
  chain probe_snat { type nat hook postrouting priority srcnat; policy accept;
    oifname "va" masquerade
    oifname "vb" masquerade fully-random
  }
}
"""


@functools.cache
def lab_unavailable_reason() -> str | None:
    """None when a lab can be built here, else what this machine lacks (for pytest.skip and the CLI).

    Probes the real thing once per process: a throwaway namespace with a veth pair, a bridge,
    nftables NAT with dynamic sets, a conntrack listing and IP forwarding. Then, with all of that
    present, it loads the lab's own ruleset for every NAT type: a refusal there, or a command that
    hangs, is the lab's fault and raises LabBroken rather than naming a reason to skip.
    """
    if os.environ.get(DISABLE_ENV):
        return f"NAT lab disabled by {DISABLE_ENV}"
    if not sys.platform.startswith("linux"):
        return "NAT lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "NAT lab needs root (network namespaces, nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("conntrack", "conntrack")):
        if shutil.which(tool) is None:
            return f"NAT lab needs `{tool}`: apt-get install -y {package}"
    probe = f"kl{secrets.token_hex(3)}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except LabTimeout as exc:
        raise LabBroken(f"NAT lab: creating a network namespace hung: {exc}") from exc
    except LabError as exc:
        return f"NAT lab cannot create a network namespace: {exc}"
    try:
        nft = ["ip", "netns", "exec", probe, "nft", "-f", "-"]
        steps: list[tuple[str, list[str], str | None]] = [
            (
                "veth and bridge links",
                ["ip", "-n", probe, "-batch", "-"],
                "link set lo up\nlink add name va type veth peer name vb\nlink add name vbr type bridge\n",
            ),
            ("nftables NAT with dynamic sets", nft, _NFT_CAPABILITIES),
            ("conntrack", ["ip", "netns", "exec", probe, "conntrack", "-L"], None),
            ("IP forwarding", ["ip", "netns", "exec", probe, "sysctl", "-qw", "net.ipv4.ip_forward=1"], None),
        ]
        for what, argv, stdin in steps:
            try:
                _run(argv, stdin=stdin)
            except LabTimeout as exc:
                raise LabBroken(f"NAT lab: {what} hung: {exc}") from exc
            except LabError as exc:
                return f"NAT lab: {what} unusable here: {exc}"
        # The machine has all the lab needs: from here on, a refusal is the lab's own bug.
        for nat in NAT_TYPES:
            try:
                _run(nft, stdin=nft_ruleset(nat))
                _run(["ip", "netns", "exec", probe, "nft", "delete", "table", "ip", "natlab"])
            except LabError as exc:
                raise LabBroken(f"NAT lab: its own {nat} ruleset failed on a machine with nftables NAT: {exc}") from exc
        return None
    finally:
        _delete_namespace(probe)


class NatLab:
    """A lab of homes behind NATs; a context manager that always tears down what it built."""

    def __init__(self, prefix: str = "kl") -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", prefix):
            raise ValueError("prefix: 1 to 6 lowercase letters or digits, starting with a letter")
        self.prefix = prefix
        self.lab_id = f"{prefix}{secrets.token_hex(3)}"  # unique per instance: runs never collide
        self.public_ns = f"{self.lab_id}-pub"
        self.public_addresses: tuple[str, str] = PUBLIC_ADDRESSES
        self.homes: dict[str, Home] = {}
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._built = False
        self._wan: subprocess.Popen[bytes] | None = None  # the delay line (natlab_wan.py), once a link is set
        self._wan_routed: set[int] = set()  # homes whose uplink has its line set up
        self._wan_through: set[int] = set()  # of those, homes whose packets go through it (not a perfect link)

    # --- building ---------------------------------------------------------------------------

    def __enter__(self) -> NatLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        self._namespaces.append(name)  # recorded first: a half-made namespace is still deleted
        _run(["ip", "netns", "add", name])

    def build(self) -> None:
        """Create the public namespace: the internet bridge with the rendezvous addresses."""
        if self._built:
            return
        self._add_namespace(self.public_ns)
        a1, a2 = self.public_addresses
        _ip_batch(
            self.public_ns,
            [
                "link set lo up",
                # A bridge takes the lowest MAC of its ports unless given one: adding a home
                # would change it and strand every router's ARP entry for the rendezvous.
                "link add name internet address 02:00:00:00:00:01 type bridge",
                f"addr add {a1}/24 dev internet",
                f"addr add {a2}/24 dev internet",
                "link set internet up",
            ],
        )
        _ns_exec(self.public_ns, ["sh", "-c", f"{_NO_BRIDGE_NETFILTER}; echo 1 > /proc/sys/net/ipv4/ip_forward"])
        self._built = True

    def add_home(self, name: str, nat: str) -> Home:
        """A NAT router of type `nat` on the internet, with one host behind it."""
        if not self._built:
            self.build()
        if nat not in NAT_TYPES:
            raise ValueError(f"unknown NAT type {nat!r}; expected one of {NAT_TYPES}")
        if not _NAME.fullmatch(name) or name in self.homes:
            raise ValueError(f"home name {name!r}: unique, lowercase letters, digits and '-', 20 at most")
        index = len(self.homes) + 1
        if index > MAX_HOMES:
            raise ValueError(f"at most {MAX_HOMES} homes per lab")
        home = Home(
            name=name,
            nat=nat,
            index=index,
            router_ns=f"{self.lab_id}-{name}-r",
            public_address=f"198.51.100.{4 * index + 2}",
            gateway=f"192.0.2.{16 * index + 1}",
        )
        self.homes[name] = home
        isp_side = f"198.51.100.{4 * index + 1}"
        self._add_namespace(home.router_ns)
        _ip_batch(
            home.router_ns,
            [
                "link set lo up",
                f"link add name wan type veth peer name home{index} netns {self.public_ns}",
                f"addr add {home.public_address}/30 dev wan",
                "link set wan up",
                f"route add default via {isp_side}",
                f"link add name lan address 02:00:00:00:01:{index:02x} type bridge",  # fixed, as above
                f"addr add {home.gateway}/28 dev lan",
                "link set lan up",
            ],
        )
        _ip_batch(self.public_ns, [f"addr add {isp_side}/30 dev home{index}", f"link set home{index} up"])
        # New namespaces start with forwarding off and an empty conntrack table; flush anyway so
        # the lab never depends on that.
        _ns_exec(
            home.router_ns,
            ["sh", "-ec", f"{_ROUTER_SYSCTLS}; nft -f -; conntrack -F 2>/dev/null || true"],
            stdin=nft_ruleset(nat),
        )
        self.add_host(home)
        return home

    def add_host(self, home: Home) -> Host:
        """Another machine on the home's LAN (the "same LAN" case); returns it."""
        k = len(home.hosts) + 1
        if k > MAX_HOSTS_PER_HOME:
            raise ValueError(f"at most {MAX_HOSTS_PER_HOME} hosts per home")
        host = Host(namespace=f"{self.lab_id}-{home.name}-h{k}", address=f"192.0.2.{16 * home.index + 1 + k}")
        self._add_namespace(host.namespace)
        _ip_batch(
            home.router_ns,
            [
                f"link add name port{k} type veth peer name eth0 netns {host.namespace}",
                f"link set port{k} master lan",
                f"link set port{k} up",
            ],
        )
        _ip_batch(
            host.namespace,
            [
                "link set lo up",
                f"addr add {host.address}/28 dev eth0",
                "link set eth0 up",
                f"route add default via {home.gateway}",
            ],
        )
        home.hosts.append(host)
        return host

    # --- the WAN ------------------------------------------------------------------------------

    def set_wan(self, home: Home, link: WanLink) -> None:
        """Give `home`'s uplink a one-way delay, jitter, loss and rate each way (natlab_wan.py), or
        change them. Takes effect for the next packet. `WanLink()` is a perfect link: the kernel
        forwards it, as the internet's routers would, and the delay line is bypassed (its Python
        costs each packet a wake-up and CPU that no real link has; `wan_counts` stands still)."""
        if self._wan is None:
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "natlab_wan.py")
            self._wan = self.run_public([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        answer = self._wan_call(home=home.index, address=home.public_address, **dataclasses.asdict(link))
        if home.index in self._wan_routed:
            self._route_through_line(home, link != WanLink())
            return
        tun, table, address = answer["tun"], 100 + home.index, home.public_address
        isp_side = f"198.51.100.{4 * home.index + 1}"
        _ns_exec(
            self.public_ns,
            ["sh", "-ec", f"for k in rp_filter=0 accept_local=1 forwarding=1; do sysctl -qw net.ipv4.conf.{tun}.$k; "
             # early demux would hand a connection's packets to its local socket before the rules
             "done; sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.ip_early_demux=0"],
        )  # fmt: skip
        # What crosses the home's link, either way, goes into its line first; what the line gives
        # back toward the home goes on to it. Between two homes a packet crosses both lines. The
        # local table moves behind these rules, or a home's packets to the rendezvous would be
        # delivered before their line held them.
        local_last = [] if self._wan_routed else ["rule add pref 10000 lookup local", "rule del pref 0"]
        _ip_batch(
            self.public_ns,
            [
                *local_last,
                f"link set {tun} up",
                f"route add default dev {tun} table {table}",
                # ARP for the ISP side of the link is answered only where it routes as local
                f"rule add pref {500 + home.index} iif home{home.index} to {isp_side}/32 lookup local",
                f"rule add pref {1000 + home.index} iif {tun} to {address}/32 lookup main",
            ],
        )
        self._wan_routed.add(home.index)
        self._route_through_line(home, link != WanLink())

    def _route_through_line(self, home: Home, through: bool) -> None:
        """Send what crosses `home`'s link into its line (or no longer: the kernel forwards it)."""
        if through == (home.index in self._wan_through):
            return
        table, verb = 100 + home.index, "add" if through else "del"
        _ip_batch(
            self.public_ns,
            [
                f"rule {verb} pref {2000 + home.index} iif home{home.index} lookup {table}",
                f"rule {verb} pref {3000 + home.index} to {home.public_address}/32 lookup {table}",
            ],
        )
        if through:
            self._wan_through.add(home.index)
        else:
            self._wan_through.discard(home.index)

    def wan_counts(self, home: Home) -> tuple[int, int]:
        """Packets the home's line has passed and dropped, both ways."""
        answer = self._wan_call(home=home.index, address=home.public_address, stats=True)
        return answer["passed"], answer["dropped"]

    def _wan_call(self, **request: Any) -> dict[str, Any]:
        assert self._wan is not None
        return ask_json_line(self._wan, request, COMMAND_TIMEOUT_S, "the WAN delay line")

    def shape(self, home: Home, up_bytes_s: float, down_bytes_s: float) -> None:
        """Cap `home`'s uplink and downlink at these rates (bytes a second, 0: uncapped), each its
        own, as a home's line is: the kernel's token bucket (`tc … tbf`) on the egress of each end
        of the home's veth, the router's `wan` for what leaves it, the public side's `homeN` for
        what arrives. For rates past what the delay line's Python was measured carrying (11.4 MB/s
        over one edge); it adds no delay (used with `set_wan` on the same home, it is untested)."""
        for namespace, device, rate in (
            (home.router_ns, "wan", up_bytes_s),
            (self.public_ns, f"home{home.index}", down_bytes_s),
        ):
            if rate < 0:
                raise ValueError("a link's rate is never negative")
            if rate == 0:
                _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"], check=False)
            else:
                _ns_exec(namespace, ["tc", "qdisc", "replace", "dev", device, "root", *_token_bucket(rate)])

    # --- running ----------------------------------------------------------------------------

    def run(self, namespace: str, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process inside one of this lab's namespaces; teardown kills it."""
        if namespace not in self._namespaces:
            raise ValueError(f"{namespace!r} is not a namespace of lab {self.lab_id}")
        proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], **popen_kwargs)
        self._processes.append(proc)
        return proc

    def run_public(self, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """A process on the rendezvous host (it can bind either public address)."""
        return self.run(self.public_ns, argv, **popen_kwargs)

    def run_home(self, home: Home, argv: list[str], host: int = 0, **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """A process on one of the home's hosts (the first unless `host` says otherwise)."""
        return self.run(home.hosts[host].namespace, argv, **popen_kwargs)

    def exec(self, namespace: str, argv: list[str], stdin: str | None = None) -> str:
        """Run a short command in a lab namespace to completion (bounded); return its stdout."""
        if namespace not in self._namespaces:
            raise ValueError(f"{namespace!r} is not a namespace of lab {self.lab_id}")
        return _ns_exec(namespace, argv, stdin=stdin).stdout

    def udp_agent(self, namespace: str) -> UdpAgent:
        """A helper process in `namespace` that binds, sends and receives UDP on request."""
        return UdpAgent(
            self.run(namespace, [sys.executable, "-c", _AGENT_SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        )

    # --- teardown ---------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return list(self._namespaces)

    def close(self) -> None:
        """Kill the lab's processes and delete its namespaces (their veths go with them).

        Safe to call twice, and on a half-built lab.
        """
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self._processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._processes.clear()
        for namespace in reversed(self._namespaces):  # grandchildren too
            _delete_namespace(namespace)
        self._namespaces.clear()
        self.homes.clear()
        self._wan, self._wan_routed, self._wan_through = None, set(), set()
        self._built = False

    def describe(self) -> str:
        """What was built, for people."""
        a1, a2 = self.public_addresses
        lines = [f"lab {self.lab_id}", f"  public  {self.public_ns}: rendezvous {a1}, {a2}; routes between homes"]
        for home in self.homes.values():
            lines.append(
                f"  home {home.name} ({home.nat}): router {home.router_ns} wan {home.public_address}"
                f" lan {home.gateway}/28"
            )
            lines += [f"    host {h.namespace} {h.address}" for h in home.hosts]
        return "\n".join(lines)


def leftover_namespaces(prefix: str = "kl") -> list[str]:
    """Namespaces that look like they belong to a lab with this prefix (for `down`)."""
    pattern = re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-")
    return [name for name in list_namespaces() if pattern.match(name)]


# --- a UDP agent: plain sockets inside a namespace, driven over stdin/stdout -----------------

_AGENT_SOURCE = r"""
import json, select, socket, sys
socks = {}
for line in sys.stdin:
    req = json.loads(line)
    try:
        op = req["op"]
        if op == "bind":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((req["host"], req["port"]))
            socks[len(socks)] = s
            out = {"sock": len(socks) - 1, "addr": list(s.getsockname())}
        elif op == "send":
            socks[req["sock"]].sendto(req["data"].encode(), tuple(req["to"]))
            out = {}
        elif op == "recv":
            s = socks[req["sock"]]
            if select.select([s], [], [], req["timeout"])[0]:
                data, addr = s.recvfrom(65535)
                out = {"data": data.decode(errors="replace"), "from": list(addr)}
            else:
                out = {"data": None}
        else:
            out = {"error": "unknown op " + op}
    except OSError as exc:
        out = {"error": str(exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""

Endpoint = tuple[str, int]


class UdpAgent:
    """Drives one agent process: every call is bounded in time, every failure raises LabError."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc = proc

    def _call(self, wait: float = 5.0, **request: Any) -> dict[str, Any]:
        return ask_json_line(self.proc, request, wait + 10.0, "UDP agent")  # + python startup on a busy machine

    def bind(self, host: str = "0.0.0.0", port: int = 0) -> tuple[int, Endpoint]:
        """A new socket; returns its handle and bound address."""
        answer = self._call(op="bind", host=host, port=port)
        return answer["sock"], (answer["addr"][0], answer["addr"][1])

    def send(self, sock: int, to: Endpoint, data: str) -> None:
        self._call(op="send", sock=sock, to=list(to), data=data)

    def recv(self, sock: int, timeout: float) -> tuple[str, Endpoint] | None:
        """One datagram, or None after `timeout` seconds of silence."""
        answer = self._call(wait=timeout, op="recv", sock=sock, timeout=timeout)
        if answer["data"] is None:
            return None
        return answer["data"], (answer["from"][0], answer["from"][1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # EOF ends the agent
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> UdpAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- probing a home's NAT with plain sockets ---------------------------------------------------


@dataclass(frozen=True)
class NatObservation:
    """What plain UDP sockets saw of one home's NAT (RFC 4787 tests, RFC 5780 style).

    mapped: the external endpoint the public host saw for one host socket's packets to each of
        its endpoints (first address and port, second address, second port).
    delivered: for a fresh host socket that contacted only the first endpoint, which
        unsolicited packets to its mapping got through: "same" (the control: the contacted
        endpoint itself), "other-port" (contacted address, other port), "other-address".
    """

    local: Endpoint
    mapped: dict[str, Endpoint]
    delivered: dict[str, bool]

    @property
    def mapping(self) -> str:
        first, other_address, other_port = (self.mapped[k] for k in ("first", "other-address", "other-port"))
        if first == other_address == other_port:
            return "endpoint-independent"
        if first == other_port:
            return "address-dependent"
        return "address-and-port-dependent"

    @property
    def filtering(self) -> str:
        if self.delivered["other-address"]:
            return "endpoint-independent"
        if self.delivered["other-port"]:
            return "address-dependent"
        return "address-and-port-dependent"


def probe_nat(
    lab: NatLab, home: Home, host: int = 0, ports: tuple[int, int] = (40000, 40001), quiet_s: float = 0.5
) -> NatObservation:
    """Measure a home's mapping and filtering from the public host (about a second).

    `ports` are bound on the public host for the duration; pick others if a server of yours
    uses them. A packet counts as dropped when it has not arrived `quiet_s` after the control
    packet sent behind it.
    """
    a1, a2 = lab.public_addresses
    p1, p2 = ports
    with lab.udp_agent(lab.public_ns) as server, lab.udp_agent(home.hosts[host].namespace) as client:
        servers = {"first": (a1, p1), "other-address": (a2, p1), "other-port": (a1, p2)}
        sock = {key: server.bind(*endpoint)[0] for key, endpoint in servers.items()}

        def outbound(client_sock: int, key: str) -> Endpoint:
            for _ in range(3):  # veths lose nothing, but never hang on a first ARP
                client.send(client_sock, servers[key], key)
                got = server.recv(sock[key], timeout=1.0)
                if got is not None:
                    return got[1]
            raise LabError(f"home {home.name}: nothing reached the public host at {servers[key]}")

        c1, local = client.bind()
        mapped = {key: outbound(c1, key) for key in servers}

        c2, _ = client.bind()  # fresh: nothing but the first endpoint has been contacted from it
        mapping = outbound(c2, "first")
        for key in ("other-address", "other-port", "first"):  # the control goes last
            server.send(sock[key], mapping, key)
        delivered = dict.fromkeys(servers, False)
        deadline = None
        while deadline is None or time.monotonic() < deadline:
            wait = 3.0 if deadline is None else max(0.0, deadline - time.monotonic())
            got = client.recv(c2, timeout=wait)
            if got is None:
                if deadline is None:
                    raise LabError(f"home {home.name}: the contacted endpoint's reply was not delivered")
                break
            delivered[got[0]] = True
            if got[0] == "first" and deadline is None:
                deadline = time.monotonic() + quiet_s
    return NatObservation(
        local=local,
        mapped=mapped,
        delivered={
            "same": delivered["first"],
            "other-port": delivered["other-port"],
            "other-address": delivered["other-address"],
        },
    )


# --- CLI -------------------------------------------------------------------------------------


def _demo(prefix: str) -> int:
    with NatLab(prefix) as lab:
        for nat in NAT_TYPES:
            lab.add_home(nat, nat)
        print(lab.describe())
        failures = 0
        for home in lab.homes.values():
            seen = probe_nat(lab, home)
            want_mapping, want_filtering, _ = NAT_BEHAVIOUR[home.nat]
            ok = (seen.mapping, seen.filtering) == (want_mapping, want_filtering)
            failures += not ok
            host, port = seen.mapped["first"]
            verdict = "ok" if ok else "UNEXPECTED"
            print(f"{home.nat:16} mapping {seen.mapping:27} filtering {seen.filtering:27} {verdict} ({host}:{port})")
    print("torn down")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("demo", "up", "down"))
    parser.add_argument("--prefix", default="kl", help="namespace name prefix (default kl)")
    args = parser.parse_args(argv)
    if args.command == "down":
        if os.geteuid() != 0:
            print("needs root", file=sys.stderr)
            return 2
        for name in leftover_namespaces(args.prefix):
            _delete_namespace(name)
            print(f"deleted {name}")
        return 0
    reason = lab_unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    if args.command == "demo":
        return _demo(args.prefix)
    lab = NatLab(args.prefix)
    try:
        for nat in NAT_TYPES:
            lab.add_home(nat, nat)
    except BaseException:
        lab.close()
        raise
    print(lab.describe())
    print(f"left running; remove with: python {sys.argv[0]} down --prefix {args.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
