"""The host's engine and its loop, one ring after another: deploy a ring and serve on it, retire
it, keep what a broken ring left for the next, and load this machine's own stages or every block
alone."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kafila.contracts import MemberStatus, SessionStatus
from kafila.planner import PlanRefused
from kafila.planner.plan import smallest_stage_bytes
from kafila.planner.report import plan_report
from kafila.planner.who_serves import Role
from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.backends import backend_or_none
from kafila.runtime.machine.this_machine import admit_alone, this_device
from kafila.serving.batcher import Suspended
from kafila.serving.engine_loop import EngineLoop, Sink, fail_suspended
from kafila.session.availability import Availability
from kafila.session.deployer import SessionFailed
from kafila.session.host import HostSession
from kafila.session.host_config import HostConfig, HostUi
from kafila.session.lifecycle import (
    Deployed,
    DeployFailed,
    Event,
    Look,
    Measurements,
    MemberFailed,
    OwnShortOfMemory,
)


class HostEngines:
    """The engine that serves, its loop (kept even while /v1 turns requests away), and the
    requests a broken ring left, which go on on the next ring unless their client left."""

    def __init__(self, config: HostConfig, availability: Availability, ui: HostUi, broke: Callable[[], None]):
        self.config, self.availability, self.ui = config, availability, ui
        self.manifest = config.model.manifest
        self.broke = broke  # told, from the engine thread, when the loop breaks
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.held: list[tuple[Suspended, Sink]] = []  # requests a broken ring left, for the next ring
        self.held_since: float | None = None
        self._url_given = False  # the first ready line gives the API's URL

    def look(self, now: float) -> Look:
        """What the session core is shown of the engine: idle or not, broken or not, and what an
        idle ring's stages measured."""
        loop = self.loop
        idle = loop is None or (loop.running == 0 and loop.queued == 0)
        measurements: Measurements | None = None
        if loop is not None and idle:
            measurements = tuple(((entry.range[0], entry.range[1]), entry.steps_alone) for entry in loop.stage_report)
        return Look(
            now=now,
            idle=idle,
            running=loop.running if loop is not None else 0,
            engine_error=loop.error if loop is not None else None,
            measurements=measurements,
        )

    def activate(self, engine: Engine) -> None:
        """Serve with `engine`: what the broken ring left goes on here, ahead of new requests."""
        self.engine = engine
        loop = EngineLoop(
            engine, self.config.session.concurrency, self.config.settings.n_batch, self.config.session.context,
            self.config.speculate, draft_model=self.config.draft_model,
        )  # fmt: skip
        loop.on_break = self.broke
        loop.start()
        held, self.held, self.held_since = self.availability.still_wanted(self.held), [], None
        if held:
            loop.resume(held)
            self.ui.say(f"{len(held)} request{'s' if len(held) != 1 else ''} the broken ring left go on on this one")
        self.loop = loop
        self.availability.become_ready(engine, loop, self.manifest.architecture)

    def resume(self) -> None:
        """/v1 serves again on the engine as it is."""
        if self.engine is not None and self.loop is not None:
            self.availability.become_ready(self.engine, self.loop, self.manifest.architecture)

    async def retire(self, reason: str, keep_held: bool) -> EngineLoop | None:
        """Stop the loop and close the engine; with `keep_held`, what its broken ring left waits
        for the next ring (`resume_within_s` at the most). Returns the loop, for what it measured."""
        loop, self.loop = self.loop, None
        if loop is not None and keep_held:
            await asyncio.to_thread(loop.halt)
            loop.suspend(reason)
            left = loop.take_suspended()
            if left and self.held_since is None:
                self.held_since = time.monotonic()
            self.held += left
        if loop is not None:  # also when /v1 already turns requests away: its thread must end
            await asyncio.to_thread(loop.stop, reason)
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        return loop

    def abandon(self, reason: str) -> None:
        """End the requests in flight without blocking the event loop (a signal handler's)."""
        loop = self.loop
        if loop is not None:
            threading.Thread(target=loop.stop, args=(reason,), daemon=True).start()

    def fail_held(self, message: str) -> None:
        held, self.held, self.held_since = self.held, [], None
        for suspended, sink in held:
            fail_suspended(suspended, sink, message)

    async def serve_alone(self, why: str) -> None:
        """Every block on this machine, if it can hold them: where a session falls back to."""
        device = (await asyncio.to_thread(this_device, memory=self.config.memory)).besides(self.config.draft_bytes)
        admit_alone(self.manifest, device, self.config.session)
        path = await self._whole_model()
        engine = await asyncio.to_thread(open_engine, path, [self.manifest.n_blocks], self.config.settings)
        self.activate(engine)
        backend = await asyncio.to_thread(backend_or_none)
        alone = SessionStatus(
            division=[self.manifest.n_blocks], members=[MemberStatus(name="this machine", backend=backend)]
        )
        self.availability.session_described_by(lambda: alone)
        self.ui.say(f"{why}: serving on this machine alone")

    async def load_local(self) -> None:
        """Load this machine's own stages, as the command line divided them, and serve."""
        counts = self.config.counts
        where = "in this process" if len(counts) == 1 else f"as {len(counts)} local stages {counts}"
        self.availability.waiting_for = [f"{self.config.model.name} to load {where}"]
        backend = await asyncio.to_thread(backend_or_none)
        local = SessionStatus(
            division=counts, members=[MemberStatus(name="this machine", stages=counts, backend=backend)]
        )
        self.availability.session_described_by(lambda: local)
        path = await self._whole_model()
        cutting = f"cutting {path.name} into {len(counts)} stage files"
        with self.ui.progress_bars() as progress:
            engine = await asyncio.to_thread(
                open_engine, path, counts, self.config.settings, None, functools.partial(progress, cutting)
            )
        self.activate(engine)
        self.announce_ready(where)

    async def _whole_model(self) -> Path:
        """The whole model file, to serve every block here: a model on the hub known by its header
        alone is downloaded now (said, with its progress)."""
        with self.ui.progress_bars() as progress:
            return await asyncio.to_thread(self.config.model.whole, progress, self.ui.say)

    async def deploy_ring(
        self, network: HostSession, members: list[str], describe: Callable[[], SessionStatus], load: int | None = None
    ) -> Event:
        """Plan, deliver, load and serve over `members` for `load` requests at once (None: the
        session's room), answering how it went; `describe` is what /status shows of the session
        from then on."""
        try:
            self.availability.waiting_for = ["the members to load their stages"]
            started = time.perf_counter()
            choice = network.choose(members, load)  # refusals surface here, before anything is sent
            self.ui.show_plan(plan_report(choice.plan, time.perf_counter() - started, choice))
            self.ui.say(network.pricing_note(members))
            for standing_by in (m for m in choice.members if m.role is Role.STANDS_BY):
                self.ui.say(standing_by.words)
            self.availability.session_described_by(describe)

            def pending(waits: list[str]) -> None:
                self.availability.waiting_for = waits or ["the head to load"]

            with self.ui.progress_bars() as progress:
                deployment = await network.deploy(choice, progress, pending)
            engine = await network.deployer.ring_engine(deployment)
            self.activate(engine)
        except SessionFailed as failure:
            smallest = smallest_stage_bytes(self.manifest, self.config.session)
            if failure.member is not None and failure.member in members:
                name = network.member_name(failure.member)
                return MemberFailed(failure.member, str(failure), failure.shortage, smallest, name)
            if failure.member is None and failure.shortage is not None:  # this host's own share
                return OwnShortOfMemory(str(failure), failure.shortage, smallest)
            return no_ring(failure)
        except Exception as error:
            return no_ring(error)
        head = "" if deployment.head_here else f", the head on {network.member_name(deployment.chain[-1])}"
        self.announce_ready(f"as {len(deployment.chain)} stages {deployment.counts} across the ring{head}")
        return Deployed(tuple(deployment.members), deployment.epoch, tuple(network.standing_by(choice)))

    def announce_ready(self, where: str) -> None:
        """Says the session serves; the first time, where: the API's URL is given once, when it answers."""
        session, model = self.config.session, self.config.model.name
        details = (
            f"{where}, context {session.context} × {session.concurrency} requests, "
            f"chat template: {self.availability.chat_template_source}"
        )
        self.availability.events.publish("ready", f"ready: {model}, {details}")
        self.ui.say(f"ready: {model}{'' if self._url_given else f' on {self.config.api_url}'}, {details}")
        self._url_given = True


def no_ring(error: Exception) -> DeployFailed:
    """How a deployment, or serving alone, failed: `refused` where the plan found the model does not fit."""
    return DeployFailed(str(error), refused=isinstance(error, PlanRefused))
