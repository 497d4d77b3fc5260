"""A stage file the host sends a member, cut mid-way in a real session: the member keeps what it
got, and the host's next offer of the same file sends only the rest."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import openai
import pytest
from host_process import running_host, said, serving_alone, start_member, stop, until_status
from serving_checks import unsplit_greedy
from tiny_models import write_wide_model
from waiting import until

from kafila.network.link import LinkConfig

PROMPT = "the quick brown fox"
CHUNK = 1 << 20  # the transfer's chunk: a partial file is kept in whole chunks
RESUMED = re.compile(r"member-0 held (\d+) bytes of its stage from before: sent the other (\d+)")
COMMON = ("--context", "256", "--concurrency", "2", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose member stage is several chunks (about 4 MB a block), so a transfer can be cut
    mid-way by the test."""
    return write_wide_model(tmp_path_factory.mktemp("resume") / "wide.gguf", n_blocks=6)


def partial_in(cache: Path) -> Path | None:
    return next(iter(cache.rglob("*.partial")), None)


def test_a_stage_transfer_cut_mid_way_resumes_from_the_members_bytes_and_serves_the_same_text(
    tmp_path: Path, wide: Path
) -> None:
    """The member stops (SIGSTOP) once two chunks of its stage are in: the host, hearing nothing for
    the links' idle bound, serves alone. Woken, the member finds its host link gone, joins again
    with the same cache, and the host's new offer of the same stage sends only what the member's
    partial file lacks; the ring then serves the unsplit model's greedy text. Both processes' links
    pace the stage with the "rate" congestion controller (kafila.network.congestion), the links'
    default: this is its end-to-end check that a stage arrives whole and a cut one resumes."""
    assert LinkConfig().congestion_control == "rate"
    cache = tmp_path / "cache"
    with running_host("--model", wide, "--members", "2", *COMMON, ready=False) as host:
        code, rendezvous = host.join_line()
        member = start_member(code, rendezvous, "member-0", cache, "--threads", "1")
        try:

            def two_chunks_in() -> bool:
                assert member.poll() is None, host.output()
                partial = partial_in(cache)
                return partial is not None and partial.stat().st_size >= 2 * CHUNK

            # polled often: on loopback the rest of the stage follows in well under a second
            until(two_chunks_in, lambda: f"two chunks of the stage in the member's cache\n{host.output()}", 120, 0.002)
            member.send_signal(signal.SIGSTOP)
            partial = partial_in(cache)
            assert partial is not None, "the stage's partial file went before the member stopped"
            try:
                until_status(host, serving_alone, "serving alone, the member's link gone")
                kept = partial.stat().st_size
            finally:
                member.send_signal(signal.SIGCONT)
            try:
                status = until_status(
                    host,
                    lambda s: (
                        s.get("ready") and any(m.get("name") == "member-0" and "blocks" in m for m in s["members"])
                    ),
                    "a ring that takes the member back",
                )
            except AssertionError as error:
                raise AssertionError(f"{error}\n--- the member said:\n{stop(member)}") from None
            assert said(host, "member-0 held"), host.output()
            held, sent = map(int, RESUMED.findall(host.output())[0])
            # whole chunks, at least those in before the cut (more came while the link's loss was found)
            assert held % CHUNK == 0 and held >= kept - kept % CHUNK and sent > 0, (held, kept)
            [stage] = [p for p in cache.rglob("*.gguf") if re.fullmatch(r"[0-9a-f]{64}\.gguf", p.name)]
            assert held + sent == stage.stat().st_size
            member_status = next(m for m in status["members"] if m.get("name") == "member-0")
            assert member_status["stage_source"] == "host", member_status
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=60)
            result = client.completions.create(model="wide", prompt=PROMPT, max_tokens=12, temperature=0)
            assert result.choices[0].text == unsplit_greedy(wide, PROMPT, 12)
            assert not list(cache.rglob("*.partial"))
        finally:
            output = stop(member)
        assert "Traceback" not in output, output
