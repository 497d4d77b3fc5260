"""Models by name: `kafila host --model hf://org/repo:QUANT`. The pure core (names, choosing the
file from a listing) and the shell around huggingface_hub, against a real HTTP server on loopback
that speaks the hub's API (tests/helpers/fake_hub.py), serving tiny GGUF models."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from disks import small_disk
from fake_hub import FakeHub, Repo, serving_hub
from host_process import running_host
from huggingface_hub import constants as hub_constants
from tiny_gguf import write_split_parts
from tiny_models import write_tiny_model

from kafila.hub.fetch import FetchedModel, ModelFetchError, fetch_model
from kafila.hub.reference import (
    HubFile,
    HubReference,
    ModelNameError,
    choose_file,
    parse_reference,
    quant_of,
)
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.gguf.gguf_file import GGUFFormatError
from kafila.runtime.gguf.gguf_merge import merge_parts
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings
from kafila.units import human_bytes

REPO = "tiny-org/Tiny-GGUF"


# ---- the pure core ----------------------------------------------------------------------------


def test_names_that_mean_the_hub_and_names_that_mean_a_file() -> None:
    assert parse_reference("hf://Qwen/Qwen3-8B-GGUF:Q4_K_M") == HubReference("Qwen/Qwen3-8B-GGUF", quant="Q4_K_M")
    assert parse_reference("Qwen/Qwen3-8B-GGUF:q8_0") == HubReference("Qwen/Qwen3-8B-GGUF", quant="q8_0")
    assert parse_reference("hf://org/repo") == HubReference("org/repo")
    assert parse_reference("org/repo/sub/model-Q8_0.gguf") == HubReference("org/repo", filename="sub/model-Q8_0.gguf")
    assert parse_reference("hf://org/repo/model.gguf") == HubReference("org/repo", filename="model.gguf")
    # local paths: an existing file, a path from the root or here, a bare file name
    assert parse_reference("org/repo/model.gguf", local_file_exists=True) is None
    assert parse_reference("/models/org/model.gguf") is None
    assert parse_reference("./org/repo/model.gguf") is None
    assert parse_reference("model.gguf") is None
    assert parse_reference("org/repo") is None  # without hf:// two words are a path, not a whole repository
    assert str(HubReference("org/repo", quant="Q8_0")) == "hf://org/repo:Q8_0"


@pytest.mark.parametrize(
    "value",
    ["hf://org:Q4", "hf://org/re po:Q4", "hf://org/repo:Q4 K", "hf://org/repo/", "hf://org/repo/a/../b.gguf",
     "hf://-org/repo:Q4", "hf://org/repo:", "hf://" + "a" * 600],
)  # fmt: skip
def test_a_bad_hub_name_is_a_clear_error(value: str) -> None:
    with pytest.raises(ModelNameError):
        parse_reference(value)


LISTING = [
    HubFile("README.md"),
    HubFile("Qwen3-8B-Q4_K_M.gguf"),
    HubFile("Qwen3-8B-Q4_K_S.gguf"),
    HubFile("Qwen3-8B-IQ4_XS.gguf"),
    HubFile("Qwen3-8B-Q8_0.gguf"),
    HubFile("mmproj-Qwen3-8B-F16.gguf"),
    HubFile("BF16/Qwen3-8B-BF16-00002-of-00002.gguf"),
    HubFile("BF16/Qwen3-8B-BF16-00001-of-00002.gguf"),
]


def test_the_quant_picks_one_file_as_a_whole_word_whatever_its_case() -> None:
    assert choose_file(HubReference("q/r", quant="q4_k_m"), LISTING).first.path == "Qwen3-8B-Q4_K_M.gguf"
    assert choose_file(HubReference("q/r", quant="Q8_0"), LISTING).parts == (HubFile("Qwen3-8B-Q8_0.gguf"),)
    assert choose_file(HubReference("q/r", quant="IQ4_XS"), LISTING).first.path == "Qwen3-8B-IQ4_XS.gguf"
    assert quant_of("Qwen3-8B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL" and quant_of("README.gguf") is None


def test_a_split_model_comes_with_every_part_in_order() -> None:
    choice = choose_file(HubReference("q/r", quant="bf16"), LISTING)
    assert choice.split and [p.path for p in choice.parts] == [
        "BF16/Qwen3-8B-BF16-00001-of-00002.gguf",
        "BF16/Qwen3-8B-BF16-00002-of-00002.gguf",
    ]
    named = choose_file(HubReference("q/r", filename="BF16/Qwen3-8B-BF16-00002-of-00002.gguf"), LISTING)
    assert named.parts == choice.parts
    with pytest.raises(ModelNameError, match="should have 3 parts"):
        choose_file(HubReference("q/r", quant="Q2_K"), [HubFile("m-Q2_K-00001-of-00003.gguf")])


def test_no_match_or_several_matches_name_what_there_is() -> None:
    with pytest.raises(
        ModelNameError, match=r"no GGUF file for quant Q5_K_M; it has: BF16, IQ4_XS, Q4_K_M, Q4_K_S, Q8_0$"
    ):
        choose_file(HubReference("q/r", quant="Q5_K_M"), LISTING)
    with pytest.raises(ModelNameError, match="no GGUF file for quant Q4_K;"):  # Q4_K is not Q4_K_M's prefix
        choose_file(HubReference("q/r", quant="Q4_K"), LISTING)
    twice = [HubFile("a-Q8_0.gguf"), HubFile("b-Q8_0.gguf")]
    with pytest.raises(ModelNameError, match=r"matches several files.*a-Q8_0\.gguf, b-Q8_0\.gguf"):
        choose_file(HubReference("q/r", quant="Q8_0"), twice)
    with pytest.raises(ModelNameError, match="several GGUF models; name one"):
        choose_file(HubReference("q/r"), LISTING)
    assert choose_file(HubReference("q/r"), [HubFile("only.gguf"), HubFile("mmproj-x.gguf")]).first.path == "only.gguf"
    with pytest.raises(ModelNameError, match=r"has no file 'x\.gguf'"):
        choose_file(HubReference("q/r", filename="x.gguf"), LISTING)


# ---- the shell, against a hub on loopback --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny.gguf", "llama", n_blocks=2).read_bytes()


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("split")
    whole = write_tiny_model(folder / "tiny-Q8_0.gguf", "llama", n_blocks=2)
    return whole, write_split_parts(whole, folder, 2)


@pytest.fixture
def hub(tiny_bytes: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))  # the memo of model hashes
    files = {"Tiny-Q8_0.gguf": tiny_bytes, "Tiny-F16.gguf": tiny_bytes, "README.md": b"# tiny\n"}
    return FakeHub({REPO: Repo(files)})


def fetch(hub: FakeHub, name: str, cache: Path, seen: list[tuple[str, int, int]] | None = None) -> FetchedModel:
    reference = parse_reference(name)
    assert reference is not None
    update = (lambda what, done, total: seen.append((what, done, total))) if seen is not None else None
    return fetch_model(reference, update, endpoint=hub.url, hub_cache=cache)


def test_a_quant_is_downloaded_once_checked_and_then_taken_from_the_cache(
    hub: FakeHub, tiny_bytes: bytes, tmp_path: Path
) -> None:
    with serving_hub(hub):
        seen: list[tuple[str, int, int]] = []
        first = fetch(hub, f"{REPO}:q8_0", tmp_path / "hf", seen)
        assert first.path.read_bytes() == tiny_bytes and first.path.name == "Tiny-Q8_0.gguf"
        assert tmp_path / "hf" in first.path.parents  # in the hub's cache
        assert hub.gets_of("Tiny-Q8_0.gguf") == [None]
        whole = len(tiny_bytes)
        assert ("downloading Tiny-Q8_0.gguf", whole, whole) in seen
        assert ("checking Tiny-Q8_0.gguf", whole, whole) in seen  # the sha256 the hub lists, compared
        again: list[tuple[str, int, int]] = []
        second = fetch(hub, f"hf://{REPO}:Q8_0", tmp_path / "hf", again)
        assert second.path == first.path
        assert hub.gets_of("Tiny-Q8_0.gguf") == [None]  # no second download
        assert again == []  # nor a second hash: remembered by path, size and time
        assert first.offline is None
    # the hub gone (its port closed): the copy this machine checked is served, said to be that
    offline = fetch(hub, f"hf://{REPO}:Q8_0", tmp_path / "hf")
    assert offline.path == first.path and offline.commit == first.commit
    assert offline.offline is not None and "refused" in offline.offline.lower()
    with pytest.raises(ModelFetchError, match=r"could not reach the hub for tiny-org/Other.*no earlier download"):
        fetch(hub, "hf://tiny-org/Other:Q8_0", tmp_path / "hf")


def test_an_interrupted_download_resumes_with_a_range_request(
    hub: FakeHub, tiny_bytes: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's client keeps what it wrote, in whole pieces of DOWNLOAD_CHUNK_SIZE (10 MiB), and asks
    for the rest; the tiny model is 160 KiB, so the pieces are made 1 KiB here."""
    monkeypatch.setattr(hub_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.drop_after["Tiny-F16.gguf"] = 4096
    with serving_hub(hub):
        fetched = fetch(hub, f"{REPO}/Tiny-F16.gguf", tmp_path / "hf")
    assert hub.gets_of("Tiny-F16.gguf") == [None, "bytes=4096-"]
    assert hashlib.sha256(fetched.path.read_bytes()).digest() == hashlib.sha256(tiny_bytes).digest()


def test_a_file_whose_hash_is_not_the_listed_one_is_refused_and_deleted(hub: FakeHub, tmp_path: Path) -> None:
    hub.repos[REPO].listed_sha256["Tiny-Q8_0.gguf"] = "ab" * 32
    with serving_hub(hub), pytest.raises(ModelFetchError, match=f"the hub lists {'ab' * 32}.*deleted"):
        fetch(hub, f"hf://{REPO}:Q8_0", tmp_path / "hf")
    kept = [p for p in (tmp_path / "hf").rglob("*") if {"blobs", "snapshots"} & set(p.parts) and not p.is_dir()]
    assert kept == []  # neither the blob nor the snapshot's link: the next run downloads afresh


def test_a_quant_the_repository_lacks_names_those_it_has(hub: FakeHub, tmp_path: Path) -> None:
    with serving_hub(hub), pytest.raises(ModelNameError, match="no GGUF file for quant Q4_K_M; it has: F16, Q8_0"):
        fetch(hub, f"hf://{REPO}:Q4_K_M", tmp_path / "hf")
    assert hub.gets_of("Tiny-Q8_0.gguf") == []


def test_a_missing_repository_is_refused_before_any_download(hub: FakeHub, tmp_path: Path) -> None:
    with serving_hub(hub), pytest.raises(ModelFetchError, match="no repository tiny-org/Nothing on the hub"):
        fetch(hub, "hf://tiny-org/Nothing:Q8_0", tmp_path / "hf")
    assert not [s for s in hub.seen if "/resolve/" in s[1]]


def test_split_parts_merge_into_the_model_they_were_cut_from(
    split_model: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    """Kafila's reader reads one file: a part alone is refused with the way out, and the merged
    parts are the model again, to the token llama.cpp generates from it."""
    whole, parts = split_model
    with pytest.raises(GGUFFormatError, match=r"one part of a model split in 2 files.*llama-gguf-split --merge"):
        read_manifest(parts[0])
    merged = merge_parts(parts, tmp_path / "merged.gguf")
    assert read_manifest(merged) == read_manifest(whole)
    texts = []
    for model in (whole, merged):
        engine = open_engine(model, [2], ContextSettings(n_ctx=128, n_batch=32, n_seq_max=1, n_threads=1))
        try:
            texts.append(generate(engine, "hello world", 16, SamplingSettings()).text)
        finally:
            engine.close()
    assert texts[0] == texts[1] and texts[0]
    with pytest.raises(GGUFFormatError, match="split in 2 parts; 1 were given"):
        merge_parts(parts[:1], tmp_path / "half.gguf")


def test_a_split_model_on_the_hub_is_downloaded_checked_and_merged_once(
    hub: FakeHub, split_model: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    whole, parts = split_model
    hub.repos["tiny-org/Big-GGUF"] = Repo({p.name: p.read_bytes() for p in parts})
    with serving_hub(hub):
        seen: list[tuple[str, int, int]] = []
        fetched = fetch(hub, "hf://tiny-org/Big-GGUF:q8_0", tmp_path / "hf", seen)
        assert fetched.path.name == "tiny-Q8_0.gguf" and tmp_path / "kafila" in fetched.path.parents
        assert [p.path for p in fetched.choice.parts] == [p.name for p in parts]
        assert read_manifest(fetched.path) == read_manifest(whole)
        shown = {what for what, _, _ in seen}
        assert shown >= {f"{doing} {p.name}" for p in parts for doing in ("downloading", "checking")}
        assert any(what.startswith("merging 2 parts") and done == total for what, done, total in seen)
        before = list(hub.seen)
        assert fetch(hub, "hf://tiny-org/Big-GGUF:Q8_0", tmp_path / "hf").path == fetched.path
        assert [s for s in hub.seen[len(before) :] if "/resolve/" in s[1]] == []  # the merged file is kept


def test_a_member_resolves_no_names() -> None:
    """Only the host downloads: `kafila join --model` takes this machine's own file, and says so."""
    code = "7-crimson-harbor-lemon-tiger-orbit-cactus"
    refused = subprocess.run(
        [sys.executable, "-m", "kafila", "join", code, "--rendezvous", "127.0.0.1:9", "--model", f"hf://{REPO}:Q8_0"],
        env={**os.environ, "COLUMNS": "300"}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "a model on the hub is for the host to name" in refused.stderr


def test_kafila_host_serves_a_model_named_on_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    """The whole path: HF_ENDPOINT, HF_TOKEN and HF_HUB_CACHE as a person sets them, `kafila host
    --model hf://…` downloading, checking and serving the file, and the official client's completion."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hf"), "KAFILA_CACHE": str(tmp_path / "kafila"), "HF_TOKEN": "hf_kafila"}
    with serving_hub(hub):
        env["HF_ENDPOINT"] = hub.url
        refused = subprocess.run(
            [sys.executable, "-m", "kafila", "host", "--model", f"{REPO}:Q4_K_M", "--port", "0"],
            env={**os.environ, **env, "COLUMNS": "300"}, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert "no GGUF file for quant Q4_K_M; it has: F16, Q8_0" in refused.stderr
        assert "taken as a hub name" in refused.stderr  # no hf://: it could have been a mistyped path
        args = ("--model", f"hf://{REPO}:Q8_0", "--context", "256", "--concurrency", "1", "--threads", "1")
        with running_host(*args, env=env) as host:
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            assert [m.id for m in client.models.list().data] == ["Tiny-Q8_0"]
            done = client.completions.create(model="Tiny-Q8_0", prompt="hello", max_tokens=4, temperature=0)
            assert done.usage is not None and done.usage.completion_tokens == 4
            said = host.output()
            assert f"model hf://{REPO}:Q8_0:" in said
            # stderr is a log here, not a terminal: a line as each long job starts and one as it ends
            size = human_bytes(len(hub.repos[REPO].files["Tiny-Q8_0.gguf"]))
            assert f"downloading Tiny-Q8_0.gguf: {size}" in said and f"checking Tiny-Q8_0.gguf: {size}" in said
            assert said.count("Tiny-Q8_0.gguf: done in") == 2
    assert hub.gets_of("Tiny-Q8_0.gguf") == [None]
    asked = {(what, token) for what, token in hub.authorizations if "/api/models/" in what or "/resolve/" in what}
    assert {token for _, token in asked} == {"Bearer hf_kafila"}  # the listings, the HEAD and the download
    assert {what.split()[0] for what, _ in asked} == {"GET", "HEAD"}


def test_a_hub_that_ignores_range_still_gives_the_whole_file_after_a_cut(
    hub: FakeHub, tiny_bytes: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server (a mirror, a proxy) that answers a resumed download's Range with the whole file
    (200): the client takes that answer from its start, and the file is whole and checked."""
    monkeypatch.setattr(hub_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.ranges = False
    hub.drop_after["Tiny-F16.gguf"] = 4096
    with serving_hub(hub):
        fetched = fetch(hub, f"{REPO}/Tiny-F16.gguf", tmp_path / "hf")
    assert hub.gets_of("Tiny-F16.gguf") == [None, "bytes=4096-"]  # it asked for the rest, and got all of it
    assert fetched.path.read_bytes() == tiny_bytes


def test_a_disk_that_fills_mid_download_is_a_clear_error(hub: FakeHub, tiny_bytes: bytes, tmp_path: Path) -> None:
    """The hub's cache on a disk with room for a part of the model: the download stops with an
    error that says the disk is full, not a traceback, and no file passes for the model."""
    with small_disk(tmp_path / "disk", "64k") as disk, serving_hub(hub):
        assert len(tiny_bytes) > 64 << 10
        with pytest.raises(ModelFetchError, match=r"downloading Tiny-F16.gguf .* failed: .*No space left on device"):
            fetch(hub, f"{REPO}/Tiny-F16.gguf", disk / "hf")
        assert not list(disk.rglob("Tiny-F16.gguf"))  # no file by the model's name: nothing passes for it


def test_parts_merged_onto_a_disk_that_fills_up_say_so_and_leave_nothing(
    split_model: tuple[Path, list[Path]], tmp_path: Path
) -> None:
    _whole, parts = split_model
    with small_disk(tmp_path / "disk", "64k") as disk:
        assert sum(part.stat().st_size for part in parts) > 64 << 10
        with pytest.raises(GGUFFormatError, match=r"the disk holding .* filled up while the parts were merged: free"):
            merge_parts(parts, disk / "merged.gguf")
        assert not list(disk.iterdir())
