"""Stage-file transfer on loopback: `send_stage_file` over a QUIC link against plain TCP.

The runs move the same random file and do the same work at the receiving end (write to disk,
sha256). The QUIC link is measured twice: with both ends in this process and one event loop
(one core pays both sides' Python work), and with the receiver in a child process (this script
with `--receiver`), as on a real ring. Peak memory is sampled during each run from
/proc/self/statm (each side's, in the two-process run): a transfer must stream with bounded
memory, whatever the file's size.

    python scripts/bench_transfer.py [--size-mb 200] [--datagram-size 1200]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from child_link import link_to_parent, loopback_socket, start_child

from kafila.network.identity import create_identity
from kafila.network.link import DatagramDemux, Link, LinkConfig, open_link, should_dial
from kafila.network.transfer import CHUNK_SIZE, receive_stage_file, send_stage_file

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class PeakRss:
    """The highest resident set size seen while the block runs, sampled every 20 ms."""

    async def __aenter__(self) -> PeakRss:
        self.start = self.peak = rss()
        self._task = asyncio.ensure_future(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss())
            await asyncio.sleep(0.02)

    async def __aexit__(self, *_: object) -> None:
        self._task.cancel()
        self.peak = max(self.peak, rss())

    @property
    def grew_mb(self) -> float:
        return (self.peak - self.start) / 1e6


def make_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as stream:
        left = size
        while left:
            data = os.urandom(min(left, CHUNK_SIZE))
            stream.write(data)
            digest.update(data)
            left -= len(data)
    return digest.hexdigest()


async def link_pair(datagram_size: int) -> tuple[Link, Link, DatagramDemux, DatagramDemux]:
    a, b = await DatagramDemux.over(loopback_socket()), await DatagramDemux.over(loopback_socket())
    ia, ib = create_identity(), create_identity()
    dial = should_dial(ia.fingerprint, ib.fingerprint)
    config = LinkConfig(idle_timeout_s=30, keepalive_s=15, max_datagram_size=datagram_size)
    la, lb = await asyncio.gather(
        open_link(a, b.local_address, ia, ib.fingerprint, dial, config),
        open_link(b, a.local_address, ib, ia.fingerprint, not dial, config),
    )
    return la, lb, a, b


async def over_quic(path: Path, sha: str, cache: Path, datagram_size: int) -> tuple[float, float]:
    la, lb, a, b = await link_pair(datagram_size)
    async with PeakRss() as memory:
        started = time.perf_counter()
        sent, received = await asyncio.gather(send_stage_file(la, path, sha, 0), receive_stage_file(lb, cache))
        elapsed = time.perf_counter() - started
    assert sent == path.stat().st_size and received.stat().st_size == sent
    await la.close()
    await lb.close()
    await asyncio.sleep(0.05)
    a.close()
    b.close()
    received.unlink()
    return elapsed, memory.grew_mb


async def receiver() -> None:
    """The child of a two-process run: receive one stage file, then say how long it took."""
    order, link, demux = await link_to_parent()
    async with PeakRss() as memory:
        cpu = time.process_time()
        path = await receive_stage_file(link, Path(order["cache"]))
        cpu = time.process_time() - cpu
    print(json.dumps({"path": str(path), "cpu_s": cpu, "grew_mb": memory.grew_mb}), flush=True)
    async for _ in link.frames():  # until the sender closes the link
        pass
    demux.close()


async def over_quic_two_processes(path: Path, sha: str, cache: Path, datagram_size: int) -> tuple[float, str, str]:
    """The receiver in a child process; returns seconds, RSS growth and CPU use per side.

    The receiver's RSS growth is from a fresh process; the sender's is this process's, whose
    heap the one-process run before it already grew, so it reads low.
    """
    config = LinkConfig(idle_timeout_s=30, keepalive_s=15, max_datagram_size=datagram_size)
    child = await start_child(__file__, "--receiver", {"config": config.model_dump(), "cache": str(cache)})
    link = await child.link(config)
    async with PeakRss() as memory:
        cpu, started = time.process_time(), time.perf_counter()
        sent = await send_stage_file(link, path, sha, 0)  # returns once the receiver has checked the hash
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    report = await child.line()
    received = Path(report["path"])
    assert sent == path.stat().st_size and received.stat().st_size == sent
    await link.close()
    await asyncio.wait_for(child.process.wait(), 10)
    child.demux.close()
    received.unlink()
    grew = f"+{memory.grew_mb:.0f} / +{report['grew_mb']:.0f} MB"
    return elapsed, grew, f"{cpu / elapsed:.2f} / {report['cpu_s'] / elapsed:.2f}"


async def over_tcp(path: Path, sha: str, out: Path) -> tuple[float, float]:
    """The same bytes through a plain TCP socket: read, send, receive, write and hash."""
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        digest = hashlib.sha256()
        with out.open("wb") as stream:
            while data := await reader.read(CHUNK_SIZE):
                stream.write(data)
                digest.update(data)
            stream.flush()
            os.fsync(stream.fileno())
        writer.close()
        done.set_result(digest.hexdigest())

    server = await asyncio.start_server(receive, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with PeakRss() as memory:
        started = time.perf_counter()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        with path.open("rb") as stream:
            while data := stream.read(CHUNK_SIZE):
                writer.write(data)
                await writer.drain()
        writer.close()
        assert await done == sha
        elapsed = time.perf_counter() - started
    server.close()
    out.unlink()
    return elapsed, memory.grew_mb


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)  # the child's role
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--datagram-size", type=int, default=LinkConfig().max_datagram_size, help="QUIC datagram bytes")
    args = parser.parse_args()
    if args.receiver:
        await receiver()
        return
    size = args.size_mb * 1_000_000
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        path = root / "stage.gguf"
        sha = make_file(path, size)
        one_s, one_mb = await over_quic(path, sha, root / "cache", args.datagram_size)
        two_s, two_mb, two_cpu = await over_quic_two_processes(path, sha, root / "cache", args.datagram_size)
        tcp_s, tcp_mb = await over_tcp(path, sha, root / "tcp.out")
    one, two, tcp = size / one_s / 1e6, size / two_s / 1e6, size / tcp_s / 1e6
    print(f"{args.size_mb} MB stage file on loopback, QUIC link with {args.datagram_size}-byte datagrams:\n")
    print("| path | MB/s | seconds | peak RSS growth (sender / receiver) | CPU s per s (sender / receiver) | of TCP |")
    print("|---|---|---|---|---|---|")
    rows = [
        ("QUIC, both ends in one process", f"{one:.1f}", f"{one_s:.1f}", f"+{one_mb:.0f} MB", "1 process", one / tcp),
        ("QUIC, receiver in a child process", f"{two:.1f}", f"{two_s:.1f}", two_mb, two_cpu, two / tcp),
        ("plain TCP, one process", f"{tcp:.0f}", f"{tcp_s:.2f}", f"+{tcp_mb:.0f} MB", "1 process", 1.0),
    ]
    for name, rate, seconds, grew, cpu, share in rows:
        print(f"| {name} | {rate} | {seconds} | {grew} | {cpu} | {share:.1%} |")


if __name__ == "__main__":
    asyncio.run(main())
