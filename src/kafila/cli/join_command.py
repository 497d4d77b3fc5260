"""`kafila join CODE`: lend this machine to a session until its host ends it."""

from __future__ import annotations

import asyncio
import socket
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated

import typer

from kafila.cli.addresses import parse_host_port
from kafila.cli.backend_view import say_backend
from kafila.cli.bars import transfer_bars
from kafila.cli.early_start import nat_tests_begun
from kafila.cli.errors import device_name, fail, shown, stderr, warn
from kafila.cli.sizes import MEMORY_HELP, parse_memory
from kafila.contracts import Progress
from kafila.network.discovery import DEFAULT_DISCOVERY_TIMEOUT_S, DiscoveryError, discover
from kafila.network.session_codes import CodeFormatError, split_code
from kafila.portability import run
from kafila.runtime.gguf.stage_cache import check_stage_cache_setting
from kafila.runtime.llama.loading import LlamaUnavailable, load_llama
from kafila.runtime.llama.threads import THREADS_HELP, serving_threads
from kafila.runtime.machine.memory import memory_pressure
from kafila.session.member_runner import MemberConfig, run_member


def join(
    code: Annotated[
        str, typer.Argument(help="The session code the host printed, e.g. 7-crimson-harbor-lemon-tiger-orbit-cactus.")
    ],
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
    threads: Annotated[int | None, typer.Option("--threads", min=1, help=THREADS_HELP)] = None,
    memory: Annotated[str | None, typer.Option("--memory", help=MEMORY_HELP)] = None,
) -> None:
    """Join a session: this machine runs the blocks the host assigns it, until the host ends the session.

    If its link to the host drops (a network blip, a machine that slept), it joins again by itself."""
    nat_tests = nat_tests_begun(rendezvous)
    try:
        load_llama()
    except LlamaUnavailable as error:
        fail(str(error), False)
    member = device_name(name, f"{socket.gethostname()}"[:64])
    say_backend(member)
    try:
        channel, _ = split_code(code)
    except CodeFormatError as error:
        fail(str(error), False)
    if model is not None and not model.is_file():
        hub = " (a model on the hub is for the host to name: each member then fetches its own stage from the hub)"
        fail(f"no model file at {model}{hub if str(model).startswith('hf:') else ''}", False)
    try:
        lent = parse_memory(memory)
        check_stage_cache_setting()
    except ValueError as error:
        fail(str(error), False)
    pressure = memory_pressure(lent)  # macOS: other apps' share of unified memory
    if pressure is not None:
        warn(pressure)
    if rendezvous is None:  # the host's embedded rendezvous answers for its channel on the LAN
        stderr.print(f"looking for the host of {channel} on this network", highlight=False)
        try:
            address = run(discover(channel, discovery_port, DEFAULT_DISCOVERY_TIMEOUT_S))
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

    config = MemberConfig(code, address, member, threads or serving_threads(), model, lent)
    try:
        reason = run_member(config, MemberConsole(member), nat_tests)
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C: asyncio.run may raise either
        stderr.print(f"[dim]{shown(member)}:[/dim] left the session", highlight=False)
        return
    except Exception as error:  # every failure a person can meet: one line, no traceback
        fail(f"{member}: {error}", False)  # named like its other lines: a demo runs several here
    stderr.print(f"[dim]{shown(member)}:[/dim] the session ended: {shown(reason, True)}", highlight=False)


class MemberConsole:
    """A member's messages on stderr, each marked with its name (a demo runs several in one terminal)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def say(self, text: str) -> None:
        stderr.print(f"[dim]{shown(self.name)}:[/dim] {shown(text, True)}", highlight=False, soft_wrap=True)

    def progress_bars(self) -> AbstractContextManager[Progress]:
        return transfer_bars()
