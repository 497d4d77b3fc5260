"""QUIC link benchmark on loopback: frame round trips against raw UDP, and one-way throughput.

Both ends run in this process (one event loop), so each round trip pays both sides' Python
work on the same core; two machines would overlap it. The raw UDP echo in the same loop is the
floor.

    python scripts/bench_link.py [--round-trips 300]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time

import numpy as np

from kafila.network.frames import DType, Frame, Kind
from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, Link, LinkConfig, open_link, should_dial


def bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def link_pair() -> tuple[Link, Link, DatagramDemux, DatagramDemux]:
    a, b = await DatagramDemux.over(bound()), await DatagramDemux.over(bound())
    ia, ib = create_identity(), create_identity()
    dial = should_dial(ia.fingerprint, ib.fingerprint)
    config = LinkConfig(idle_timeout_s=30, keepalive_s=15)
    la, lb = await asyncio.gather(
        open_link(a, b.local_address, ia, ib.fingerprint, dial, config),
        open_link(b, a.local_address, ib, ia.fingerprint, not dial, config),
    )
    return la, lb, a, b


async def round_trips(la: Link, lb: Link, hidden: int, dtype: DType, count: int) -> list[float]:
    async def echo() -> None:
        for _ in range(count):
            await lb.send(await lb.receive())

    frame = Frame.of_hidden(Kind.DECODE, 1, 0, np.ones((1, hidden), dtype=np.float32), dtype)
    echoer = asyncio.create_task(echo())
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await la.send(frame)
        await la.receive()
        times.append(time.perf_counter() - started)
    await echoer
    return times


async def udp_round_trips(size: int, count: int) -> list[float]:
    loop = asyncio.get_running_loop()
    a, b = bound(), bound()
    payload = b"x" * size
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await loop.sock_sendto(a, payload, b.getsockname())
        data, source = await loop.sock_recvfrom(b, 65536)
        await loop.sock_sendto(b, data, source)
        await loop.sock_recvfrom(a, 65536)
        times.append(time.perf_counter() - started)
    a.close()
    b.close()
    return times


async def throughput(la: Link, lb: Link, megabytes: int = 20) -> float:
    frame = Frame.of_hidden(Kind.PREFILL, 2, 0, np.ones((16, 4096), dtype=np.float32))  # 256 KiB
    count = megabytes * 2**20 // len(frame.payload)

    async def drain() -> None:
        for _ in range(count):
            await lb.receive()

    started = time.perf_counter()
    receiver = asyncio.create_task(drain())
    for _ in range(count):
        await la.send(frame)
        await asyncio.sleep(0)
    await receiver
    return count * len(frame.payload) / (time.perf_counter() - started) / 1e6


async def main(count: int) -> None:
    la, lb, a, b = await link_pair()
    print("| frame | payload bytes | QUIC median ms | QUIC p99 ms | raw UDP median ms | ratio |")
    print("|---|---|---|---|---|---|")
    for hidden in (640, 2048, 4096):
        for dtype in (DType.F32, DType.F16):
            size = hidden * (4 if dtype is DType.F32 else 2)
            quic = await round_trips(la, lb, hidden, dtype, count)
            udp = await udp_round_trips(size + 32, count)
            q50, q99 = statistics.median(quic) * 1e3, float(np.quantile(quic, 0.99)) * 1e3
            u50 = statistics.median(udp) * 1e3
            print(
                f"| {hidden} × {dtype.name.lower()} | {size} | {q50:.2f} | {q99:.2f} | {u50:.3f} | {q50 / u50:.0f}× |"
            )
    rate = await throughput(la, lb)
    print(f"\none-way throughput, 256 KiB prefill frames: {rate:.1f} MB/s")
    await la.close()
    await lb.close()
    a.close()
    b.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--round-trips", type=int, default=300)
    asyncio.run(main(parser.parse_args().round_trips))
