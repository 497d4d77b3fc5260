"""A trusted member floods the host: what the host holds in memory, with the bounds and without.

The host end is this process: a real QUIC link, read by a `LinkRouter` as the host's are, and
nobody reading the flooded channel (as while serving: the host reads no transfer traffic, and
activations only from its predecessor). The member is a child process (this script with
`--member`) that sends 256 KiB frames on one kind of traffic as fast as QUIC takes them, until
the host sends it away or it has sent `--megabytes`.

Each kind runs twice in the same run, each in a fresh host process: with the default bounds (`LinkConfig`'s
`max_held_bytes`, `ChannelBounds`), and with the bounds lifted past the flood (as before issue
33). The figure is the host's peak resident memory above where it started, sampled every 20 ms;
the limit beside it is the bound, and the megabytes sent.

    python scripts/bench_flood.py [--megabytes 1024] [--kinds control,transfer,activation]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from bench_transfer import PeakRss, rss
from child_link import link_to_parent, start_child

from kafila.network.link import Link, LinkConfig, LinkError
from kafila.session.router import TRANSFER_SEQUENCES, ChannelBounds, LinkRouter
from kafila.wire.control import CONTROL_SEQUENCE
from kafila.wire.frames import Frame, Kind

SEQUENCES = {"control": CONTROL_SEQUENCE, "transfer": TRANSFER_SEQUENCES[0], "activation": 5}
FRAME = 256 << 10
CONFIG = LinkConfig(idle_timeout_s=30.0, keepalive_s=15.0)
UNBOUNDED = 1 << 50
IN_FLIGHT = 4 << 20  # the member queues no more than this ahead of the host's acknowledgements


def unacknowledged(link: Link) -> int:
    """Bytes the member queued that the host has not acknowledged (aioquic keeps them to resend)."""
    quic = link.core.quic
    return 0 if quic is None else sum(len(stream.sender._buffer) for stream in quic._streams.values())


# --- the child: the flooding member ---
async def member() -> None:
    order, link, demux = await link_to_parent(CONFIG)
    frame = Frame(Kind.PING, order["sequence"], payload=b"f" * FRAME)
    sent = 0
    try:
        while sent < order["bytes"] and not link.closed.done():
            await link.send(frame)
            sent += frame.wire_bytes
            while not link.closed.done() and unacknowledged(link) > IN_FLIGHT:
                await asyncio.sleep(0.001)  # what the host has not acknowledged is not yet sent
        while not link.closed.done() and unacknowledged(link) > 0:
            await asyncio.sleep(0.01)
    except LinkError:
        pass
    sent -= unacknowledged(link)
    reason = str(link.closed.result()) if link.closed.done() else "not sent away"
    print(json.dumps({"sent": sent, "reason": reason}), flush=True)
    await link.close()
    demux.close()


# --- the parent: the host ---
@dataclass(frozen=True)
class Run:
    kind: str
    bounded: bool
    sent_bytes: int
    peak_extra_bytes: int
    after_bytes: int
    reason: str
    seconds: float


async def flood(kind: str, bounded: bool, n_bytes: int) -> Run:
    config = CONFIG if bounded else CONFIG.model_copy(update={"max_held_bytes": UNBOUNDED})
    bounds = ChannelBounds() if bounded else ChannelBounds(control=UNBOUNDED, transfer=UNBOUNDED)
    child = await start_child(__file__, "--member", {"sequence": SEQUENCES[kind], "bytes": n_bytes})
    started = time.perf_counter()
    async with PeakRss() as memory:
        link = await child.link(config)
        router = LinkRouter(link, "member", bounds)
        result = await child.line()
    seconds = time.perf_counter() - started
    await router.close()
    await child.process.wait()
    child.demux.close()
    grown = memory.peak - memory.start
    return Run(kind, bounded, result["sent"], grown, rss() - memory.start, result["reason"], seconds)


def mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f}"


async def host(kind: str, bounded: bool, megabytes: int) -> None:
    """One run in a fresh process: memory freed by an earlier run would hide the next one's growth."""
    run = await flood(kind, bounded, megabytes << 20)
    print(json.dumps(asdict(run)), flush=True)


async def measure(args: argparse.Namespace) -> None:
    runs = []
    for kind in args.kinds.split(","):
        for bounded in (True, False):
            argv = [__file__, "--host", kind, "--megabytes", str(args.megabytes)] + ([] if bounded else ["--unbounded"])
            child = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=asyncio.subprocess.PIPE)
            out, _ = await child.communicate()
            runs.append(Run(**json.loads(out.decode().strip().splitlines()[-1])))
            print(f"  {runs[-1]}", file=sys.stderr)
    link_bound, channels = CONFIG.max_held_bytes, ChannelBounds()
    limit = {"control": channels.control, "transfer": min(channels.transfer, link_bound), "activation": link_bound}
    print(f"A member floods one channel nobody reads with 256 KiB frames ({args.megabytes} MiB at most), MiB:\n")
    print("| traffic | bound | bounded: sent | bounded: peak | unbounded: sent | unbounded: peak | ratio |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        on, off = (next(r for r in runs if r.kind == kind and r.bounded is b) for b in (True, False))
        ratio = off.peak_extra_bytes / max(on.peak_extra_bytes, 1)
        print(
            f"| {kind} | {mib(limit[kind])} | {mib(on.sent_bytes)} | {mib(on.peak_extra_bytes)} | "
            f"{mib(off.sent_bytes)} | {mib(off.peak_extra_bytes)} | {ratio:.1f}× |"
        )
    print("\nWhy each bounded run ended:")
    for run in runs:
        if run.bounded:
            print(f"- {run.kind}: {run.reason} ({run.seconds:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--member", action="store_true", help=argparse.SUPPRESS)  # the flooding child
    parser.add_argument("--host", choices=sorted(SEQUENCES), help=argparse.SUPPRESS)  # one run's host
    parser.add_argument("--unbounded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--kinds", default="control,transfer,activation")
    args = parser.parse_args()
    if args.member:
        asyncio.run(member())
    elif args.host:
        asyncio.run(host(args.host, not args.unbounded, args.megabytes))
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()
