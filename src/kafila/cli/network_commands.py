"""`kafila nat` and `kafila rendezvous`: NAT classification, and the rendezvous (signalling, STUN, relay)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kafila.cli.addresses import parse_host_port
from kafila.cli.errors import fail, stderr
from kafila.network.nat import probe_nat
from kafila.network.rendezvous import Limits
from kafila.network.rendezvous_server import SESSION_PATH, start_rendezvous
from kafila.portability import run, signals_handled


def nat(
    rendezvous: Annotated[str, typer.Option("--rendezvous", help="The rendezvous's STUN address, HOST:PORT.")],
    bind: Annotated[str, typer.Option("--bind", help="Local address to probe from.")] = "0.0.0.0",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Classify this machine's NAT (RFC 4787 mapping and filtering) against a rendezvous."""
    try:
        host, port = parse_host_port(rendezvous, 3478)
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except (ValueError, OSError) as error:
        fail(f"bad --rendezvous {rendezvous!r}: {error}", as_json)
    try:
        report = run(probe_nat((str(address), port), bind_host=bind))
    except (ConnectionError, OSError) as error:
        fail(str(error), as_json)
    if as_json:
        print(json.dumps(report.as_output()))
        return
    table = Table(title=f"NAT behaviour seen by {rendezvous}")
    table.add_column("what")
    table.add_column("answer")
    for key, value in report.as_output().items():
        if key != "notes":
            table.add_row(key, "—" if value is None else str(value))
    Console().print(table)
    for note in report.notes:
        stderr.print(f"• {note}", highlight=False)


def rendezvous(
    host: Annotated[str, typer.Option("--host", help="Primary address to serve on.")] = "0.0.0.0",
    http_port: Annotated[
        int, typer.Option("--http-port", min=0, max=65535, help="WebSocket signalling TCP port (0: any).")
    ] = 8470,
    stun_port: Annotated[int, typer.Option("--stun-port", min=0, max=65535, help="STUN UDP port.")] = 3478,
    alt_port: Annotated[int, typer.Option("--alt-port", min=0, max=65535, help="Second STUN port (0: any).")] = 0,
    alt_address: Annotated[
        str | None, typer.Option("--alt-address", help="A second address of this host, for RFC 5780 tests.")
    ] = None,
    discovery_port: Annotated[
        int,
        typer.Option("--discovery-port", min=0, max=65535, help="Answer LAN discovery on this UDP port (0: off)."),
    ] = 0,
    open_token: Annotated[
        str | None,
        typer.Option(
            "--open-token",
            envvar="KAFILA_OPEN_TOKEN",
            help="Open sessions only for hosts that give this token (`kafila host --open-token`); joining needs "
            "only a session code. For a rendezvous on the internet.",
        ),
    ] = None,
    session_idle: Annotated[
        float,
        typer.Option(
            "--session-idle",
            min=1.0,
            help="Seconds a filled session lasts with no join, signal, relay traffic or renewal by its host "
            "(kafila host renews while it admits members).",
        ),
    ] = Limits().session_idle_s,
) -> None:
    """Run the rendezvous: session signalling over WebSocket, STUN (RFC 5389 binding, RFC 5780
    with --alt-address) and the UDP relay; with --discovery-port, `kafila join CODE` on its LAN
    finds it without --rendezvous. Prints `READY <stun host:port>`, then `HTTP <host:port>`."""

    async def serve() -> None:
        try:
            handle = await start_rendezvous(
                host,
                http_port,
                stun_port,
                alt_port,
                alt_address,
                discovery_port=discovery_port or None,
                open_token=open_token or None,
                limits=Limits(session_idle_s=session_idle),
            )
        except OSError as error:
            fail(f"cannot bind the rendezvous's sockets: {error.strerror or error}", False)
        stop = asyncio.Event()
        try:  # the handlers are in before READY: whoever waits for it may stop the rendezvous at once
            with signals_handled(asyncio.get_running_loop(), lambda _signum: stop.set()):
                endpoints = handle.stun.endpoints
                where = ", ".join(f"{a}:{p}" for a, p in endpoints.local())
                stderr.print(f"STUN on {where}" + ("" if alt_address else " (one address: no RFC 5780 change of IP)"))
                http_host, http_bound = handle.http_address
                stderr.print(f"signalling on ws://{http_host}:{http_bound}{SESSION_PATH}; relay ports on {host}")
                print(f"READY {endpoints.address}:{endpoints.port}", flush=True)
                print(f"HTTP {http_host}:{http_bound}", flush=True)
                await stop.wait()
        finally:
            await handle.close()

    run(serve())
