"""`kafila host`'s header read begun as the command starts (`cli.early_start.HeaderRead`), against
the fake hub on loopback: it gives what reading the header then gives, and fails as that read fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_hub import FakeHub, Repo, serving_hub
from tiny_models import write_tiny_model

from kafila.cli.early_start import HeaderRead, header_read_begun
from kafila.hub.fetch import ModelFetchError
from kafila.hub.ranges import read_hub_header
from kafila.hub.reference import HubReference

REPO = "tiny-org/Tiny-GGUF"
FILE = "Tiny-Q8_0.gguf"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))  # the headers kept for their readers
    monkeypatch.delenv("HF_TOKEN", raising=False)
    model = write_tiny_model(tmp_path / FILE, "llama", n_blocks=4)
    return FakeHub({REPO: Repo({FILE: model.read_bytes(), "README.md": b"# tiny\n"})})


def test_a_header_read_begun_early_is_the_header_read_then(hub: FakeHub) -> None:
    reference = HubReference(REPO, filename=FILE)
    with serving_hub(hub):
        begun = HeaderRead(reference, endpoint=hub.url)
        early = read_hub_header(reference, read=begun.result())
        then = read_hub_header(reference, endpoint=hub.url)
    assert early.model == then.model and early.manifest() == then.manifest()
    assert begun.reference == reference


def test_a_header_read_begun_early_fails_as_the_read_then_fails(hub: FakeHub) -> None:
    missing = HubReference("tiny-org/Nowhere-GGUF", filename=FILE)
    with serving_hub(hub):
        begun = HeaderRead(missing, endpoint=hub.url)
        with pytest.raises(ModelFetchError) as early:
            begun.result()
        with pytest.raises(ModelFetchError) as then:
            read_hub_header(missing, endpoint=hub.url)
    assert type(early.value) is type(then.value) and str(early.value) == str(then.value)


def test_only_a_hub_name_for_a_host_with_members_begins_a_read(tmp_path: Path) -> None:
    local = write_tiny_model(tmp_path / "local.gguf", "llama", n_blocks=2)
    assert header_read_begun(str(local), True) is None  # a local file: no hub
    assert header_read_begun(f"hf://{REPO}:Q8_0", False) is None  # alone, the host downloads the whole file
    assert header_read_begun(None, True) is None  # the bundled model
    assert header_read_begun("hf://", True) is None  # refused by model_source, saying why
