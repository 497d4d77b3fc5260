"""Nobody downloads the whole model (issue 36, its core): a model on the hub planned from its header
alone, and one stage fetched by the ranges of exactly its tensors, checked against what was planned
from. Against the fake hub on loopback (tests/helpers/fake_hub.py), with tiny models the `gguf`
package writes; the stages are compared with what the slicer cuts from the whole file."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import pytest
from disks import small_disk
from fake_hub import COMMIT, FakeHub, Repo, serving_hub
from test_split_correctness import N_BLOCKS, greedy_split, greedy_unsplit
from tiny_gguf import write_split_parts
from tiny_models import TINY_SHAPES, write_tiny_model

from kafila.contracts import HubModel
from kafila.hub.listing import HubRefused, HubUnreachable
from kafila.hub.ranges import (
    HubHeader,
    HubMismatch,
    RangeSettings,
    fetch_stage,
    fetch_vocabulary,
    read_hub_header,
    stage_key,
)
from kafila.hub.reference import HubReference
from kafila.runtime.engine.engines import prefix_cut_from, prefix_cut_of
from kafila.runtime.engine.stage import TokenEmbedding, Vocabulary
from kafila.runtime.gguf.gguf_file import FastGGUFReader, GGUFFormatError, HeaderIncomplete, HeaderReader
from kafila.runtime.gguf.header import ModelHeader, TensorSpan, check_spans
from kafila.runtime.gguf.manifest import manifest_of, read_manifest
from kafila.runtime.gguf.slicer import SliceError, StageFile, block_range_file, stage_layout, stage_piece
from kafila.runtime.gguf.stage_cache import PARTIAL_KEPT_S
from kafila.runtime.llama.loading import load_llama
from kafila.runtime.llama.model import VocabularyOnly
from kafila.session.host_model import HubOnlyModel

REPO = "tiny-org/Tiny-GGUF"
FILE = "Tiny-Q8_0.gguf"
DIVISION = [(0, 1, False), (1, 3, False), (3, 4, True)]  # 4 blocks in three stages, the head last
# Small pieces, so that the tiny model's stages are fetched in many ranges, two at a time.
SMALL = RangeSettings(workers=2, piece_bytes=8 << 10, journal_bytes=1 << 10, join_gap=4 << 10)
SLACK = 4 << 10  # what joining neighbours may fetch beyond the tensors, per range


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ranges") / "Tiny-Q8_0.gguf", "llama", n_blocks=4)


@pytest.fixture
def hub(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))  # the headers kept for their readers
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return FakeHub({REPO: Repo({FILE: tiny.read_bytes(), "README.md": b"# tiny\n"})})


class Shown(list[tuple[str, int, int]]):
    def append_args(self, what: str, done: int, total: int) -> None:
        self.append((what, done, total))


def plan(hub: FakeHub, first_read: int = 1024) -> HubHeader:
    """The host's part: the model planned from its header, read from 1 KiB up."""
    return read_hub_header(HubReference(REPO, filename=FILE), endpoint=hub.url, first_read=first_read)


def fetch(
    hub: FakeHub, model: HubModel, stage: tuple[int, int, bool], out: Path, token: str, **options: object
) -> StageFile:
    """One member's fetch of its stage, with its own token: the hub counts what it sent to each."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_TOKEN", token)
        return fetch_stage(model, *stage, out, endpoint=hub.url, settings=SMALL, **options)  # type: ignore[arg-type]


def needed_bytes(header: HubHeader, stage: tuple[int, int, bool]) -> int:
    """The bytes of the tensors the stage reads from the model: what a fetch should cost."""
    return sum(int(t.n_bytes) for t in stage_piece(header.header.reader, *stage, "tiny").source_tensors())


def test_the_header_alone_gives_the_manifest_the_whole_file_gives(hub: FakeHub, tiny: Path) -> None:
    with serving_hub(hub):
        header = plan(hub)
    whole = FastGGUFReader(tiny)
    assert header.manifest() == read_manifest(tiny)
    assert header.model.commit == COMMIT and header.model.repo_id == REPO
    [part] = header.model.parts
    assert part.path == FILE and part.size == tiny.stat().st_size and part.header_bytes == whole.data_offset
    assert part.sha256 == hub.sha256(REPO, FILE)
    # read in pieces from 1 KiB, each twice the last, until the header fitted: never the weights
    assert hub.sent_of[FILE] < 2 * whole.data_offset < tiny.stat().st_size // 10
    assert all(end <= 2 * whole.data_offset for _, end in hub.ranges_of(FILE))
    tensors = {t.name: (t.data_offset, t.n_bytes) for t in whole.tensors}
    assert {s.name: (s.start, s.n_bytes) for s in header.header.spans.values()} == tensors


def test_the_header_read_stops_where_the_header_ends_not_at_its_first_pieces_length(hub: FakeHub, tiny: Path) -> None:
    """The host's header read asks for a first piece longer than most headers (8 MiB, or a 16th of
    the file), and stops reading where the header ends: the hub, sending at a rate in 64 KiB writes
    (one each 0.13 s), sends a few of them (the socket takes what comes before the client has closed
    it), not the whole piece of 544 KB."""
    padded = "Padded-Q8_0.gguf"  # the tiny model with 8 MiB after it: a first piece of 520 KiB
    hub.repos[REPO].files[padded] = tiny.read_bytes() + bytes(8 << 20)
    hub.rate_bytes_s = 0.5e6
    with serving_hub(hub):
        header = read_hub_header(HubReference(REPO, filename=padded), endpoint=hub.url)
    length, size = FastGGUFReader(tiny).data_offset, len(hub.repos[REPO].files[padded])
    assert header.model.parts[0].header_bytes == length
    assert hub.ranges_of(padded) == [(0, size // 16)]  # one request
    assert length <= hub.sent_of[padded] <= (256 << 10) < size // 16


def test_bytes_that_end_inside_the_header_say_so(tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    length = FastGGUFReader(tiny).data_offset
    for cut in (8, 1000, length - 1):
        (tmp_path / "h").write_bytes(data[:cut])
        with pytest.raises(HeaderIncomplete):
            HeaderReader(tmp_path / "h")
    (tmp_path / "h").write_bytes(data[:length])
    assert HeaderReader(tmp_path / "h").header_bytes == length
    with pytest.raises(GGUFFormatError, match="runs into"):
        check_spans([TensorSpan("a", 0, length, 100), TensorSpan("b", 0, length + 99, 10)], [length], [len(data)])
    with pytest.raises(GGUFFormatError, match="past the end of the file"):
        check_spans([TensorSpan("a", 0, length, len(data))], [length], [len(data)])


@pytest.mark.parametrize("arch", sorted(N_BLOCKS))
def test_every_family_laid_out_from_its_header_with_each_tensor_at_its_place_is_the_slicers_stage(
    arch: str, tmp_path: Path
) -> None:
    """No network: a stage file laid out from the header alone (`stage_layout`), each source
    tensor's bytes copied from the file straight to the place the layout gives (scaled where it
    says), is byte for byte the stage the slicer cuts from the whole file, in every family
    (identity blocks, scaled tensors, rewritten windows); and the manifest the whole file gives."""
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    data = model.read_bytes()
    (tmp_path / "header").write_bytes(data[: FastGGUFReader(model).data_offset])
    header = ModelHeader([HeaderReader(tmp_path / "header")], [model.name])
    manifest = read_manifest(model)
    assert manifest_of(header.reader, model.name, model.stem) == manifest
    cut = (manifest.stage_starts or range(1, manifest.n_blocks))[-1]
    for first, end, is_head in [(0, cut, False), (cut, manifest.n_blocks, True)]:
        piece = stage_piece(header.reader, first, end, is_head, model.name)
        layout = stage_layout(piece)
        assert set(layout.places) == {t.name for t in piece.source_tensors()}
        placed = tmp_path / f"placed-{first}.gguf"
        placed.touch()
        fd = os.open(placed, os.O_RDWR)
        try:
            layout.start(fd)
            for span in header.spans_of(piece.source_tensors()):
                assert layout.lengths[span.name] == span.n_bytes
                os.pwrite(fd, layout.scaled(span.name, data[span.start : span.end]), layout.places[span.name])
        finally:
            os.close(fd)
        assert placed.read_bytes() == block_range_file(model, first, end, tmp_path / "whole", is_head).path.read_bytes()


def test_a_stage_whose_query_norms_are_scaled_is_fetched_into_place_and_resumed_as_the_slicer_cuts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 62-block gemma3 (Gemma 3 27B's count), whose slices scale their query norms: those tensors
    arrive in the side file and are scaled into the stage once all came, so a fetch stopped midway
    and resumed (what arrived kept) still gives the slicer's stage, byte for byte."""
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    shape = replace(TINY_SHAPES["gemma3"], n_head=2, n_head_kv=1)
    model = write_tiny_model(tmp_path / FILE, "gemma3", n_blocks=62, shape=shape)
    stage = (20, 41, False)
    reader = FastGGUFReader(model)
    assert stage_layout(stage_piece(reader, *stage, model.name)).scales  # the case this test is for
    with serving_hub(FakeHub({REPO: Repo({FILE: model.read_bytes()})})) as served:
        header = plan(served)

        def stop_halfway(what: str, done: int, total: int) -> None:
            if what.startswith("fetching") and done >= total // 2:
                raise Interrupted

        with pytest.raises(Interrupted):
            fetch(served, header.model, stage, tmp_path / "m", "hf_first", progress=stop_halfway)
        got = fetch(served, header.model, stage, tmp_path / "m", "hf_second")
    cut = block_range_file(model, *stage[:2], tmp_path / "cut", is_head=stage[2])
    assert got.path.read_bytes() == cut.path.read_bytes() and got.sha256 == cut.sha256


def test_a_disk_too_small_for_the_stage_is_refused_before_a_byte_is_fetched(hub: FakeHub, tmp_path: Path) -> None:
    """The stage file is written where its bytes land: a disk that cannot hold it is refused with
    the space it needs, before the hub is asked for any tensor."""
    with small_disk(tmp_path / "disk", "64k") as disk, serving_hub(hub):
        header = plan(hub)
        asked = len(hub.ranges_of(FILE))
        with pytest.raises(SliceError, match=r"the rest of blocks .* needs .* in .*, which has .* free: free some"):
            fetch(hub, header.model, DIVISION[1], disk / "m", "hf_small")
        assert [end - start for start, end in hub.ranges_of(FILE)[asked:]] == [header.model.parts[0].header_bytes]


def test_each_stage_fetched_by_ranges_is_the_slicers_stage_and_generates_the_same_text(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    with serving_hub(hub):
        header = plan(hub)
        planning = hub.sent_of[FILE]
        header_bytes = header.model.parts[0].header_bytes
        fetched = []
        for index, stage in enumerate(DIVISION):
            seen = Shown()
            token = f"hf_member{index}"
            got = fetch(hub, header.model, stage, tmp_path / f"member{index}", token, progress=seen.append_args)
            cut = block_range_file(tiny, stage[0], stage[1], tmp_path / "cut", is_head=stage[2])
            assert got.path.read_bytes() == cut.path.read_bytes() and got.sha256 == cut.sha256
            assert (got.first_block, got.end_block, got.is_head) == (stage[0], stage[1], stage[2])
            # the hub sent this member its header again and its stage's tensors, about nothing else
            need = needed_bytes(header, stage) + header_bytes
            assert need <= hub.sent_to[f"Bearer {token}"] <= need + SLACK
            fetching = [s for s in seen if s[0].startswith("fetching blocks")]
            assert fetching[-1][1] == fetching[-1][2] >= need - header_bytes and fetching[0][1] == 0
            assert not any(s[0].startswith("writing") for s in seen)  # no second pass over the bytes
            fetched.append(got.path)
        assert sum(hub.sent_to.values()) - planning < tiny.stat().st_size + 3 * (header_bytes + SLACK)
        # a stage kept from before is taken from the cache: the hub is not asked
        before = dict(hub.sent_to)
        again = fetch(hub, header.model, DIVISION[1], tmp_path / "member1", "hf_member1")
        assert again.path == fetched[1] and hub.sent_to == before
    prompt = [2, 10, 20, 30, 40]
    assert greedy_split(fetched, prompt, 16) == greedy_unsplit(tiny, prompt, 16)


def test_a_machine_that_gains_blocks_in_a_replan_fetches_only_the_tensors_its_kept_stages_lack(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """Blocks 1-2 and the head (block 3) kept; a replan gives the machine blocks 0-2, then the head
    from block 2: each new stage takes what the kept stages hold, fetches only the rest (the header
    again, checked, and block 0's tensors; then nothing but the header), and is byte for byte the
    slicer's cut."""
    reader = FastGGUFReader(tiny)

    def block_bytes(blocks: range) -> int:
        return sum(int(t.n_bytes) for t in reader.tensors if t.name.split(".")[:2] in [["blk", str(b)] for b in blocks])

    with serving_hub(hub):
        header = plan(hub)
        header_bytes = header.model.parts[0].header_bytes
        out = tmp_path / "member"
        fetch(hub, header.model, (1, 3, False), out, "hf_before")
        fetch(hub, header.model, (3, 4, True), out, "hf_before")
        seen = Shown()
        grown = fetch(hub, header.model, (0, 3, False), out, "hf_grown", progress=seen.append_args)
        head = fetch(hub, header.model, (2, 4, True), out, "hf_head")
    assert grown.path.read_bytes() == block_range_file(tiny, 0, 3, tmp_path / "cut").path.read_bytes()
    assert head.path.read_bytes() == block_range_file(tiny, 2, 4, tmp_path / "cut", is_head=True).path.read_bytes()
    for token, blocks in (("hf_grown", range(0, 1)), ("hf_head", range(0))):
        need = header_bytes + block_bytes(blocks)
        assert need <= hub.sent_to[f"Bearer {token}"] <= need + SLACK, (token, hub.sent_to, need)
    assert any("MB of it kept here" in what for what, _done, _total in seen), seen


def test_the_vocabulary_a_host_without_the_head_needs_is_one_range_and_reads_as_the_whole_file(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """A host whose head is on a member tokenizes, applies the chat template, embeds and cuts
    caches from the model's metadata and token embedding alone: fetched by the embedding's range
    (and the header again, checked), kept, and read by llama.cpp as it reads the whole file."""
    with serving_hub(hub):
        header = plan(hub)
        planning = hub.sent_to.get("Bearer hf_host", 0)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_TOKEN", "hf_host")
            path = fetch_vocabulary(header.model, tmp_path / "host", endpoint=hub.url, settings=SMALL)
            sent = hub.sent_to["Bearer hf_host"] - planning
            assert fetch_vocabulary(header.model, tmp_path / "host", endpoint=hub.url) == path  # kept
            assert hub.sent_to["Bearer hf_host"] - planning == sent
    embedding = next(t for t in FastGGUFReader(tiny).tensors if t.name == "token_embd.weight")
    need = header.model.parts[0].header_bytes + int(embedding.n_bytes)
    assert need <= sent <= need + SLACK < tiny.stat().st_size
    assert prefix_cut_of(path) == prefix_cut_of(tiny) == prefix_cut_from(header.header.reader)
    tokens = [1, 5, 9, 200]
    assert np.array_equal(TokenEmbedding(path)(tokens), TokenEmbedding(tiny)(tokens))
    load_llama()
    text = "the quick brown fox"
    whole, alone = VocabularyOnly(tiny), VocabularyOnly(path)
    try:
        assert Vocabulary(alone).tokenize(text) == Vocabulary(whole).tokenize(text) and alone.n_vocab == whole.n_vocab
    finally:
        whole.close()
        alone.close()


def test_a_split_model_is_planned_from_every_parts_header_and_fetched_from_the_parts_holding_its_tensors(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    parts = write_split_parts(tiny, tmp_path, 3)
    hub.repos["tiny-org/Big-GGUF"] = Repo({p.name: p.read_bytes() for p in parts})
    with serving_hub(hub):
        header = read_hub_header(HubReference("tiny-org/Big-GGUF", quant="Q8_0"), endpoint=hub.url, first_read=512)
        assert [p.path for p in header.model.parts] == [p.name for p in parts]
        assert header.manifest() == read_manifest(tiny)
        for index, stage in enumerate(DIVISION):
            got = fetch(hub, header.model, stage, tmp_path / "member", f"hf_m{index}")
            cut = block_range_file(tiny, stage[0], stage[1], tmp_path / "cut", is_head=stage[2])
            assert got.path.read_bytes() == cut.path.read_bytes()
        single = HubOnlyModel(plan(hub), HubReference(REPO, filename=FILE))
    assert sum(hub.sent_of[p.name] for p in parts) < 2 * sum(p.stat().st_size for p in parts)
    # No one hashes the merged file, yet the model has a name that pricings learned serving it
    # can be kept by: the same parts at the same commit always give it. A one-part model's is the
    # file's sha256, as the hub lists it.
    split = HubOnlyModel(header, HubReference("tiny-org/Big-GGUF", quant="Q8_0"))
    [name] = {asyncio.run(split.identity(lambda *_: None)) for _ in range(2)}
    assert name is not None and len(name) == 64 and name not in {p.sha256 for p in header.model.parts}
    assert asyncio.run(single.identity(lambda *_: None)) == hashlib.sha256(tiny.read_bytes()).hexdigest()


def test_a_connection_cut_off_resumes_where_it_broke(hub: FakeHub, tiny: Path, tmp_path: Path) -> None:
    with serving_hub(hub):
        header = plan(hub)
        hub.drop_after[FILE] = 3000  # the next GET (the header again) is cut after 3000 bytes
        gets = len(hub.gets_of(FILE))
        got = fetch(hub, header.model, DIVISION[2], tmp_path / "m", "hf_m")
    first, second = hub.ranges_of(FILE)[gets:][:2]
    assert first == (0, header.model.parts[0].header_bytes) and second == (3000, first[1])
    cut = block_range_file(tiny, 3, 4, tmp_path / "cut", is_head=True)
    assert got.path.read_bytes() == cut.path.read_bytes()


def test_the_fake_hubs_rate_caps_what_it_sends_every_client_together(hub: FakeHub, tiny: Path) -> None:
    """The stage delivery benchmark's hub sends 50 MB/s in all (scripts/bench_stage_delivery.py):
    two clients fetching the whole file at once share the rate, and get every byte."""
    hub.rate_bytes_s = 1e6
    got: list[bytes] = []
    with serving_hub(hub):
        url = f"{hub.url}/{REPO}/resolve/{COMMIT}/{FILE}"
        readers = [threading.Thread(target=lambda: got.append(urlopen(url, timeout=30).read())) for _ in range(2)]
        started = time.monotonic()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=30)
        seconds = time.monotonic() - started
    assert got == [tiny.read_bytes()] * 2
    paced = 2 * len(got[0]) - (64 << 10)  # the first 64 KiB leave at once, the rest at the rate
    assert paced / 1e6 <= seconds < 10 * paced / 1e6, seconds


class Interrupted(Exception):
    pass


def test_a_fetch_stopped_midway_resumes_without_fetching_again_what_it_kept(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """The first fetch stops (as a process killed would) once half its bytes are in; the second
    fetches the rest alone: its ranges start where each piece's bytes ended."""
    stage = DIVISION[1]
    with serving_hub(hub):
        header = plan(hub)
        shown: list[tuple[str, int, int]] = []

        def stop_halfway(what: str, done: int, total: int) -> None:
            shown.append((what, done, total))
            if what.startswith("fetching") and done >= total // 2:
                raise Interrupted

        with pytest.raises(Interrupted):
            fetch(hub, header.model, stage, tmp_path / "m", "hf_first", progress=stop_halfway)
        kept, total = shown[-1][1], shown[-1][2]
        assert 0 < kept < total
        assert list((tmp_path / "m" / "hub-partial").iterdir())  # what arrived is kept in the cache
        resumed = Shown()
        asked_before = len(hub.ranges_of(FILE))
        got = fetch(hub, header.model, stage, tmp_path / "m", "hf_second", progress=resumed.append_args)
        asked = hub.ranges_of(FILE)[asked_before:]
    assert resumed[0][0].startswith("fetching") and resumed[0][1] >= kept  # the count starts from what was kept
    header_bytes = header.model.parts[0].header_bytes
    assert asked[0] == (0, header_bytes)  # the header, checked again
    assert sum(end - start for start, end in asked[1:]) == total - resumed[0][1]
    cut = block_range_file(tiny, stage[0], stage[1], tmp_path / "cut", is_head=stage[2])
    assert got.path.read_bytes() == cut.path.read_bytes()
    assert not (tmp_path / "m" / "hub-partial" / stage_key(header.model, *stage).digest()).exists()


def test_a_partial_fetch_left_a_day_goes_at_the_next_fetch_and_a_recent_one_stays(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """Two stages' fetches stop midway (a fetch ahead the plan did not need leaves one so); the
    next fetch of a third gives up the one untouched for a day, keeps the recent one to resume."""
    with serving_hub(hub):
        header = plan(hub)

        def stop_halfway(what: str, done: int, total: int) -> None:
            if what.startswith("fetching") and done >= total // 2:
                raise Interrupted

        works = {}
        for stage in DIVISION[:2]:
            with pytest.raises(Interrupted):
                fetch(hub, header.model, stage, tmp_path / "m", "hf_first", progress=stop_halfway)
            works[stage] = tmp_path / "m" / "hub-partial" / stage_key(header.model, *stage).digest()
        old, recent = works[DIVISION[0]], works[DIVISION[1]]
        day_ago = time.time() - PARTIAL_KEPT_S - 60
        for path in (old, *old.iterdir()):
            os.utime(path, (day_ago, day_ago))
        fetch(hub, header.model, DIVISION[2], tmp_path / "m", "hf_first")
    assert not old.exists()
    assert recent.exists() and any(recent.iterdir())


def test_a_fetch_kept_under_another_plan_is_started_afresh_and_gives_the_slicers_stage(
    hub: FakeHub, tiny: Path, tmp_path: Path
) -> None:
    """What a stopped fetch kept (and a file an older Kafila left there, its packed ranges) belongs
    to its plan: a fetch in other pieces drops it, fetches every tensor again, and writes the
    slicer's stage."""
    stage = DIVISION[1]
    with serving_hub(hub):
        header = plan(hub)

        def stop_halfway(what: str, done: int, total: int) -> None:
            if what.startswith("fetching") and done >= total // 2:
                raise Interrupted

        with pytest.raises(Interrupted):
            fetch(hub, header.model, stage, tmp_path / "m", "hf_first", progress=stop_halfway)
        [work] = (tmp_path / "m" / "hub-partial").iterdir()
        (work / "ranges.bin").write_bytes(b"\xff" * 4096)
        before = hub.sent_to.get("Bearer hf_other", 0)
        other = RangeSettings(workers=3, piece_bytes=4 << 10, journal_bytes=1 << 10, join_gap=4 << 10)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_TOKEN", "hf_other")
            got = fetch_stage(header.model, *stage, tmp_path / "m", endpoint=hub.url, settings=other)
        sent = hub.sent_to["Bearer hf_other"] - before
    assert sent >= needed_bytes(header, stage)  # every tensor fetched again
    cut = block_range_file(tiny, stage[0], stage[1], tmp_path / "cut", is_head=stage[2])
    assert got.path.read_bytes() == cut.path.read_bytes() and not work.exists()


def mirror_of(copy: bytes, listed: str | None = None) -> FakeHub:
    """A hub with another copy of the file under the same commit, listing `listed` as its sha256
    (a mirror that does not know its copy differs) or its true one."""
    return FakeHub({REPO: Repo({FILE: copy}, listed_sha256={FILE: listed} if listed else {})})


def test_a_hub_copy_that_differs_is_refused_and_says_how(hub: FakeHub, tiny: Path, tmp_path: Path) -> None:
    """A member's hub (HF_ENDPOINT: a mirror, say) serving another copy under the same commit: its
    header differs, or its size, or its sha256 (one tensor's bytes): each refused, with the reason."""
    data = tiny.read_bytes()
    length = FastGGUFReader(tiny).data_offset
    name_at = data.index(b"general.name") + len(b"general.name") + 4 + 8  # the value's first byte
    header_changed = data[:name_at] + bytes([data[name_at] ^ 1]) + data[name_at + 1 :]
    tensor_changed = data[:-10] + bytes(b ^ 0xFF for b in data[-10:])
    shorter = data[:-64]
    with serving_hub(hub):
        header = plan(hub)
    planned = header.model.parts[0].sha256
    cases = [
        (mirror_of(header_changed, planned), r"header on the hub at 0123456789ab is not the one planned from \(sha256"),
        (mirror_of(tensor_changed), r"the hub's copy has sha256 [0-9a-f]{64}, the model planned from has"),
        (mirror_of(shorter, planned), rf"the hub serves {len(shorter)} bytes, the model planned from has {len(data)}"),
    ]
    for mirror, reason in cases:
        with serving_hub(mirror), pytest.raises(HubMismatch, match=reason):
            fetch_stage(header.model, *DIVISION[2], tmp_path / "m", endpoint=mirror.url, settings=SMALL)
        assert sum(mirror.sent_of.values()) <= length  # refused before any tensor was fetched
    assert not list((tmp_path / "m").glob("*.gguf"))


def test_a_gated_repository_without_a_token_and_an_unreachable_hub_are_typed_errors(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving_hub(hub):
        header = plan(hub)
        hub.repos[REPO].gated = True
        with pytest.raises(HubRefused, match="is gated: accept its terms on the hub and set HF_TOKEN"):
            fetch_stage(header.model, *DIVISION[0], tmp_path / "m", endpoint=hub.url, settings=SMALL)
        with pytest.raises(HubRefused, match="gated"):
            plan(hub)
        monkeypatch.setenv("HF_TOKEN", "hf_allowed")
        assert plan(hub).model == header.model  # the same repository, with a token
        monkeypatch.delenv("HF_TOKEN")
    # the hub gone (its port closed)
    with pytest.raises(HubUnreachable, match="the hub did not answer"):
        fetch_stage(header.model, *DIVISION[0], tmp_path / "m", endpoint=hub.url, settings=SMALL)
    with pytest.raises(HubUnreachable, match="could not reach the hub"):
        plan(hub)


def test_a_hub_that_ignores_range_is_refused_with_a_typed_error_for_the_fallback(hub: FakeHub, tmp_path: Path) -> None:
    """A server that answers a range with the whole file (200) cannot give a stage by its ranges:
    the fetch is refused with a typed error (the member then takes its stage from the host), and
    planning, which needs only the header, is refused the same way rather than reading the file."""
    with serving_hub(hub):
        header = plan(hub)
        hub.ranges = False
        with pytest.raises(HubMismatch, match="answered a range request with 200, not 206"):
            fetch(hub, header.model, DIVISION[1], tmp_path / "m", "hf_m")
        with pytest.raises(HubMismatch, match="not 206"):
            plan(hub)
    assert not list((tmp_path / "m").rglob("*.gguf"))
