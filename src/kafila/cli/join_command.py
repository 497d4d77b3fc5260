"""`kafila join CODE`: lend this machine to a session until its host ends it."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from kafila.cli.errors import fail, stderr
from kafila.cli.network_commands import parse_host_port


def join(
    code: Annotated[str, typer.Argument(help="The session code the host printed, e.g. 7-crimson-harbor-otter-lemon.")],
    rendezvous: Annotated[
        str | None,
        typer.Option("--rendezvous", envvar="KAFILA_RENDEZVOUS", help="HOST:PORT of the rendezvous the host printed."),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option("--model", help="This machine's own copy of the model: its stage is cut from it, not sent."),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="This machine's name in the session.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads for llama.cpp.")] = None,
) -> None:
    """Join a session: this machine runs the blocks the host assigns it, until the host ends the session."""
    from kafila.network.session_codes import CodeFormatError, split_code
    from kafila.runtime.llama_backend import LlamaUnavailable, load_llama

    try:
        load_llama()
    except LlamaUnavailable as error:
        fail(str(error), False)
    try:
        split_code(code)
    except CodeFormatError as error:
        fail(f"that is not a session code: {error}", False)
    if rendezvous is None:
        fail("where is the rendezvous? pass --rendezvous HOST:PORT as the host printed it", False)
    if model is not None and not model.is_file():
        fail(f"no model file at {model}", False)
    try:
        address = parse_host_port(rendezvous.strip(), 8470)
    except ValueError as error:
        fail(str(error), False)
    member = name or f"{socket.gethostname()}"[:64]
    try:
        reason = asyncio.run(_join(code, address, model, member, threads or max(1, os.cpu_count() or 1)))
    except KeyboardInterrupt:
        stderr.print("left the session", highlight=False)
        return
    except Exception as error:  # every failure a person can meet: one line, no traceback
        fail(str(error), False)
    stderr.print(f"the session ended: {reason}", highlight=False)


async def _join(code: str, rendezvous: tuple[str, int], model: Path | None, name: str, threads: int) -> str:
    from kafila.network.edges import connect_edges
    from kafila.network.link import DatagramDemux
    from kafila.network.rendezvous_client import RendezvousClient, verify_host
    from kafila.network.session_codes import channel_part
    from kafila.runtime.local_plan import cache_dir, this_device
    from kafila.runtime.slicer import file_sha256
    from kafila.session.member import MemberState, follow_host
    from kafila.session.presence import present
    from kafila.session.router import LinkRouter

    def say(text: str) -> None:
        stderr.print(f"[dim]{name}:[/dim] {text}", highlight=False)

    say("measuring this device (cached afterwards)")
    device = await asyncio.to_thread(this_device)
    presence = await present(name, rendezvous, device)
    model_sha = await asyncio.to_thread(file_sha256, model) if model is not None else None
    client = await RendezvousClient.join(
        presence.url, channel_part(code), capability=presence.capability,
        fingerprint=presence.identity.fingerprint, candidates=presence.candidates,
    )  # fmt: skip
    demux = None
    routers: dict[str, LinkRouter] = {}
    try:
        say(f"joined; proving the code with the host ({len(client.members)} of {client.expected_members} here)")
        await verify_host(client, code, presence.identity.fingerprint)
        peers = [m for m in client.members.values() if m.member_id != client.member_id]
        demux = await DatagramDemux.over(presence.sock)
        edges = await connect_edges(client, demux, presence.identity, client.code, peers)
        for member_id, edge in edges.items():
            routers[member_id] = LinkRouter(edge.link, member_id)
        paths = ", ".join(f"{client.members[m].name} {e.path}" for m, e in edges.items())
        say(f"linked: {paths}")
        state = MemberState(cache=cache_dir() / "stages", model=model, threads=threads, say=say)
        return await follow_host(routers[client.host_id], routers, state, model_sha)
    finally:
        for router in routers.values():
            try:
                await router.close("leaving")
            except Exception:
                pass
        await client.close()
        if demux is not None:
            demux.close()
        presence.sock.close()
