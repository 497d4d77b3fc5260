"""`kafila join CODE`: lend this machine to a session until its host ends it."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
from pathlib import Path
from typing import Annotated

import typer

from kafila.cli.bars import transfer_bars
from kafila.cli.errors import fail, stderr
from kafila.cli.network_commands import parse_host_port
from kafila.cli.sizes import MEMORY_HELP, parse_memory
from kafila.network.discovery import DEFAULT_DISCOVERY_TIMEOUT_S, DiscoveryError, discover
from kafila.network.edges import connect_edges
from kafila.network.link import DatagramDemux
from kafila.network.rendezvous_client import RendezvousClient, verify_host
from kafila.network.session_codes import CodeFormatError, channel_part, split_code
from kafila.runtime.llama_backend import LlamaUnavailable, load_llama
from kafila.runtime.local_plan import cache_dir, cached_model_pricings, hash_model, this_device
from kafila.runtime.stage_cache import check_stage_cache_setting
from kafila.session.member import LostHost, MemberState, RingLinks, SessionEnded, edge_connector, follow_host
from kafila.session.presence import machine_tag, present
from kafila.session.router import LinkRouter

# After losing the host's link (not its goodbye), join again: the host takes the machine back in.
# A join that lasted STEADY_S counts as a success, so only rejoins in quick succession run out.
REJOINS = 3
REJOIN_PAUSE_S = 1.0
STEADY_S = 60.0


def join(
    code: Annotated[str, typer.Argument(help="The session code the host printed, e.g. 7-crimson-harbor-otter-lemon.")],
    rendezvous: Annotated[
        str | None,
        typer.Option(
            "--rendezvous",
            envvar="KAFILA_RENDEZVOUS",
            help="HOST:PORT of the rendezvous the host printed; default: find the host on this LAN.",
        ),
    ] = None,
    discovery_port: Annotated[
        int,
        typer.Option(
            "--discovery-port",
            envvar="KAFILA_DISCOVERY_PORT",
            min=1,
            max=65535,
            help="UDP port to find the host on, without --rendezvous.",
        ),
    ] = 8470,
    model: Annotated[
        Path | None,
        typer.Option("--model", help="This machine's own copy of the model: its stage is cut from it, not sent."),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="This machine's name in the session.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads for llama.cpp.")] = None,
    memory: Annotated[str | None, typer.Option("--memory", help=MEMORY_HELP)] = None,
) -> None:
    """Join a session: this machine runs the blocks the host assigns it, until the host ends the session.

    If its link to the host drops (a network blip, a machine that slept), it joins again by itself."""
    try:
        load_llama()
    except LlamaUnavailable as error:
        fail(str(error), False)
    try:
        channel, _ = split_code(code)
    except CodeFormatError as error:
        fail(str(error), False)
    if model is not None and not model.is_file():
        fail(f"no model file at {model}", False)
    try:
        lent = parse_memory(memory)
        check_stage_cache_setting()
    except ValueError as error:
        fail(str(error), False)
    if rendezvous is None:  # the host's embedded rendezvous answers for its channel on the LAN
        stderr.print(f"looking for the host of {channel} on this network", highlight=False)
        try:
            address = asyncio.run(discover(channel, discovery_port, DEFAULT_DISCOVERY_TIMEOUT_S))
        except KeyboardInterrupt:
            return
        except (DiscoveryError, OSError) as error:
            fail(str(error), False)
        stderr.print(f"found its rendezvous at {address[0]}:{address[1]}", highlight=False)
    else:
        try:
            address = parse_host_port(rendezvous.strip(), 8470)
        except ValueError as error:
            fail(str(error), False)

    member = name or f"{socket.gethostname()}"[:64]
    rejoins = 0
    while True:
        started = time.monotonic()
        try:
            reason = asyncio.run(_join(code, address, model, member, threads or max(1, os.cpu_count() or 1), lent))
        except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C: asyncio.run may raise either
            stderr.print(f"[dim]{member}:[/dim] left the session", highlight=False)
            return
        except LostHost as lost:  # the host may still serve: its seat for this machine is open
            rejoins = 1 if time.monotonic() - started >= STEADY_S else rejoins + 1
            if rejoins > REJOINS:
                fail(f"{member}: {lost} ({REJOINS} joins again did not last)", False)
            stderr.print(f"[dim]{member}:[/dim] {lost}; joining the session again", highlight=False, soft_wrap=True)
            time.sleep(REJOIN_PAUSE_S)
            continue
        except Exception as error:  # every failure a person can meet: one line, no traceback
            fail(f"{member}: {error}", False)  # named like its other lines: a demo runs several here
        stderr.print(f"[dim]{member}:[/dim] the session ended: {reason}", highlight=False)
        return


async def _join(
    code: str, rendezvous: tuple[str, int], model: Path | None, name: str, threads: int, memory: int | None
) -> str:
    def say(text: str) -> None:
        stderr.print(f"[dim]{name}:[/dim] {text}", highlight=False, soft_wrap=True)

    say("measuring this device (cached afterwards)")
    device = await asyncio.to_thread(this_device, memory=memory)
    priced_models = await asyncio.to_thread(cached_model_pricings)
    presence = await present(name, rendezvous, device)
    model_sha = None
    if model is not None:  # before joining: the host plans with it as soon as everyone has joined
        with transfer_bars() as progress:
            model_sha = await hash_model(model, functools.partial(progress, f"hashing {model.name} (once)"))
    client = await RendezvousClient.join(
        presence.url, channel_part(code), capability=presence.capability,
        fingerprint=presence.identity.fingerprint, candidates=presence.candidates,
    )  # fmt: skip
    demux = None
    links: RingLinks | None = None
    try:
        say(f"joined; proving the code with the host ({len(client.members)} of {client.expected_members} here)")
        roster = await verify_host(client, code, presence.identity.fingerprint)
        # Pin the host's proved certificate, whatever the rendezvous has said of it since.
        host_info = client.members.get(client.host_id)
        if host_info is None:
            raise SessionEnded("the host left the session")
        host_info = host_info.model_copy(update={"fingerprint": roster[client.host_id]})
        demux = await DatagramDemux.over(presence.sock)
        edges = await connect_edges(client, demux, presence.identity, client.code, [host_info])
        host_edge = edges[client.host_id]
        say(f"linked to the host ({host_edge.path})")
        links = RingLinks(
            LinkRouter(host_edge.link, client.host_id),
            edge_connector(client, demux, presence.identity),
            say,
            name_of=lambda m: client.members[m].name if m in client.members else m[:6],
        )
        state = MemberState(cache=cache_dir() / "stages", model=model, threads=threads, say=say, bars=transfer_bars)
        return await follow_host(links, state, model_sha, machine_tag(client.code), priced_models)
    finally:
        if links is not None:
            await links.close("leaving")
        await client.close()
        if demux is not None:
            demux.close()
        presence.sock.close()
