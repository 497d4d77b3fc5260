"""The host's own stage fetched from the hub before its plan (session/fetch_ahead.py): the stage a
plan among machines like the host gives it, whether the real plan lets the fetch end or halts it,
and, against the fake hub, a fetch ahead that the plan keeps (its stage then taken from the cache,
fetched once) and one it halts (a later fetch of that stage resumes from what arrived)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub, Repo, serving_hub
from tiny_models import write_tiny_model
from waiting import until

from kafila.contracts import FleetDevice
from kafila.hub.ranges import FetchHalted, RangeSettings, fetch_stage, read_hub_header, stage_key
from kafila.hub.reference import HubReference
from kafila.planner.types import ModelManifest, ServingSpec
from kafila.runtime.gguf.slicer import block_range_file, stage_piece
from kafila.runtime.gguf.stage_cache import find_hub_stage
from kafila.session.fetch_ahead import AheadFetch, OwnStage, ProgressRelay, keeps_fetching, provisional_stage
from kafila.session.pricing import Machine, RingPricing

REPO, FILE = "tiny-org/Tiny-GGUF", "Tiny-Q8_0.gguf"
BLOCKS = 21
# The benchmark's generated model: 21 blocks of about 47 MB, a small head.
MANIFEST = ModelManifest(
    name="bench", architecture="llama", block_bytes=(47_000_000,) * BLOCKS, head_bytes=9_000_000,
    kv_bytes_per_token=(8192,) * BLOCKS,
)  # fmt: skip
DEVICE = FleetDevice(name="pc", memory_gib=16, bandwidth_gb_s=40, head_bandwidth_gb_s=40, overhead_us=200)
SESSION = ServingSpec(context=256, concurrency=1)
SMALL = RangeSettings(workers=2, piece_bytes=8 << 10, journal_bytes=1 << 10, join_gap=4 << 10)


def test_among_machines_like_it_the_host_takes_the_head_and_its_share_of_the_blocks() -> None:
    stage = provisional_stage(MANIFEST, DEVICE, 3, SESSION)
    assert stage == OwnStage(14, BLOCKS, True), stage
    # the plan a host makes once two members like it have joined gives it the same stage
    machines = {name: Machine(name, DEVICE.model_copy(update={"name": name})) for name in ("home", "a", "b")}
    plan = RingPricing(MANIFEST, SESSION, host="home").plan(machines, ["home", "a", "b"])
    own = next(s for s in plan.stages if s.device == "home")
    assert (own.start, own.end, own.is_head) == (stage.first, stage.end, stage.is_head)
    assert provisional_stage(MANIFEST, DEVICE, 7, SESSION) == OwnStage(18, BLOCKS, True)


def test_a_host_whose_like_cannot_hold_the_head_or_the_model_fetches_nothing_ahead() -> None:
    heavy_head = MANIFEST.model_copy(update={"head_bytes": 800_000_000})
    small = DEVICE.model_copy(update={"memory_gib": 0.5})  # room for blocks, not for that head
    assert provisional_stage(heavy_head, small, 3, SESSION) is None
    tiny = DEVICE.model_copy(update={"memory_gib": 0.05})  # three of it cannot hold the model at all
    assert provisional_stage(MANIFEST, tiny, 3, SESSION) is None


def test_the_fetch_ahead_ends_where_the_plan_keeps_most_of_it_and_halts_where_not() -> None:
    ahead = OwnStage(14, BLOCKS, True)
    assert keeps_fetching(MANIFEST, ahead, [ahead])
    assert keeps_fetching(MANIFEST, ahead, [OwnStage(12, BLOCKS, True)])  # more: the rest fetched after
    assert keeps_fetching(MANIFEST, ahead, [OwnStage(17, BLOCKS, True)])  # 4 of its 7 blocks and the head
    assert not keeps_fetching(MANIFEST, ahead, [OwnStage(19, BLOCKS, True)])  # 2 of 7 and the head
    assert not keeps_fetching(MANIFEST, ahead, [OwnStage(0, 7, False)])  # the head on a member
    assert not keeps_fetching(MANIFEST, ahead, [])  # this host holds no stage


def test_progress_goes_to_whatever_shows_it_now() -> None:
    relay, first, second = ProgressRelay(), [], []
    relay("fetching", 1, 10)  # nothing shows it yet
    relay.to(lambda *update: first.append(update))
    relay("fetching", 2, 10)
    relay.to(lambda *update: second.append(update))
    relay("fetching", 3, 10)
    assert (first, second) == ([("fetching", 2, 10)], [("fetching", 3, 10)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ahead") / FILE, "llama", n_blocks=4)


@pytest.fixture
def hub(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))  # the headers kept for their readers
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return FakeHub({REPO: Repo({FILE: tiny.read_bytes()})})


def test_a_fetch_ahead_the_plan_keeps_is_its_stage_fetched_once(hub: FakeHub, tiny: Path, tmp_path: Path) -> None:
    ahead_of = OwnStage(2, 4, True)
    with serving_hub(hub):
        header = read_hub_header(HubReference(REPO, filename=FILE), endpoint=hub.url)
        manifest = header.manifest()
        asked_before = len(hub.ranges_of(FILE))
        ahead = AheadFetch(header, ahead_of, manifest, tmp_path / "stages", endpoint=hub.url, settings=SMALL)
        shown: list[tuple[str, int, int]] = []
        assert ahead.settle([ahead_of], lambda *update: shown.append(update))
        asked = hub.ranges_of(FILE)[asked_before:]
        assert asked and min(start for start, _ in asked) >= header.model.parts[0].header_bytes, asked  # planned from
        # the file's metadata asked once, as the header was read: the fetch begun after it takes that
        assert [path for method, path, _ in hub.seen if method == "HEAD"] == [f"/{REPO}/resolve/{COMMIT}/{FILE}"]
        sent = dict(hub.sent_to)
        got = fetch_stage(header.model, 2, 4, True, tmp_path / "stages", endpoint=hub.url, settings=SMALL)
        assert hub.sent_to == sent  # taken from the cache: nothing fetched twice
    assert got.path.read_bytes() == block_range_file(tiny, 2, 4, tmp_path / "cut", is_head=True).path.read_bytes()


def test_a_plan_that_gives_the_host_more_than_was_fetched_ahead_fetches_only_the_rest(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    with serving_hub(hub):
        header = read_hub_header(HubReference(REPO, filename=FILE), endpoint=hub.url)
        ahead = AheadFetch(header, OwnStage(2, 4, True), header.manifest(), tmp_path / "stages", endpoint=hub.url)
        assert ahead.settle([OwnStage(1, 4, True)], lambda *update: None)  # it holds all of it: kept
        sent = sum(hub.sent_to.values())
        stages, planned = tmp_path / "stages", header
        got = fetch_stage(header.model, 1, 4, True, stages, endpoint=hub.url, settings=SMALL, planned=planned)
        fetched = sum(hub.sent_to.values()) - sent
    block_1 = stage_piece(header.header.reader, 1, 2, False, FILE).source_tensors()
    assert 0 < fetched <= sum(int(t.n_bytes) for t in block_1) + 4 * (4 << 10), fetched  # block 1's tensors alone
    assert got.path.read_bytes() == block_range_file(tiny, 1, 4, tmp_path / "cut", is_head=True).path.read_bytes()


def test_a_fetch_ahead_the_plan_does_not_keep_halts_and_a_later_fetch_of_its_stage_resumes(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """Halted mid-way (the hub slowed, so that it is under way), the fetch leaves no stage in the
    cache, only its journalled bytes; fetching that stage later asks the hub only for the rest."""
    ahead_of, cache = OwnStage(0, 2, False), tmp_path / "stages"
    with serving_hub(hub):
        header = read_hub_header(HubReference(REPO, filename=FILE), endpoint=hub.url)
        stage_bytes = sum(int(t.n_bytes) for t in stage_piece(header.header.reader, 0, 2, False, FILE).source_tensors())
        hub.rate_bytes_s = stage_bytes / 8  # eight seconds for the stage: halted well before its end
        ahead = AheadFetch(header, ahead_of, header.manifest(), cache, endpoint=hub.url, settings=SMALL)
        shown: list[tuple[str, int, int]] = []
        ahead.progress.to(lambda *update: shown.append(update))

        def under_way_or_ended() -> bool:
            return ahead.done or any(done > 0 for what, done, _ in shown if what.startswith("fetching"))

        until(under_way_or_ended, lambda: f"the fetch ahead under way: {shown}")
        assert not ahead.done, shown
        assert not ahead.settle([OwnStage(2, 4, True)], lambda *update: None)  # nothing of it kept: halted
        assert find_hub_stage(cache, stage_key(header.model, 0, 2, False)) is None
        kept = shown[-1][1]
        assert 0 < kept < stage_bytes
        hub.rate_bytes_s = 0.0
        before = sum(hub.sent_to.values())
        got = fetch_stage(header.model, 0, 2, False, cache, endpoint=hub.url, settings=SMALL)
        fetched = sum(hub.sent_to.values()) - before
    assert fetched <= header.model.parts[0].header_bytes + stage_bytes - kept + 4 * (4 << 10), (fetched, kept)
    assert got.path.read_bytes() == block_range_file(tiny, 0, 2, tmp_path / "cut").path.read_bytes()


def test_a_halted_fetch_raises_its_own_error(hub: FakeHub, tmp_path: Path) -> None:
    halt = threading.Event()
    halt.set()
    with serving_hub(hub):
        header = read_hub_header(HubReference(REPO, filename=FILE), endpoint=hub.url)
        with pytest.raises(FetchHalted):
            fetch_stage(header.model, 0, 2, False, tmp_path / "s", endpoint=hub.url, settings=SMALL, halt=halt)
