"""The host's shell around its session core: one queue of what happens, and the core's decisions
carried out, around the HTTP server.

Sources push typed events into the queue: the rendezvous client (a member joined or left), the
links (one closed), the deployer's listeners (a stage stopped), admissions (one ended) and the
engine loop (it broke). `watch` waits on the queue with the core's `next_deadline()`
as its timeout, as aioquic's shell re-arms one timer from `get_timer()`; it hands the core what
came, then a `Look` at what is a state rather than a happening, and carries out the commands.
Decisions are the core's; the runner drives, carries out and tells.

Presentation is the caller's: every message, the plan table and the transfer progress go
through a `HostUi`, so the CLI renders them with rich and tests or other front ends need not.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kafila.contracts import FleetDevice, LoadStatus, SessionStatus
from kafila.network.pake import TrustError
from kafila.network.session_codes import split_code
from kafila.planner import PlanRefused
from kafila.runtime.machine.this_machine import cache_dir, cached_model_pricings, this_device
from kafila.session.admissions import TRUST_EXCHANGE_S
from kafila.session.availability import Availability
from kafila.session.core import ANSWERED, GUESS_BUDGET, SessionCore
from kafila.session.event_shell import EventShell
from kafila.session.fetch_ahead import AheadFetch, provisional_stage
from kafila.session.host import HostSession
from kafila.session.host_config import (
    HostConfig,
    HostUi,
    hash_with_progress,
    price_model_here_first,
    rendezvous_address,
    seconds_from_env,
)
from kafila.session.host_engines import HostEngines, no_ring
from kafila.session.host_model import HubOnlyModel
from kafila.session.host_status import session_status
from kafila.session.lifecycle import (
    AbandonRing,
    Admit,
    CodeRefused,
    Command,
    Deploy,
    Dismiss,
    Dismissed,
    Event,
    Fail,
    FailHeld,
    ForgetRing,
    Gathered,
    Interrupted,
    JoinerRefused,
    Judged,
    LoadJudged,
    Look,
    LowerMemory,
    LowerOwnMemory,
    NewcomerChecked,
    Opened,
    Phase,
    PriceLoad,
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
    StartFailed,
    Stopped,
    Unready,
    Warn,
)
from kafila.session.local_members import DemoMembers
from kafila.session.presence import present

if TYPE_CHECKING:
    from kafila.network.rendezvous_server import RendezvousHandle

FOLLOWED = (*ANSWERED, SendAway)  # commands that take time: carried out in order, in the background


class GuessBudgetSpent(TrustError):
    """Raised into the trust exchange to end a session's forming: too many joiners failed the code."""


class HostRunner:
    """The shell around `SessionCore`: it feeds the core what happens, and does what the core
    decides (load or gather, serve, replan, stop), around the HTTP server."""

    def __init__(self, config: HostConfig, availability: Availability, ui: HostUi) -> None:
        self.config, self.availability, self.ui = config, availability, ui
        policy = config.policy
        self.core = SessionCore(policy) if config.members > 1 else SessionCore.one_machine(policy)
        self.rendezvous_session: HostSession | None = None
        self.rendezvous: RendezvousHandle | None = None  # the embedded one, when the host runs it
        # The code is out and the fetch ahead begun: the host waits on its members, who start now.
        self.gathering = asyncio.Event()
        self.demo = DemoMembers(self._demo_member_failed)
        self.shell = EventShell(self.core, self._look, self._tell, self._carry_out, FOLLOWED, self.incident)
        self.engines = HostEngines(config, availability, ui, self.shell.wake_from_thread)
        self.manifest = self.engines.manifest
        self._hashing: asyncio.Future[str | None] | None = None  # the model's sha256, for members with a copy
        self._rendezvous_at: tuple[str, int] = ("", 0)  # where this host and its members reach the rendezvous
        self._advertised = ""  # the same, as the join line gives it
        self._device: FleetDevice | None = None  # this machine, as measured for the planner
        self._ahead_shown = contextlib.ExitStack()  # the bars of the fetch ahead of the plan, while members come
        self._ahead_begun = False

    @property
    def going_on(self) -> bool:
        """Whether the session may still serve (it has not failed for good, nor been stopped)."""
        return self.core.phase not in (Phase.FAILED, Phase.STOPPING)

    async def watch(self) -> None:
        """Until the session can serve no more, hand the core what happens (`EventShell.watch`)."""
        await self.shell.watch(lambda: self.going_on)

    def _look(self) -> Look:
        look, network = self.engines.look(time.monotonic()), self.rendezvous_session
        if network is None:
            return look
        arrivals = network.admissions.arrivals()
        return replace(
            look,
            alive=frozenset(network.alive()),
            listed=frozenset(network.client.members),
            arrivals=tuple(arrivals),
            names={m: network.member_name(m) for m in network.known}
            | {m: network.client.members[m].name for m in arrivals},
        )

    # --- carrying out ---
    async def _carry_out(self, command: Command) -> list[Event]:
        """Do what the core decided; the events it answers with, if any."""
        network = self.rendezvous_session
        match command:
            case Retire(reason=reason, learn=learn):
                await self._retire(reason, learn)
                return [Retired(tuple(network.alive()) if network else (), self.engines.held_since)]
            case Deploy(members=members, load=load):
                assert network is not None
                describe = functools.partial(self._network_status, network)
                return [await self.engines.deploy_ring(network, list(members), describe, load)]
            case Dismiss(member=member, reason=reason):
                assert network is not None
                self.availability.events.publish("left", f"{network.member_name(member)} was sent home", reason)
                await network.dismiss(member, reason)
                return [Dismissed(member, tuple(network.alive()))]
            case ServeAlone(why=why):
                try:
                    await self.engines.serve_alone(why)
                    return [ServedAlone()]
                except Exception as error:
                    return [no_ring(error)]
            case PriceRebalance():
                loop = self.engines.loop
                tokens = loop.stats.generated_tokens if loop else None
                verdict = network.rebalance_verdict(loop.stage_report, tokens) if loop and network else None
                worth_it = verdict is not None and verdict.worth_it
                return [Judged(time.monotonic(), worth_it, verdict.reason if verdict else "")]
            case PriceLoad(users=users):
                loop = self.engines.loop
                weighed = await network.load_verdict(loop.stage_report, users) if loop and network else None
                reason = weighed.reason if weighed else f"at {users} requests at once no plan could be weighed"
                return [LoadJudged(time.monotonic(), users, weighed is not None and weighed.worth_it, reason)]
            case RenewCode(reason=reason):
                assert network is not None
                await network.end(reason)
                return await self._open_and_gather()
            case SendAway(members=members):
                assert network is not None
                for member in members:
                    self.availability.events.publish("left", f"{network.member_name(member)} left the ring")
                await network.send_away(members)
            case _:
                self._tell(command)
        return []

    def _tell(self, command: Command) -> None:
        """Carry out a command that needs no waiting."""
        network = self.rendezvous_session
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
            case Resume():
                self.engines.resume()
            case Fail(message=message):
                self.fail(message)
            case FailHeld(message=message):
                self.engines.fail_held(message)
            case LowerMemory(member=member, memory_bytes=memory) if network is not None:
                network.lower_memory(member, memory)
            case LowerOwnMemory(memory_bytes=memory) if network is not None:
                network.lower_memory(network.me, memory)
            case Admit(member=member) if network is not None:
                name = network.joiner_name(member)
                self.ui.say(f"{name} joined; checking its code")
                self.availability.events.publish("joined", f"{name} joined; checking its code")
                network.admissions.admit(member, functools.partial(self._admitted, name, member))
            case Refuse(member=member, reason=reason) if network is not None:
                name = network.joiner_name(member)
                network.admissions.refuse(member, reason, functools.partial(self._admitted, name, member))
            case ForgetRing():
                if network is not None:  # nothing serves: no ring left to watch
                    network.forget_ring()
            case AbandonRing(reason=reason):
                if network is not None:
                    network.deployer.abandon_ring()  # a step waiting on the ring ends at once
                self.engines.abandon(reason)
            case _:
                raise AssertionError(f"{command} cannot be carried out here")

    def _admitted(self, name: str, member: str, error: BaseException | None) -> None:
        """An admission ended (`Admissions.admit`); a failed proof of the code may be a guess."""
        guess = isinstance(error, TrustError) and error.guess  # an exchange begun and not proved, however it ended
        detail = None if error is None else str(error) or type(error).__name__
        self.shell.push(NewcomerChecked(name, detail, guess, member))

    def interrupt(self, reason: str) -> None:
        """Ctrl-C or SIGTERM: end the requests in flight now, without blocking the event loop (a
        signal handler calls it)."""
        self.shell.hand_now([Interrupted(reason)])

    async def _retire(self, reason: str, learn: bool = False) -> None:
        """Stop the engine loop and close the engine. The ring is abandoned first: its engine thread
        may be waiting on the event loop, and a stale wait would steal the next ring's frames."""
        network, stopping = self.rendezvous_session, self.core.phase == Phase.STOPPING
        if network is not None:
            network.deployer.abandon_ring()
        loop = await self.engines.retire(reason, keep_held=not stopping)
        if loop is not None and network is not None and learn and not stopping:
            repriced = network.learn_from_serving(loop.stage_report)  # for the replan that follows
            if repriced:
                self.ui.say(f"the next plan prices {', '.join(repriced)} by what their stages measured serving")
        if network is not None:
            await network.deployer.drop_own_stage()  # its memory may be needed to serve alone

    # --- starting ---
    async def start(self) -> bool:
        """Load this machine's stages, or open the session, gather its members, plan and serve;
        False if the session cannot go on (the host has said why)."""
        self.shell.loop = asyncio.get_running_loop()
        try:
            if self.config.members == 1:
                await self.engines.load_local()
                await self.shell.drive([ServedAlone()])
            else:
                await self._start_network()
        except Exception as error:
            self.shell.hand_now([StartFailed(str(error), refused=isinstance(error, PlanRefused))])
        return self.going_on

    async def _start_network(self) -> None:
        config = self.config
        if config.rendezvous is None:
            assert config.embedded_rendezvous is not None, "a host without --rendezvous runs one"
            self.rendezvous = await config.embedded_rendezvous(config)
        self._rendezvous_at = rendezvous_address(config, self.rendezvous)
        self._advertised = f"{self._rendezvous_at[0]}:{self._rendezvous_at[1]}"
        # Begun now, it runs while the members join: the first hash of a large model takes a minute.
        self._hashing = hashing = asyncio.ensure_future(hash_with_progress(config.model, self.ui))
        hashing.add_done_callback(lambda done: done.cancelled() or done.exception())  # gather says why
        self.availability.waiting_for = ["this machine to be measured"]
        self._device = (await asyncio.to_thread(this_device, memory=config.memory)).besides(config.draft_bytes)
        await self._price_model()
        await self.shell.drive(await self._open_and_gather())

    async def _price_model(self) -> None:
        """This machine's pricing of the model before the first plan (`price_model_here_first`),
        taken before the code is said, so that no member starting up loads the cores it times."""
        assert self._hashing is not None and self._device is not None
        self.availability.waiting_for = ["this machine to price the model's stages"]
        try:
            sha256 = await asyncio.shield(self._hashing)
        except Exception:  # gather says why the hash failed
            return
        await price_model_here_first(self.config, self._device, sha256, self.ui)

    async def _begin_fetch_ahead(self) -> None:
        """Where this host serves a model known by its header: the stage a plan with members like
        this machine would give it, fetched from the hub while the members come
        (`session.fetch_ahead`), its progress shown until they have all joined."""
        model, device, config = self.config.model, self._device, self.config
        if not isinstance(model, HubOnlyModel) or device is None or self._hashing is None:
            return
        try:
            sha256 = await asyncio.shield(self._hashing)
        except Exception:  # gather says why the hash failed
            sha256 = None
        pricings = tuple(await asyncio.to_thread(cached_model_pricings))
        plan = functools.partial(provisional_stage, self.manifest, device, config.members, config.session)
        stage = await asyncio.to_thread(plan, pricings, sha256)
        if stage is None:
            return
        ahead = model.ahead = AheadFetch(model.header, stage, self.manifest, cache_dir() / "stages")
        ahead.progress.to(self._ahead_shown.enter_context(self.ui.progress_bars()))
        self.ui.say(
            f"fetching {stage.words()} from the hub while the members come: this machine's share were they "
            "machines like it (the plan keeps what it shares of it)"
        )

    async def _open_and_gather(self) -> list[Event]:
        """Open a session at the rendezvous, say its code, and wait until every seat is taken by a
        verified, linked member (or a joiner fails the code)."""
        config, others = self.config, self.config.members - 1
        assert self._hashing is not None and self._device is not None
        begun, config.nat_tests = config.nat_tests, None  # a code renewed later tests the NAT again
        presence = await present(config.name, self._rendezvous_at, self._device, begun=begun)
        self.rendezvous_session = network = await HostSession.open(
            presence, config.members, self.manifest, config.model, config.session, config.settings,
            cache_dir() / "stages", self.ui.say, self._hashing, config.open_token,
        )  # fmt: skip
        network.client.roster_changed = self.shell.wake
        network.roster.link_down = lambda _member: self.shell.wake()
        network.deployer.stage_broken = self.shell.push
        network.every_member_serves = config.every_member_serves
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
            self.demo.start(network.code, self._advertised, others, config.member_shares)
        if not self._ahead_begun:  # once, after the code: nothing of it delays the join line
            self._ahead_begun = True
            try:
                await self._begin_fetch_ahead()
            except Exception as error:  # the stage is fetched after the plan, as without it
                self.ui.warn("this machine's stage could not be fetched ahead of the plan", str(error))
        network.renewing = lambda: self.core.wants_rendezvous_session
        network.rendezvous_lost = functools.partial(self._rendezvous_lost, network)
        self.shell.hand_now([Opened(join)])
        self.gathering.set()
        try:
            await network.gather(
                None, self._refused_while_forming, seconds_from_env("KAFILA_TRUST_EXCHANGE_S", TRUST_EXCHANGE_S)
            )
        except TrustError as error:
            return [CodeRefused(str(error))]
        finally:
            self._ahead_shown.close()  # the plan's deployment shows the rest of the fetch ahead
        for member in network.alive():
            self.availability.events.publish("joined", f"{network.member_name(member)} joined")
        return [Gathered(tuple(network.alive()))]

    def _refused_while_forming(self, member: str, error: TrustError) -> None:
        """A joiner was sent away while the session formed (`verify_members`); the core counts a
        failed proof of the code against the guess budget, and when that is spent, forming ends."""
        assert self.rendezvous_session is not None
        name = self.rendezvous_session.joiner_name(member)
        self.shell.hand_now([JoinerRefused(name, str(error) or type(error).__name__, error.guess)])
        if not self.going_on:
            raise GuessBudgetSpent("the session admits no one: too many joiners failed to prove its code")

    def _network_status(self, network: HostSession) -> SessionStatus:
        core, watch = self.core, self.core.load
        load = None
        if core.policy.follow_load:
            measured = None if watch.measured is None else round(watch.measured, 2)
            load = LoadStatus(planned=watch.planned, measured=measured, reason=watch.reason or None)
        admitting, failed = core.guesses.admitting, core.guesses.failed_proofs
        return session_status(network, admitting, failed, GUESS_BUDGET, core.newcomers, load)

    # --- telling and ending ---
    def incident(self, what: str, detail: str) -> None:
        """Something went wrong: the person at the host is told, and /status keeps it."""
        self.ui.warn(what, detail)
        self.availability.record_incident(what, detail)

    def _rendezvous_lost(self, network: HostSession, why: str) -> None:
        if self.core.phase != Phase.STOPPING and network is self.rendezvous_session:
            self.incident(
                "the rendezvous session ended",
                f"{why}: the ring serves on over its own links, but no member can join or rejoin it; "
                "start the host again for a new code",
            )

    def _demo_member_failed(self, what: str, detail: str) -> None:
        if self.core.phase != Phase.STOPPING:  # members leave when the session ends: that is not a failure
            self.incident(what, detail)

    def fail(self, message: str) -> None:
        """The session cannot serve: /v1 says why from now on, and so does the host's terminal,
        and requests a broken ring left end with it."""
        self.availability.become_unready([], failure=message)
        self.ui.error(message)
        self.availability.events.publish("failed", message)
        self.engines.fail_held(message)

    async def stop(self, reason: str) -> None:
        self.shell.hand_now([Stopped(reason)])
        await self.shell.stop()  # a deployment under way, say, ends: so does the session
        self._ahead_shown.close()
        if isinstance(self.config.model, HubOnlyModel) and self.config.model.ahead is not None:
            self.config.model.ahead.halt()  # its journal is kept for the next start
        if self._hashing is not None:
            self._hashing.cancel()
        await self._retire(reason)
        self.engines.fail_held(reason)
        if self.rendezvous_session is not None:
            await self.rendezvous_session.end(reason)
        await self.demo.stop()
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
