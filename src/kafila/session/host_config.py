"""What a host is started with, what a person at it sees, and where it and its members meet: the
host's settings and the small I/O around them that the runner uses (this machine's address, the
model's hash). The embedded rendezvous is started by `HostConfig.embedded_rendezvous`
(`session.embedded_rendezvous`): its server's modules (FastAPI, uvicorn) are loaded only by a
host that runs one, since a host's members wait on its join line (issue 36)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kafila.contracts import FleetDevice, Progress
from kafila.network.discovery import DEFAULT_DISCOVERY_PORT
from kafila.network.nat import outgoing_address
from kafila.planner.report import PlanReport
from kafila.planner.types import ServingSpec
from kafila.runtime.engine.draft_model import DraftModel
from kafila.runtime.engine.speculation import Speculate
from kafila.runtime.llama.loading import teams_bound
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.threads import CoreShare
from kafila.runtime.machine.model_probe import host_prices_model, price_model_here
from kafila.runtime.machine.probe import ProbeError
from kafila.runtime.machine.this_machine import cached_model_pricings
from kafila.session.core import ServingPolicy
from kafila.session.host_model import HostModel, LocalModel
from kafila.session.presence import NatTests

if TYPE_CHECKING:
    from kafila.network.rendezvous_server import RendezvousHandle

# How long admitted newcomers wait for a moment without requests before /v1 turns new ones away
# so that the running ones can finish and the ring be replanned with them.
NEWCOMER_PATIENCE_S = 30.0
# The least time between two rebalances, doubled after each: a ring measured on a machine whose
# load comes and goes cannot flap between divisions more than a few times an hour.
REBALANCE_COOLDOWN_S = 60.0
# The load served is read over this window's busy part; the least time between two replans for
# load is the cool-down, doubled after each, as for rebalances.
LOAD_WINDOW_S = 30.0
LOAD_COOLDOWN_S = 60.0


def seconds_from_env(name: str, default: float) -> float:
    """A duration the environment may shorten (tests do), never negative; `default` if unreadable."""
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


class HostUi(Protocol):
    """What a person at the host sees."""

    def say(self, text: str) -> None: ...
    def warn(self, what: str, detail: str) -> None: ...
    def error(self, message: str) -> None: ...
    def announce_code(self, code: str, join_line: str, discoverable: bool = False) -> None:
        """`discoverable`: members on this network can join with the code alone (LAN discovery)."""

    def show_plan(self, report: PlanReport) -> None: ...
    def progress_bars(self) -> AbstractContextManager[Progress]:
        """A bar per thing named in the updates (what, bytes done, bytes in all), gone at the end."""
        ...


@dataclass
class HostConfig:
    model: HostModel  # a local file, or a model on the hub known by its header (`host_model`)
    counts: list[int]  # the local division, for a session of one member
    session: ServingSpec
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
    memory: int | None = None  # bytes this machine lends (`--memory`); None: what is free
    discovery_port: int | None = DEFAULT_DISCOVERY_PORT  # LAN discovery by the embedded rendezvous; None: off
    rebalance: bool = True  # divide the blocks again when the stages' measured times clearly call for it
    allowed_hosts: tuple[str, ...] = ()  # host names the API answers to besides addresses and localhost
    open_token: str | None = None  # what an external rendezvous asks of hosts that open a session
    resume_within_s: float = 60.0  # how long requests a broken ring left wait for the next one
    every_member_serves: bool = False  # no member stands by, even where the ring is faster without it
    speculate: Speculate = Speculate.NGRAM  # what tokens are drafted with, to check several per trip
    member_shares: tuple[CoreShare, ...] = ()  # the demo's members' cores, one share each; (): left to share them all
    draft_model: DraftModel | None = None  # what --speculate draft drafts with (`--draft`), loaded at start
    draft_bytes: int = 0  # what the draft model holds of this machine's memory: not the blocks' to use
    nat_tests: NatTests | None = None  # against the external rendezvous, begun as the command started
    # Starts the rendezvous this host runs where `rendezvous` is None (`embedded_rendezvous.start_embedded_rendezvous`).
    embedded_rendezvous: Callable[[HostConfig], Awaitable[RendezvousHandle]] | None = None

    @property
    def api_url(self) -> str:
        """Where clients reach the API: the listening socket's address."""
        address, port = self.sock.getsockname()[:2]
        return f"http://{f'[{address}]' if ':' in address else address}:{port}/v1"

    @property
    def settings(self) -> ContextSettings:
        n = self.session.concurrency
        return ContextSettings(n_ctx=self.session.context * n, n_batch=512, n_seq_max=n, n_threads=self.threads)

    @property
    def policy(self) -> ServingPolicy:
        """The session core's patience: the command line's, shortened by the environment (tests do)."""
        return ServingPolicy(
            newcomer_patience_s=seconds_from_env("KAFILA_NEWCOMER_PATIENCE_S", NEWCOMER_PATIENCE_S),
            rebalance_cooldown_s=seconds_from_env("KAFILA_REBALANCE_COOLDOWN_S", REBALANCE_COOLDOWN_S),
            rebalance=self.rebalance and self.members > 1,
            resume_within_s=self.resume_within_s,
            follow_load=self.members > 1 and not self.every_member_serves,
            load_window_s=max(0.1, seconds_from_env("KAFILA_LOAD_WINDOW_S", LOAD_WINDOW_S)),
            load_cooldown_s=seconds_from_env("KAFILA_LOAD_COOLDOWN_S", LOAD_COOLDOWN_S),
        )


def rendezvous_address(config: HostConfig, embedded: RendezvousHandle | None) -> tuple[str, int]:
    """Where this host and its members reach the rendezvous. The host reaches its own at the
    address it gives members, so that every member's candidates are on the same network and
    punches between them line up."""
    if config.rendezvous is not None:
        return config.rendezvous
    assert embedded is not None, "with no --rendezvous, the host runs one"
    host, port = embedded.http_address
    return (lan_address() if host in ("0.0.0.0", "::") else host), port


async def price_model_here_first(config: HostConfig, device: FleetDevice, model_sha256: str | None, ui: HostUi) -> None:
    """Before the first plan, this machine's pricing of the model it serves: kept from before, or
    measured now on its own stages (`model_probe.price_model_here`, a few seconds), so that the
    plan prices this host on the model itself and every member by the ratio of its generic probe
    to this host's. A model on the hub that this host holds no copy of is priced as before, by
    the generic probe, until its stage has served; KAFILA_PRICE_MODEL=off skips the measure."""
    model = config.model
    if not host_prices_model() or model_sha256 is None:
        return
    if not isinstance(model, LocalModel):
        kept = await asyncio.to_thread(cached_model_pricings)
        if any(pricing.model_sha256 == model_sha256 for pricing in kept):
            ui.say(f"pricing {model.name}'s stages on this machine: kept from what its stage measured serving it")
        else:
            ui.say(
                f"pricing: this host holds no copy of {model.label} to time, so the first plan prices it by the "
                "generic probe; what its stage measures serving is kept for the next start"
            )
        return
    loop = asyncio.get_running_loop()

    def said(text: str, _fraction: float) -> None:
        loop.call_soon_threadsafe(ui.say, f"pricing {model.name}'s stages on this machine: {text}")

    memory, started = int(device.memory_gib * 2**30), time.monotonic()
    served_blocks = -(-model.manifest.n_blocks // max(1, config.members))  # a stage's blocks, were they even
    try:
        pricing, stages = await asyncio.to_thread(
            price_model_here, model.path, model_sha256, memory, config.threads, said, served_blocks, teams_bound()
        )
    except ProbeError as error:
        ui.warn("the model's stages could not be priced on this machine", f"{error}; the generic probe prices them")
        return
    numbers = f"b {pricing.bandwidth_gb_s} GB/s, head b {pricing.head_bandwidth_gb_s} GB/s, o {pricing.overhead_us} µs"
    if stages is None:
        ui.say(f"pricing {model.name}'s stages on this machine: kept from before ({numbers})")
    else:
        measured = ", ".join(
            f"{s.first_block}-{s.end_block - 1}{' head' if s.is_head else ''} {s.ms_per_token:.2f} ms"
            for s in stages.stages
        )
        took = time.monotonic() - started
        ui.say(f"pricing {model.name}'s stages on this machine: {measured}; {numbers} (measured in {took:.1f} s, kept)")


async def hash_with_progress(model: HostModel, ui: HostUi) -> str | None:
    """The model's sha256, for members with their own copy of it (the first hash of a large model
    takes a minute; it is cached after); a model on the hub's, as its listing gives it."""
    with ui.progress_bars() as progress:
        return await model.identity(progress)


def lan_address() -> str:
    """This machine's address on its default route, for the join line a person copies."""
    try:
        return outgoing_address(("192.0.2.1", 9))  # TEST-NET: nothing is sent
    except OSError:
        return "127.0.0.1"
