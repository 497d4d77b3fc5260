"""`kafila host`: load the model and serve the OpenAI-compatible API on this machine.

The HTTP server comes up before the stages load (with members, as the host gathers them), so
`/health` can say what the session is waiting for meanwhile; `/v1` answers once every stage is
ready. Ctrl-C ends every request in flight with an error, stops the stages and exits.

The API's server and the embedded rendezvous's run on FastAPI and uvicorn, about a quarter of
what `kafila host` imports; its members can start only once it has printed its join line. So
their modules are loaded by name, only where and when the session needs them (as `commands.main`
loads only the command named): the API's while the members start, once the join line is out and
the host's own stage is being fetched ahead (`API_SERVER`; loaded beside that fetch's start, it
delayed it), the rendezvous's where no `--rendezvous` is given (`EMBEDDED_RENDEZVOUS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kafila.cli.addresses import parse_host_port
from kafila.cli.backend_view import say_backend
from kafila.cli.bars import transfer_bars
from kafila.cli.early_start import DEMO_MEMBERS, header_read_begun, nat_tests_begun
from kafila.cli.errors import device_name, fail, shown, stderr
from kafila.cli.generate_command import NO_DEFAULT_MODEL, default_model, local_counts
from kafila.cli.model_source import MODEL_HELP, model_source
from kafila.cli.plan_view import render_plan
from kafila.cli.sizes import MEMORY_HELP, parse_memory
from kafila.contracts import Progress
from kafila.network.discovery import DEFAULT_DISCOVERY_PORT
from kafila.planner.types import PlanRefused, ServingSpec
from kafila.portability import reuse_listening_address, run, signals_handled
from kafila.runtime.engine.draft_model import DraftModel, DraftRefused, check_draft, draft_footprint
from kafila.runtime.engine.speculation import Speculate
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import check_family
from kafila.runtime.gguf.stage_cache import check_stage_cache_setting
from kafila.runtime.llama.loading import LlamaUnavailable, load_llama, shares_cores_env
from kafila.runtime.llama.threads import THREADS_HELP, CoreShare, hold_to, serving_threads, this_machine_shares
from kafila.runtime.machine.this_machine import admit_alone, this_device
from kafila.session.availability import Availability
from kafila.session.host_config import HostConfig, lan_address
from kafila.session.host_model import HubOnlyModel, LocalModel
from kafila.session.runner import HostRunner, supervised
from kafila.untrusted import printable

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kafila.cli.host_api import ApiServer
    from kafila.planner.report import PlanReport

API_SERVER = "kafila.cli.host_api"  # loaded as the host gathers its members; at once for a host alone
EMBEDDED_RENDEZVOUS = "kafila.session.embedded_rendezvous"  # loaded where no --rendezvous is given


def _listening_socket(bind_ip: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind_ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    reuse_listening_address(sock)
    try:
        sock.bind((bind_ip, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {bind_ip}:{port}: {error.strerror or error}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def host(
    model: Annotated[str | None, typer.Option("--model", help=MODEL_HELP)] = None,
    members: Annotated[
        int | None,
        typer.Option("--members", min=1, max=32, help="Machines in the session, this one included (default 1)."),
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option("--rendezvous", help="HOST:PORT of a rendezvous; default: one embedded here, for a LAN."),
    ] = None,
    rendezvous_port: Annotated[
        int, typer.Option("--rendezvous-port", min=0, max=65535, help="The embedded rendezvous's HTTP port.")
    ] = 8470,
    rendezvous_bind: Annotated[
        str | None,
        typer.Option(
            "--rendezvous-bind",
            help="The address the embedded rendezvous listens on; default: this machine's LAN address, the one "
            "the join line gives (0.0.0.0: every interface, for members on a VPN, say).",
        ),
    ] = None,
    stun_port: Annotated[
        int, typer.Option("--stun-port", min=0, max=65535, help="The embedded rendezvous's STUN port.")
    ] = 3478,
    discovery_port: Annotated[
        int,
        typer.Option(
            "--discovery-port",
            min=0,
            max=65535,
            help="UDP port on which the embedded rendezvous answers `kafila join CODE` on this LAN (0: off).",
        ),
    ] = DEFAULT_DISCOVERY_PORT,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help=f"Everything on this machine: the bundled SmolLM2-135M-Instruct, the embedded rendezvous on loopback, "
            f"and --members (default {DEMO_MEMBERS}) minus one local `kafila join` processes.",
        ),
    ] = False,
    stages: Annotated[
        int | None,
        typer.Option("--stages", min=1, max=32, help="With one member: split across this many local processes."),
    ] = None,
    division: Annotated[
        str | None, typer.Option("--division", help="With one member: block counts per local stage, head last.")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="This machine's name in the session.")] = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="HTTP port (0: any free one).")] = 8080,
    bind_ip: Annotated[str, typer.Option("--bind-ip", help="Address to serve the API on.")] = "127.0.0.1",
    context: Annotated[int, typer.Option("--context", min=16, max=1 << 20, help="Tokens per request.")] = 4096,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, max=64, help="Requests generating at once; more queue.")
    ] = 4,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="KAFILA_API_KEY", help="Require this bearer token on /v1.")
    ] = None,
    open_token: Annotated[
        str | None,
        typer.Option(
            "--open-token",
            envvar="KAFILA_OPEN_TOKEN",
            help="With --rendezvous: the token that rendezvous asks of hosts opening a session (its operator's).",
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            help="A host name the API answers to, besides addresses and localhost (repeatable): requests naming "
            "any other are refused, so a web page cannot reach the API by rebinding its own name to this machine.",
        ),
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help=THREADS_HELP)] = None,
    memory: Annotated[
        str | None,
        typer.Option(
            "--memory",
            help=f"{MEMORY_HELP} A host too small for the head leaves it to a member; one too small for any "
            "block holds no stage and only serves.",
        ),
    ] = None,
    resume_within: Annotated[
        float,
        typer.Option(
            "--resume-within",
            min=0,
            max=3600,
            help="Seconds requests in flight wait, paused, for a new ring when a member is lost, before "
            "they end with an error.",
        ),
    ] = 60.0,
    every_member_serves: Annotated[
        bool,
        typer.Option(
            "--every-member-serves",
            envvar="KAFILA_EVERY_MEMBER_SERVES",
            help="With members: put every member in the ring. By default a member whose place costs more time "
            "per token than its blocks save (a slow edge, a slow machine) stands by, and is taken in when it pays. "
            "--demo puts every member in: its members share this machine's cores.",
        ),
    ] = False,
    rebalance: Annotated[
        bool,
        typer.Option(
            "--rebalance/--no-rebalance",
            help="With members: at a moment without requests, divide the blocks again when what the stages "
            "measured serving shows a division at least 25% faster.",
        ),
    ] = True,
    speculate: Annotated[
        Speculate | None,
        typer.Option(
            "--speculate",
            case_sensitive=False,
            help="Draft tokens to check in the same trip round the ring (speculative decoding): ngram drafts "
            "the tokens that followed the text's last few tokens earlier in the prompt or the answer, which "
            "pays where a model writes back what it was shown (a file with one change, a JSON document); "
            "draft runs the --draft model on this machine. Greedy output is the same either way; sampled "
            "output has the model's distribution. Default: draft with --draft, else ngram.",
        ),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(
            "--draft",
            help="A small model with the same vocabulary, token for token, as --model (a GGUF file or "
            "hf://..., as --model), run on this machine to draft tokens for --speculate draft, which it "
            "implies. It pays where the draft writes a token in much less than a trip round the ring takes.",
        ),
    ] = None,
) -> None:
    """Serve a model on an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models),
    alone or with other machines that `kafila join` the session code it prints."""
    n_members = members if members is not None else (DEMO_MEMBERS if demo else 1)
    nat_tests = nat_tests_begun(rendezvous) if n_members > 1 else None
    header_read = header_read_begun(model, n_members > 1)
    local_split = (stages or 1) > 1 or (division is not None and "," in division)
    local_members = demo and n_members > 1
    shared = local_split or local_members  # stages that take turns on this machine's cores
    shares = this_machine_shares(n_members) if local_members else None
    if shares is not None:  # before llama.cpp loads: libgomp reads the cores it may use then
        hold_to(shares[0].cpus)
    try:
        load_llama(shared_machine=shared, bind_teams=local_members)
    except LlamaUnavailable as error:
        fail(str(error), False)
    say_backend()
    if shares is not None:
        stderr.print(described_shares(shares), highlight=False, soft_wrap=True)
    if shared:
        os.environ.update(shares_cores_env(bind_teams=local_members))  # the demo's local members inherit it
    try:
        speculate = speculation_chosen(speculate, draft)
    except ValueError as error:
        fail(str(error), False)
    # Only the host resolves hub names; with members, each machine fetches its own stage from the hub by range.
    bundled = default_model() if model is None else None
    if model is not None:
        source = model_source(model, n_members > 1, header_read)
    elif bundled is not None:
        source = LocalModel(bundled)
    else:
        fail(NO_DEFAULT_MODEL, False)
    if n_members > 1 and (stages is not None or division is not None):
        fail("--stages and --division split the model on this machine; with --members the planner divides it", False)
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty: give the key clients must send, or leave --api-key out to serve without one", False)
    try:
        check_stage_cache_setting()
    except ValueError as error:
        fail(str(error), False)
    session = ServingSpec(context=context, concurrency=concurrency)
    host_name = device_name(name, f"host-{socket.gethostname()}"[:64])
    try:
        lent = parse_memory(memory)
        if isinstance(source, LocalModel) and not source.path.is_file():
            raise ValueError(f"no model file at {source.path}")
        if n_members > 1:  # refused before a code is printed, where the planner's division could not be cut
            manifest = source.manifest
            check_family(manifest.architecture or "", manifest.n_blocks)
        draft_path = _draft_for(source, draft) if draft is not None else None
        draft_bytes = draft_footprint(draft_path, context, concurrency) if draft_path is not None else 0
        counts = []
        if n_members == 1:
            assert isinstance(source, LocalModel), "a host alone holds the whole file"
            counts = local_counts(source.path, stages, division, session, lent)
            _admit(source.path, session, lent, draft_bytes)
        sock = _listening_socket(bind_ip, port)
        external = parse_host_port(rendezvous.strip(), 8470) if rendezvous is not None else None
    except Exception as error:  # a bad file, division or address: one line, no traceback
        fail(str(error), False)
    config = HostConfig(
        model=source, counts=counts, session=session, sock=sock, api_key=api_key,
        threads=threads or (shares[0].threads if shares else serving_threads()), members=n_members, rendezvous=external,
        rendezvous_bind="127.0.0.1" if demo else (rendezvous_bind or lan_address()),
        rendezvous_port=0 if demo else rendezvous_port, stun_port=0 if demo else stun_port,
        demo=demo, name=host_name, discovery_port=discovery_port or None,
        memory=lent, rebalance=rebalance, allowed_hosts=tuple(allow_host or ()), open_token=open_token or None,
        resume_within_s=resume_within, every_member_serves=every_member_serves or demo,
        speculate=speculate, member_shares=tuple(shares[1:]) if shares else (), draft_bytes=draft_bytes,
        nat_tests=nat_tests,
        embedded_rendezvous=(
            importlib.import_module(EMBEDDED_RENDEZVOUS).start_embedded_rendezvous
            if n_members > 1 and external is None else None
        ),
    )  # fmt: skip
    if draft_path is not None:
        try:
            config.draft_model = DraftModel(draft_path, config.settings)
        except (DraftRefused, RuntimeError) as error:
            fail(f"the draft model could not be loaded: {error}", False)
    try:
        run(_serve(config))
    except KeyboardInterrupt:
        pass


def speculation_chosen(speculate: Speculate | None, draft: str | None) -> Speculate:
    """What `--speculate` and `--draft` together ask for: `--draft` alone implies a draft model,
    and each refuses what makes the other pointless."""
    if draft is None:
        if speculate is Speculate.DRAFT:
            raise ValueError("--speculate draft needs --draft MODEL: the small model to draft with on this machine")
        return speculate or Speculate.NGRAM
    if speculate not in (None, Speculate.DRAFT):
        raise ValueError(f"--draft is a draft model for --speculate draft; --speculate {speculate.value} never runs it")
    return Speculate.DRAFT


def _draft_for(target: LocalModel | HubOnlyModel, draft: str) -> Path:
    """The draft model's file, resolved as --model's is, once its vocabulary is checked against the
    target's header (raises DraftRefused, saying why)."""
    source = model_source(draft, False)
    assert isinstance(source, LocalModel), "a model for this machine alone is a whole file"
    reader = FastGGUFReader(target.path) if isinstance(target, LocalModel) else target.header.header.reader
    check_draft(reader, target.name, source.path)
    return source.path


def described_shares(shares: list[CoreShare]) -> str:
    """The demo's division of this machine's cores, one share a process, in words."""

    def share(held: CoreShare) -> str:
        cpus, threads = ",".join(map(str, held.cpus)), f"{held.threads} thread{'s' if held.threads > 1 else ''}"
        return f"CPU{'s' if len(held.cpus) > 1 else ''} {cpus} ({threads})"

    parts = [f"this host {share(shares[0])}"]
    parts += [f"demo-member-{n} {share(held)}" for n, held in enumerate(shares[1:], 1)]
    return (
        f"the demo holds each of its {len(shares)} processes to cores of its own, as separate machines: "
        + ", ".join(parts)
    )


def _admit(path: Path, session: ServingSpec, memory: int | None, draft_bytes: int = 0) -> None:
    """Refuse, before anything loads, a session this machine cannot hold: weights plus KV cache,
    beside a draft model's `draft_bytes`."""
    with stderr.status("measuring this device for the planner (cached afterwards)"):
        device = this_device(memory=memory).besides(draft_bytes)
    try:
        admit_alone(read_manifest(path), device, session)
    except PlanRefused as refused:
        if not draft_bytes:
            raise
        message = f"{refused} (beside the draft model's {draft_bytes / 2**20:.0f} MiB)"
        raise PlanRefused(message, refused.device, refused.shortfall_bytes) from refused


class RichUi:
    """The host's messages on stderr, with rich: stdout stays free for programs."""

    def say(self, text: str) -> None:
        stderr.print(printable(text, newlines=True), markup=False, highlight=False, soft_wrap=True)

    def warn(self, what: str, detail: str) -> None:
        stderr.print(f"[yellow]{shown(what)}:[/yellow] {shown(detail, True)}", highlight=False, soft_wrap=True)

    def error(self, message: str) -> None:
        stderr.print(f"[red]error:[/red] {shown(message, True)}", highlight=False, soft_wrap=True)

    def announce_code(self, code: str, join_line: str, discoverable: bool = False) -> None:
        stderr.print(f"session code: [bold]{code}[/bold]", highlight=False, soft_wrap=True)
        stderr.print(join_line, highlight=False, soft_wrap=True)
        if discoverable:
            stderr.print(
                f"on this network `kafila join {code}` finds this host by itself; --rendezvous is for the others",
                highlight=False,
                soft_wrap=True,
            )

    def show_plan(self, report: PlanReport) -> None:
        render_plan(report, stderr)

    def progress_bars(self) -> AbstractContextManager[Progress]:
        return transfer_bars()


async def _serve(config: HostConfig) -> None:
    serving = Availability()
    host = HostRunner(config, serving, RichUi())
    server: ApiServer | None = None
    stopping = asyncio.Event()  # Ctrl-C, SIGTERM, or the host could not start: no server to start
    watcher: asyncio.Task[None] | None = None

    def shutting_down() -> None:
        host.interrupt("the host is shutting down")
        serving.events.close()  # open /events streams end now, not at the graceful-shutdown bound

    def on_signal(signum: int) -> None:
        if server is not None:
            server.handle_exit(signum, None)
        else:
            stopping.set()
            shutting_down()

    async def run() -> None:
        nonlocal watcher
        if await host.start():
            watcher = supervised(host.watch(), host)
        else:  # the host said why
            stopping.set()
            if server is not None:
                server.should_exit = True

    others = config.members - 1
    waiting = "the model to load" if not others else f"{others} member{'s' if others > 1 else ''} to join"
    stderr.print(f"[bold]kafila[/bold] {config.model.name}: waiting for {waiting}", highlight=False)
    starting = asyncio.create_task(run())
    try:
        with signals_handled(asyncio.get_running_loop(), on_signal):
            if others:  # the API's modules load while the members start, once nothing else of the host's is to do
                waits = [asyncio.ensure_future(host.gathering.wait()), asyncio.ensure_future(stopping.wait())]
                await asyncio.wait((*waits, starting), return_when=asyncio.FIRST_COMPLETED)
                for waiter in waits:
                    waiter.cancel()
            if not stopping.is_set():
                api = await asyncio.to_thread(importlib.import_module, API_SERVER)
                server = api.api_server(config, serving, shutting_down)
                if not stopping.is_set():
                    await server.serve(sockets=[config.sock])
    finally:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        if watcher is not None:
            watcher.cancel()
        await host.stop(serving.failure or "the host is shutting down")
        if serving.failure:
            raise typer.Exit(1)
