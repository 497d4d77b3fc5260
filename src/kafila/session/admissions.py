"""Who gets into a host's session: the members it forms with (`gather`) and newcomers to a freed
seat (`admit`). Each proves the code (SPAKE2, `verify_members` / `verify_newcomer`), is linked
over a QUIC link pinned to what it proved, punched where possible and relayed where not, and
says what it holds (`Hello`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from kafila.contracts import Tell
from kafila.network.edges import connect_edges
from kafila.network.link import DatagramDemux
from kafila.network.pake import TrustError
from kafila.network.rendezvous_client import (
    RendezvousClient,
    RendezvousError,
    send_abort,
    verify_members,
    verify_newcomer,
)
from kafila.runtime.llama.loading import set_up_to_share_cores, sharing_cores_hint
from kafila.session.deployer import Roster, SessionFailed, all_or_none
from kafila.session.presence import Presence
from kafila.session.router import LinkRouter
from kafila.wire.control import Hello

HELLO_TIMEOUT_S = 60.0
TRUST_EXCHANGE_S = 30.0  # for a joiner to prove the code, and to accept the member list


@dataclass
class Admissions:
    """The session's doors: `client` introduces joiners, `roster` keeps those let in."""

    client: RendezvousClient
    code: str  # the full session code, with its secret
    presence: Presence
    roster: Roster
    say: Tell
    admitted: Callable[[str], None] = lambda _member: None  # told when a newcomer took a seat
    demux: DatagramDemux | None = None  # the links' socket, once the members are verified
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # member id → its admission

    async def gather(
        self,
        ready_timeout: float | None,
        refused: Callable[[str, TrustError], None],
        exchange_timeout: float = TRUST_EXCHANGE_S,
    ) -> None:
        """Trust, links, hellos: after this every member is verified, linked and has said what it
        holds. A joiner that fails the trust exchange is sent away and reported to `refused`
        (`verify_members`)."""
        proved = await verify_members(
            self.client, self.code, self.presence.identity.fingerprint,
            exchange_timeout=exchange_timeout, ready_timeout=ready_timeout, refused=refused,
        )  # fmt: skip
        # Pin what each proved, whatever the rendezvous has said of them since.
        self.roster.known.update(
            {
                m: info.model_copy(update={"fingerprint": proved[m]})
                for m, info in self.client.members.items()
                if m in proved
            }
        )
        self.say(f"all {len(self.roster.known)} members verified; connecting")
        self.demux = await DatagramDemux.over(self.presence.sock)
        edges = await connect_edges(
            self.client, self.demux, self.presence.identity, self.client.code, self.roster.others()
        )
        for member_id, edge in edges.items():
            self.roster.linked(member_id, LinkRouter(edge.link, member_id), edge.path)
        members = list(self.roster.routers)
        hellos = await all_or_none([self._hello(m) for m in members])
        self.roster.hellos.update(zip(members, hellos, strict=True))
        self._note_members_on_this_machine(self.roster.hellos)

    def _note_members_on_this_machine(self, hellos: Mapping[str, Hello]) -> None:
        """Stages on one machine take turns on its cores. The demo sets its processes up for that
        (1.4× the tokens/s of two processes left to libgomp's defaults, measured with gemma), but
        a process can only be set up before llama.cpp loads, so a host and members started by
        hand on one machine are told how."""
        here = [self.roster.name(m) for m, hello in hellos.items() if hello.machine == self.roster.machine]
        if here and not set_up_to_share_cores():
            self.say(
                f"{', '.join(here)} {'runs' if len(here) == 1 else 'run'} on this machine too, sharing its cores "
                f"with this host's stage; for their best speed together, {sharing_cores_hint()}"
            )

    async def _hello(self, member_id: str) -> Hello:
        try:
            message = await self.roster.routers[member_id].next_control(HELLO_TIMEOUT_S)
        except TimeoutError:
            raise SessionFailed(f"{self.roster.name(member_id)} did not report in {HELLO_TIMEOUT_S:.0f} s") from None
        if not isinstance(message, Hello):
            raise SessionFailed(f"{self.roster.name(member_id)} sent {message.type} before hello")
        return message

    def arrivals(self) -> list[str]:
        """Members the rendezvous introduced after the session formed, not yet being admitted."""
        return [
            m
            for m in self.client.members
            if m != self.roster.me and m not in self.roster.known and m not in self._tasks
        ]

    def admit(self, member_id: str, done: Callable[[BaseException | None], None]) -> None:
        """Verify, link and hear from a newcomer in the background; `done(error)` says how it went
        (None: admitted, and it waits for a plan that takes it in)."""
        self._in_background(member_id, self._admit(member_id), done)

    def refuse(self, member_id: str, reason: str, done: Callable[[BaseException | None], None]) -> None:
        """Turn a joiner away without checking its code; `done` hears the refusal."""
        self._in_background(member_id, self._refuse(member_id, reason), done)

    def _in_background(
        self, member_id: str, admission: Coroutine[Any, Any, None], done: Callable[[BaseException | None], None]
    ) -> None:
        task = asyncio.create_task(admission)
        self._tasks[member_id] = task
        task.add_done_callback(lambda t: None if t.cancelled() else done(t.exception()))

    async def _refuse(self, member_id: str, reason: str) -> None:
        refusal = TrustError(reason)
        await send_abort(self.client, [member_id], refusal)
        with contextlib.suppress(RendezvousError):
            await self.client.remove(member_id)
        raise refusal

    async def _admit(self, member_id: str) -> None:
        trusted = {m: info.fingerprint for m, info in self.roster.known.items()}
        try:
            proved = await verify_newcomer(
                self.client, self.code, self.presence.identity.fingerprint, member_id, trusted
            )
        except TrustError:  # it was told why; its seat is free again for whoever proves the code
            with contextlib.suppress(RendezvousError):
                await self.client.remove(member_id)
            raise
        info = self.client.members.get(member_id)
        if info is None:
            raise RendezvousError("member_left", f"{member_id} left after proving the code")
        # What it proved, not what the rendezvous says now: this is what its link and its ring
        # neighbours pin.
        info = info.model_copy(update={"fingerprint": proved})
        self.roster.known[member_id] = info
        assert self.demux is not None  # newcomers come after the session formed
        edges = await connect_edges(self.client, self.demux, self.presence.identity, self.client.code, [info])
        self.roster.linked(member_id, LinkRouter(edges[member_id].link, member_id), edges[member_id].path)
        self.roster.hellos[member_id] = await self._hello(member_id)
        self._note_members_on_this_machine({member_id: self.roster.hellos[member_id]})
        self.admitted(member_id)

    def cancel(self) -> None:
        """The session ends: no admission goes on."""
        for task in self._tasks.values():
            task.cancel()
