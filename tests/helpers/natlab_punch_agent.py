"""One side of a hole punch, run inside a lab namespace (tests/test_nat_lab_*.py, scripts/bench_*_lab.py).

All signalling goes through a real rendezvous. The agent learns its server-reflexive address
from the rendezvous's STUN port on the socket it will punch from; the host opens a session and
prints its code, the other joins with it; both exchange candidates and round-trip times in the
introductions. On `ready`, which the rendezvous sends to both at once, each waits out half the
difference between their round trips so that both start together, then punches with low-TTL
priming. The outcome is printed as one JSON line.

With `--frames`, `--rtt` or `--hold` it then opens a pinned QUIC link on the same socket, direct
if the punch worked and through a relay the rendezvous grants if not, waits `--settle` seconds on
it (the link's datagram size search runs meanwhile), and:

- `--frames N`: both sides send N activation frames and check every frame of the other's;
- `--rtt N`: the session's host times N round trips of one activation frame per hidden size and
  dtype, which the joiner echoes, then as many raw UDP datagrams of the same size over the
  same path (the floor);
- `--hold S`: after printing the outcome, keeps the link up for at most S seconds. If it goes
  down (a killed neighbour), prints `{"down": <error class>, "reason": ...}` and exits with
  status 3; otherwise closes it and exits 0;
- `--transfer MB`: the session's host sends a stage file of MB random megabytes
  (`send_stage_file`), the joiner receives it; the host reports the seconds, and its QUIC
  connection's congestion window and round trip sampled every 50 ms (why a transfer is slow).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from waiting import line_from

from kafila.contracts import Mapping, NatBehaviour
from kafila.network.identity import create_identity
from kafila.network.link import (
    RECEIVE_BUFFER,
    DatagramDemux,
    Link,
    LinkConfig,
    LinkError,
    bind_relay,
    open_link,
    should_dial,
)
from kafila.network.nat import reflexive_address
from kafila.network.punch import punch
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.transfer import receive_stage_file, send_stage_file
from kafila.planner.reachability import predict_edge
from kafila.planner.types import EdgePrediction
from kafila.portability import forbid_fragmentation
from kafila.wire.frames import DType, Frame, Kind

LINK_DOWN_EXIT = 3  # the agent's exit status when its link went down while held
RTT_SIZES = [(hidden, dtype) for hidden in (640, 2048, 4096) for dtype in (DType.F32, DType.F16)]
RTT_WARMUP = 20  # round trips per size before timing starts
AGENT_LINE_S = 120.0  # the longest an agent may take to print a line: its own waits are shorter
PROBE = 0x20  # first byte of raw UDP floor probes: no protocol on the member socket uses it
IP_MTU_DISCOVER, IP_PMTUDISC_WANT = 10, 1  # Linux's, unnamed in Python: the kernel's default, fragments allowed
Address = tuple[str, int]


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def activations(seed: int, count: int) -> list[Frame]:
    """Deterministic frames both sides can regenerate, so the receiver can check every byte."""
    rng = np.random.default_rng(seed)
    return [
        Frame.of_hidden(Kind.DECODE, seed * 100 + i % 10, i // 10, rng.standard_normal((1, 640)).astype(np.float32))
        for i in range(count)
    ]


ALL_HEARD = Frame(Kind.PING, 1 << 40, payload=b'{"all_heard": true}')  # a sequence no activation uses


async def exchange(link: Link, mine: int, theirs: int, count: int) -> tuple[int, bool]:
    """Send our frames and receive theirs at once: how many of theirs arrived, and whether all
    did, each sequence in order and every byte intact. Then each side says it heard all (where it
    did) and waits to hear the same of its own: the link's send only queues a frame, and a close
    discards what is still queued or in flight, so neither may go on to close before the other
    has all it sent."""
    peer_heard_all = asyncio.Event()

    async def send() -> None:
        for frame in activations(mine, count):
            await link.send(frame)

    async def next_activation() -> Frame:
        while (frame := await asyncio.wait_for(link.receive(), 20)).sequence_id == ALL_HEARD.sequence_id:
            peer_heard_all.set()  # its word can overtake the last of its frames: another stream
        return frame

    async def receive() -> list[Frame]:
        got: list[Frame] = []
        with contextlib.suppress(TimeoutError, LinkError):
            while len(got) < count:
                got.append(await next_activation())
        return got

    _, got = await asyncio.gather(send(), receive())
    if len(got) == count:
        await link.send(ALL_HEARD)
    with contextlib.suppress(TimeoutError, LinkError):
        while not peer_heard_all.is_set():
            if (await asyncio.wait_for(link.receive(), 20)).sequence_id == ALL_HEARD.sequence_id:
                peer_heard_all.set()
    return len(got), _by_sequence(got) == _by_sequence(activations(theirs, count))


def _size_name(hidden: int, dtype: DType) -> str:
    return f"{hidden} {dtype.name.lower()}"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


@contextlib.contextmanager
def fragments_allowed(demux: DatagramDemux) -> Iterator[None]:
    """The raw floor's datagrams (up to 16 KiB, one a frame) cross in IP fragments, as they did
    before member sockets forbade fragmentation (`forbid_fragmentation`); forbidden again after."""
    sock = demux._sock
    sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_WANT)
    try:
        yield
    finally:
        forbid_fragmentation(sock)


async def time_round_trips(link: Link, demux: DatagramDemux, target: Address, count: int) -> dict[str, Any]:
    """The measuring side: per size, `count` frame round trips over the link, then raw UDP ones.

    Raw probes go to the link's own target (the peer, or the relay, which forwards them
    verbatim) from the same socket, so they take exactly the link's path. A probe not echoed
    within a second counts as lost. All frame round trips come first: back-to-back probes of
    several KiB exceed the relay's per-session byte rate, and would leave its budget empty for
    the frames that followed.
    """
    loop = asyncio.get_running_loop()
    echoed: list[asyncio.Future[None]] = []

    def on_echo(data: bytes, source: Address) -> None:
        if echoed and not echoed[-1].done():
            echoed[-1].set_result(None)

    results: dict[str, dict[str, Any]] = {}
    for index, (hidden, dtype) in enumerate(RTT_SIZES):
        frame = Frame.of_hidden(Kind.DECODE, 10 + index, 0, np.ones((1, hidden), dtype=np.float32), dtype)
        quic = []
        for i in range(RTT_WARMUP + count):
            started = time.perf_counter()
            await link.send(frame)
            await asyncio.wait_for(link.receive(), 20)
            if i >= RTT_WARMUP:
                quic.append(_ms(time.perf_counter() - started))
        results[_size_name(hidden, dtype)] = {"bytes": len(frame.encode()), "quic_ms": quic}
    demux.register([PROBE], on_echo)
    try:
        with fragments_allowed(demux):
            for result in results.values():
                probe = bytes([PROBE]) + bytes(result["bytes"] - 1)
                udp, lost = [], 0
                for i in range(RTT_WARMUP + count):
                    echoed.append(loop.create_future())
                    started = time.perf_counter()
                    demux.sendto(probe, target)
                    try:
                        await asyncio.wait_for(echoed[-1], 1.0)
                    except TimeoutError:
                        lost += 1
                        continue
                    if i >= RTT_WARMUP:
                        udp.append(_ms(time.perf_counter() - started))
                result.update(udp_ms=udp, udp_lost=lost)
        await link.send(Frame(Kind.CANCEL, 99))  # tells the echoing side we are done
    finally:
        demux.unregister([PROBE])
    return results


async def echo_round_trips(link: Link, demux: DatagramDemux) -> None:
    """The echoing side of `time_round_trips`: frames back over the link, probes back to their source."""
    demux.register([PROBE], demux.sendto)  # each probe straight back where it came from
    try:
        with fragments_allowed(demux):
            while (frame := await asyncio.wait_for(link.receive(), 60)).kind is not Kind.CANCEL:
                await link.send(frame)
    finally:
        demux.unregister([PROBE])


async def hold(link: Link, seconds: float) -> int:
    """Keep the link up for at most `seconds`; report it and return LINK_DOWN_EXIT if it goes down."""
    try:
        error = await asyncio.wait_for(asyncio.shield(link.closed), seconds)
    except TimeoutError:
        return 0
    print(json.dumps({"down": type(error).__name__, "reason": str(error)}), flush=True)
    print(f"link to {link.peer_address[0]}:{link.peer_address[1]} is down: {error}", file=sys.stderr, flush=True)
    return LINK_DOWN_EXIT


async def send_file(link: Link, megabytes: int) -> dict[str, Any]:
    """The session's host: send `megabytes` of random bytes as a stage file, sampling the QUIC
    sender's congestion window (bytes), bytes in flight and smoothed round trip (ms) as it goes."""
    samples: list[tuple[float, int, int, float]] = []
    started = time.perf_counter()
    assert link.core.quic is not None
    control = link.core.quic._loss._cc  # aioquic's congestion control: count the packets it is told were lost
    lost = [0]
    told = control.on_packets_lost

    def counted(*, now: float, packets: Any) -> None:
        packets = list(packets)
        lost[0] += len(packets)
        told(now=now, packets=packets)

    control.on_packets_lost = counted  # type: ignore[method-assign]

    async def sample() -> None:
        while True:
            loss = link.core.quic._loss if link.core.quic is not None else None  # aioquic's recovery
            if loss is not None:
                elapsed = time.perf_counter() - started
                samples.append((elapsed, loss.congestion_window, loss.bytes_in_flight, loss._rtt_smoothed * 1e3))
            await asyncio.sleep(0.05)

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "stage.gguf")
        digest = hashlib.sha256()
        with open(path, "wb") as stream:
            for _ in range(megabytes):
                block = os.urandom(1 << 20)
                digest.update(block)
                stream.write(block)
        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        try:
            sent = await send_stage_file(link, path, digest.hexdigest(), 0)
        finally:
            sampler.cancel()
        seconds = time.perf_counter() - started
    return {"bytes": sent, "seconds": seconds, "samples": samples, "lost_packets": lost[0]}


async def receive_file(link: Link) -> float:
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        await receive_stage_file(link, folder)
        return time.perf_counter() - started


def _by_sequence(frames: list[Frame]) -> dict[int, list[Frame]]:
    """Frames grouped by sequence, each group in arrival order: order only holds within one."""
    groups: dict[int, list[Frame]] = {}
    for frame in frames:
        groups.setdefault(frame.sequence_id, []).append(frame)
    return groups


def member_socket(stun: str) -> tuple[socket.socket, Address, Address, float]:
    """A member's one UDP socket, its host and server-reflexive candidates, and the STUN round trip."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    server = address(stun)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(server)
        host = (probe.getsockname()[0], sock.getsockname()[1])
    started = time.perf_counter()
    srflx = reflexive_address(sock, server)
    return sock, host, srflx, (time.perf_counter() - started) * 1e3


async def run(args: argparse.Namespace) -> int:
    """Punch, then link and use the link as the arguments say; print the outcome; the exit status."""
    sock, host, srflx, rtt_ms = member_socket(args.stun)
    identity = create_identity(name=args.name)
    capability = {"name": args.name, "memory_gib": 1.0, "rtt_ms": rtt_ms}
    candidates = [f"{h}:{p}" for h, p in (host, srflx)]
    url = f"ws://{args.http}/v1/session"
    introduced = time.perf_counter()
    if args.code is None:
        client = await RendezvousClient.open(
            url,
            model="lab",
            expected_members=2,
            capability=capability,
            fingerprint=identity.fingerprint,
            candidates=candidates,
        )
        print(json.dumps({"code": client.code}), flush=True)
    else:
        client = await RendezvousClient.join(
            url, args.code, capability=capability, fingerprint=identity.fingerprint, candidates=candidates
        )
    outcome: dict[str, object] = {}
    status = 0
    try:
        ready = await client.wait_ready(timeout=20)
        outcome["introduction_s"] = time.perf_counter() - introduced
        peer = next(m for m in ready.members if m.name != args.name)
        slowest = max(rtt_ms, peer.capability.rtt_ms or 0.0)
        await asyncio.sleep((slowest - rtt_ms) / 2e3)
        session = hashlib.sha256(ready.host.encode()).digest()[:8]
        result = await punch(sock, session, [address(c) for c in peer.candidates], timeout=args.timeout)
        outcome["path"] = f"{result.path[0]}:{result.path[1]}" if result.path else None
        outcome["seconds"] = result.seconds
        if args.frames or args.rtt or args.hold or args.transfer:
            demux = await DatagramDemux.over(sock, receive_buffer=args.receive_buffer or None)
            try:
                if result.path is not None:
                    target, via = result.path, "direct"
                else:
                    grant = await client.request_relay(peer.member_id, timeout=20)
                    target, via = client.relay_address(grant), "relayed"
                    await bind_relay(demux, target, bytes.fromhex(grant.relay_token), timeout=10)
                dial = should_dial(identity.fingerprint, peer.fingerprint)
                config = LinkConfig(congestion_control=args.congestion)
                link = await open_link(demux, target, identity, peer.fingerprint, dial, config)
                host = args.code is None
                mine, theirs = (1, 2) if host else (2, 1)
                outcome["link"] = via
                await asyncio.sleep(args.settle)
                if args.frames:
                    outcome["frames_received"], outcome["frames_ok"] = await exchange(link, mine, theirs, args.frames)
                    outcome["datagram_size"] = link.core.datagram_size  # what its path was found to carry
                if args.rtt and host:
                    outcome["rtt"] = await time_round_trips(link, demux, target, args.rtt)
                elif args.rtt:
                    await echo_round_trips(link, demux)
                if args.transfer and host:
                    outcome["transfer"] = await send_file(link, args.transfer)
                elif args.transfer:
                    outcome["received_s"] = await receive_file(link)
                if args.hold:
                    print(json.dumps(outcome), flush=True)
                    outcome = {}
                    status = await hold(link, args.hold)
                if not link.closed.done():
                    await asyncio.sleep(0.5)  # the peer may still be receiving
                    await link.close()
            finally:
                demux.close()
    finally:
        await client.close()
        sock.close()
    if outcome:
        print(json.dumps(outcome), flush=True)
    return status


def start_rendezvous(lab: Any) -> tuple[subprocess.Popen[str], str, str]:
    """A real `kafila rendezvous` in the lab's public namespace on both its addresses.

    Returns the process, its STUN address and its HTTP address; the caller terminates it.
    """
    from natlab import PUBLIC_ADDRESSES

    primary, alternate = PUBLIC_ADDRESSES
    process = lab.run_public(
        [sys.executable, "-m", "kafila", "rendezvous", "--host", primary, "--alt-address", alternate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready = line_from(process.stdout, "the lab's rendezvous's READY line").split()
    http = line_from(process.stdout, "the lab's rendezvous's HTTP line").split()
    if len(ready) != 2 or ready[0] != "READY" or len(http) != 2 or http[0] != "HTTP":
        process.kill()
        raise RuntimeError("the lab's rendezvous did not start")
    return process, ready[1], http[1]


@contextlib.contextmanager
def lab_with_rendezvous(prefix: str) -> Iterator[tuple[Any, str, str]]:
    """For the lab benchmarks: a NatLab with a home of each NAT type and a real rendezvous.

    Yields the lab, the rendezvous's STUN address and its HTTP address; exits with the reason
    where no lab can be built.
    """
    from natlab import NAT_TYPES, NatLab, lab_unavailable_reason

    reason = lab_unavailable_reason()
    if reason:
        raise SystemExit(f"the NAT lab cannot run here: {reason}")
    with NatLab(prefix=prefix) as lab:
        for nat in NAT_TYPES:
            lab.add_home(nat, nat)
        server, stun, http = start_rendezvous(lab)
        try:
            yield lab, stun, http
        finally:
            server.terminate()
            server.wait(timeout=10)


def peer_home(lab: Any, a: str, b: str) -> str:
    """The home of type `b` to pair with home `a`: a second one of that type when both match."""
    if a != b:
        return b
    second = f"{b}-2"
    if second not in lab.homes:
        lab.add_home(second, b)
    return second


def predicted_edge(a: str, b: str) -> EdgePrediction:
    """The planner's prediction for an edge between homes of two lab NAT types."""
    from natlab import NAT_BEHAVIOUR

    a_nat, b_nat = (
        NatBehaviour(mapping=Mapping(NAT_BEHAVIOUR[n][0]), filtering=Mapping(NAT_BEHAVIOUR[n][1])) for n in (a, b)
    )
    return predict_edge(a_nat, b_nat)


def _line(process: subprocess.Popen[str]) -> dict[str, Any]:
    text = line_from(process.stdout, "the punch agent's report", timeout=AGENT_LINE_S)
    if not text:
        process.kill()
        raise RuntimeError(f"punch agent failed: {process.stderr.read() if process.stderr else ''}")
    result: dict[str, Any] = json.loads(text)
    return result


def start_pair(lab: Any, stun: str, http: str, home_a: str, home_b: str, *options: str) -> list[subprocess.Popen[str]]:
    """Start one agent in each home of a NatLab: the first opens a session, the second joins it.

    Both get `options` (e.g. `--frames 100`); the caller reads their lines and stops them.
    """
    base = [sys.executable, __file__, "--stun", stun, "--http", http, "--timeout", "4", *options]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    agents = [lab.run_home(lab.homes[home_a], [*base, "--name", "a"], **pipes)]
    try:
        code = _line(agents[0])["code"]
        agents.append(lab.run_home(lab.homes[home_b], [*base, "--name", "b", "--code", code], **pipes))
    except BaseException:
        stop(agents)
        raise
    return agents


def stop(agents: list[subprocess.Popen[str]]) -> None:
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def run_pair(lab: Any, stun: str, http: str, home_a: str, home_b: str, *options: str) -> list[dict[str, Any]]:
    """An agent in each home with `options`, run to its end: each one's outcome line, opener first."""
    agents = start_pair(lab, stun, http, home_a, home_b, *options)
    try:
        outcomes = [_line(agent) for agent in agents]
        for agent in agents:
            agent.wait(timeout=60)
    finally:
        stop(agents)
    return outcomes


def punch_pair(
    lab: Any, stun: str, http: str, home_a: str, home_b: str, frames: int = 0, rtt: int = 0, settle: float = 0.0
) -> dict[str, Any]:
    """Punch between one agent in each home (then link, wait `settle` seconds, then `frames` or `rtt`).

    Returns whether both ended on a direct path, the slower one's punch time, the joiner's time
    from joining to the introduction, each side's link path and, if linked, whether every frame
    arrived (how many each side received), the size of the datagrams each side's link then sent,
    and the session host's round trips (`rtt`).
    """
    options = ("--frames", str(frames), "--rtt", str(rtt), "--settle", str(settle))
    outcomes = run_pair(lab, stun, http, home_a, home_b, *options)
    return {
        "direct": all(o["path"] is not None for o in outcomes),
        "seconds": max(o["seconds"] for o in outcomes),
        "introduction_s": outcomes[1]["introduction_s"],
        "links": [o.get("link") for o in outcomes],
        "frames_ok": all(o.get("frames_ok", False) for o in outcomes) if frames else None,
        "frames_received": [o.get("frames_received") for o in outcomes],
        "datagram_sizes": [o.get("datagram_size") for o in outcomes],
        "rtt": outcomes[0].get("rtt"),
    }


def kill_one(
    lab: Any, stun: str, http: str, home_a: str, home_b: str, victim: int, frames: int = 100, hold: float = 20.0
) -> dict[str, Any]:
    """Link one agent in each home, exchange frames, SIGKILL one (0: the session's host, 1: the
    joiner) and time, from the kill, how long the other takes to report the broken link.

    Returns each side's path, whether the frames arrived, the survivor's report (None if it
    reported nothing within `hold` seconds), the seconds to it, and the survivor's exit status.
    """
    agents = start_pair(lab, stun, http, home_a, home_b, "--frames", str(frames), "--hold", str(hold))
    try:
        outcomes = [_line(agent) for agent in agents]
        survivor = agents[1 - victim]
        agents[victim].kill()  # SIGKILL: no goodbye, no chance to clean up
        killed = time.monotonic()
        line = line_from(survivor.stdout, "the survivor's report or its exit", timeout=hold + AGENT_LINE_S)
        reported_s = time.monotonic() - killed
        status = survivor.wait(timeout=10)
    finally:
        stop(agents)
    return {
        "links": [o.get("link") for o in outcomes],
        "frames_ok": all(o.get("frames_ok", False) for o in outcomes),
        "report": json.loads(line) if line else None,
        "reported_s": reported_s,
        "status": status,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stun", required=True)
    parser.add_argument("--http", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--code")
    parser.add_argument("--timeout", type=float, default=4.0)
    parser.add_argument("--frames", type=int, default=0, help="then link over QUIC and exchange this many frames")
    parser.add_argument("--rtt", type=int, default=0, help="then time this many frame round trips per size")
    parser.add_argument(
        "--settle", type=float, default=0.0, help="wait this long on the new link first (its datagram size search)"
    )
    parser.add_argument("--hold", type=float, default=0.0, help="then keep the link up this long, reporting its end")
    parser.add_argument(
        "--receive-buffer", type=int, default=RECEIVE_BUFFER, help="the link socket's SO_RCVBUF (0: the kernel's)"
    )
    parser.add_argument("--congestion", choices=["reno", "cubic", "rate"], default=LinkConfig().congestion_control)
    parser.add_argument("--transfer", type=int, default=0, help="then the host sends a stage file of this many MB")
    raise SystemExit(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
