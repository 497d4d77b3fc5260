"""`kafila join`: one member's side of a session.

After the trust exchange and its link to the host is up, a member does only what the host's
control messages say. An `Assign` names its stage and ring neighbours: it links to those
neighbours (only the edges the plan uses ever come up) while it obtains the stage file (already
cached, sliced from its own copy of the model, or received over the link), then answers
`Staged`. On `Load` it loads the stage and runs it between its neighbours until the host
reassigns or ends the session. The stage runs in a worker thread, so the links' event loop keeps
answering keep-alives while llama.cpp computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafila.contracts import BackendReport, ModelPricing, Progress, Tell
from kafila.hub.fetch import ModelFetchError
from kafila.hub.ranges import fetch_stage, stage_key
from kafila.network.edges import connect_edges
from kafila.network.identity import Identity
from kafila.network.link import DatagramDemux, LinkError
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.transfer import receive_stage_file
from kafila.runtime.engine.stage import BlockStage, HeadStage
from kafila.runtime.engine.worker import RingStage, as_decoded, handle_frames
from kafila.runtime.gguf.slicer import StageFile, block_range_file, file_sha256
from kafila.runtime.gguf.stage_cache import find_hub_stage, make_room, mark_used, stage_files, trim_stage_cache
from kafila.runtime.llama.errors import out_of_memory
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.memory import short_of_memory
from kafila.session.router import FrameFeed, FrameSink, FrameSource, LinkRouter
from kafila.wire.control import (
    MAX_CACHED_STAGES,
    MAX_MODEL_PRICINGS,
    Assign,
    ControlError,
    EdgePath,
    End,
    Hello,
    Load,
    Loaded,
    RingEdge,
    Staged,
    StageFailedReport,
    StageSource,
    StageWanted,
    StandBy,
    parse_control,
)
from kafila.wire.frames import Frame, Kind


class SessionEnded(Exception):
    """The host ended the session (cleanly, with a reason) or vanished."""


class LostHost(SessionEnded):
    """The link to the host went down without its goodbye: the session may live on without this
    member (a network blip, a machine that slept), and a join with the same code may take it back."""


def cached_stage_hashes(cache: Path, limit: int = MAX_CACHED_STAGES) -> list[str]:
    """Stage files already here, by the hash they are named after (the slicer's naming), the most
    recently written first: where there are more than a hello can carry, those are likeliest to
    be asked for again."""
    recent_first = sorted(stage_files(cache), key=lambda f: f.used_at, reverse=True)
    return [Path(f.name).stem for f in recent_first[:limit]]


async def serve_stage(
    stage: RingStage, inbound: FrameSource, outbound: FrameSink, executor: ThreadPoolExecutor
) -> None:
    """Frames from the predecessor through the stage to the successor, batching what arrives together.

    A head answers each step with its logits, to the host.

    The stage's thread (the executor's) takes its frames from a `FrameFeed` that the link fills
    as they arrive, and hands each batch's answer to the loop, which sends it at once: one wake-up
    of each thread a batch, no task or executor call on the loop between them (docs/benchmarks.md,
    "The link's receive path and the hand-offs"). It ends with the link's error once its
    predecessor's link is down, or with the error of a send that failed.

    A frame the stage rejects (wrong hidden size, bad shape, no room in its cache) becomes an
    ERROR frame for that sequence sent on round the ring (`handle_frames`), so the host fails that
    request with the reason and this member carries on. Every frame gets exactly one answer,
    even when something unforeseen fails: the host counts them.
    """
    loop = asyncio.get_running_loop()
    feed = FrameFeed()
    failed: Exception | None = None
    sending = True  # until this coroutine ends: a batch that comes back after it is not sent

    def answer(taken: list[Frame], out: list[Frame]) -> None:  # on the loop, in the order of the batches
        nonlocal failed, sending
        for frame in taken:
            inbound.taken(frame)
        try:
            for frame in out if sending else ():
                outbound.send_now(frame)
        except Exception as error:  # the successor's link is down: the stage stops, as its await did
            failed, sending = error, False
            feed.stop()

    def hand_back(taken: list[Frame], out: list[Frame]) -> None:  # on the stage's thread
        loop.call_soon_threadsafe(answer, taken, out)

    task = asyncio.current_task()
    assert task is not None

    def abandoned() -> bool:  # on the stage's thread: cancelled, or the loop is gone, without a word to it
        return task.cancelling() > 0 or loop.is_closed()

    inbound.hand_to(feed.put)
    serving = loop.run_in_executor(executor, _serve_feed, stage, feed, hand_back, abandoned)
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        sending = False
        feed.stop()
        with contextlib.suppress(Exception):
            await serving  # the batch in hand ends first: the stage is the thread's until then
        raise
    finally:
        sending = False
        inbound.take_back(feed.put)
        for frame in feed.left():  # a stopped stage's: a new ring drains what the old one left
            inbound.taken(frame)
    if failed is not None:
        raise failed
    await inbound.receive()  # ended: raises why (the link's error), as a reader of the channel learns it


def _serve_feed(
    stage: RingStage, feed: FrameFeed, answer: Callable[[list[Frame], list[Frame]], Any], abandoned: Callable[[], bool]
) -> None:
    """The stage's thread: each batch the feed holds through the stage, its answer to the loop, a
    piece at a time (`as_decoded`: a greedy step's row goes on before the rows behind it run)."""
    while (burst := feed.take(abandoned)) is not None:
        for frames in as_decoded(burst):
            try:
                out = handle_frames(stage, frames)
            except Exception as error:  # a bug, not a bad frame (handle_frames answers those one by one)
                reason = f"{stage.name} failed: {error}"
                answered = [f for f in frames if f.kind is not Kind.SAMPLER]  # a sampler start has no answer
                out = [Frame(Kind.ERROR, f.sequence_id, payload=reason.encode()[:4000]) for f in answered]
            answer(frames, out)


@dataclass
class MemberState:
    cache: Path
    model: Path | None
    threads: int
    say: Tell
    stage: RingStage | None = None
    serving: asyncio.Task[None] | None = None
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="stage"))
    reports: list[asyncio.Future[None]] = field(default_factory=list)  # failures on their way to the host
    bars: Callable[[], AbstractContextManager[Progress]] | None = None  # transfer progress
    # One fetch from the hub at a time: a fetch left running by an assignment that failed (its
    # thread cannot be stopped) must finish before the next, which may fetch the same ranges
    # into the same journal, begins; that one then finds the stage kept.
    hub_fetch: threading.Lock = field(default_factory=threading.Lock)

    async def drop_stage(self) -> None:
        if self.serving is not None:
            self.serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.serving
            self.serving = None
        if self.stage is not None:
            stage, self.stage = self.stage, None
            await asyncio.get_running_loop().run_in_executor(self.executor, stage.close)


@contextlib.contextmanager
def _bar(state: MemberState, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """Progress of `what` (bytes done, bytes in all), on a bar where this member shows them."""
    if state.bars is None:
        yield None
        return
    with state.bars() as update:
        yield functools.partial(update, what)


@dataclass(frozen=True)
class Obtained:
    """A stage file here, verified, and where it came from (for the host's /status)."""

    path: Path
    source: StageSource
    seconds: float
    why: str | None = None  # why it did not come from the hub, where the host offered that


async def obtain_stage_file(assign: Assign, host: LinkRouter, state: MemberState) -> Obtained:
    """The assigned stage file in the cache, verified by its hash, by whichever way the host said."""
    started = time.perf_counter()
    path = state.cache / f"{assign.sha256 or 'unnamed'}.gguf"  # where the cache keeps it, or made below
    digest = None  # known without reading the file again where this member just wrote it
    source: StageSource = "host"
    why = None
    if assign.source == "cache":
        mark_used(path)
        source = "cache"
    else:
        await asyncio.to_thread(make_room, state.cache, assign.size)
    if assign.source == "hub":
        made, why, kept = await _from_hub(assign, state)
        if made is not None:
            path, digest, source = made.path, made.sha256, "cache" if kept else "hub"
        else:
            await host.send_control(StageWanted(epoch=assign.epoch, reason=why or "the hub failed"))
    if assign.source == "slice":
        if state.model is None:
            raise ValueError("the host asked for a local slice, but this member has no --model")

        what = f"slicing blocks {assign.first_block}-{assign.end_block - 1} from {state.model.name}"
        state.say(what)
        with _bar(state, what) as progress:
            made = await asyncio.to_thread(
                block_range_file, state.model, assign.first_block, assign.end_block, state.cache, assign.head, progress
            )
        path, digest, source = Path(made.path), made.sha256, "slice"
    elif assign.source == "transfer" or (assign.source == "hub" and source == "host"):
        why_here = f" (--model {state.model.name} is not the host's model file)" if state.model is not None else ""
        state.say(f"receiving stage {assign.stage_index} ({assign.size / 1e6:.1f} MB) from the host{why_here}")
        with _bar(state, f"stage {assign.stage_index} from the host") as progress:
            path = Path(await receive_stage_file(host.transfer, state.cache, progress, sequence_id=assign.transfer))
    if not path.is_file():
        raise ValueError(f"stage file {path.name} is not in the cache at {state.cache}")
    if digest is None:
        digest = await asyncio.to_thread(file_sha256, path)
    if assign.sha256 is not None and digest != assign.sha256:
        raise ValueError(f"stage file {path.name} has sha256 {digest[:12]}…, not the assigned {assign.sha256[:12]}…")
    await asyncio.to_thread(trim_stage_cache, state.cache, [path])
    return Obtained(path, source, time.perf_counter() - started, why)


async def _from_hub(assign: Assign, state: MemberState) -> tuple[StageFile | None, str | None, bool]:
    """The stage fetched by its ranges from the hub the host named, checked against the header the
    host planned from (and the stage's sha256, where the host holds the stage too); else None and
    why (the hub out of reach, refusing this machine, or sending other bytes than planned), said
    here too: the host then sends the stage. True where this cache kept it from before."""
    assert assign.hub is not None  # the Assign's own check
    blocks = f"blocks {assign.first_block}-{assign.end_block - 1}"
    key = stage_key(assign.hub, assign.first_block, assign.end_block, assign.head)
    kept = await asyncio.to_thread(find_hub_stage, state.cache, key)
    if kept is not None and assign.sha256 in (None, kept.sha256):
        state.say(f"{blocks} of {assign.hub.label} are in this machine's stage cache")
        first, end = assign.first_block, assign.end_block
        return StageFile(0, first, end, assign.head, kept.path, kept.sha256, kept.n_bytes), None, True
    state.say(f"fetching {blocks} from the hub ({assign.hub.label}, {assign.size / 1e6:.1f} MB)")
    bars: AbstractContextManager[Progress | None] = state.bars() if state.bars else contextlib.nullcontext()
    with bars as progress:  # its bar: fetching the ranges, straight into the stage file
        try:
            made = await asyncio.to_thread(_fetch_alone, state.hub_fetch, assign, state.cache, progress)
        except ModelFetchError as error:  # HubRefused, HubUnreachable, HubMismatch
            why = f"{type(error).__name__}: {error}"[:3000]
        else:
            if assign.sha256 in (None, made.sha256):
                return made, None, False
            why = f"HubMismatch: the hub's {blocks} are not the host's (sha256 {made.sha256[:12]}…)"
    state.say(f"could not fetch {blocks} from the hub ({why}); asking the host for them")
    return None, why, False


def _fetch_alone(lock: threading.Lock, assign: Assign, cache: Path, progress: Progress | None) -> StageFile:
    """`fetch_stage` for `assign`, once no other fetch of this member's runs (blocking)."""
    assert assign.hub is not None
    with lock:
        return fetch_stage(assign.hub, assign.first_block, assign.end_block, assign.head, cache, progress)


Connect = Callable[[dict[str, str]], Awaitable[dict[str, tuple[LinkRouter, EdgePath]]]]


def edge_connector(client: RendezvousClient, demux: DatagramDemux, identity: Identity) -> Connect:
    """How a member links to ring neighbours the host names, each pinned to the fingerprint the host
    vouched for: punched, else relayed (`connect_edges`)."""

    async def connect(vouched: dict[str, str]) -> dict[str, tuple[LinkRouter, EdgePath]]:
        unknown = [p for p in vouched if p not in client.members]
        if unknown:
            raise ValueError(f"the host named {', '.join(unknown)}, who is not in this session")
        for peer, fingerprint in vouched.items():
            if client.members[peer].fingerprint.lower() != fingerprint.lower():
                raise ValueError(
                    f"the rendezvous reports another certificate for {client.members[peer].name} ({peer}) than the "
                    "host verified: refused (the rendezvous may be tampering)"
                )
        peers = [client.members[p].model_copy(update={"fingerprint": vouched[p]}) for p in vouched]
        edges = await connect_edges(client, demux, identity, client.code, peers)
        return {m: (LinkRouter(edge.link, m), edge.path) for m, edge in edges.items()}

    return connect


@dataclass
class RingLinks:
    """This member's links: the host's, always, and those to its current ring neighbours.

    Links come up only for the edges the plan uses, when an assignment names them, and links
    the new plan no longer uses are closed: a member holds at most three links (the host and
    its two neighbours) however large the ring, where a mesh needs one to every other member,
    and relays carry only what the ring needs.
    """

    host: LinkRouter
    connect: Connect
    say: Tell
    name_of: Callable[[str], str] = lambda member_id: member_id[:6]
    routers: dict[str, LinkRouter] = field(default_factory=dict)
    paths: dict[str, EdgePath] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.routers.setdefault(self.host.peer_id, self.host)

    async def for_assignment(self, assign: Assign) -> list[RingEdge]:
        """Links to `assign`'s neighbours (new ones punched together with theirs), others closed."""
        wanted = {assign.predecessor, assign.successor} - {self.host.peer_id}
        for peer, router in list(self.routers.items()):
            if peer == self.host.peer_id:
                continue
            # A link the host says broke is rebuilt even if this end has not noticed yet: both
            # ends must punch again together.
            if peer not in wanted or peer in assign.relink or router.link.closed.done():
                del self.routers[peer]
                self.paths.pop(peer, None)
                with contextlib.suppress(Exception):
                    await router.close("the new plan drops or rebuilds this link")
        missing = sorted(wanted - set(self.routers))
        unvouched = [p for p in missing if p not in assign.fingerprints]
        if unvouched:
            raise ValueError(f"the host named ring neighbour {', '.join(unvouched)} without its verified fingerprint")
        if missing:
            for peer, (router, path) in (await self.connect({p: assign.fingerprints[p] for p in missing})).items():
                self.routers[peer], self.paths[peer] = router, path
                self.say(f"linked to ring neighbour {self.name_of(peer)} ({path})")
        for router in self.routers.values():
            router.activation.drain()  # frames of a broken ring must not reach the new one
        return [
            RingEdge(peer=peer, path=self.paths[peer], rtt_ms=self.routers[peer].link.core.rtt_ms)
            for peer in sorted(wanted)
        ]

    async def drop_ring_links(self, reason: str) -> None:
        """Close every link but the host's: this member stands by, out of the ring."""
        for peer, router in list(self.routers.items()):
            if peer != self.host.peer_id:
                del self.routers[peer]
                self.paths.pop(peer, None)
                with contextlib.suppress(Exception):
                    await router.close(reason)

    async def close(self, reason: str) -> None:
        for router in self.routers.values():
            with contextlib.suppress(Exception):
                await router.close(reason)


async def follow_host(
    links: RingLinks,
    state: MemberState,
    model_sha: str | None,
    machine: str | None = None,
    priced_models: Sequence[ModelPricing] = (),
    backend: BackendReport | None = None,
) -> str:
    """Carry out the host's control messages until it ends the session; returns its reason."""
    host = links.host
    hello = Hello(
        model_sha256=model_sha,
        cached_stages=cached_stage_hashes(state.cache),
        machine=machine,
        priced_models=list(priced_models)[:MAX_MODEL_PRICINGS],
        backend=backend,
    )
    await host.send_control(hello)
    staged: tuple[Assign, Path] | None = None
    try:
        while True:
            try:
                message = await host.next_control()
            except LinkError as error:
                raise LostHost(f"lost the host: {error}") from None
            if isinstance(message, End):
                return message.reason
            if isinstance(message, Assign):
                staged = None
                await state.drop_stage()
                try:
                    edges, obtained = await _prepare(message, links, state)
                except Exception as error:
                    state.say(f"cannot take stage {message.stage_index}: {error}")
                    await host.send_control(StageFailedReport(epoch=message.epoch, message=str(error)))
                    continue
                staged = (message, obtained.path)
                await host.send_control(
                    Staged(
                        epoch=message.epoch,
                        edges=edges,
                        source=obtained.source,
                        seconds=round(obtained.seconds, 3),
                        why=obtained.why,
                    )
                )
            elif isinstance(message, StandBy):
                staged = None
                await state.drop_stage()
                await links.drop_ring_links("the host's plan leaves this member out of the ring")
                state.say(f"standing by, out of the ring: {message.reason}")
            elif isinstance(message, Load) and staged is not None and staged[0].epoch == message.epoch:
                assign, path = staged
                staged = None
                await _load_and_serve(assign, path, links, state)
    except LinkError as error:  # a word to the host that could not go (a stage transfer it broke, say)
        ended = host_said_end(host)
        if ended is not None:
            return ended
        raise LostHost(f"lost the host: {error}") from None
    finally:
        await state.drop_stage()
        state.executor.shutdown(wait=False)


def host_said_end(host: LinkRouter) -> str | None:
    """The reason of the host's End that arrived before its goodbye and is still unread: a member
    busy taking a stage when the host shut down finds the link closed as it answers, and the host's
    word waits behind that. None where the host said no End (it was lost)."""
    while (frame := host.control.receive_nowait()) is not None:
        with contextlib.suppress(ControlError):
            message = parse_control(frame)
            if isinstance(message, End):
                return message.reason
    return None


async def _prepare(assign: Assign, links: RingLinks, state: MemberState) -> tuple[list[RingEdge], Obtained]:
    """Link to the neighbours and get the stage file at the same time; if one fails, both stop."""
    try:
        async with asyncio.TaskGroup() as group:
            edges = group.create_task(links.for_assignment(assign))
            path = group.create_task(obtain_stage_file(assign, links.host, state))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return edges.result(), path.result()


async def _load_and_serve(assign: Assign, path: Path, links: RingLinks, state: MemberState) -> None:
    """Load the staged file and serve it between the neighbours; a lost ring link is reported to the host."""
    host = links.host
    started = time.perf_counter()
    settings = ContextSettings(
        n_ctx=assign.n_ctx, n_batch=assign.n_batch, n_seq_max=assign.n_seq_max, n_threads=state.threads
    )
    loop = asyncio.get_running_loop()
    blocks = f"blocks {assign.first_block}-{assign.end_block - 1}"
    free = await loop.run_in_executor(state.executor, short_of_memory, assign.need_bytes)
    if free is not None and assign.need_bytes is not None:
        why = f"{free / 2**30:.2f} GiB free here; {blocks} need {assign.need_bytes / 2**30:.2f} GiB"
        state.say(f"cannot load stage {assign.stage_index}: {why}")
        await host.send_control(
            StageFailedReport(epoch=assign.epoch, message=why, out_of_memory=True, can_hold_bytes=free)
        )
        return
    try:
        stage: RingStage = await loop.run_in_executor(
            state.executor, HeadStage if assign.head else BlockStage, path, settings
        )
        state.stage = stage
    except Exception as error:
        state.say(f"cannot load stage {assign.stage_index}: {error}")
        await host.send_control(
            StageFailedReport(epoch=assign.epoch, message=str(error)[:4000], out_of_memory=out_of_memory(error))
        )
        return
    inbound = links.routers[assign.predecessor].activation
    outbound = links.routers[assign.successor].activation
    state.serving = asyncio.create_task(serve_stage(stage, inbound, outbound, state.executor))
    state.serving.add_done_callback(lambda task: _report_stopped(task, assign, links, state))
    seconds = time.perf_counter() - started
    role = " and the head" if assign.head else ""
    state.say(f"serving blocks {assign.first_block}-{assign.end_block - 1}{role} (ready in {seconds:.1f} s)")
    await host.send_control(Loaded(epoch=assign.epoch, stage_index=assign.stage_index, seconds=seconds))


def _report_stopped(task: asyncio.Task[None], assign: Assign, links: RingLinks, state: MemberState) -> None:
    """A stage that stopped by itself (a ring link went down) tells the host, which replans at once."""
    host = links.host
    if task.cancelled() or task.exception() is None or host.link.closed.done():
        return
    neighbours = (assign.predecessor, assign.successor)
    lost = next((p for p in neighbours if p in links.routers and links.routers[p].link.closed.done()), None)
    reason = f"stage {assign.stage_index} stopped: {task.exception()}"
    state.say(reason)
    report = StageFailedReport(epoch=assign.epoch, message=reason, lost_peer=lost)
    state.reports.append(asyncio.ensure_future(host.send_control(report)))
