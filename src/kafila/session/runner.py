"""The host's lifecycle: load the model or gather members, serve, replan when a stage fails, a
newcomer is admitted or the stages' measured times call for another division, stop.

Presentation is the caller's: every message, the plan table and the transfer progress go
through a `HostUi`, so the CLI renders them with rich and tests or other front ends need not.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kafila.contracts import MemberStatus, SessionStatus
from kafila.network.discovery import DEFAULT_DISCOVERY_PORT
from kafila.network.pake import TrustError
from kafila.network.rendezvous_server import RendezvousHandle, start_rendezvous
from kafila.planner import PlanRefused
from kafila.planner.report import PlanReport, plan_report
from kafila.planner.types import SessionSpec
from kafila.runtime.engine_loop import EngineLoop
from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.local_plan import admit_alone, cache_dir, hash_model, this_device
from kafila.runtime.manifest import read_manifest
from kafila.runtime.pipeline import open_engine
from kafila.session.core import (
    Action,
    Admit,
    HoldRequests,
    JudgeRebalance,
    ReplanAfterBreak,
    ReplanWithNewcomers,
    ServingCore,
    SessionView,
    StopHolding,
)
from kafila.session.host import HostSession, SessionFailed
from kafila.session.local_members import LocalMember
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
    from kafila.api.server import Serving
    from kafila.runtime.engine_loop import EngineLoop
    from kafila.runtime.llama_backend import ContextSettings
    from kafila.runtime.pipeline import Engine
    from kafila.session.host import HostSession


class HostUi(Protocol):
    """What a person at the host sees."""

    def say(self, text: str) -> None: ...
    def warn(self, what: str, detail: str) -> None: ...
    def error(self, message: str) -> None: ...
    def announce_code(self, code: str, join_line: str, discoverable: bool = False) -> None:
        """`discoverable`: members on this network can join with the code alone (LAN discovery)."""

    def show_plan(self, report: PlanReport) -> None: ...
    def progress_bars(self) -> AbstractContextManager[Callable[[str, int, int], None]]:
        """A bar per thing named in the updates (what, bytes done, bytes in all), gone at the end."""
        ...


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
    memory: int | None = None  # bytes this machine lends (`--memory`); None: what is free
    discovery_port: int | None = DEFAULT_DISCOVERY_PORT  # LAN discovery by the embedded rendezvous; None: off
    rebalance: bool = True  # divide the blocks again when the stages' measured times clearly call for it

    @property
    def settings(self) -> ContextSettings:
        n = self.session.concurrency
        return ContextSettings(n_ctx=self.session.context * n, n_batch=512, n_seq_max=n, n_threads=self.threads)


class HostRunner:
    """The host's lifecycle around the HTTP server: load or gather, serve, replan on failure, stop."""

    def __init__(self, config: HostConfig, serving: Serving, ui: HostUi) -> None:
        self.config, self.serving, self.ui = config, serving, ui
        self.manifest = read_manifest(config.path)
        self.engine: Engine | None = None
        self.engine_loop: EngineLoop | None = None  # the one serving, even while /v1 turns requests away
        self.join_line = ""  # what a member runs to join, once the session is open
        self.core = ServingCore(  # the serving host's decisions (`session.core`)
            newcomer_patience_s=newcomer_patience_s(),
            rebalance_cooldown_s=seconds_from_env("KAFILA_REBALANCE_COOLDOWN_S", REBALANCE_COOLDOWN_S),
            rebalance=config.rebalance,
        )
        self.network: HostSession | None = None
        self.rendezvous: RendezvousHandle | None = None  # the embedded one, when the host runs it
        self.joiners: list[LocalMember] = []
        self.stopping = False
        self._hashing: asyncio.Future[str] | None = None  # the model's sha256, for members with a copy

    # --- engines ---
    def _activate(self, engine: Engine) -> None:
        self.engine = engine
        loop = EngineLoop(
            engine, self.config.session.concurrency, self.config.settings.n_batch, self.config.session.context
        )
        loop.start()
        self.engine_loop = loop
        self.serving.become_ready(engine, loop, self.manifest.architecture)

    def interrupt(self, reason: str) -> None:
        """End the requests in flight now, without blocking the event loop (a signal handler calls it)."""
        if self.network is not None:
            self.network.abandon_ring()  # a step waiting on the ring ends at once
        if self.serving.paused:  # requests waiting for a planned replan: there will be none
            self.serving.become_unready([], failure=reason)
        loop = self.engine_loop
        if loop is not None:
            threading.Thread(target=loop.stop, args=(reason,), daemon=True).start()

    async def _retire(self, reason: str) -> None:
        """Stop the engine loop and close the engine. The ring is abandoned first: its engine thread
        may be waiting on the event loop, and a stale wait would steal the next ring's frames."""
        if self.network is not None:
            self.network.abandon_ring()
        loop, self.engine_loop = self.engine_loop, None
        if loop is not None and self.network is not None and not self.stopping:
            repriced = self.network.learn_from_serving(loop.stage_report)  # for the replan that follows
            if repriced:
                self.ui.say(f"the next plan prices {', '.join(repriced)} by what their stages measured serving")
        if loop is not None:  # also when /v1 already turns requests away: its thread must end
            await asyncio.to_thread(loop.stop, reason)
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        if self.network is not None:
            await self.network.drop_own_stage()  # its memory may be needed to serve alone

    async def _serve_alone(self, why: str) -> None:
        """Every block on this machine, if it can hold them: where a session falls back to."""
        device = await asyncio.to_thread(this_device, memory=self.config.memory)
        admit_alone(self.manifest, device, self.config.session)
        engine = await asyncio.to_thread(open_engine, self.config.path, [self.manifest.n_blocks], self.config.settings)
        self._activate(engine)
        alone = SessionStatus(division=[self.manifest.n_blocks], members=[MemberStatus(name="this machine")])
        self.serving.session_status = lambda: alone
        self.ui.say(f"{why}: serving on this machine alone")

    # --- one machine ---
    async def start_local(self) -> None:
        counts = self.config.counts
        where = "in this process" if len(counts) == 1 else f"as {len(counts)} local stages {counts}"
        self.serving.waiting_for = [f"{self.config.path.name} to load {where}"]
        local = SessionStatus(division=counts, members=[MemberStatus(name="this machine", stages=counts)])
        self.serving.session_status = lambda: local
        cutting = f"cutting {self.config.path.name} into {len(counts)} stage files"
        with self.ui.progress_bars() as progress:
            engine = await asyncio.to_thread(
                open_engine, self.config.path, counts, self.config.settings, None, functools.partial(progress, cutting)
            )
        self._activate(engine)
        self._announce_ready(where)

    async def watch_local(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.2)
            if self.stopping:  # members leave when the session ends: that is not a failure
                return
            loop = self.engine_loop
            if loop is None or loop.error is None:
                continue
            error = loop.error
            self.incident("a stage failed", error)
            self.serving.become_unready(["the host to replan without the failed stage"])
            await self._retire(error)
            try:
                await self._serve_alone("replanned")
            except Exception as failure:
                self.fail(f"{error}; the host cannot serve alone: {failure}")
                return

    # --- several machines ---
    async def start_network(self) -> None:
        config = self.config
        if config.rendezvous is None:
            try:
                bind, ports = config.rendezvous_bind, (config.rendezvous_port, config.stun_port)
                self.rendezvous = await start_rendezvous(bind, *ports, discovery_port=config.discovery_port)
            except OSError as error:
                raise OSError(
                    f"the embedded rendezvous cannot listen on {config.rendezvous_bind} (port "
                    f"{config.rendezvous_port}, STUN port {config.stun_port}): {error.strerror or error}. Is another "
                    "kafila host running here? `--rendezvous-port 0 --stun-port 0` take free ports (the join line "
                    "says which)"
                ) from None
            bound = self.rendezvous.http_address
            # The host reaches its own rendezvous at the address it gives members, so that every
            # member's candidates are on the same network and punches between them line up.
            reachable = lan_address() if bound[0] in ("0.0.0.0", "::") else bound[0]
            address = (reachable, bound[1])
            advertised = f"{reachable}:{bound[1]}"
        else:
            address = config.rendezvous
            advertised = f"{address[0]}:{address[1]}"
        # Begun now, it runs while the members join: the first hash of a large model takes a minute.
        self._hashing = hashing = asyncio.ensure_future(self._hash_model())
        hashing.add_done_callback(lambda done: done.cancelled() or done.exception())  # gather says why
        self.serving.waiting_for = ["this machine to be measured"]
        device = await asyncio.to_thread(this_device, memory=config.memory)
        others = config.members - 1
        while True:
            presence = await present(config.name, address, device)
            self.network = await HostSession.open(
                presence, config.members, self.manifest, config.path, config.session, config.settings,
                cache_dir() / "stages", self.ui.say, hashing,
            )  # fmt: skip
            network = self.network
            join = f"kafila join {network.code} --rendezvous {advertised}"
            self.join_line = join
            if config.demo:  # the members are this host's own processes; the line is for a look only
                where = f"the demo starts {others} local member{'s' if others > 1 else ''} with"
            else:
                where = f"on each of the other {others} machines" if others > 1 else "on the other machine"
            discoverable = not config.demo and self.rendezvous is not None and self.rendezvous.discovery is not None
            self.ui.announce_code(network.code, f"{where}: {join}", discoverable)
            self.serving.waiting_for = [f"{others} member{'s' if others > 1 else ''} to join with: {join}"]
            self.serving.session_status = network.status
            if config.demo and not self.joiners:
                rendezvous_at = f"{address[0]}:{address[1]}"
                self.joiners = [self._start_joiner(network.code, rendezvous_at, i + 1) for i in range(others)]
            try:
                await network.gather(ready_timeout=None)
                break
            except TrustError as error:
                # Each failed exchange may be a guess at the secret: this code is spent. A new
                # one bounds anyone guessing to one try per code; members who had joined rejoin.
                self.ui.warn("refused a member", str(error))
                self.ui.say("that code is void now; a new one follows")
                await network.end(f"the session was closed: {error}")
        if not await self._deploy_leaving_out_failures(network.alive()):
            await self._serve_alone("every member failed its part")

    async def _hash_model(self) -> str:
        path = self.config.path
        with self.ui.progress_bars() as progress:
            return await hash_model(path, functools.partial(progress, f"hashing {path.name} (once)"))

    async def _deploy_leaving_out_failures(self, members: list[str]) -> bool:
        """Deploy over `members`; a member that fails its part is sent home and the rest are
        planned again. False when nobody is left (the caller decides what then)."""
        network = self.network
        assert network is not None
        while members:
            try:
                await self._deploy(members)
                return True
            except SessionFailed as failure:
                if failure.member is None or failure.member not in members:
                    raise
                self.ui.warn("leaving a member out", str(failure))
                await network.dismiss(failure.member, f"the host left this member out: {failure}")
                members = [m for m in network.alive() if m != failure.member]
        return False

    async def _deploy(self, members: list[str]) -> None:
        network = self.network
        assert network is not None
        self.serving.waiting_for = ["the members to load their stages"]
        started = time.perf_counter()
        plan = network.plan(members)  # refusals surface here, before anything is sent
        self.ui.show_plan(plan_report(plan, time.perf_counter() - started))
        self.ui.say(network.pricing_note(members))
        self.serving.session_status = network.status  # after serving alone, the ring's again

        def pending(waits: list[str]) -> None:
            self.serving.waiting_for = waits or ["the head to load"]

        with self.ui.progress_bars() as progress:
            deployment = await network.deploy(members, progress, pending)
        loop = asyncio.get_running_loop()
        engine = await asyncio.to_thread(network.engine, deployment, loop)
        self._activate(engine)
        head = "" if deployment.head_here else f", the head on {network.member_name(deployment.chain[-1])}"
        self._announce_ready(f"as {len(deployment.chain)} stages {deployment.counts} across the ring{head}")

    async def watch_network(self) -> None:
        """Replan when the ring breaks (with the members left), and when newcomers have been admitted
        (at a quiet moment, so no request in flight is lost); admit members that take a left seat."""
        network = self.network
        assert network is not None
        while not self.stopping:
            await asyncio.sleep(0.2)
            if self.stopping:  # members leave when the session ends: that is not a failure
                return
            action = self.core.next_action(self._view(network))
            while isinstance(action, Admit):
                name = network.client.members[action.member].name
                self.ui.say(f"{name} joined; checking its code")
                network.admit(action.member, functools.partial(self._admitted, name))
                action = self.core.next_action(self._view(network))
            if not await self._carry_out(action):
                return

    def _view(self, network: HostSession) -> SessionView:
        deployment, loop = network.deployment, self.engine_loop
        return SessionView(
            now=time.monotonic(),
            deployed=frozenset(deployment.members if deployment else ()),
            alive=frozenset(network.alive()),
            engine=loop is not None,
            arrivals=tuple(network.arrivals()),
            newcomers=tuple(network.waiting_newcomers()),
            broken=network.broken,
            engine_error=loop.error if loop is not None else None,
            idle=loop is None or (loop.running == 0 and loop.queued == 0),
            ready=self.serving.ready,
        )

    async def _carry_out(self, action: Action) -> bool:
        """Do what the core decided; False when the host cannot go on."""
        match action:
            case ReplanAfterBreak(lost=lost):
                return await self._replan_after_break(list(lost))
            case ReplanWithNewcomers(newcomers=newcomers):
                return await self._replan_with_newcomers(newcomers)
            case HoldRequests(newcomers=newcomers):
                self._hold_requests_for(newcomers)
            case StopHolding():
                self._stop_holding_requests()
            case JudgeRebalance():
                loop = self.engine_loop
                if loop is not None:
                    return await self._rebalance_if_worth_it(loop)
        return True

    def _admitted(self, name: str, error: BaseException | None) -> None:
        network = self.network
        assert network is not None
        if error is None:
            self.ui.say(f"{name} verified and linked; it joins the ring once no request is running")
        else:
            self.ui.warn(f"did not admit {name}", str(error) or type(error).__name__)
            if not network.admitting:
                self.ui.say("this session admits no more members (a failed code may be a guess at its secret)")

    async def _replan_after_break(self, lost: list[str]) -> bool:
        """The ring broke: replan with the members left, or serve alone. False when the host cannot go on."""
        network = self.network
        assert network is not None
        loop = self.engine_loop
        if network.deployment is None:  # serving alone, and that engine failed
            self.fail(f"serving alone failed: {loop.error if loop else 'no engine'}")
            return False
        names = ", ".join(network.member_name(m) for m in lost)
        error = (loop.error if loop and loop.error else None) or network.broken or f"lost {names}"
        self.incident("the ring broke", error)
        self.serving.become_unready(["the host to replan with the members that are left"])
        await self._retire(error)
        going_on = await self._redeploy(error)
        if going_on and network.admitting and self.join_line:
            self.ui.say(f"a seat is free again; to fill it: {self.join_line}")
        return going_on

    def _hold_requests_for(self, newcomers: Sequence[str]) -> None:
        """Under steady load a moment without requests may never come: after NEWCOMER_PATIENCE_S,
        new requests wait (up to `Serving.pause_wait_s`) while those running and queued finish, so
        the newcomers get their replan and nothing in flight is lost."""
        network = self.network
        assert network is not None
        names = ", ".join(network.member_name(m) for m in newcomers)
        self.ui.say(f"the requests running finish first; new ones wait for the replan taking in {names}")
        waits = [f"the requests running to finish, then the host to replan taking in {names}"]
        self.serving.become_unready(waits, paused=True)

    def _stop_holding_requests(self) -> None:
        """The newcomers went before their replan: serve on with the ring as it is."""
        if not self.serving.ready and self.engine is not None and self.engine_loop is not None:
            self.serving.become_ready(self.engine, self.engine_loop, self.manifest.architecture)
            self.ui.say("the newcomers left before the replan; serving on with the ring as it is")

    async def _replan_with_newcomers(self, newcomers: Sequence[str]) -> bool:
        """Newcomers were admitted and no request is in flight: plan again with them in."""
        network = self.network
        assert network is not None
        names = ", ".join(network.member_name(m) for m in newcomers)
        return await self._replan_by_choice(f"taking in {names}")

    async def _replan_by_choice(self, why: str) -> bool:
        """Replan a ring that is not broken (no request in flight): requests that come meanwhile
        wait for the new ring rather than be turned away."""
        self.serving.become_unready([f"the host to replan, {why}"], paused=True)
        await self._retire(f"the host is replanning, {why}")
        return await self._redeploy(why, f", {why}")

    async def _rebalance_if_worth_it(self, loop: EngineLoop) -> bool:
        """No request is in flight: if the ring, priced by what its stages measured, would be clearly
        faster divided again (`HostSession.rebalance_verdict`), replan over the same machines.
        Nothing in flight is lost; a request that comes meanwhile waits for the new ring."""
        network = self.network
        assert network is not None
        if not self.core.worth_judging([(entry.range, entry.steps_alone) for entry in loop.stage_report]):
            return True
        verdict = network.rebalance_verdict(loop.stage_report)
        if verdict is None or not verdict.worth_it:
            return True
        self.core.rebalanced(time.monotonic())
        why = "rebalancing by what the stages measured serving"
        self.ui.say(f"{why}: {verdict.reason}")
        return await self._replan_by_choice(why)

    async def _redeploy(self, error: str, why: str = "") -> bool:
        """Deploy over every member still linked; serve alone when none is left. When neither can
        serve, say why and wait for members to join again (the session lives on for them)."""
        network = self.network
        assert network is not None
        alive = network.alive()
        try:
            if alive and await self._deploy_leaving_out_failures(alive):
                machines = len(network.deployment.members) + 1 if network.deployment else 1  # the host too
                self.ui.say(f"replanned with {machines} members{why}")
            else:
                network.deployment = None
                await self._serve_alone(f"replanned{why}: no member is left")
            return True
        except PlanRefused as refused:
            message = f"{error}; the members that are left cannot hold the model: {refused}"
        except Exception as failure:
            message = f"{error}; replanning failed: {failure}"
        network.deployment, network.broken = None, None  # nothing serves: no ring left to watch
        self.fail(message)
        if not network.admitting:
            return False
        self.ui.say(f"waiting for members to join again: {self.join_line}")
        return True

    # --- both ---
    def _announce_ready(self, where: str) -> None:
        assert self.serving.template is not None
        session = self.config.session
        self.ui.say(
            f"ready: {self.config.path.stem}, {where}, context {session.context} × {session.concurrency} requests, "
            f"chat template: {self.serving.template.source}"
        )

    def incident(self, what: str, detail: str) -> None:
        """Something went wrong: the person at the host is told, and /status keeps it."""
        self.ui.warn(what, detail)
        self.serving.record_incident(what, detail)

    def _start_joiner(self, code: str, rendezvous: str, number: int) -> LocalMember:
        """A local `kafila join` for the demo, as a person would run it on another machine; if it ends
        badly while the session runs, the host says how (a native crash names its signal)."""
        loop = asyncio.get_running_loop()

        def ended(member: LocalMember) -> None:
            with contextlib.suppress(RuntimeError):  # the host's loop has closed: it is exiting anyway
                loop.call_soon_threadsafe(self._joiner_ended, member)

        name = f"demo-member-{number}"
        command = [sys.executable, "-m", "kafila", "join", code, "--rendezvous", rendezvous, "--name", name]
        return LocalMember(name, command, ended)

    def _joiner_ended(self, member: LocalMember) -> None:
        failure = member.failure()
        if failure is not None and not self.stopping:
            self.incident(f"{member.name} {'died' if member.process.returncode < 0 else 'exited'}", failure)

    def fail(self, message: str) -> None:
        """The session cannot serve: /v1 says why from now on, and so does the host's terminal."""
        self.serving.become_unready([], failure=message)
        self.ui.error(message)

    async def stop(self, reason: str) -> None:
        self.stopping = True
        if self._hashing is not None:
            self._hashing.cancel()
        await self._retire(reason)
        if self.network is not None:
            await self.network.end(reason)
        for joiner in self.joiners:
            await asyncio.to_thread(joiner.stop)
        if self.rendezvous is not None:
            await self.rendezvous.close()


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
