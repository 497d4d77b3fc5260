"""The session's data plane over real QUIC links: a member's stage served by `serve_stage`, the
head's `RingEngine` driving it through `QuicRing`, and greedy output equal to the unsplit model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from linked_routers import FAST, linked_routers
from tiny_models import write_tiny_model
from waiting import until_async

from kafila.cli.host_command import RichUi
from kafila.contracts import (
    MAX_BACKEND_DEVICES,
    MAX_REPORTED_FEATURES,
    BackendDevice,
    BackendReport,
    FleetDevice,
    ModelPricing,
)
from kafila.network.link import LinkError, LinkOverBound
from kafila.network.rendezvous_client import RendezvousClient
from kafila.network.rendezvous_server import start_rendezvous
from kafila.runtime.engine.engines import RingEngine
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.ring import StageFailed, check_ring_error
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.stage import BlockStage
from kafila.runtime.gguf.slicer import StageFile, cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.session.availability import Availability
from kafila.session.deployer import Deployer, Roster
from kafila.session.host_model import LocalModel
from kafila.session.lifecycle import StageBroken
from kafila.session.member import cached_stage_hashes, host_said_end, serve_stage
from kafila.session.quic_ring import QuicRing
from kafila.session.router import TRANSFER_SEQUENCES, ChannelBounds, LinkRouter, traffic_of
from kafila.wire.control import (
    CONTROL_SEQUENCE,
    MAX_CACHED_STAGES,
    MAX_MODEL_PRICINGS,
    Assign,
    ControlError,
    EdgePath,
    End,
    Hello,
    Load,
    Staged,
    StageFailedReport,
    StandBy,
    control_frame,
    parse_control,
)
from kafila.wire.frames import DType, Frame, Kind

SETTINGS = ContextSettings(n_ctx=256, n_batch=32, n_seq_max=2, n_threads=1)
PROMPT = "the quick brown fox"


@contextlib.asynccontextmanager
async def quic_ring_engine(stages: list[StageFile]) -> AsyncIterator[RingEngine]:
    """The head's engine in this process, its one block stage served by `serve_stage` over a real link."""
    host, member, demuxes = await linked_routers()
    executor = ThreadPoolExecutor(1)
    stage = BlockStage(stages[0].path, SETTINGS)
    serving = asyncio.create_task(serve_stage(stage, member.activation, member.activation, executor))
    ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
    engine = await asyncio.to_thread(RingEngine, [stages[1]], SETTINGS, ring=ring)
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.close)
        serving.cancel()
        stage.close()
        executor.shutdown()
        for demux in demuxes:
            demux.close()


def test_control_messages_round_trip_and_malformed_ones_are_refused() -> None:
    sha = "ab" * 32
    assign = Assign(
        epoch=1, stage_index=0, first_block=0, end_block=2, sha256=sha, size=10, source="transfer",
        predecessor="h", successor="h", n_ctx=256, n_batch=32, n_seq_max=2,
    )  # fmt: skip
    pricing = ModelPricing(model_sha256=sha, bandwidth_gb_s=12.8, head_bandwidth_gb_s=22.4, overhead_us=371.0)
    hello = Hello(model_sha256=sha, cached_stages=[sha], priced_models=[pricing])
    fullest = Hello(
        model_sha256=sha,
        cached_stages=[f"{i:064x}" for i in range(MAX_CACHED_STAGES)],
        machine="f" * 16,
        priced_models=[pricing.model_copy(update={"bandwidth_gb_s": 1 / 3})] * MAX_MODEL_PRICINGS,
        backend=BackendReport(
            serving=["CUDA" + "0" * 58 + f"{i:02d}" for i in range(MAX_BACKEND_DEVICES)],
            gpu_offload=True,
            devices=[
                BackendDevice(name="N" * 64, description="D" * 160, kind="gpu", free_bytes=2**64, total_bytes=2**64)
            ]
            * MAX_BACKEND_DEVICES,
            cpu_features=["F" * 32] * MAX_REPORTED_FEATURES,
            idle_gpu="V" * 64,
        ),
    )  # the most a member may report still fits in one control message
    short = StageFailedReport(
        epoch=3, message="failed to allocate buffer for kv cache", out_of_memory=True, can_hold_bytes=2**30
    )
    planned = assign.model_copy(update={"need_bytes": 3 * 2**30})
    standby = StandBy(epoch=4, reason="far-laptop stands by: its edges add 150.4 ms to each pass of the ring")
    for message in (hello, fullest, assign, planned, short, standby, End(reason="bye")):
        assert parse_control(control_frame(message)) == message
    good = {"model_sha256": sha, "bandwidth_gb_s": 1.0, "head_bandwidth_gb_s": 1.0, "overhead_us": 1.0}

    def hello_frame(priced: list[dict[str, object]]) -> Frame:
        payload = json.dumps({"type": "hello", "priced_models": priced}).encode()
        return Frame(Kind.PING, CONTROL_SEQUENCE, payload=payload)

    assert parse_control(hello_frame([good])) == Hello(priced_models=[ModelPricing.model_validate(good)])

    def failed_frame(**fields: object) -> Frame:
        payload = json.dumps({"type": "failed", "epoch": 3, "message": "no", **fields}).encode()
        return Frame(Kind.PING, CONTROL_SEQUENCE, payload=payload)

    bad = [
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b"{not json"),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b'{"type": "assign"}'),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b'{"type": "hello", "model_sha256": "xyz"}'),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b'{"type": "launch"}'),
        hello_frame([dict(good, bandwidth_gb_s=0)]),  # no speed
        hello_frame([dict(good, model_sha256="x")]),  # no hash
        hello_frame([good] * 17),  # more than a member reports
        Frame(Kind.PING, 3, payload=b'{"type": "end", "reason": "x"}'),
        failed_frame(out_of_memory="sometimes"),  # a flag, not a word
        failed_frame(out_of_memory=True, can_hold_bytes=-1),
        failed_frame(out_of_memory=True, can_hold_bytes=2**61),  # beyond any machine
        failed_frame(out_of_memory=True, can_hold_bytes=1.5),
        failed_frame(message="x" * 4001),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b'{"type": "standby", "epoch": -1, "reason": "x"}'),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b'{"type": "standby", "epoch": 1, "reason": "%s"}' % (b"x" * 1001)),
        Frame(Kind.PING, CONTROL_SEQUENCE, payload=b"x" * 70_000),
    ]
    for frame in bad:
        with pytest.raises(ControlError):
            parse_control(frame)
    assert traffic_of(Frame(Kind.PING, CONTROL_SEQUENCE)) == "control"
    assert traffic_of(Frame(Kind.FILE, 2**63 + 5)) == "transfer"
    assert traffic_of(Frame(Kind.DECODE, 3)) == "activation"


def test_a_member_reports_its_most_recent_stage_files_first_and_no_more_than_a_hello_holds(tmp_path: Path) -> None:
    names = [f"{i:064x}" for i in range(MAX_CACHED_STAGES + 3)]
    for age, name in enumerate(names):
        (tmp_path / f"{name}.gguf").write_bytes(b"")
        os.utime(tmp_path / f"{name}.gguf", (10_000 - age, 10_000 - age))  # the first name is the newest
    (tmp_path / "not-a-stage.gguf").write_bytes(b"")
    (tmp_path / f"{'g' * 64}.gguf").write_bytes(b"")  # not a hash
    assert cached_stage_hashes(tmp_path) == names[:MAX_CACHED_STAGES]
    assert cached_stage_hashes(tmp_path / "absent") == []


def test_a_ring_over_quic_generates_what_the_unsplit_model_does(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    stages = cached_slices(model, [2, 2], tmp_path / "stages")
    unsplit = open_engine(model, [4], SETTINGS)
    try:
        expected = generate(unsplit, PROMPT, 12, SamplingSettings()).text
    finally:
        unsplit.close()

    async def scenario() -> tuple[str, list[dict[str, object]]]:
        async with quic_ring_engine(stages) as engine:
            text = (await asyncio.to_thread(generate, engine, PROMPT, 12, SamplingSettings())).text
            report = (await asyncio.to_thread(engine.stage_report)).stages
        return text, report

    text, report = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert text and text == expected
    assert [stage.range for stage in report] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("said_end", [True, False])
def test_a_member_whose_answer_finds_the_link_closed_reads_the_end_the_host_sent_first(said_end: bool) -> None:
    """The host said End, waited, and closed while the member was busy taking a stage: the
    member's answer finds the link closed, and the End unread behind it says the session ended
    (not a lost host, which the member would join again). Without an End, the host was lost."""

    async def scenario() -> str | None:
        host, member, demuxes = await linked_routers()
        try:
            if said_end:  # as the host does, it closes once the End has arrived, unread
                await host.send_control(End(reason="the host is shutting down"))
                await until_async(lambda: member.control.held_bytes > 0, "the End at the member")
            await host.close("the host is shutting down")
            await until_async(member.link.closed.done, "the member's link hears the goodbye")
            with pytest.raises(LinkError):
                await member.send_control(StageFailedReport(epoch=1, message="no room for the stage"))
            return host_said_end(member)
        finally:
            for demux in demuxes:
                demux.close()

    ended = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert ended == ("the host is shutting down" if said_end else None)


def test_a_member_that_vanishes_fails_the_ring_step_quickly(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    stages = cached_slices(model, [2, 2], tmp_path / "stages")

    async def scenario() -> float:
        host, _member, demuxes = await linked_routers()
        ring = QuicRing(asyncio.get_running_loop(), host.activation, "member", host.activation, "member")
        engine = await asyncio.to_thread(RingEngine, [stages[1]], SETTINGS, ring=ring)
        demuxes[1].close()  # the member's socket is gone: no goodbye, no more packets
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            with pytest.raises(StageFailed, match="link to member is down"):
                await asyncio.to_thread(generate, engine, PROMPT, 4, SamplingSettings())
        finally:
            await asyncio.to_thread(engine.close)
            demuxes[0].close()
        return loop.time() - started

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) < 5.0


def test_a_member_answers_out_of_order_and_malformed_frames_with_errors_and_carries_on(tmp_path: Path) -> None:
    """A frame at a position its sequence has not reached, or of the wrong width, gets an ERROR
    frame round the ring naming the stage; the member keeps serving the next, well-formed one."""
    import numpy as np

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    stages = cached_slices(model, [2, 2], tmp_path / "stages")

    async def scenario() -> list[Frame]:
        host, member, demuxes = await linked_routers()
        executor = ThreadPoolExecutor(1)
        stage = BlockStage(stages[0].path, SETTINGS)
        serving = asyncio.create_task(serve_stage(stage, member.activation, member.activation, executor))
        rows = np.ones((1, stage.hidden), dtype=np.float32)
        try:
            replies = []
            for frame in (
                Frame.of_hidden(Kind.DECODE, 1, 50, rows),  # sequence 1 has no position 0..49
                Frame.of_hidden(Kind.DECODE, 0, 0, np.ones((1, stage.hidden + 3), dtype=np.float32)),
                Frame.of_hidden(Kind.PREFILL, 0, 0, rows),  # well formed: served
            ):
                await host.activation.send(frame)
                replies.append(await asyncio.wait_for(host.activation.receive(), 30))
            return replies
        finally:
            serving.cancel()
            stage.close()
            executor.shutdown()
            for demux in demuxes:
                demux.close()

    out_of_order, too_wide, served = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert out_of_order.kind is Kind.ERROR and out_of_order.sequence_id == 1 and "blocks 0-1" in out_of_order.text()
    assert too_wide.kind is Kind.ERROR and too_wide.sequence_id == 0
    assert served.kind is Kind.PREFILL and served.sequence_id == 0 and served.hidden_states().shape == (1, 64)


def test_a_sequence_a_member_refuses_fails_alone_over_quic(tmp_path: Path) -> None:
    """Over a real QUIC link, a member's stage refuses one sequence of a batch (rows at a position
    its cache has not reached): `QuicRing` returns the ERROR frame as that sequence's answer, the
    other sequence gets the logits it gets alone, and the ring serves on."""
    import numpy as np

    from kafila.runtime.engine.engines import EngineStep, SequenceFailed

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    stages = cached_slices(model, [2, 2], tmp_path / "stages")

    async def scenario() -> tuple[object, object, object, list[dict[str, object]]]:
        async with quic_ring_engine(stages) as engine:
            prompt = engine.tokenize(PROMPT)
            (alone,) = await asyncio.to_thread(engine.step_many, [EngineStep(0, 0, prompt, decode=False)])
            await asyncio.to_thread(engine.forget, 0)
            both = [EngineStep(0, 0, prompt, decode=False), EngineStep(1, 9, [5], decode=True)]
            ok, failed = await asyncio.to_thread(engine.step_many, both)
            await asyncio.to_thread(engine.forget, 1)
            report = (await asyncio.to_thread(engine.stage_report)).stages
        return alone, ok, failed, report

    alone, ok, failed, report = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert isinstance(failed, SequenceFailed) and failed.sequence_id == 1 and "position 9" in failed.message
    assert isinstance(ok, np.ndarray) and isinstance(alone, np.ndarray) and np.array_equal(ok, alone)
    assert [stage.range for stage in report] == [(0, 2), (2, 4)]


def test_a_machine_tag_is_stable_in_a_session_and_differs_between_sessions() -> None:
    from kafila.session.presence import machine_tag

    tag = machine_tag("7-crimson-harbor")
    assert tag == machine_tag("7-crimson-harbor") and tag != machine_tag("8-crimson-harbor")
    assert Hello(machine=tag).machine == tag  # what members send the host, which counts machines


def test_processes_held_to_cores_of_their_own_are_machines_of_their_own() -> None:
    """The demo holds its processes to disjoint cores: each then counts as a machine (a wave of
    its own in flight); held to the same cores, or not held at all, they are one."""
    import os

    from kafila.session.presence import machine_tag

    whole = machine_tag("7-crimson-harbor")
    cpus = sorted(os.sched_getaffinity(0))
    tags = []
    try:
        for cpu in cpus[:2]:
            os.sched_setaffinity(0, {cpu})  # this thread only: the tag is read from the calling thread
            tags.append(machine_tag("7-crimson-harbor"))
        os.sched_setaffinity(0, {cpus[0]})
        again = machine_tag("7-crimson-harbor")
    finally:
        os.sched_setaffinity(0, cpus)
    assert machine_tag("7-crimson-harbor") == whole and again == tags[0]
    if len(cpus) == os.cpu_count() and len(cpus) > 1:
        assert len({whole, *tags}) == 3


def test_a_member_links_only_to_neighbours_with_the_fingerprint_the_host_verified() -> None:
    """A newcomer was never in a member's roster, so the host's assignment names each neighbour's
    verified fingerprint: a neighbour without one, or one the rendezvous reports differently (it
    may be tampering), is refused before any packet is sent."""
    from types import SimpleNamespace

    from kafila.contracts import FleetDevice
    from kafila.network.rendezvous import MemberInfo
    from kafila.session.member import RingLinks, edge_connector

    verified, other = "ab" * 32, "cd" * 32
    info = MemberInfo(
        member_id="m4", name="newcomer", host=False, capability=FleetDevice(name="newcomer", memory_gib=8.0),
        candidates=[], fingerprint=verified,
    )  # fmt: skip
    client = SimpleNamespace(members={"m4": info}, code="7-crimson-harbor")
    connect = edge_connector(client, None, None)  # type: ignore[arg-type]  # refused before the network

    async def link(vouched: dict[str, str]) -> object:
        return await connect(vouched)

    with pytest.raises(ValueError, match="another certificate for newcomer"):
        asyncio.run(link({"m4": other}))
    with pytest.raises(ValueError, match="not in this session"):
        asyncio.run(link({"m9": verified}))
    links = RingLinks(SimpleNamespace(peer_id="m1"), connect, print)  # type: ignore[arg-type]
    assign = Assign(
        epoch=2, stage_index=0, first_block=0, end_block=2, sha256="ab" * 32, size=10, source="transfer",
        predecessor="m1", successor="m4", n_ctx=256, n_batch=32, n_seq_max=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="without its verified fingerprint"):
        asyncio.run(links.for_assignment(assign))


def test_a_member_with_less_free_memory_than_its_stage_needs_says_so_without_loading_it(tmp_path: Path) -> None:
    """The host's assignment says what the stage needs; a member following it over a real link,
    with less free than that, answers the host's `load` with `failed`, out of memory, and what it
    has free, and goes on following the host."""
    from kafila.session.member import MemberState, RingLinks, follow_host

    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    stage = cached_slices(model, [2, 2], tmp_path / "cache")[0]  # in the member's cache already

    async def nobody(_vouched: dict[str, str]) -> dict[str, tuple[LinkRouter, EdgePath]]:
        raise AssertionError("a stage between the host and the host links to no one")

    async def scenario() -> tuple[object, list[str]]:
        host, member, demuxes = await linked_routers()
        said: list[str] = []
        state = MemberState(tmp_path / "cache", None, 1, said.append)
        following = asyncio.create_task(follow_host(RingLinks(member, nobody, said.append), state, None))
        try:
            assert isinstance(await host.next_control(10), Hello)
            assign = Assign(
                epoch=1, stage_index=0, first_block=0, end_block=2, sha256=stage.sha256, size=stage.n_bytes,
                source="cache", predecessor="host", successor="host", n_ctx=256, n_batch=32, n_seq_max=2,
                need_bytes=2**59,  # more than any machine has
            )  # fmt: skip
            await host.send_control(assign)
            assert isinstance(await host.next_control(10), Staged)
            await host.send_control(Load(epoch=1))
            failed = await host.next_control(10)
            await host.send_control(End(reason="done"))
            assert await asyncio.wait_for(following, 10) == "done"
            return failed, said
        finally:
            following.cancel()
            for demux in demuxes:
                demux.close()

    failed, said = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert isinstance(failed, StageFailedReport) and failed.epoch == 1 and failed.out_of_memory, failed
    assert failed.can_hold_bytes is not None and 0 < failed.can_hold_bytes < 2**59, failed
    assert "GiB free here; blocks 0-1 need 536870912.00 GiB" in failed.message, failed.message
    assert any("cannot load stage 0" in line for line in said), said


def test_a_control_message_the_host_cannot_read_is_refused_and_the_next_one_heard(tmp_path: Path) -> None:
    """A member's unknown or malformed control message while the ring serves costs only itself:
    the host's listener to that member refuses it and still hears the member's genuine report
    that its stage stopped (it used to stop listening at the first, and missed the report)."""

    async def scenario() -> tuple[str, dict[str, int]]:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        clients: list[RendezvousClient] = []
        host_router, member_router, demuxes = await linked_routers()
        try:
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=2, capability=FleetDevice(name="host", memory_gib=8),
                fingerprint="a1" * 32,
            )  # fmt: skip
            clients.append(host)
            member = await RendezvousClient.join(
                handle.url, host.code, capability=FleetDevice(name="rack", memory_gib=8), fingerprint="b2" * 32
            )
            clients.append(member)
            await host.wait_for_members(2, 10)
            roster = Roster(client=host, machine="m", routers={member.member_id: host_router})
            deployer = Deployer(roster, LocalModel(tmp_path / "m.gguf"), SETTINGS, tmp_path, say=lambda _text: None)
            reports: list[StageBroken] = []
            deployer.stage_broken = reports.append
            deployer._listen([member.member_id], epoch=3)
            for payload in (b'{"type": "no-such-message"}', b"\xff\x00 not json", b'{"type": "failed"}'):
                await member_router.link.send(Frame(Kind.PING, CONTROL_SEQUENCE, payload=payload))
            await member_router.send_control(StageFailedReport(epoch=3, message="lost its successor", lost_peer="m1"))
            await until_async(lambda: bool(reports), "the member's report that its stage stopped", 10)
            await deployer.stop_listening()
            assert [report.epoch for report in reports] == [3]
            return reports[0].report, deployer.refused_controls
        finally:
            for client in clients:
                await client.close()
            for router in (host_router, member_router):
                await router.close()
            for demux in demuxes:
                demux.close()
            await handle.close()

    broken, refused = asyncio.run(scenario())
    assert broken == "rack: lost its successor"
    assert list(refused.values()) == [3]


@pytest.mark.parametrize("congestion", ["reno", "rate"])
@pytest.mark.parametrize("traffic", ["control", "transfer", "activation"])
def test_a_member_that_sends_what_the_host_does_not_read_is_sent_away_at_the_bound(
    traffic: str, congestion: str
) -> None:
    """A trusted member flooding any channel while the ring serves: the host holds at most the
    bound of it, sends the member away (its link ends, so the session replans without it), and
    the member learns why. Before, every frame was queued without end (about 1 MB per MB sent).
    With "rate" the flood's round trips grew to 0.2-0.7 s on loopback, and the member learned of
    the host's goodbye only when aioquic's draining ended, 3 probe timeouts later, after its own
    idle bound had called the link dead (half the runs, before the link reported it on arrival)."""
    sequence = {"control": CONTROL_SEQUENCE, "transfer": TRANSFER_SEQUENCES[0], "activation": 5}[traffic]
    bound = 8 << 20
    config = FAST.model_copy(update={"max_held_bytes": bound, "congestion_control": congestion})

    async def scenario() -> tuple[BaseException, BaseException, int, int]:
        host, member, demuxes = await linked_routers(config)
        frame = Frame(Kind.PING, sequence, payload=b"f" * (256 << 10))
        sent, most_held = 0, 0
        try:
            async with asyncio.timeout(30):
                while not host.link.closed.done():  # 256 KiB at a time, as fast as QUIC takes it
                    with contextlib.suppress(LinkError):
                        await member.link.send(frame)
                        sent += frame.wire_bytes
                    held = host.link.held_bytes
                    most_held = max(most_held, held)
                    await asyncio.sleep(0)
                await member.link.closed
            return host.link.closed.result(), member.link.closed.result(), sent, most_held
        finally:
            for router in (host, member):
                await router.close()
            for demux in demuxes:
                demux.close()

    refused, told, sent, most_held = asyncio.run(scenario())
    channel_bound = {"control": ChannelBounds().control, "transfer": bound, "activation": bound}[traffic]
    assert isinstance(refused, LinkOverBound) and isinstance(told, LinkOverBound), (refused, told)
    assert "sent away by peer" in str(told)
    assert sent > channel_bound  # it did send past the bound ...
    assert most_held <= bound + (256 << 10) + 64  # ... and the host held no more than that, and one frame


def test_random_bytes_a_member_sends_as_its_error_are_shown_and_kept_never_obeyed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A member's ERROR frame of random bytes, markup and terminal escapes, over a real link: the
    request it names fails with that text, and the host's console and /status show it as text.
    Before, such bytes reached rich as markup and killed the host's watcher (every request then
    got 503 "the host stopped watching its session")."""
    rng = random.Random(33)
    hostile = b"[/]\x1b[2J\x1b]52;c;aGk=\x07[bold" + rng.randbytes(4000)

    async def scenario() -> Frame:
        host, member, demuxes = await linked_routers()
        try:
            await member.activation.send(Frame(Kind.ERROR, 0, dtype=DType.NONE, payload=hostile))
            return await asyncio.wait_for(host.activation.receive(), 10)
        finally:
            for router in (host, member):
                await router.close()
            for demux in demuxes:
                demux.close()

    frame = asyncio.run(scenario())
    assert check_ring_error(frame) is frame  # an ERROR naming a request fails that request alone
    failure = f"rack reported: {frame.text()}"  # as RingEngine words the request's failure
    ui, serving = RichUi(), Availability()
    ui.say(failure)
    ui.warn("a request failed", failure)
    ui.error(f"the session cannot serve: {failure}")
    serving.record_incident("a request failed", failure)
    shown = capsys.readouterr().err
    assert "rack reported: [/]" in shown and "[bold" in shown  # shown as it is written ...
    assert "\x1b" not in shown and "\x07" not in shown  # ... and nothing of it obeyed
    kept = serving.incidents[-1].detail
    assert "\x1b" not in kept and kept.startswith("rack reported: [/]")
