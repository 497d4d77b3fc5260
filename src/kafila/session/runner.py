"""The host's lifecycle: load the model or gather members, serve, replan when a stage fails, a
newcomer is admitted or the stages' measured times call for another division, stop.

Presentation is the caller's: every message, the plan table and the transfer progress go
through a `HostUi`, so the CLI renders them with rich and tests or other front ends need not.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kafila.contracts import FleetDevice, MemberStatus, Progress, SessionStatus
from kafila.network.discovery import DEFAULT_DISCOVERY_PORT
from kafila.network.pake import TrustError
from kafila.network.rendezvous import Limits
from kafila.network.rendezvous_server import RendezvousHandle, start_rendezvous
from kafila.network.session_codes import split_code
from kafila.planner import PlanRefused
from kafila.planner.plan import smallest_stage_bytes
from kafila.planner.report import PlanReport, plan_report
from kafila.planner.types import ServingSpec
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.backends import backend_or_none
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.this_machine import admit_alone, cache_dir, hash_model, this_device
from kafila.serving.batcher import Suspended
from kafila.serving.engine_loop import EngineLoop, Sink, fail_suspended
from kafila.session.availability import Availability
from kafila.session.core import (
    GUESS_BUDGET,
    AbandonRing,
    Admit,
    CodeRefused,
    Command,
    Deploy,
    Deployed,
    DeployFailed,
    Dismiss,
    Dismissed,
    Event,
    Fail,
    ForgetRing,
    Gathered,
    Interrupted,
    JoinerRefused,
    Judged,
    LowerMemory,
    LowerOwnMemory,
    MemberFailed,
    NewcomerChecked,
    Observed,
    Opened,
    OwnShortOfMemory,
    Phase,
    PriceRebalance,
    RecordIncident,
    Refuse,
    RenewCode,
    Resume,
    Retire,
    Retired,
    Say,
    SendAway,
    ServeAlone,
    ServedAlone,
    ServingCore,
    SessionCore,
    SessionView,
    Unready,
    Warn,
)
from kafila.session.deployer import SessionFailed
from kafila.session.host import TRUST_EXCHANGE_S, HostSession
from kafila.session.local_members import DemoMembers
from kafila.session.presence import present

# How long admitted newcomers wait for a moment without requests before /v1 turns new ones away
# so that the running ones can finish and the ring be replanned with them.
NEWCOMER_PATIENCE_S = 30.0
# The least time between two rebalances, doubled after each: a ring measured on a machine whose
# load comes and goes cannot flap between divisions more than a few times an hour.
REBALANCE_COOLDOWN_S = 60.0


def seconds_from_env(name: str, default: float) -> float:
    """A duration the environment may shorten (tests do), never negative; `default` if unreadable."""
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


def newcomer_patience_s() -> float:
    return seconds_from_env("KAFILA_NEWCOMER_PATIENCE_S", NEWCOMER_PATIENCE_S)


if TYPE_CHECKING:
    from kafila.runtime.engine.engines import Engine


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
    path: Path
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

    @property
    def api_url(self) -> str:
        """Where clients reach the API: the listening socket's address."""
        address, port = self.sock.getsockname()[:2]
        return f"http://{f'[{address}]' if ':' in address else address}:{port}/v1"

    @property
    def settings(self) -> ContextSettings:
        n = self.session.concurrency
        return ContextSettings(n_ctx=self.session.context * n, n_batch=512, n_seq_max=n, n_threads=self.threads)


WATCH_ERRORS_TOLERATED = 25  # the same error on this many turns running (5 s) ends the watching


class GuessBudgetSpent(TrustError):
    """Raised into the trust exchange to end a session's forming: too many joiners failed the code."""


class HostRunner:
    """The shell around `SessionCore`: it feeds the core what happens, and does what the core
    decides (load or gather, serve, replan, stop), around the HTTP server."""

    def __init__(self, config: HostConfig, availability: Availability, ui: HostUi) -> None:
        self.config, self.availability, self.ui = config, availability, ui
        self.manifest = read_manifest(config.path)
        self.engine: Engine | None = None
        self.engine_loop: EngineLoop | None = None  # the one serving, even while /v1 turns requests away
        rules = ServingCore(  # the serving ring's decisions
            newcomer_patience_s=newcomer_patience_s(),
            rebalance_cooldown_s=seconds_from_env("KAFILA_REBALANCE_COOLDOWN_S", REBALANCE_COOLDOWN_S),
            rebalance=config.rebalance and config.members > 1,
        )
        self.core = SessionCore(rules) if config.members > 1 else SessionCore.one_machine(rules)
        self.rendezvous_session: HostSession | None = None
        self.rendezvous: RendezvousHandle | None = None  # the embedded one, when the host runs it
        self.demo = DemoMembers(self._demo_member_failed)
        self.stopping = False
        self._hashing: asyncio.Future[str] | None = None  # the model's sha256, for members with a copy
        self._rendezvous_at: tuple[str, int] = ("", 0)  # where this host and its members reach the rendezvous
        self._advertised = ""  # the same, as the join line gives it
        self._device: FleetDevice | None = None  # this machine, as measured for the planner
        self._held: list[tuple[Suspended, Sink]] = []  # requests a broken ring left, for the next ring
        self._held_since = 0.0
        self._url_given = False  # the first ready line gives the API's URL

    @property
    def going_on(self) -> bool:
        """Whether the session may still serve (it has not failed for good, nor been stopped)."""
        return self.core.phase not in (Phase.FAILED, Phase.STOPPING)

    # --- the loop: events in, commands out ---
    async def _drive(self, events: Sequence[Event]) -> None:
        """Hand each event to the core and carry out its commands in order; the answer of the last
        (`ANSWERED`) is the next event."""
        pending = deque(events)
        while pending:
            for command in self.core.handle(pending.popleft()):
                pending.extend(await self._carry_out(command))

    async def watch(self) -> None:
        """Several times a second, show the core the session as it is, until it can serve no more.

        One bad turn (a member's hostile text in an error, a message nobody foresaw) is an
        incident, not the end of watching: the same error WATCH_ERRORS_TOLERATED turns running
        ends the session, as it cannot recover by itself."""
        repeated, last = 0, ""
        while self.going_on and not self.stopping:
            await asyncio.sleep(0.2)
            if self.stopping:  # members leave when the session ends: that is not a failure
                return
            try:
                await self._drive(
                    [Observed(session_view(self.rendezvous_session, self.engine_loop, self.availability.ready))]
                )
                repeated = 0
            except Exception as error:
                text = f"{type(error).__name__}: {error}"
                repeated = repeated + 1 if text == last else 1
                last = text
                if repeated >= WATCH_ERRORS_TOLERATED:
                    raise
                if repeated == 1:
                    self.incident("the host met an error watching its session", text)
            if self._held and time.monotonic() - self._held_since > self.config.resume_within_s:
                self._fail_held(f"the ring broke, and no new ring served within {self.config.resume_within_s:g} s")

    async def _carry_out(self, command: Command) -> list[Event]:
        """Do what the core decided; the events it answers with, if any."""
        network = self.rendezvous_session
        match command:
            case Retire(reason=reason, learn=learn):
                await self._retire(reason, learn)
                return [Retired(tuple(network.alive()) if network else ())]
            case Deploy(members=members):
                return [await self._deployed(list(members))]
            case Dismiss(member=member, reason=reason):
                assert network is not None
                self.availability.events.publish("left", f"{network.member_name(member)} was sent home", reason)
                await network.dismiss(member, reason)
                return [Dismissed(member, tuple(network.alive()))]
            case ServeAlone(why=why):
                try:
                    await self._serve_alone(why)
                    return [ServedAlone()]
                except Exception as error:
                    return [no_ring(error)]
            case PriceRebalance():
                loop = self.engine_loop
                verdict = network.rebalance_verdict(loop.stage_report) if loop and network else None
                worth_it = verdict is not None and verdict.worth_it
                return [Judged(time.monotonic(), worth_it, verdict.reason if verdict else "")]
            case RenewCode(reason=reason):
                assert network is not None
                await network.end(reason)
                return await self._open_and_gather()
            case LowerMemory(member=member, memory_bytes=memory):
                assert network is not None
                network.lower_memory(member, memory)
            case LowerOwnMemory(memory_bytes=memory):
                assert network is not None
                network.lower_memory(network.me, memory)
            case SendAway(members=members):
                assert network is not None
                for member in members:
                    self.availability.events.publish("left", f"{network.member_name(member)} left the ring")
                await network.send_away(members)
            case Admit(member=member):
                assert network is not None
                name = network.joiner_name(member)
                self.ui.say(f"{name} joined; checking its code")
                self.availability.events.publish("joined", f"{name} joined; checking its code")
                network.admit(member, functools.partial(self._admitted, name))
            case Refuse(member=member, reason=reason):
                assert network is not None
                network.refuse(member, reason, functools.partial(self._admitted, network.joiner_name(member)))
            case ForgetRing():
                if network is not None:  # nothing serves: no ring left to watch
                    network.forget_ring()
            case Resume():
                if self.engine is not None and self.engine_loop is not None:
                    self.availability.become_ready(self.engine, self.engine_loop, self.manifest.architecture)
            case _:
                self._tell(command)
        return []

    def _tell(self, command: Command) -> None:
        """Carry out a command that needs no waiting (a callback's, or a signal handler's)."""
        match command:
            case Say(text=text, kind=kind):
                self.ui.say(text)
                self.availability.events.publish(kind, text)
            case Warn(what=what, detail=detail):
                self.ui.warn(what, detail)
                self.availability.events.publish("warning", what, detail)
            case RecordIncident(what=what, detail=detail):
                self.incident(what, detail)
            case Unready(waiting_for=waits, paused=paused, failure=failure):
                self.availability.become_unready(list(waits), failure=failure, paused=paused)
            case Fail(message=message):
                self.fail(message)
            case AbandonRing(reason=reason):
                if self.rendezvous_session is not None:
                    self.rendezvous_session.deployer.abandon_ring()  # a step waiting on the ring ends at once
                loop = self.engine_loop
                if loop is not None:
                    threading.Thread(target=loop.stop, args=(reason,), daemon=True).start()
            case _:
                raise AssertionError(f"{command} cannot be carried out at once")

    def _drive_now(self, events: Sequence[Event]) -> None:
        """Hand the core events whose commands need no waiting (a callback's, a signal handler's)."""
        for event in events:
            for command in self.core.handle(event):
                self._tell(command)

    def _admitted(self, name: str, error: BaseException | None) -> None:
        """An admission ended (`HostSession.admit`); a failed proof of the code may be a guess."""
        guess = isinstance(error, TrustError) and error.guess  # an exchange begun and not proved, however it ended
        detail = None if error is None else str(error) or type(error).__name__
        self._drive_now([NewcomerChecked(name, detail, guess)])

    def interrupt(self, reason: str) -> None:
        """Ctrl-C or SIGTERM: end the requests in flight now, without blocking the event loop (a
        signal handler calls it)."""
        self.stopping = True
        self._drive_now([Interrupted(reason)])

    # --- engines ---
    def _activate(self, engine: Engine) -> None:
        self.engine = engine
        loop = EngineLoop(
            engine, self.config.session.concurrency, self.config.settings.n_batch, self.config.session.context
        )
        loop.start()
        held, self._held = self.availability.still_wanted(self._held), []
        if held:  # what the broken ring left goes on here, ahead of new requests, unless its client left
            loop.resume(held)
            self.ui.say(f"{len(held)} request{'s' if len(held) != 1 else ''} the broken ring left go on on this one")
        self.engine_loop = loop
        self.availability.become_ready(engine, loop, self.manifest.architecture)

    def _hold(self, loop: EngineLoop) -> None:
        """Keep what a broken ring left for the next ring (`resume_within_s` at the most)."""
        left = loop.take_suspended()
        if left and not self._held:
            self._held_since = time.monotonic()
        self._held += left

    def _fail_held(self, message: str) -> None:
        held, self._held = self._held, []
        for suspended, sink in held:
            fail_suspended(suspended, sink, message)

    async def _retire(self, reason: str, learn: bool = False) -> None:
        """Stop the engine loop and close the engine. The ring is abandoned first: its engine thread
        may be waiting on the event loop, and a stale wait would steal the next ring's frames."""
        if self.rendezvous_session is not None:
            self.rendezvous_session.deployer.abandon_ring()
        loop, self.engine_loop = self.engine_loop, None
        if loop is not None and self.rendezvous_session is not None and learn and not self.stopping:
            repriced = self.rendezvous_session.learn_from_serving(loop.stage_report)  # for the replan that follows
            if repriced:
                self.ui.say(f"the next plan prices {', '.join(repriced)} by what their stages measured serving")
        if loop is not None and not self.stopping:
            self._hold(loop)
        if loop is not None:  # also when /v1 already turns requests away: its thread must end
            await asyncio.to_thread(loop.stop, reason)
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        if self.rendezvous_session is not None:
            await self.rendezvous_session.deployer.drop_own_stage()  # its memory may be needed to serve alone

    async def _serve_alone(self, why: str) -> None:
        """Every block on this machine, if it can hold them: where a session falls back to."""
        device = await asyncio.to_thread(this_device, memory=self.config.memory)
        admit_alone(self.manifest, device, self.config.session)
        engine = await asyncio.to_thread(open_engine, self.config.path, [self.manifest.n_blocks], self.config.settings)
        self._activate(engine)
        backend = await asyncio.to_thread(backend_or_none)
        alone = SessionStatus(
            division=[self.manifest.n_blocks], members=[MemberStatus(name="this machine", backend=backend)]
        )
        self.availability.session_described_by(lambda: alone)
        self.ui.say(f"{why}: serving on this machine alone")

    # --- one machine ---
    async def start_local(self) -> bool:
        """Load this machine's own stages and serve; False if the session cannot go on."""
        counts = self.config.counts
        where = "in this process" if len(counts) == 1 else f"as {len(counts)} local stages {counts}"
        self.availability.waiting_for = [f"{self.config.path.name} to load {where}"]
        backend = await asyncio.to_thread(backend_or_none)
        local = SessionStatus(
            division=counts, members=[MemberStatus(name="this machine", stages=counts, backend=backend)]
        )
        self.availability.session_described_by(lambda: local)
        cutting = f"cutting {self.config.path.name} into {len(counts)} stage files"
        with self.ui.progress_bars() as progress:
            engine = await asyncio.to_thread(
                open_engine, self.config.path, counts, self.config.settings, None, functools.partial(progress, cutting)
            )
        self._activate(engine)
        self._announce_ready(where)
        await self._drive([ServedAlone()])
        return self.going_on

    # --- several machines ---
    async def start_network(self) -> bool:
        """Open the session, gather its members, plan and serve; False if the session cannot go on
        (the host has said why)."""
        config = self.config
        if config.rendezvous is None:
            self.rendezvous = await start_embedded_rendezvous(config)
        self._rendezvous_at = rendezvous_address(config, self.rendezvous)
        self._advertised = f"{self._rendezvous_at[0]}:{self._rendezvous_at[1]}"
        # Begun now, it runs while the members join: the first hash of a large model takes a minute.
        self._hashing = hashing = asyncio.ensure_future(hash_with_progress(config.path, self.ui))
        hashing.add_done_callback(lambda done: done.cancelled() or done.exception())  # gather says why
        self.availability.waiting_for = ["this machine to be measured"]
        self._device = await asyncio.to_thread(this_device, memory=config.memory)
        await self._drive(await self._open_and_gather())
        return self.going_on

    async def _open_and_gather(self) -> list[Event]:
        """Open a session at the rendezvous, say its code, and wait until every seat is taken by a
        verified, linked member (or a joiner fails the code)."""
        config, others = self.config, self.config.members - 1
        assert self._hashing is not None and self._device is not None
        presence = await present(config.name, self._rendezvous_at, self._device)
        self.rendezvous_session = network = await HostSession.open(
            presence, config.members, self.manifest, config.path, config.session, config.settings,
            cache_dir() / "stages", self.ui.say, self._hashing, config.open_token,
        )  # fmt: skip
        join = f"kafila join {network.code} --rendezvous {self._advertised}"
        if config.demo:  # the members are this host's own processes; the line is for a look only
            where = f"the demo starts {others} local member{'s' if others > 1 else ''} with"
        else:
            where = f"on each of the other {others} machines" if others > 1 else "on the other machine"
        discoverable = not config.demo and self.rendezvous is not None and self.rendezvous.discovery is not None
        self.ui.announce_code(network.code, f"{where}: {join}", discoverable)
        self.availability.keep_secret(network.code, split_code(network.code)[1])
        self.availability.join_line = join
        self.availability.waiting_for = [
            f"{others} member{'s' if others > 1 else ''} to join with the code on the host's console"
        ]
        self.availability.session_described_by(functools.partial(self._network_status, network))
        if config.demo and not self.demo.members:
            self.demo.start(network.code, self._advertised, others)
        network.renewing = lambda: self.core.wants_rendezvous_session
        network.rendezvous_lost = functools.partial(self._rendezvous_lost, network)
        self._drive_now([Opened(join)])
        try:
            await network.gather(
                None, self._refused_while_forming, seconds_from_env("KAFILA_TRUST_EXCHANGE_S", TRUST_EXCHANGE_S)
            )
        except TrustError as error:
            return [CodeRefused(str(error))]
        for member in network.alive():
            self.availability.events.publish("joined", f"{network.member_name(member)} joined")
        return [Gathered(tuple(network.alive()))]

    def _refused_while_forming(self, member: str, error: TrustError) -> None:
        """A joiner was sent away while the session formed (`verify_members`); the core counts a
        failed proof of the code against the guess budget, and when that is spent, forming ends."""
        assert self.rendezvous_session is not None
        name = self.rendezvous_session.joiner_name(member)
        self._drive_now([JoinerRefused(name, str(error) or type(error).__name__, error.guess)])
        if not self.going_on:
            raise GuessBudgetSpent("the session admits no one: too many joiners failed to prove its code")

    def _network_status(self, network: HostSession) -> SessionStatus:
        core = self.core
        return network.status(admitting=core.admitting, failed_proofs=core.failed_proofs, guess_budget=GUESS_BUDGET)

    async def _deployed(self, members: list[str]) -> Event:
        """Deploy over `members`, answering how it went."""
        try:
            machines = await self._deploy(members)
            return Deployed(machines)
        except SessionFailed as failure:
            smallest = smallest_stage_bytes(self.manifest, self.config.session)
            if failure.member is not None and failure.member in members:
                assert self.rendezvous_session is not None
                name = self.rendezvous_session.member_name(failure.member)
                return MemberFailed(failure.member, str(failure), failure.shortage, smallest, name)
            if failure.member is None and failure.shortage is not None:  # this host's own share
                return OwnShortOfMemory(str(failure), failure.shortage, smallest)
            return no_ring(failure)
        except Exception as error:
            return no_ring(error)

    async def _deploy(self, members: list[str]) -> int:
        """Plan, deliver, load and serve; the machines in the ring."""
        network = self.rendezvous_session
        assert network is not None
        self.availability.waiting_for = ["the members to load their stages"]
        started = time.perf_counter()
        plan = network.plan(members)  # refusals surface here, before anything is sent
        self.ui.show_plan(plan_report(plan, time.perf_counter() - started))
        self.ui.say(network.pricing_note(members))
        self.availability.session_described_by(functools.partial(self._network_status, network))  # after serving alone

        def pending(waits: list[str]) -> None:
            self.availability.waiting_for = waits or ["the head to load"]

        with self.ui.progress_bars() as progress:
            deployment = await network.deploy(members, progress, pending)
        loop = asyncio.get_running_loop()
        engine = await asyncio.to_thread(network.deployer.engine, deployment, loop)
        self._activate(engine)
        head = "" if deployment.head_here else f", the head on {network.member_name(deployment.chain[-1])}"
        self._announce_ready(f"as {len(deployment.chain)} stages {deployment.counts} across the ring{head}")
        return len(deployment.members) + 1  # the host too

    # --- both ---
    def _announce_ready(self, where: str) -> None:
        """Says the session serves; the first time, where: the API's URL is given once, when it answers."""
        session, model = self.config.session, self.config.path.stem
        details = (
            f"{where}, context {session.context} × {session.concurrency} requests, "
            f"chat template: {self.availability.chat_template_source}"
        )
        self.availability.events.publish("ready", f"ready: {model}, {details}")
        self.ui.say(f"ready: {model}{'' if self._url_given else f' on {self.config.api_url}'}, {details}")
        self._url_given = True

    def incident(self, what: str, detail: str) -> None:
        """Something went wrong: the person at the host is told, and /status keeps it."""
        self.ui.warn(what, detail)
        self.availability.record_incident(what, detail)

    def _rendezvous_lost(self, network: HostSession, why: str) -> None:
        if not self.stopping and network is self.rendezvous_session:
            self.incident(
                "the rendezvous session ended",
                f"{why}: the ring serves on over its own links, but no member can join or rejoin it; "
                "start the host again for a new code",
            )

    def _demo_member_failed(self, what: str, detail: str) -> None:
        if not self.stopping:  # members leave when the session ends: that is not a failure
            self.incident(what, detail)

    def fail(self, message: str) -> None:
        """The session cannot serve: /v1 says why from now on, and so does the host's terminal,
        and requests a broken ring left end with it."""
        self.availability.become_unready([], failure=message)
        self.ui.error(message)
        self.availability.events.publish("failed", message)
        self._fail_held(message)

    async def stop(self, reason: str) -> None:
        self.stopping = True
        if self._hashing is not None:
            self._hashing.cancel()
        await self._retire(reason)
        self._fail_held(reason)
        if self.rendezvous_session is not None:
            await self.rendezvous_session.end(reason)
        await self.demo.stop()
        if self.rendezvous is not None:
            await self.rendezvous.close()


def session_view(network: HostSession | None, loop: EngineLoop | None, ready: bool) -> SessionView:
    """What the session core is shown several times a second: the session as it is now."""
    idle = loop is None or (loop.running == 0 and loop.queued == 0)
    seen = SessionView(
        now=time.monotonic(),
        deployed=frozenset(),
        alive=frozenset(),
        engine=loop is not None,
        engine_error=loop.error if loop is not None else None,
        idle=idle,
        ready=ready,
        measurements=[(entry.range, entry.steps_alone) for entry in loop.stage_report] if loop and idle else None,
    )
    if network is None:
        return seen
    deployment, arrivals = network.deployment, network.arrivals()
    return replace(
        seen,
        deployed=frozenset(deployment.members if deployment else ()),
        alive=frozenset(network.alive()),
        arrivals=tuple(arrivals),
        newcomers=tuple(network.waiting_newcomers()),
        broken=network.broken,
        names={m: network.member_name(m) for m in network.known}
        | {m: network.client.members[m].name for m in arrivals},
    )


def no_ring(error: Exception) -> DeployFailed:
    """How a deployment, or serving alone, failed: `refused` where the plan found the model does not fit."""
    return DeployFailed(str(error), refused=isinstance(error, PlanRefused))


def rendezvous_address(config: HostConfig, embedded: RendezvousHandle | None) -> tuple[str, int]:
    """Where this host and its members reach the rendezvous. The host reaches its own at the
    address it gives members, so that every member's candidates are on the same network and
    punches between them line up."""
    if config.rendezvous is not None:
        return config.rendezvous
    assert embedded is not None, "with no --rendezvous, the host runs one"
    host, port = embedded.http_address
    return (lan_address() if host in ("0.0.0.0", "::") else host), port


async def hash_with_progress(path: Path, ui: HostUi) -> str:
    """The model's sha256, for members with their own copy of it (the first hash of a large model
    takes a minute; it is cached after)."""
    with ui.progress_bars() as progress:
        return await hash_model(path, functools.partial(progress, f"hashing {path.name} (once)"))


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


def supervised(coroutine: Coroutine[Any, Any, None], host: HostRunner) -> asyncio.Task[None]:
    """A watcher task whose own failure is reported, not lost: the host would stop recovering."""
    task = asyncio.create_task(coroutine)

    def reported(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            host.fail(f"the host stopped watching its session: {done.exception()!r}")

    task.add_done_callback(reported)
    return task


def lan_address() -> str:
    """This machine's address on its default route, for the join line a person copies."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
