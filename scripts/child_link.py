"""A QUIC link on loopback between a benchmark and a child process of its own script, so that each
end has a process (and a GIL) of its own: the parent starts the child with its role's flag and
writes it an order on stdin (its fingerprint and address, and what the benchmark adds), the child
answers on stdout with its own, and both open the link. bench_link, bench_transfer and bench_flood
measure over one; each line after the answer is the benchmark's own."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from linked_routers import loopback_socket

from kafila.network.identity import Identity, create_identity
from kafila.network.link import DatagramDemux, Link, LinkConfig, open_link, should_dial


@dataclass
class Child:
    """The parent's end: the child process, told its order, and its answer."""

    process: asyncio.subprocess.Process
    demux: DatagramDemux
    identity: Identity
    answer: dict[str, Any]

    async def link(self, config: LinkConfig) -> Link:
        """The link to the child, opened as the child opens its own end."""
        peer = self.answer["fingerprint"]
        dial = should_dial(self.identity.fingerprint, peer)
        return await open_link(self.demux, tuple(self.answer["address"]), self.identity, peer, dial, config)

    async def line(self) -> dict[str, Any]:
        """The next line the child writes after its answer."""
        assert self.process.stdout is not None
        line: dict[str, Any] = json.loads(await self.process.stdout.readline())
        return line


async def start_child(script: str, role: str, order: Mapping[str, Any]) -> Child:
    """`script` started again with the flag `role`, told `order` beside this end's fingerprint and
    address, and its answer read."""
    demux = await DatagramDemux.over(loopback_socket())
    identity = create_identity()
    process = await asyncio.create_subprocess_exec(
        sys.executable, script, role, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdin is not None
    told = {"fingerprint": identity.fingerprint, "address": demux.local_address, **order}
    process.stdin.write(json.dumps(told).encode() + b"\n")
    await process.stdin.drain()
    child = Child(process, demux, identity, {})
    child.answer = await child.line()
    return child


async def link_to_parent(
    config: LinkConfig | None = None, answer: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], Link, DatagramDemux]:
    """In the child: the parent's order, and the link to the parent (with `config`, else the one the
    order carries) once this end has answered with its fingerprint, address and `answer`."""
    order: dict[str, Any] = json.loads(sys.stdin.readline())
    demux = await DatagramDemux.over(loopback_socket())
    identity = create_identity()
    said = {"fingerprint": identity.fingerprint, "address": demux.local_address, **(answer or {})}
    print(json.dumps(said), flush=True)
    dial = should_dial(identity.fingerprint, order["fingerprint"])
    link_config = config or LinkConfig(**order["config"])
    link = await open_link(demux, tuple(order["address"]), identity, order["fingerprint"], dial, link_config)
    return order, link, demux
