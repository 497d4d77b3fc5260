"""QUIC link benchmark on loopback: frame round trips against raw UDP, and one-way throughput.

Every configuration is measured two ways in the same run:

- **one process**: both ends in this process and one event loop, so each byte pays both sides'
  Python work on one core;
- **two processes**: the peer end runs in a child process (this script with `--peer`), so the
  sender and the receiver each have their own interpreter, as on a real ring.

The floor is a raw UDP echo of the frame's size, in the same loop (one process) or through the
child (two processes). Throughput sends 256 KiB prefill frames one way and stops the clock when
the receiver has them all; the CPU seconds each side spent in that time say which side limits it.

    python scripts/bench_link.py [--round-trips 300] [--megabytes 32] [--repeats 3]
        [--datagram-sizes 1200,1452] [--congestion reno] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from child_link import link_to_parent, loopback_socket, start_child

from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, Link, LinkConfig, open_link, should_dial
from kafila.wire.frames import DType, Frame, Kind

SIZES = [(hidden, dtype) for hidden in (640, 2048, 4096) for dtype in (DType.F32, DType.F16)]
BULK = Frame.of_hidden(Kind.PREFILL, 2, 0, np.ones((16, 4096), dtype=np.float32))  # 256 KiB


def link_config(datagram_size: int, congestion: str) -> LinkConfig:
    options: dict[str, Any] = {"idle_timeout_s": 30.0, "keepalive_s": 15.0, "max_datagram_size": datagram_size}
    # reno was the only choice before LinkConfig had the field; since, the default is "rate"
    if congestion != "reno" or "congestion_control" in LinkConfig.model_fields:
        options["congestion_control"] = congestion
    return LinkConfig(**options)


def control(message: dict[str, Any]) -> Frame:
    return Frame(Kind.PING, 3, payload=json.dumps(message).encode())


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(data, addr)


# --- the child: the peer end of a two-process link ---
async def peer() -> None:
    """Echo DECODE frames, drain PREFILL frames on request, echo raw UDP; told what to do on stdin."""
    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    order, link, demux = await link_to_parent(answer={"echo": echo.get_extra_info("sockname")[1]})
    expected = received = 0
    cpu = wall = 0.0
    profile: cProfile.Profile | None = None
    async for frame in link.frames():
        if frame.kind is Kind.DECODE:
            await link.send(frame)
        elif frame.kind is Kind.PREFILL:
            received += 1
            if received == expected:
                if profile is not None:
                    profile.disable()
                    profile.dump_stats(order["profile"])
                    profile = None
                report = {"drained": received, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
                await link.send(control(report))
        elif frame.kind is Kind.PING:
            message = json.loads(frame.payload)
            if "drain" in message:
                expected, received = message["drain"], 0
                if order.get("profile"):
                    profile = cProfile.Profile()
                    profile.enable()
                cpu, wall = time.process_time(), time.perf_counter()
                await link.send(control({"ready": True}))
            elif "bye" in message:
                break
    await link.close()
    await asyncio.sleep(0.05)
    echo.close()
    demux.close()


# --- the parent ---
@dataclass
class Ends:
    """A link and what to measure over it: the peer's link (one process) or its child (two)."""

    link: Link
    demux: DatagramDemux
    peer: Link | None = None
    peer_demux: DatagramDemux | None = None
    child: asyncio.subprocess.Process | None = None
    echo: tuple[str, int] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


async def one_process(config: LinkConfig) -> Ends:
    a, b = await DatagramDemux.over(loopback_socket()), await DatagramDemux.over(loopback_socket())
    ia, ib = create_identity(), create_identity()
    dial = should_dial(ia.fingerprint, ib.fingerprint)
    la, lb = await asyncio.gather(
        open_link(a, b.local_address, ia, ib.fingerprint, dial, config),
        open_link(b, a.local_address, ib, ia.fingerprint, not dial, config),
    )
    return Ends(la, a, lb, b)


async def two_processes(config: LinkConfig, profile: Path | None) -> Ends:
    child = await start_child(
        __file__, "--peer", {"config": config.model_dump(), "profile": str(profile) if profile else None}
    )
    link = await child.link(config)
    return Ends(link, child.demux, child=child.process, echo=("127.0.0.1", child.answer["echo"]))


async def close(ends: Ends) -> None:
    if ends.child is not None:
        await ends.link.send(control({"bye": True}))
        await asyncio.wait_for(ends.child.wait(), 10)
    await ends.link.close()
    if ends.peer is not None:
        await ends.peer.close()
    await asyncio.sleep(0.05)
    ends.demux.close()
    if ends.peer_demux is not None:
        ends.peer_demux.close()


async def round_trips(ends: Ends, hidden: int, dtype: DType, count: int) -> list[float]:
    echoer = None
    if ends.peer is not None:
        peer = ends.peer

        async def echo() -> None:
            for _ in range(count):
                await peer.send(await peer.receive())

        echoer = asyncio.create_task(echo())
    frame = Frame.of_hidden(Kind.DECODE, 1, 0, np.ones((1, hidden), dtype=np.float32), dtype)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await ends.link.send(frame)
        await ends.link.receive()
        times.append(time.perf_counter() - started)
    if echoer is not None:
        await echoer
    return times


async def udp_round_trips(ends: Ends, size: int, count: int) -> list[float]:
    """Raw UDP echo of `size` bytes: in this loop (one process) or through the child (two)."""
    loop = asyncio.get_running_loop()
    a = loopback_socket()
    b = loopback_socket() if ends.echo is None else None  # one process: echo from a second socket here
    target = b.getsockname() if b is not None else ends.echo
    assert target is not None
    payload = b"x" * size
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await loop.sock_sendto(a, payload, target)
        if b is not None:
            data, source = await loop.sock_recvfrom(b, 65536)
            await loop.sock_sendto(b, data, source)
        await loop.sock_recvfrom(a, 65536)
        times.append(time.perf_counter() - started)
    a.close()
    if b is not None:
        b.close()
    return times


@dataclass
class Rate:
    mb_s: float
    sender_cpu: float  # CPU seconds per wall second, this process (both ends when one process)
    receiver_cpu: float | None  # the child's, when two processes


async def throughput(ends: Ends, megabytes: int, profile: Path | None) -> Rate:
    count = megabytes * 2**20 // len(BULK.payload)
    report: dict[str, Any] = {}
    if ends.peer is not None:
        peer = ends.peer

        async def drain() -> None:
            for _ in range(count):
                await peer.receive()

        receiver = asyncio.create_task(drain())
    else:
        await ends.link.send(control({"drain": count}))
        assert json.loads((await ends.link.receive()).payload).get("ready")

        async def wait_report() -> None:
            report.update(json.loads((await ends.link.receive()).payload))

        receiver = asyncio.create_task(wait_report())
    profiler = cProfile.Profile() if profile else None
    cpu, started = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(count):
        await ends.link.send(BULK)
        await asyncio.sleep(0)
    await receiver
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if profiler is not None and profile is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    if ends.child is not None:
        assert report["drained"] == count
    receiver_cpu = report["cpu_s"] / elapsed if report else None
    return Rate(count * len(BULK.payload) / elapsed / 1e6, cpu / elapsed, receiver_cpu)


def ms(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) * 1e3


async def measure(args: argparse.Namespace) -> None:
    configs = [(size, cc) for size in args.datagram_sizes for cc in args.congestion]
    rates: dict[tuple[int, str, bool], list[Rate]] = {}
    rtts: dict[tuple[int, str, bool], dict[tuple[int, DType], list[float]]] = {}
    floors: dict[bool, dict[tuple[int, DType], list[float]]] = {False: {}, True: {}}
    for repeat in range(args.repeats):
        for size, cc in configs:
            config = link_config(size, cc)
            for separate in (False, True):  # alternate, so load on the machine hits both alike
                key = (size, cc, separate)
                where = "two" if separate else "one"
                prof = args.profile / f"{size}-{cc}-{where}" if args.profile and repeat == 0 else None
                if prof is not None:
                    prof.mkdir(parents=True, exist_ok=True)
                ends = await (
                    two_processes(config, prof and prof / "receiver.prof") if separate else one_process(config)
                )
                try:
                    if repeat == 0:
                        for hidden, dtype in SIZES:
                            times = await round_trips(ends, hidden, dtype, args.round_trips)
                            rtts.setdefault(key, {})[(hidden, dtype)] = times
                            if (hidden, dtype) not in floors[separate]:
                                size_bytes = hidden * (4 if dtype is DType.F32 else 2) + 32
                                floors[separate][(hidden, dtype)] = await udp_round_trips(
                                    ends, size_bytes, args.round_trips
                                )
                    await throughput(ends, 4, None)  # warm up: congestion window, buffers
                    rates.setdefault(key, []).append(
                        await throughput(ends, args.megabytes, prof and prof / "sender.prof")
                    )
                finally:
                    await close(ends)
    report(args, configs, rates, rtts, floors)


def report(
    args: argparse.Namespace,
    configs: list[tuple[int, str]],
    rates: dict[tuple[int, str, bool], list[Rate]],
    rtts: dict[tuple[int, str, bool], dict[tuple[int, DType], list[float]]],
    floors: dict[bool, dict[tuple[int, DType], list[float]]],
) -> None:
    print(f"Round trips of one activation frame ({args.round_trips} each), ms; UDP = raw UDP echo floor")
    for size, cc in configs:
        one, two = rtts[(size, cc, False)], rtts[(size, cc, True)]
        print(f"\n{size}-byte datagrams, {cc}:\n")
        print(
            "| frame | payload bytes | 1 proc median | 1 proc p99 | 2 procs median | 2 procs p99 "
            "| 2 / 1 | UDP median 1 proc | UDP median 2 procs |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for hidden, dtype in SIZES:
            payload = hidden * (4 if dtype is DType.F32 else 2)
            a, b = one[(hidden, dtype)], two[(hidden, dtype)]
            ua, ub = floors[False][(hidden, dtype)], floors[True][(hidden, dtype)]
            print(
                f"| {hidden} × {dtype.name.lower()} | {payload} | {ms(a, 0.5):.2f} | {ms(a, 0.99):.2f} "
                f"| {ms(b, 0.5):.2f} | {ms(b, 0.99):.2f} | {ms(b, 0.5) / ms(a, 0.5):.2f}× "
                f"| {ms(ua, 0.5):.3f} | {ms(ub, 0.5):.3f} |"
            )
    print(f"\nOne-way throughput, 256 KiB prefill frames, {args.megabytes} MiB per run, median of {args.repeats} runs")
    print("(CPU = CPU seconds per wall second: in one process both ends; in two, sender / receiver):\n")
    print("| datagram | congestion | 1 proc MB/s | 1 proc CPU | 2 procs MB/s | 2 procs CPU | 2 / 1 | 2-proc runs |")
    print("|---|---|---|---|---|---|---|---|")
    for size, cc in configs:
        single, split = rates[(size, cc, False)], rates[(size, cc, True)]
        rate_1, rate_2 = statistics.median(r.mb_s for r in single), statistics.median(r.mb_s for r in split)
        cpu_a = statistics.median(r.sender_cpu for r in single)
        cpu_s = statistics.median(r.sender_cpu for r in split)
        cpu_r = statistics.median(r.receiver_cpu or 0.0 for r in split)
        runs = ", ".join(f"{r.mb_s:.1f}" for r in split)
        print(
            f"| {size} | {cc} | {rate_1:.1f} | {cpu_a:.2f} | {rate_2:.1f} | {cpu_s:.2f} / {cpu_r:.2f} "
            f"| {rate_2 / rate_1:.2f}× | {runs} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # the child's role
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--megabytes", type=int, default=32, help="MiB per throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per configuration")
    parser.add_argument(
        "--datagram-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[LinkConfig().max_datagram_size]
    )
    parser.add_argument("--congestion", type=lambda s: s.split(","), default=["reno"])
    parser.add_argument("--profile", type=Path, help="write cProfile stats of the first throughput runs here")
    args = parser.parse_args()
    asyncio.run(peer() if args.peer else measure(args))


if __name__ == "__main__":
    main()
