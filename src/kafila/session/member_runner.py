"""A member's whole time in a session: measure this machine, join, prove the code to the host, link
to it and follow it (`member.follow_host`); and, when the link to the host is lost rather than
ended by its goodbye, join again, a few times, since the host may still serve with a seat open.

The CLI (`kafila join`) only parses flags and presents: what is said and the progress bars go
through a `MemberUi`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kafila.contracts import Progress
from kafila.network.edges import connect_edges
from kafila.network.link import DatagramDemux
from kafila.network.rendezvous_client import RendezvousClient, RendezvousClosed, RendezvousError, verify_host
from kafila.network.session_codes import channel_part
from kafila.portability import run
from kafila.runtime.llama.backends import backend_or_none
from kafila.runtime.machine.this_machine import cache_dir, cached_model_pricings, hash_model, this_device
from kafila.session.member import LostHost, MemberState, RingLinks, SessionEnded, edge_connector, follow_host
from kafila.session.presence import NatTests, RendezvousUnreachable, machine_tag, present
from kafila.session.router import LinkRouter

# After losing the host's link (not its goodbye), join again: the host takes the machine back in.
# A join that lasted STEADY_S counts as a success, so only rejoins in quick succession run out.
REJOINS = 3
REJOIN_PAUSE_S = 1.0
STEADY_S = 60.0
# A machine whose uplink went down may find its old seat still held (the rendezvous drops a dead
# connection after 120 s, or when the host sends it away): a join again keeps trying for this
# long. A rendezvous out of reach is tried for less: with the host's own rendezvous, the host is
# most likely gone.
REJOIN_WINDOW_S = 180.0
UNREACHABLE_WINDOW_S = 30.0
RETRY_PAUSE_S = 3.0  # the first pause before a try again; each next one doubles, up to MAX_RETRY_PAUSE_S
MAX_RETRY_PAUSE_S = 30.0


class MemberUi(Protocol):
    """What a person at a member sees."""

    def say(self, text: str) -> None: ...
    def progress_bars(self) -> AbstractContextManager[Progress]:
        """A bar per thing named in the updates (what, bytes done, bytes in all), gone at the end."""
        ...


class MemberGaveUp(RuntimeError):
    """The link to the host was lost again and again, each join lasting too little to count."""


@dataclass(frozen=True)
class MemberConfig:
    code: str
    rendezvous: tuple[str, int]
    name: str
    threads: int
    model: Path | None = None  # this machine's own copy: its stage is cut from it, not sent
    memory: int | None = None  # bytes this machine lends (`--memory`); None: what is free


@dataclass
class Rejoins:
    """When to join again after losing the host: while joins keep lasting, or a few times in a row."""

    limit: int = REJOINS
    steady_s: float = STEADY_S
    count: int = 0

    def after_loss(self, lasted_s: float) -> bool:
        """Whether to join again after a join that lasted `lasted_s` lost its host."""
        self.count = 1 if lasted_s >= self.steady_s else self.count + 1
        return self.count <= self.limit


def worth_retrying(error: BaseException, rejoining: bool, since_s: float) -> bool:
    """Whether a join that failed before it got in should be tried again, for what time mends,
    within REJOIN_WINDOW_S of the first try or of losing the host (`since_s`): a full session
    (a seat another holds, which the host frees when its holder fails to prove the code, or that
    the rendezvous still holds for this machine's old connection) or a rate limit; and, when
    joining again after a loss, a network still coming back (for UNREACHABLE_WINDOW_S). A first
    join says at once why anything else failed."""
    if isinstance(error, RendezvousError) and not isinstance(error, RendezvousClosed):
        return error.code in ("session_full", "rate_limited") and since_s < REJOIN_WINDOW_S
    unreachable = (RendezvousUnreachable, RendezvousClosed, OSError, TimeoutError)
    return rejoining and isinstance(error, unreachable) and since_s < UNREACHABLE_WINDOW_S


def retry_pause(error: BaseException, tries: int) -> float:
    """Seconds before try `tries + 1`: doubling from RETRY_PAUSE_S up to MAX_RETRY_PAUSE_S, and no
    sooner than the rendezvous asked (`retry_after_s`)."""
    pause = min(RETRY_PAUSE_S * 2 ** max(tries - 1, 0), MAX_RETRY_PAUSE_S)
    asked = error.retry_after_s if isinstance(error, RendezvousError) else None
    return max(pause, min(float(asked), MAX_RETRY_PAUSE_S)) if asked else pause


def run_member(config: MemberConfig, ui: MemberUi, nat_tests: NatTests | None = None) -> str:
    """Join and follow the host until it ends the session; returns why it ended. Joins again after
    losing the host (`Rejoins`); MemberGaveUp when that keeps failing. `nat_tests`: begun as the
    command started, for the first try (a try again tests again)."""
    rejoins = Rejoins()
    first_try = time.monotonic()
    lost_at: float | None = None  # when the host was last lost; None on the first join
    tries = 0  # failed tries since the first join or the last loss
    while True:
        started = time.monotonic()
        begun, nat_tests = nat_tests, None
        try:
            return run(join_once(config, ui, begun))
        except LostHost as lost:  # the host may still serve: its seat for this machine is open
            if not rejoins.after_loss(time.monotonic() - started):
                raise MemberGaveUp(f"{lost} ({rejoins.limit} joins again did not last)") from None
            ui.say(f"{lost}; joining the session again")
            lost_at, tries = time.monotonic(), 0
            time.sleep(REJOIN_PAUSE_S)
        except Exception as error:
            since = time.monotonic() - (lost_at if lost_at is not None else first_try)
            if not worth_retrying(error, lost_at is not None, since):
                raise
            tries += 1
            pause = retry_pause(error, tries)
            again = "again " if lost_at is not None else ""
            ui.say(f"could not join {again}yet ({error}); trying again in {pause:g} s")
            time.sleep(pause)


async def join_once(config: MemberConfig, ui: MemberUi, nat_tests: NatTests | None = None) -> str:
    """One join: measured, introduced, verified, linked to the host, following it until the end."""
    ui.say("measuring this device (cached afterwards)")
    device = await asyncio.to_thread(this_device, memory=config.memory)
    priced_models = await asyncio.to_thread(cached_model_pricings)
    backend = await asyncio.to_thread(backend_or_none)
    presence = await present(config.name, config.rendezvous, device, begun=nat_tests)
    model_sha = None
    if config.model is not None:  # before joining: the host plans with it as soon as everyone has joined
        with ui.progress_bars() as progress:
            hashing = functools.partial(progress, f"hashing {config.model.name} (once)")
            model_sha = await hash_model(config.model, hashing)
    client = await RendezvousClient.join(
        presence.url, channel_part(config.code), capability=presence.capability,
        fingerprint=presence.identity.fingerprint, candidates=presence.candidates,
    )  # fmt: skip
    demux = None
    links: RingLinks | None = None
    try:
        ui.say(f"joined; proving the code with the host ({len(client.members)} of {client.expected_members} here)")
        roster = await verify_host(client, config.code, presence.identity.fingerprint)
        # Pin the host's proved certificate, whatever the rendezvous has said of it since.
        host_info = client.members.get(client.host_id)
        if host_info is None:
            raise SessionEnded("the host left the session")
        host_info = host_info.model_copy(update={"fingerprint": roster[client.host_id]})
        demux = await DatagramDemux.over(presence.sock)
        edges = await connect_edges(client, demux, presence.identity, client.code, [host_info])
        host_edge = edges[client.host_id]
        ui.say(f"linked to the host ({host_edge.path})")
        links = RingLinks(
            LinkRouter(host_edge.link, client.host_id),
            edge_connector(client, demux, presence.identity),
            ui.say,
            name_of=lambda m: client.members[m].name if m in client.members else m[:6],
        )
        stages = cache_dir() / "stages"
        state = MemberState(cache=stages, model=config.model, threads=config.threads, say=ui.say, bars=ui.progress_bars)
        return await follow_host(links, state, model_sha, machine_tag(client.code), priced_models, backend)
    finally:
        if links is not None:
            await links.close("leaving")
        await client.close()
        if demux is not None:
            demux.close()
        presence.sock.close()
