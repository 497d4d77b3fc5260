"""`kafila host`'s HTTP server: the OpenAI-compatible API, `/health` and `/status`, on uvicorn.

A module of its own, which `host_command` loads once the host gathers its members, its join line
printed (at once for a host alone): FastAPI, uvicorn and the API's routes are about a quarter of
what `kafila host` imports, and a host's members can only start once it has printed that line
(issue 36). Nothing answers on the API before then; its socket is bound from the start, so a
client's connection waits in its backlog rather than being refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from kafila.api.server import ApiConfig, create_app
from kafila.network.http_guard import HEADER_TIMEOUT_S, ConnectionGate, guarded_http, raise_open_file_limit
from kafila.session.availability import Availability
from kafila.session.host_config import HostConfig, seconds_from_env

API_HEADER_TIMEOUT_ENV = "KAFILA_API_HEADER_TIMEOUT_S"  # tests shorten it


def api_gate(open_files: int) -> ConnectionGate:
    """The API's connection cap, well under the descriptor limit that the session's links, stage
    files and workers share: past it a connection is refused at the door, rather than every
    socket failing with "Too many open files". One cap for every address: clients on loopback
    (agents, the web page) all come from one."""
    cap = max(64, min(4096, open_files // 2))
    return ConnectionGate(per_address=cap, total=cap)


class ApiServer(uvicorn.Server):
    """uvicorn's server with the host's own signal handling: Ctrl-C and SIGTERM are taken by
    `host_command` for the whole session, from before this server exists, and end it through
    `handle_exit`. uvicorn's own capture re-raises the signal once `serve()` returns, which would
    interrupt the session's orderly end (telling members, closing the rendezvous) half-way."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the name before uvicorn 0.29
        return


def api_server(config: HostConfig, serving: Availability, on_exit: Callable[[], None]) -> ApiServer:
    """The server of the host's API over `serving`, to serve on `config.sock`; `on_exit` is called
    as it begins to shut down."""
    api = ApiConfig(
        model_id=config.model.name,
        context_per_sequence=config.session.context,
        api_key=config.api_key,
        allowed_hosts=frozenset(config.allowed_hosts),
    )
    header_timeout_s = seconds_from_env(API_HEADER_TIMEOUT_ENV, HEADER_TIMEOUT_S)
    uvicorn_config = uvicorn.Config(
        create_app(serving, api), log_level="warning", lifespan="off", timeout_graceful_shutdown=5, access_log=False,
        http=guarded_http(api_gate(raise_open_file_limit()), header_timeout_s),
        log_config=None,  # uvicorn's lines go to the program's log, where repeats are summarised
    )  # fmt: skip
    return ApiServer(uvicorn_config, on_exit)
