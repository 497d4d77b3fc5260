"""The rendezvous a host runs for its members where none is given (`kafila host` without
`--rendezvous`). A module of its own, loaded only by such a host: the rendezvous's server runs on
FastAPI and uvicorn, which a host meeting its members at another rendezvous need not import before
its join line (issue 36)."""

from __future__ import annotations

from kafila.network.rendezvous import Limits
from kafila.network.rendezvous_server import RendezvousHandle, start_rendezvous
from kafila.session.host_config import HostConfig, seconds_from_env


async def start_embedded_rendezvous(config: HostConfig) -> RendezvousHandle:
    """The rendezvous this host runs for its members, when none is given."""
    try:
        bind, ports = config.rendezvous_bind, (config.rendezvous_port, config.stun_port)
        idle = max(1.0, seconds_from_env("KAFILA_SESSION_IDLE_S", Limits().session_idle_s))
        return await start_rendezvous(
            bind, *ports, discovery_port=config.discovery_port, limits=Limits(session_idle_s=idle)
        )
    except OSError as error:
        raise OSError(
            f"the embedded rendezvous cannot listen on {config.rendezvous_bind} (port "
            f"{config.rendezvous_port}, STUN port {config.stun_port}): {error.strerror or error}. Is another "
            "kafila host running here? `--rendezvous-port 0 --stun-port 0` take free ports (the join line "
            "says which)"
        ) from None
