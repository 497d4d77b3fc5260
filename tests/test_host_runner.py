"""The host's shell around its session core, in process: events pushed into its queue reach the
core and the core's decisions are carried out, with fake collaborators for the engine and the
rendezvous session (as aioquic's test_asyncio drives its shell), and a real `HostRunner` built
from a tiny model file. The core's own decisions: tests/test_session_core.py; the whole host
over real processes and sockets: tests/test_session_network.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_models import write_tiny_model
from waiting import until_async

from kafila.planner.types import ServingSpec
from kafila.session.availability import Availability
from kafila.session.core import Phase, SessionCore
from kafila.session.host_config import HostConfig
from kafila.session.host_model import LocalModel
from kafila.session.lifecycle import Deployed, Gathered, Look, NewcomerChecked, Opened, StageBroken
from kafila.session.runner import HostRunner


def config_of(model: Path, members: int, rebalance: bool = True, resume_within_s: float = 60.0) -> HostConfig:
    config = HostConfig(
        model=LocalModel(model), counts=[2], session=ServingSpec(context=256, concurrency=1), sock=socket.socket(),
        api_key=None, threads=1, members=members, rendezvous=None, rendezvous_bind="127.0.0.1",
        rendezvous_port=0, stun_port=0, demo=False, name="host", rebalance=rebalance,
        resume_within_s=resume_within_s,
    )  # fmt: skip
    config.sock.close()
    return config


def test_the_host_hands_its_core_the_rebalance_setting_and_one_machine_never_rebalances(tmp_path: Path) -> None:
    """`kafila host --no-rebalance` reaches the rule that judges rebalances; a host of one machine
    has nothing to divide again. (What the rule then does: tests/test_session_core.py.)"""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)

    def core_of(members: int, rebalance: bool) -> SessionCore:
        return HostRunner(config_of(model, members, rebalance), Availability(), ui=None).core  # type: ignore[arg-type]

    assert core_of(3, rebalance=True).policy.rebalance and core_of(3, rebalance=True).networked
    assert not core_of(3, rebalance=False).policy.rebalance
    alone = core_of(1, rebalance=True)
    assert not alone.policy.rebalance and not alone.networked and alone.phase == Phase.DEPLOYING


# --- fakes for what the shell drives ----------------------------------------------------------


class Ui:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        self.lines.append(text)

    def warn(self, what: str, detail: str) -> None:
        self.lines.append(f"{what}: {detail}")

    def error(self, message: str) -> None:
        self.lines.append(message)

    @contextlib.contextmanager
    def progress_bars(self) -> Iterator[Any]:
        yield lambda *_update: None


@dataclass
class Engines:
    """The engine side: idle or busy as the test says, and what the shell asked of it. Each
    deployment waits until the test lets it finish."""

    idle: bool = True
    held_since: float | None = None
    loop: None = None
    calls: list[str] = field(default_factory=list)
    deployments: list[tuple[str, ...]] = field(default_factory=list)
    finish: asyncio.Event = field(default_factory=asyncio.Event)

    async def deploy_ring(
        self, _network: object, members: list[str], _describe: object, _load: int | None = None
    ) -> Deployed:
        self.deployments.append(tuple(members))
        await self.finish.wait()
        return Deployed(tuple(members), epoch=len(self.deployments) + 1)

    def look(self, now: float) -> Look:
        return Look(now=now, idle=self.idle)

    async def retire(self, reason: str, keep_held: bool) -> None:
        self.calls.append(f"retire: {reason}")
        if keep_held:  # the broken ring left a request
            self.held_since = time.monotonic()

    def fail_held(self, message: str) -> None:
        self.calls.append(f"fail held: {message}")
        self.held_since = None

    def resume(self) -> None:
        self.calls.append("resume")

    def abandon(self, reason: str) -> None:
        self.calls.append(f"abandon: {reason}")


class Admissions:
    def arrivals(self) -> list[str]:
        return []


class Deployer:
    def abandon_ring(self) -> None:
        pass

    async def drop_own_stage(self) -> None:
        pass


@dataclass
class Client:
    members: dict[str, Any]


@dataclass
class Session:
    """The rendezvous session: who is linked and listed, and what the shell asked of it."""

    linked: set[str]
    deployer: Deployer = field(default_factory=Deployer)
    admissions: Admissions = field(default_factory=Admissions)
    sent_away: list[str] = field(default_factory=list)
    ended: str = ""

    @property
    def client(self) -> Client:
        return Client({m: None for m in self.linked})

    @property
    def known(self) -> dict[str, Any]:
        return {m: None for m in self.linked}

    def alive(self) -> list[str]:
        return sorted(self.linked)

    def member_name(self, member: str) -> str:
        return member

    def learn_from_serving(self, _report: object) -> list[str]:
        return []

    async def send_away(self, members: tuple[str, ...]) -> None:
        self.sent_away += members

    async def end(self, reason: str) -> None:
        self.ended = reason


def serving(
    tmp_path: Path, ring: tuple[str, ...], linked: set[str], **config: Any
) -> tuple[HostRunner, Engines, Session]:
    """A real runner whose core serves a ring of `ring`, over fake collaborators."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)
    runner = HostRunner(config_of(model, len(ring) + 1, **config), Availability(), Ui())  # type: ignore[arg-type]
    engines, session = Engines(), Session(linked)
    runner.engines, runner.rendezvous_session = engines, session  # type: ignore[assignment]
    runner.core.handle(Opened("kafila join …"))
    runner.core.handle(Gathered(ring))
    runner.core.handle(Deployed(ring, epoch=1))
    return runner, engines, session


def watched(runner: HostRunner) -> asyncio.Task[None]:
    runner.shell.loop = asyncio.get_running_loop()
    return asyncio.create_task(runner.watch())


async def ended(runner: HostRunner, watcher: asyncio.Task[None]) -> None:
    await runner.stop("the test is over")
    await asyncio.wait_for(watcher, 5)
    assert runner.rendezvous_session.ended == "the test is over"  # type: ignore[union-attr]


def test_an_admitted_newcomer_is_taken_in_as_soon_as_its_admission_is_pushed(tmp_path: Path) -> None:
    async def scenario() -> None:
        runner, engines, _session = serving(tmp_path, ("laptop",), {"laptop", "phone"})
        watcher = watched(runner)
        runner.shell.push(NewcomerChecked("phone", member="phone"))  # as the admission's callback does
        await until_async(lambda: engines.deployments, "a deployment taking the newcomer in", 5)
        assert engines.deployments == [("laptop", "phone")]
        assert engines.calls == ["retire: the host is replanning, taking in phone"]
        assert runner.core.phase == Phase.DEPLOYING and not runner.availability.ready
        engines.finish.set()
        await until_async(lambda: runner.core.phase == Phase.SERVING, "the new ring serving", 5)
        assert runner.core.ring == {"laptop", "phone"} and not runner.core.newcomers
        await ended(runner, watcher)

    asyncio.run(scenario())


def test_a_link_down_wakes_the_watcher_which_frees_the_seat_and_replans_without_the_member(tmp_path: Path) -> None:
    async def scenario() -> None:
        runner, engines, session = serving(tmp_path, ("laptop", "workstation"), {"laptop", "workstation"})
        runner.core.last_look = time.monotonic() + 3600  # no look falls due by itself: only the wake-up
        watcher = watched(runner)
        session.linked.discard("workstation")
        runner.shell.wake()  # as the link's closed callback does
        await until_async(lambda: engines.deployments, "a deployment without the member lost", 5)
        assert session.sent_away == ["workstation"] and engines.deployments == [("laptop",)]
        assert runner.availability.incidents[-1].what == "the ring broke"
        engines.finish.set()
        await until_async(lambda: runner.core.phase == Phase.SERVING, "the new ring serving", 5)
        await ended(runner, watcher)

    asyncio.run(scenario())


def test_a_stage_report_of_the_serving_ring_breaks_it_and_a_stale_one_does_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        runner, engines, _session = serving(tmp_path, ("laptop",), {"laptop"})
        watcher = watched(runner)
        runner.shell.push(StageBroken("laptop: lost its successor", epoch=0))  # an earlier ring's
        await until_async(lambda: runner.core.last_look > 0, "a look after the report", 5)
        assert runner.core.phase == Phase.SERVING and not engines.deployments
        runner.shell.push(StageBroken("laptop: lost its successor", epoch=1))
        await until_async(lambda: engines.deployments, "a replan after the report", 5)
        assert engines.calls == ["retire: laptop: lost its successor"]
        engines.finish.set()
        await ended(runner, watcher)

    asyncio.run(scenario())


def test_requests_a_broken_ring_left_end_while_a_slow_replan_is_still_under_way(tmp_path: Path) -> None:
    """`--resume-within`: the watcher goes on during a deployment, so the deadline of the requests
    a broken ring left is kept however long the deployment takes."""

    async def scenario() -> None:
        runner, engines, session = serving(tmp_path, ("laptop",), {"laptop"}, resume_within_s=0.3)
        watcher = watched(runner)
        session.linked.clear()
        session.linked.add("laptop")
        runner.shell.push(StageBroken("laptop: its stage stopped", epoch=1))
        await until_async(lambda: engines.deployments, "the replan", 5)
        await until_async(
            lambda: any(call.startswith("fail held") for call in engines.calls), "the held requests' end", 5
        )
        assert engines.calls[-1] == "fail held: the ring broke, and no new ring served within 0.3 s"
        assert runner.core.phase == Phase.DEPLOYING  # the deployment goes on
        await ended(runner, watcher)  # and stopping ends it
        assert runner.core.phase == Phase.STOPPING and runner.shell.following is None

    asyncio.run(scenario())
