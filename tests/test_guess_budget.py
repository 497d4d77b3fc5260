"""Every guess at the session code's secret is counted, and none is answered before it is proved:
an attacker that is not `kafila join` (the library's own client and exchange, driven by hand)
joins a real `kafila host` with a guessed secret, sends its SPAKE2 message, and then does what a
guesser would to learn the answer without proving it: aborts, sends garbage, goes silent, leaves,
or proves its guess. The host's only answers are its own SPAKE2 message (which says nothing of the
secret) and its notice of refusal; each try costs one of its 3 possible guesses, and the third
ends a forming host."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from host_process import Host, running_host, start_member, status_of, stop, until_status, wait_ready
from tiny_models import write_tiny_model

from kafila.contracts import FleetDevice
from kafila.network.pake import Exchange, Role, TrustError, abort_message
from kafila.network.rendezvous_client import RendezvousClient, RendezvousError
from kafila.session.presence import rendezvous_endpoints

COMMON = ("--context", "256", "--concurrency", "2", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
ENV = {"KAFILA_TRUST_EXCHANGE_S": "3"}  # silence is found out in 3 s, not 30
FINGERPRINT = "ab" * 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("guesses") / "tiny.gguf", "llama", n_blocks=4)


def a_guess(code: str) -> str:
    """The same public words, another secret."""
    words = code.split("-")
    return "-".join([*words[:-1], "zebra" if words[-1] != "zebra" else "tiger"])


async def guess_once(rendezvous: str, code: str, name: str, ending: str) -> list[str]:
    """One try at the secret that ends as `ending`; every kind of message the host sent back."""
    host, port = rendezvous.rsplit(":", 1)
    url, _ = rendezvous_endpoints((host, int(port)))
    client = await RendezvousClient.join(
        url, code, capability=FleetDevice(name=name, memory_gib=8), fingerprint=FINGERPRINT
    )
    host_id = client.host_id
    exchange = Exchange(
        Role.JOINER, code, host_id=host_id, joiner_id=client.member_id,
        own_fingerprint=FINGERPRINT, peer_fingerprint=client.members[host_id].fingerprint,
    )  # fmt: skip
    heard: list[str] = []
    try:
        await client.send_signal(host_id, exchange.start())
        first = await client.next_signal(host_id, timeout=30)
        heard.append(json.loads(first)["kind"])
        if ending == "proof":  # the guess proved, as `kafila join` would: the joiner proves first
            for reply in exchange.receive(first):
                await client.send_signal(host_id, reply)
        elif ending == "abort":
            await client.send_signal(host_id, abort_message(TrustError("never mind")))
        elif ending == "garbage":
            await client.send_signal(host_id, "{not a trust message")
        elif ending == "leave":
            await client.leave()
            return heard
        while True:  # whatever else the host says, until it sends this joiner away ("silence": waits for that)
            heard.append(json.loads(await client.next_signal(host_id, timeout=30))["kind"])
    except (RendezvousError, TimeoutError):
        return heard
    finally:
        await client.close()


def guesses(host: Host, endings: list[str]) -> None:
    """Each try in turn, once the host has counted the one before (its /status, not the clock)."""
    code, rendezvous = host.join_line()
    for index, ending in enumerate(endings):
        heard = asyncio.run(guess_once(rendezvous, a_guess(code), f"guesser-{index}", ending))
        assert heard[0] == "pake" and "confirm" not in heard, (ending, heard)  # no answer to the guess
        assert set(heard[1:]) <= {"abort"}, (ending, heard)
        if index + 1 < len(endings):
            until_status(host, lambda status, n=index + 1: status["failed_proofs"] == n, f"{index + 1} counted")


def test_each_way_a_guess_can_end_is_counted_and_none_is_answered(model: Path, tmp_path: Path) -> None:
    """A proof of a wrong secret and one that leaves after its SPAKE2 message: two of the three
    guesses spent. An honest member then forms the session with the same code."""
    with running_host("--model", model, "--members", "2", *COMMON, ready=False, env=ENV) as host:
        guesses(host, ["proof", "leave"])
        status = until_status(host, lambda status: status["failed_proofs"] == 2, "both counted")
        assert status["admitting"] is True and status["guess_budget"] == 3
        code, rendezvous = host.join_line()
        member = start_member(code, rendezvous, "honest", tmp_path / "cache", "--threads", "1")
        try:
            wait_ready(host)
            assert status_of(host)["failed_proofs"] == 2
        finally:
            stop(member)


def test_three_guesses_that_never_prove_anything_end_a_forming_host(model: Path) -> None:
    """Abort, garbage, silence, each after the SPAKE2 message: the third spends the budget, and a
    forming host stops, saying why (a new code needs a new start)."""
    with running_host("--model", model, "--members", "2", *COMMON, ready=False, env=ENV) as host:
        guesses(host, ["abort", "garbage", "silence"])
        assert host.process.wait(timeout=60) != 0
        assert "admits no one from now on" in host.output(), host.output()
