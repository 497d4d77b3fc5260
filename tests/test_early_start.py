"""What `kafila host` and `kafila join` begin before importing the rest of themselves
(`cli.early_start`): read from the command line as the command reads it, and taken by the command
only for the same model or rendezvous; against the fake hub on loopback, a header read begun by
the entry point is the one the host then waits on, the hub asked for it once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, Repo, serving_hub
from tiny_models import write_tiny_model
from waiting import until

from kafila.cli.early_start import EarlyWork, begin, early_work, header_read_begun, nat_tests_begun
from kafila.hub.ranges import read_hub_header
from kafila.hub.reference import HubReference

REPO, FILE = "tiny-org/Tiny-GGUF", "Tiny-Q8_0.gguf"
MODEL = f"hf://{REPO}:Q8_0"


def test_a_host_with_members_begins_its_header_and_nat_tests_as_its_command_line_gives_them() -> None:
    both = EarlyWork(model=MODEL, rendezvous="203.0.113.1:8470")
    assert early_work("host", ["--model", MODEL, "--members", "3", "--rendezvous", "203.0.113.1:8470"], {}) == both
    assert early_work("host", [f"--model={MODEL}", "--members=3", "--rendezvous=203.0.113.1:8470"], {}) == both
    assert early_work("host", ["--threads", "1", "--model", MODEL, "--members", "2"], {}) == EarlyWork(model=MODEL)
    assert early_work("host", ["--demo"], {}) == EarlyWork()  # the bundled model, the embedded rendezvous
    assert early_work("host", ["--demo", "--model", MODEL], {}) == EarlyWork(model=MODEL)  # three, by default


def test_a_host_alone_or_a_command_line_the_command_refuses_begins_nothing() -> None:
    assert early_work("host", ["--model", MODEL], {}) == EarlyWork()  # alone: the whole file, downloaded
    assert early_work("host", ["--model", MODEL, "--members", "1"], {}) == EarlyWork()
    assert early_work("host", ["--model", MODEL, "--members", "three"], {}) == EarlyWork()
    assert early_work("host", ["--", "--model", MODEL, "--members", "3"], {}) == EarlyWork()
    assert early_work("probe", ["--model", MODEL, "--members", "3"], {}) == EarlyWork()


def test_a_member_begins_its_nat_tests_against_the_rendezvous_given_or_its_variable() -> None:
    assert early_work("join", ["7-a-b", "--rendezvous", "203.0.113.1"], {}) == EarlyWork(rendezvous="203.0.113.1")
    given = {"KAFILA_RENDEZVOUS": "203.0.113.2:9000"}
    assert early_work("join", ["7-a-b"], given) == EarlyWork(rendezvous="203.0.113.2:9000")
    assert early_work("join", ["7-a-b"], {}) == EarlyWork()  # its host found on the LAN


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "kafila"))  # the headers kept for their readers
    monkeypatch.delenv("HF_TOKEN", raising=False)
    model = write_tiny_model(tmp_path / FILE, "llama", n_blocks=4)
    return FakeHub({REPO: Repo({FILE: model.read_bytes()})})


def test_the_header_read_the_entry_point_began_is_the_one_the_host_takes(hub: FakeHub) -> None:
    with serving_hub(hub):
        begin("host", ["--model", MODEL, "--members", "3"], endpoint=hub.url)
        until(lambda: hub.gets_of(FILE), lambda: f"the header's read under way before the command takes it: {hub.seen}")
        taken = header_read_begun(MODEL, True)
        assert taken is not None
        reference = HubReference(REPO, filename=FILE)
        header = read_hub_header(reference, read=taken.result())
        assert header.model == read_hub_header(reference, endpoint=hub.url).model
    assert len(hub.gets_of(FILE)) == 2  # the early read's one request, and the comparison's
    assert header_read_begun(MODEL, False) is None  # taken once


def test_what_was_begun_for_another_rendezvous_is_not_taken() -> None:
    begin("join", ["7-a-b", "--rendezvous", "127.0.0.1:9"])
    tests = nat_tests_begun("127.0.0.2:9")
    assert tests is not None and tests.rendezvous == ("127.0.0.2", 9)
    assert nat_tests_begun(None) is None


def test_the_header_read_begins_before_the_gguf_reader_and_numpy_are_imported() -> None:
    """What `begin` needs to ask the hub for the header is huggingface_hub alone: the hub's answers
    come while `kafila host` imports the rest (numpy, the GGUF reader, the stage fetch)."""
    heavy = ("numpy", "gguf", "kafila.hub.ranges", "kafila.runtime.gguf.gguf_file")
    shown = f"import sys, kafila.cli.early_start; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
