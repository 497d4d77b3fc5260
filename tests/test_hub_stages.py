"""Every machine fetches its own stage from the hub (issue 36): `kafila host --model hf://…` with
real `kafila join` processes, the host planning from the model's header and each machine, the host
too, fetching by range exactly the tensors of its stage from the fake hub (tests/helpers/fake_hub.py),
told apart there by the token each sends; nobody downloads the whole file. Where a member cannot
have its stage from the hub (the hub out of its reach, or a gated repository and no token), the
host sends it (fetching it first), and /status says so and why."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_hub import FakeHub, Repo, serving_hub
from host_process import Host, free_port, running_host, seeded_cache, serving_alone, stop, until_status
from pydantic import ValidationError
from serving_checks import unsplit_greedy
from test_session_network import head_elsewhere
from tiny_gguf import write_split_parts
from tiny_models import ModelShape, write_tiny_model
from waiting import until

from kafila.contracts import HubModel, HubPart
from kafila.hub.fetch import fetch_model
from kafila.hub.reference import HubReference
from kafila.runtime.gguf.gguf_file import HeaderReader
from kafila.runtime.gguf.header import JOIN_GAP
from kafila.runtime.gguf.slicer import stage_piece
from kafila.runtime.gguf.stage_cache import stage_files
from kafila.session.deployer import offered
from kafila.wire.control import MAX_CONTROL_BYTES, Assign, ControlError, control_frame, parse_control

REPO = "tiny-org/Tiny-GGUF"
FILE = "Tiny-Q8_0.gguf"
PROMPT = "the quick brown fox"
SERVING = ("--context", "256", "--concurrency", "1")
COMMON = ("--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hub-stages") / FILE, "llama", n_blocks=4)


def assign(source: str, hub: HubModel | None) -> Assign:
    return Assign(
        epoch=1, stage_index=0, first_block=0, end_block=2, sha256="a" * 64, size=1000, source=source,  # type: ignore[arg-type]
        predecessor="host", successor="host", n_ctx=256, n_batch=32, n_seq_max=1, hub=hub,
    )  # fmt: skip


def hub_model(parts: int, path_chars: int = 20) -> HubModel:
    part = HubPart(path="p" * path_chars + ".gguf", size=10, sha256="b" * 64, header_bytes=8, header_sha256="c" * 64)
    return HubModel(repo_id="org/repo", commit="d" * 40, parts=(part,) * parts)


def test_an_assign_names_a_hub_model_exactly_when_its_stage_comes_from_the_hub() -> None:
    assert assign("hub", hub_model(1)).hub == hub_model(1)
    with pytest.raises(ValidationError, match="a hub model goes with source hub"):
        assign("hub", None)
    with pytest.raises(ValidationError, match="a hub model goes with source hub"):
        assign("transfer", hub_model(1))
    # it travels as a control message, and comes back the same
    message = assign("hub", hub_model(2))
    assert parse_control(control_frame(message)) == message


def test_only_a_stage_the_member_makes_from_a_source_it_trusts_may_come_unnamed_by_the_host() -> None:
    """A host that knows the model by its header alone holds no file of a member's stage, so it
    names no sha256 for it: the member checks what the hub sends against the planned headers, or
    cuts it from its own copy of the model (same sha256). A file the host sends, or one a cache
    holds, is always named."""
    unnamed = assign("hub", hub_model(1)).model_copy(update={"sha256": None})
    assert parse_control(control_frame(unnamed)).sha256 is None  # type: ignore[union-attr]
    for source in ("hub", "slice"):
        Assign.model_validate(
            {**unnamed.model_dump(), "source": source, "hub": unnamed.hub if source == "hub" else None}
        )
    for source in ("transfer", "cache"):
        with pytest.raises(ValidationError, match="is named by its sha256"):
            Assign.model_validate({**unnamed.model_dump(), "source": source, "hub": None})


def test_a_hub_model_too_long_for_a_control_message_is_offered_as_a_transfer() -> None:
    small = assign("hub", hub_model(3))
    assert offered(small) is small
    huge = offered(assign("hub", hub_model(1000, 200)))  # 1,000 parts of long names: past 64 KiB
    assert huge.source == "transfer" and huge.hub is None
    assert len(control_frame(huge).payload) <= MAX_CONTROL_BYTES
    with pytest.raises(ControlError, match="the limit is"):  # what a member would have refused
        parse_control(control_frame(assign("hub", hub_model(1000, 200))))


def hub_env(tmp_path: Path, who: str, endpoint: str, token: str | None) -> dict[str, str]:
    """A machine's own view of the hub: its endpoint, its token (or none at all) and its caches."""
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp_path / f"hf-home-{who}"),  # no token file but the one given here
        "HF_HUB_CACHE": str(tmp_path / f"hf-{who}"),
        "KAFILA_CACHE": str(tmp_path / f"kafila-{who}"),
    }
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def start_joiner(code: str, rendezvous: str, name: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """A real `kafila join` as another machine with its own hub settings, its output piped."""
    seeded_cache(Path(env["KAFILA_CACHE"]))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | env | {"COLUMNS": "200"}
    command = [sys.executable, "-m", "kafila", "join", code, "--rendezvous", rendezvous, "--name", name]
    command += ["--threads", "1"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)


@contextmanager
def hub_session(
    tmp_path: Path,
    hub: FakeHub,
    members: dict[str, dict[str, str]],
    outputs: dict[str, str],
    host: str = "host",
    settings: tuple[str, ...] = SERVING,
    joiners: dict[str, subprocess.Popen[str]] | None = None,
    reference: str = f"hf://{REPO}:Q8_0",
    before_joining: Callable[[Host], None] = lambda _host: None,
) -> Iterator[Host]:
    """A host on `hf://` with HF_TOKEN hf_host (its caches named `host`) and the members named, each
    with its own hub settings, joining one after another in the order given (so that a second
    session on the same machines plans them as the first did), their processes in `joiners`; their
    outputs land in `outputs` once the host has stopped (and on stderr when the test fails);
    `before_joining` is called with the host once it has said its join line."""
    joiners = {} if joiners is None else joiners
    failed = False
    host_env = hub_env(tmp_path, host, hub.url, "hf_host")
    seeded_cache(Path(host_env["KAFILA_CACHE"]))  # the test session's one probe, as the members': one division
    args = ("--model", reference, "--members", str(len(members) + 1), *settings, *COMMON)
    try:
        with running_host(*args, ready=False, env=host_env) as serving:
            code, rendezvous = serving.join_line()
            before_joining(serving)
            for name, env in members.items():
                joiners[name] = start_joiner(code, rendezvous, name, env)
                until_status(serving, lambda status, name=name: name in members_of(status), f"{name} to join", 120)
            yield serving
    except BaseException:
        failed = True
        raise
    finally:
        for name, joiner in joiners.items():
            outputs[name] = stop(joiner)
            if failed:
                print(f"--- {name} said:\n{outputs[name]}", file=sys.stderr)


def staged(count: int) -> Any:
    """/status with the ring serving and each of `count` members' stage source said."""

    def holds(status: dict[str, Any]) -> bool:
        members = [m for m in status.get("members", []) if not m.get("host")]
        return bool(status.get("ready")) and len(members) == count and all("stage_source" in m for m in members)

    return holds


def serving_unsplit(host: Host, model: Path, count: int, what: str) -> dict[str, Any]:
    """/status once the ring with `count` members serves, each member's stage said (`what`, if it
    never does), its greedy text checked to be the unsplit model's."""
    status = until_status(host, staged(count), what, 240)
    client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    return status


def members_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in status["members"] if not m.get("host")}


def fetched_for(reader: HeaderReader, blocks: list[int], is_head: bool) -> int:
    """What a machine fetches for a stage: the model's header again, checked, and the stage's tensors."""
    piece = stage_piece(reader, *blocks, is_head, FILE)
    return reader.header_bytes + sum(int(t.n_bytes) for t in piece.source_tensors())


def test_every_machine_fetches_only_its_own_stage_from_the_hub_and_the_ring_serves_the_unsplit_model(
    tmp_path: Path, model: Path
) -> None:
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})})
    outputs: dict[str, str] = {}
    with serving_hub(hub):
        members = {f"member-{i}": hub_env(tmp_path, f"m{i}", hub.url, f"hf_member{i}") for i in range(2)}
        with hub_session(tmp_path, hub, members, outputs) as host:
            status = until_status(host, staged(2), "a ring of three machines, its members' stages said", 240)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=12, temperature=0)
            assert result.choices[0].text and result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
            table = subprocess.run(
                [sys.executable, "-m", "kafila", "status", "--url", host.base_url], capture_output=True, text=True,
                timeout=60, check=True, env={**os.environ, "COLUMNS": "250"},
            ).stdout  # fmt: skip
    reader = HeaderReader(model)
    head = status["plan"]["head"]
    seen = members_of(status)
    assert {m["stage_source"] for m in seen.values()} == {"hub"}, seen
    whole = model.stat().st_size
    for i, name in enumerate(sorted(seen)):
        member = seen[name]
        assert member["stage_bytes"] > 0 and member["stage_seconds"] >= 0 and "stage_why" not in member
        got = hub.sent_to.get(f"Bearer hf_member{i}", 0)
        # the model's header again, checked, and its stage's tensors, with what lies in gaps under
        # JOIN_GAP between them (one request rather than two): never the whole model
        need = fetched_for(reader, member["blocks"], name == head)
        assert need <= got <= need + JOIN_GAP and got < whole, (name, got, need, whole)
        assert "fetching blocks" in outputs[name] and "receiving stage" not in outputs[name], outputs[name]
    assert table.count("hub, ") == 2, table
    # The host planned from the header (read once by a probe of at most twice its length, or a
    # sixteenth of the file) and fetched its own stage as a member does: not the whole file.
    own = next(m for m in status["members"] if m.get("host"))
    assert head == own["name"], status["plan"]  # the head here: its stage holds the vocabulary too
    need = fetched_for(reader, own["blocks"], True)
    got = hub.sent_to.get("Bearer hf_host", 0)
    probe = max(2 * reader.header_bytes, whole // 16)
    assert need <= got <= need + probe + JOIN_GAP and got < whole, (got, need, whole)
    assert 0 < hub.sent_of[FILE] - sum(hub.sent_to.get(f"Bearer hf_member{i}", 0) for i in range(2)) == got
    # Again, with the same machines (the host with a fresh cache, so that it prices and divides as
    # the first time): each finds its stage in its cache, and the hub sends them nothing.
    before = {f"Bearer hf_member{i}": hub.sent_to.get(f"Bearer hf_member{i}", 0) for i in range(2)}
    with serving_hub(hub), hub_session(tmp_path, hub, members, outputs, host="host-again") as host:
        again = until_status(host, staged(2), "the same ring again, its stages said", 240)
    assert {n: m["blocks"] for n, m in members_of(again).items()} == {n: m["blocks"] for n, m in seen.items()}
    assert {m["stage_source"] for m in members_of(again).values()} == {"cache"}, members_of(again)
    assert {token: hub.sent_to.get(token, 0) for token in before} == before


def test_the_host_fetches_its_stage_while_the_members_come_and_not_again_once_they_have_joined(
    tmp_path: Path, model: Path
) -> None:
    """Before anyone types its join line, the host fetches the stage a plan among machines like it
    gives it (here the plan's own: the members are alike); once they have joined and the plan is
    made, it fetches nothing more, and the ring serves the unsplit model's text."""
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})})
    outputs: dict[str, str] = {}
    fetched_before: list[int] = []

    def stage_fetched(host: Host) -> None:
        stages = tmp_path / "kafila-host" / "stages"  # the host's KAFILA_CACHE (hub_env)
        until(lambda: stage_files(stages) or host.process.poll() is not None, "the host's stage fetched ahead", 120)
        assert host.process.poll() is None, host.output()
        fetched_before.append(hub.sent_to.get("Bearer hf_host", 0))

    with serving_hub(hub):
        members = {f"member-{i}": hub_env(tmp_path, f"m{i}", hub.url, f"hf_member{i}") for i in range(2)}
        with hub_session(tmp_path, hub, members, outputs, before_joining=stage_fetched) as host:
            status = serving_unsplit(host, model, 2, "a ring of three machines, its members' stages said")
            said = host.output()
    own = next(m for m in status["members"] if m.get("host"))
    ahead = re.search(r"fetching blocks (\d+)-(\d+) and the head from the hub while the members come", said)
    assert ahead is not None and [int(ahead[1]), int(ahead[2]) + 1] == own["blocks"], (said, own)
    assert status["plan"]["head"] == own["name"], status["plan"]
    reader, whole = HeaderReader(model), model.stat().st_size
    need = fetched_for(reader, own["blocks"], True)
    got = hub.sent_to.get("Bearer hf_host", 0)
    assert got == fetched_before[0], (got, fetched_before)  # all of it before the members came; nothing after
    assert need <= got <= need + max(2 * reader.header_bytes, whole // 16) + JOIN_GAP, (got, need)
    assert said.count(f"fetching blocks {ahead[1]}-{ahead[2]} of {FILE}: ") == 2, said  # its start and its end


def test_a_host_too_small_for_the_head_fetches_its_blocks_and_the_vocabulary_and_serves_the_unsplit_model(
    tmp_path: Path, model: Path
) -> None:
    """`--memory` leaves the host room for a block but not the head: the head is on a member, and
    the host, which knows the model by its header alone, fetches its own blocks and the vocabulary
    file (the metadata and token embedding it tokenizes, embeds and samples with), not the whole
    file; the ring serves the unsplit model's text."""
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})})
    outputs: dict[str, str] = {}
    with serving_hub(hub):
        members = {f"member-{i}": hub_env(tmp_path, f"m{i}", hub.url, f"hf_member{i}") for i in range(2)}
        with hub_session(tmp_path, hub, members, outputs, settings=head_elsewhere(model)) as host:
            status = serving_unsplit(host, model, 2, "a ring with the head on a member")
            said = host.output()
    own = next(m for m in status["members"] if m.get("host"))
    assert status["plan"]["head"] != own["name"] and "blocks" in own, status
    assert {m["stage_source"] for m in members_of(status).values()} == {"hub"}, status
    reader = HeaderReader(model)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    need = fetched_for(reader, own["blocks"], False) + int(embedding.n_bytes)  # the header planned from, once
    whole = model.stat().st_size
    got = hub.sent_to.get("Bearer hf_host", 0)
    assert need <= got <= need + max(2 * reader.header_bytes, whole // 16) + 2 * JOIN_GAP and got < whole, (got, need)
    assert "fetching the vocabulary" in said and "downloading" not in said, said


def test_a_host_left_alone_downloads_the_whole_file_then_and_says_so(tmp_path: Path, model: Path) -> None:
    """The host's one member dies: it serves every block now, so it downloads the whole file (its
    whole stage, said in its output) and serves the unsplit model's text alone."""
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})})
    outputs: dict[str, str] = {}
    joiners: dict[str, subprocess.Popen[str]] = {}
    with serving_hub(hub):
        members = {"member-0": hub_env(tmp_path, "m0", hub.url, "hf_member0")}
        with hub_session(tmp_path, hub, members, outputs, joiners=joiners) as host:
            until_status(host, staged(1), "a ring of two machines", 240)
            before = hub.sent_to.get("Bearer hf_host", 0)
            assert before < model.stat().st_size
            joiners["member-0"].kill()
            until_status(host, serving_alone, "the host serving alone", 120)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=12, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
            said = host.output()
    assert hub.sent_to["Bearer hf_host"] - before == model.stat().st_size
    assert "it downloads the whole file" in said, said


def test_a_members_stage_fetch_cut_off_mid_way_resumes_where_it_broke_and_the_ring_serves_the_unsplit_model(
    tmp_path: Path, model: Path
) -> None:
    """The hub drops the member's connection 20,000 bytes into its stage's tensors (past its header,
    which is shorter): the member asks again from the byte where it broke, never from the start,
    keeps its stage from the hub rather than falling back to the host, and the ring serves the
    unsplit model's greedy text."""
    cut = 20_000
    assert HeaderReader(model).header_bytes < cut
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})}, cut_for={"Bearer hf_member0": cut})
    outputs: dict[str, str] = {}
    with serving_hub(hub):
        members = {"member-0": hub_env(tmp_path, "m0", hub.url, "hf_member0")}
        with hub_session(tmp_path, hub, members, outputs) as host:
            status = until_status(host, staged(1), "a ring of two machines, its member's stage said", 240)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=12, temperature=0)
            assert result.choices[0].text and result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    assert hub.cut_for == {}  # the member's connection was cut
    member = members_of(status)["member-0"]
    assert member["stage_source"] == "hub" and "stage_why" not in member, member
    asked = hub.ranges_of(FILE)
    resumed = [(a, b) for a, b in asked if (a - cut, b) in asked]
    assert resumed, asked  # the same range again, from where the cut left it
    # every byte of its stage fetched once: the header again, checked, and its tensors
    need = fetched_for(HeaderReader(model), member["blocks"], status["plan"]["head"] == "member-0")
    got = hub.sent_to["Bearer hf_member0"]
    assert need <= got <= need + JOIN_GAP, (got, need)
    assert "receiving stage" not in outputs["member-0"], outputs["member-0"]


def test_a_replan_after_a_member_leaves_fetches_only_the_tensors_each_machine_lacks(
    tmp_path: Path, model: Path
) -> None:
    """Of a ring of three on hf://, one member dies: the host and the member left divide the model
    again, and each fetches from the hub only the header and the tensors its kept stage does not
    hold (nothing, where its blocks did not change); the new ring serves the unsplit model's text."""
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()})})
    outputs: dict[str, str] = {}
    joiners: dict[str, subprocess.Popen[str]] = {}
    with serving_hub(hub):
        members = {f"member-{i}": hub_env(tmp_path, f"m{i}", hub.url, f"hf_member{i}") for i in range(2)}
        with hub_session(tmp_path, hub, members, outputs, joiners=joiners) as host:
            first = until_status(host, staged(2), "a ring of three machines", 240)
            before = dict(hub.sent_to)
            joiners["member-1"].kill()

            def replanned(status: dict[str, Any]) -> bool:
                left = members_of(status).get("member-0", {})
                return bool(status.get("ready")) and status.get("epoch", 0) > first["epoch"] and "stage_source" in left

            after = until_status(host, replanned, "a ring of the two machines left", 120)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=12, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 12)
    reader = HeaderReader(model)

    def lacked(name: str, token: str) -> tuple[int, int]:
        """What the machine `name` fetched for its new stage, and the most it should have: the
        tensors its kept stage lacks, and a member the header again, checked (the host has the one
        it planned from)."""
        old, new = (next(m for m in s["members"] if m["name"] == name) for s in (first, after))
        was = stage_piece(reader, *old["blocks"], name == first["plan"]["head"], FILE)
        now = stage_piece(reader, *new["blocks"], name == after["plan"]["head"], FILE)
        if (old["blocks"], name == first["plan"]["head"]) == (new["blocks"], name == after["plan"]["head"]):
            return hub.sent_to.get(token, 0) - before.get(token, 0), 0  # its stage as it was: from its cache
        missing = [t for t in now.source_tensors() if t.name not in was.copied()]
        header_again = reader.header_bytes if name != host_name else 0
        return hub.sent_to.get(token, 0) - before.get(token, 0), header_again + sum(int(t.n_bytes) for t in missing)

    host_name = next(m["name"] for m in after["members"] if m.get("host"))
    needs = []
    for name, token in ((host_name, "Bearer hf_host"), ("member-0", "Bearer hf_member0")):
        got, need = lacked(name, token)
        assert need <= got <= need + 2 * JOIN_GAP, (name, got, need, first["plan"], after["plan"])
        needs.append(need - (reader.header_bytes if name != host_name and need else 0))
    assert max(needs) > 0, needs  # the two left hold four blocks where they held three: tensors fetched
    assert members_of(after)["member-0"]["stage_source"] in ("hub", "cache"), after


def test_a_member_the_hub_will_not_serve_receives_its_stage_from_the_host_and_says_why(
    tmp_path: Path, model: Path
) -> None:
    """One member's hub is out of its reach (HF_ENDPOINT on a closed port), another has no token
    for a gated repository: both fall back to the host, and both say why, in their output and in
    the host's /status."""
    hub = FakeHub({REPO: Repo({FILE: model.read_bytes()}, gated=True)})
    outputs: dict[str, str] = {}
    nowhere = f"http://127.0.0.1:{free_port()}"
    with serving_hub(hub):
        members = {
            "cut-off": hub_env(tmp_path, "cut", nowhere, "hf_cut"),
            "no-token": hub_env(tmp_path, "anon", hub.url, None),
        }
        with hub_session(tmp_path, hub, members, outputs) as host:
            status = until_status(host, staged(2), "a ring whose members said where their stages came from", 240)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
    seen = members_of(status)
    assert {m["stage_source"] for m in seen.values()} == {"host"}, seen
    assert "HubUnreachable" in seen["cut-off"]["stage_why"], seen
    assert "HubRefused" in seen["no-token"]["stage_why"], seen
    assert hub.sent_to.get(None, 0) == 0  # the gated repository sent nothing without a token
    for name in members:
        assert "could not fetch blocks" in outputs[name] and "receiving stage" in outputs[name], outputs[name]


def test_a_member_whose_hub_sends_other_tensor_bytes_refuses_them_and_receives_its_stage_from_the_host(
    tmp_path: Path, model: Path
) -> None:
    """The member's hub (its own HF_ENDPOINT) serves the same header, size and listed sha256 at the
    same commit, but one byte differs in every block's first tensor: the stage it cuts is not the
    host's, so it refuses it and the host sends it. Only a host that holds the whole file can tell
    (here, downloaded before into its hub cache: it cuts every stage from it and names each by its
    sha256); a host that knows the model by its header alone trusts the hub at the pinned commit
    for the tensors' bytes, as docs/protocol.md says."""
    original = model.read_bytes()
    tampered = bytearray(original)
    seen_blocks = set()
    for tensor in HeaderReader(model).tensors:
        block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else None
        if block is not None and block not in seen_blocks:
            seen_blocks.add(block)
            tampered[int(tensor.data_offset)] ^= 0x01
    honest = FakeHub({REPO: Repo({FILE: original})})
    lying = FakeHub({REPO: Repo({FILE: bytes(tampered)}, listed_sha256={FILE: hashlib.sha256(original).hexdigest()})})
    outputs: dict[str, str] = {}
    with serving_hub(honest), serving_hub(lying):
        fetch_model(HubReference(REPO, quant="Q8_0"), endpoint=honest.url, hub_cache=tmp_path / "hf-host")
        members = {"misled": hub_env(tmp_path, "misled", lying.url, "hf_misled")}
        with hub_session(tmp_path, honest, members, outputs) as host:
            status = until_status(host, staged(1), "a ring whose member said where its stage came from", 240)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Tiny-Q8_0", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
    member = members_of(status)["misled"]
    assert member["stage_source"] == "host" and "HubMismatch" in member["stage_why"], member
    assert lying.sent_to.get("Bearer hf_misled", 0) > 0  # it did fetch, and refused what came
    assert "could not fetch blocks" in outputs["misled"] and "receiving stage" in outputs["misled"]


def test_a_model_in_49_parts_that_a_member_cannot_fetch_the_host_fetches_and_sends_in_requests_bounded_by_parts(
    tmp_path: Path,
) -> None:
    """A model split in 49 parts of three tensors each; the member's hub is out of its reach, so the
    host, which planned from the 49 headers, fetches that member's stage itself and sends it. Each
    fetch asks every part's header once and each part's tensors in one range (one request a part,
    never one a tensor), over connections the client keeps: the hub's requests grow with the parts,
    not with parts times tensors. The ring serves the unsplit model's greedy text."""
    shape = ModelShape(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, tied_output=False, embd_std=1.0)
    whole = write_tiny_model(tmp_path / "Split-Q8_0.gguf", "llama", n_blocks=16, shape=shape)  # 147 tensors
    (tmp_path / "parts").mkdir()
    parts = write_split_parts(whole, tmp_path / "parts", 49)
    n_tensors = len(HeaderReader(whole).tensors)
    assert n_tensors == 3 * len(parts)
    repo = "tiny-org/Split-GGUF"
    hub = FakeHub({repo: Repo({p.name: p.read_bytes() for p in parts})})
    outputs: dict[str, str] = {}
    nowhere = f"http://127.0.0.1:{free_port()}"
    with serving_hub(hub):
        members = {"cut-off": hub_env(tmp_path, "cut", nowhere, "hf_cut")}
        with hub_session(tmp_path, hub, members, outputs, reference=f"hf://{repo}:Q8_0") as host:
            status = until_status(host, staged(1), "a ring whose member took its stage from the host", 240)
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="Split-Q8_0", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text and result.choices[0].text == unsplit_greedy(whole, PROMPT, 8)
    member = members_of(status)["cut-off"]
    assert member["stage_source"] == "host" and "HubUnreachable" in member["stage_why"], member
    assert "receiving stage" in outputs["cut-off"], outputs["cut-off"]
    gets = [(path, asked) for method, path, asked in hub.seen if method == "GET" and "/resolve/" in path]
    tensor_gets = [(path, asked) for path, asked in gets if asked is not None and not asked.startswith("bytes=0-")]
    heads = [path for method, path, _ in hub.seen if method == "HEAD"]
    # Two fetches by range (the host's own stage and the member's), each one range a part at most;
    # per tensor it would be up to 147.
    assert 0 < len(tensor_gets) <= 2 * len(parts), len(tensor_gets)
    # Every part's header: probed to plan, then checked by each fetch; and its HEAD each time.
    assert len(gets) - len(tensor_gets) <= 4 * len(parts) and len(heads) <= 4 * len(parts), (len(gets), len(heads))
    # Connections kept alive and shared by the fetches' workers (8 at a time): 17 were seen for
    # about 350 requests; one a request, or one a tensor, would be hundreds.
    assert len(hub.connections) <= len(parts), len(hub.connections)
