"""The trust exchange: SPAKE2 on the session code, fingerprint confirmation, the host's roster.

First the sans-IO exchange on its own (real spake2, no network), then real clients through a
real rendezvous on loopback, and through rendezvous doubles that tamper: each is a subclass of
the real core that rewrites what it sends, so everything else about the service stays real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.network.identity import create_identity
from kafila.network.pake import (
    Abort,
    AbortReason,
    CodeMismatch,
    Confirm,
    Exchange,
    FingerprintMismatch,
    PeerRefused,
    Role,
    RosterMismatch,
    TrustError,
    TrustProtocolError,
    abort_message,
    check_roster,
    confirm_mac,
    encode,
)
from kafila.network.rendezvous import (
    ConnId,
    Joined,
    MemberInfo,
    MemberJoined,
    Opened,
    Output,
    Ready,
    Rendezvous,
    Send,
    SignalFrom,
    Wire,
)
from kafila.network.rendezvous_client import (
    ProvenButRefused,
    RendezvousClient,
    TrustTimeout,
    send_abort,
    verify_host,
    verify_members,
    verify_newcomer,
)
from kafila.network.rendezvous_server import RendezvousHandle, start_rendezvous
from kafila.network.session_codes import CodeFormatError

CODE = "7-crimson-harbor-lemon-tiger-orbit-cactus"
WRONG = "7-crimson-harbor-lemon-tiger-orbit-zebra"  # same channel, another secret
HOST_FP, JOINER_FP, OTHER_FP, EVIL_FP = "a1" * 32, "b2" * 32, "c3" * 32, "e0" * 32
T = TypeVar("T")


def pair(
    host_code: str = CODE,
    joiner_code: str = CODE,
    *,
    host_sees: str = JOINER_FP,
    joiner_sees: str = HOST_FP,
    joiner_id: str = "m2",
) -> tuple[Exchange, Exchange]:
    """A host and a joiner exchange; `*_sees` is the peer fingerprint the rendezvous reported to each."""
    host = Exchange(
        Role.HOST, host_code, host_id="m1", joiner_id="m2", own_fingerprint=HOST_FP, peer_fingerprint=host_sees
    )
    joiner = Exchange(
        Role.JOINER,
        joiner_code,
        host_id="m1",
        joiner_id=joiner_id,
        own_fingerprint=JOINER_FP,
        peer_fingerprint=joiner_sees,
    )
    return host, joiner


def run_pair(host: Exchange, joiner: Exchange) -> tuple[list[str], list[str]]:
    """Both SPAKE2 messages, then the joiner's confirmation (it proves first): what each side
    sent, in order. The host's confirmation is its answer to the joiner's."""
    host_sent, joiner_sent = [host.start()], [joiner.start()]
    host_sent += host.receive(joiner_sent[0])
    joiner_sent += joiner.receive(host_sent[0])
    return host_sent, joiner_sent


def confirmed_pair() -> tuple[Exchange, Exchange, list[str], list[str]]:
    host, joiner = pair()
    host_sent, joiner_sent = run_pair(host, joiner)
    host_sent += host.receive(joiner_sent[1])
    joiner.receive(host_sent[1])
    assert host.confirmed and joiner.confirmed
    return host, joiner, host_sent, joiner_sent


ROSTER = {"m1": HOST_FP, "m2": JOINER_FP, "m3": OTHER_FP}


# -- the exchange ------------------------------------------------------------------------------


def test_matching_codes_confirm_and_the_roster_arrives_intact() -> None:
    host, joiner = pair(joiner_code="  7 Crimson_HARBOR lemon TIGER orbit.Cactus ")  # what a person types is forgiven
    host_sent, joiner_sent = run_pair(host, joiner)
    assert [json.loads(b)["kind"] for b in host_sent] == ["pake"]  # nothing proved yet: nothing from the host
    assert [json.loads(b)["kind"] for b in joiner_sent] == ["pake", "confirm"]
    assert host.engaged and not host.confirmed
    host_sent += host.receive(joiner_sent[1])
    assert [json.loads(b)["kind"] for b in host_sent] == ["pake", "confirm"] and host.confirmed
    assert joiner.receive(host_sent[1]) == []
    assert host.confirmed and joiner.confirmed and joiner.roster is None
    joiner.receive(host.seal_roster(ROSTER))
    assert joiner.roster == ROSTER
    verified = check_roster(
        joiner.roster, ROSTER, host_id="m1", host_fingerprint=HOST_FP, self_id="m2", self_fingerprint=JOINER_FP
    )
    assert verified == ROSTER
    for body in [*host_sent, *joiner_sent]:
        assert body.isascii() and body.isprintable() and len(body) < 4096


def test_a_wrong_secret_is_refused_before_the_host_proves_anything() -> None:
    """A joiner with a wrong secret has only the host's SPAKE2 message, which says nothing of the
    secret: the host refuses its confirmation and sends none of its own, so a guess is never
    answered, only counted."""
    host, joiner = pair(joiner_code=WRONG)
    host_sent, joiner_sent = run_pair(host, joiner)
    with pytest.raises(CodeMismatch) as at_host:
        host.receive(joiner_sent[1])
    assert host_sent == [host_sent[0]] and host.engaged and not host.confirmed
    forged = Confirm(fingerprint=HOST_FP, mac=confirm_mac(b"\x07" * 32, joiner.context, Role.HOST, HOST_FP))
    with pytest.raises(CodeMismatch) as at_joiner:  # a host that does not hold the code cannot prove it either
        joiner.receive(encode(forged))
    assert at_host.value.member == "m2" and "member m2 could not prove" in str(at_host.value)
    assert at_joiner.value.member == "m1" and "the host (m1) could not prove" in str(at_joiner.value)
    for error in (at_host.value, at_joiner.value):
        assert "secret half differs" in str(error) and "tampering" in str(error)
        assert "cannot be told apart" in str(error)
    assert not host.confirmed and not joiner.confirmed


def test_the_exchange_is_bound_to_the_pair_of_members() -> None:
    host, joiner = pair(joiner_id="m3")  # the rendezvous told them different member ids
    _, joiner_sent = run_pair(host, joiner)
    with pytest.raises(CodeMismatch):
        host.receive(joiner_sent[1])


def test_two_joiners_spliced_together_do_not_confirm() -> None:
    """A rendezvous relaying one joiner to another as if it were the host: roles are in the MAC."""
    first, second = (
        Exchange(Role.JOINER, CODE, host_id="m1", joiner_id="m2", own_fingerprint=fp, peer_fingerprint=HOST_FP)
        for fp in (JOINER_FP, OTHER_FP)
    )
    first_sent, second_sent = [first.start()], [second.start()]
    first_sent += first.receive(second_sent[0])
    second_sent += second.receive(first_sent[0])
    with pytest.raises(CodeMismatch):
        first.receive(second_sent[1])


def test_a_swapped_joiner_fingerprint_is_detected_by_the_host() -> None:
    host, joiner = pair(host_sees=EVIL_FP)
    _, joiner_sent = run_pair(host, joiner)
    with pytest.raises(FingerprintMismatch) as caught:
        host.receive(joiner_sent[1])
    assert caught.value.member == "m2" and caught.value.reported == EVIL_FP and caught.value.proved == JOINER_FP
    assert "member m2's certificate fingerprint does not match" in str(caught.value)
    assert "the rendezvous substituted it" in str(caught.value)


def test_a_swapped_host_fingerprint_is_detected_by_the_joiner() -> None:
    host, joiner = pair(joiner_sees=EVIL_FP.upper())  # reported fingerprints are compared in lower case
    host_sent, joiner_sent = run_pair(host, joiner)
    host_sent += host.receive(joiner_sent[1])
    with pytest.raises(FingerprintMismatch) as caught:
        joiner.receive(host_sent[1])
    assert caught.value.member == "m1" and "substituted" in str(caught.value)


def test_a_tampered_roster_is_refused() -> None:
    host, joiner, _, _ = confirmed_pair()
    sealed = json.loads(host.seal_roster(ROSTER))
    for change in (
        {"members": ROSTER | {"m3": EVIL_FP}},
        {"members": ROSTER | {"m9": EVIL_FP}},
        {"members": {"m1": HOST_FP, "m2": JOINER_FP}},
        {"mac": "0" * 64},
    ):
        with pytest.raises(RosterMismatch) as caught:
            joiner.receive(json.dumps(sealed | change))
        assert "failed its integrity check" in str(caught.value) and joiner.roster is None
    joiner.receive(json.dumps(sealed))
    assert joiner.roster == ROSTER


def test_the_host_is_done_only_when_the_joiner_accepts_the_roster() -> None:
    host, joiner, _, _ = confirmed_pair()
    with pytest.raises(RuntimeError):
        joiner.accept()  # nothing to accept yet
    joiner.receive(host.seal_roster(ROSTER))
    with pytest.raises(RuntimeError):
        host.seal_roster(ROSTER)  # once per joiner
    acceptance = joiner.accept()
    with pytest.raises(RosterMismatch, match="acceptance of the roster failed its integrity check"):
        host.receive(json.dumps(json.loads(acceptance) | {"mac": "1" * 64}))
    assert not host.accepted
    assert host.receive(acceptance) == [] and host.accepted
    with pytest.raises(TrustProtocolError, match="acceptance out of order"):
        host.receive(acceptance)
    with pytest.raises(TrustProtocolError, match="only joiners send"):
        joiner.receive(acceptance)


def test_an_acceptance_before_the_roster_is_out_of_order() -> None:
    host, _, _, _ = confirmed_pair()
    other_host, other_joiner, _, _ = confirmed_pair()
    other_joiner.receive(other_host.seal_roster(ROSTER))
    with pytest.raises(TrustProtocolError, match="acceptance out of order"):
        host.receive(other_joiner.accept())


def test_check_roster_names_injected_hidden_and_swapped_members() -> None:
    def check(reported: dict[str, str]) -> dict[str, str]:
        return check_roster(
            ROSTER, reported, host_id="m1", host_fingerprint=HOST_FP, self_id="m2", self_fingerprint=JOINER_FP
        )

    assert check({m: f.upper() for m, f in ROSTER.items()}) == ROSTER
    with pytest.raises(RosterMismatch) as injected:
        check(ROSTER | {"m4": EVIL_FP})
    assert injected.value.member == "m4" and "the rendezvous injected it" in str(injected.value)
    with pytest.raises(RosterMismatch) as hidden:
        check({"m1": HOST_FP, "m2": JOINER_FP})
    assert hidden.value.member == "m3" and "hiding it" in str(hidden.value)
    with pytest.raises(FingerprintMismatch) as swapped:
        check(ROSTER | {"m3": EVIL_FP})
    assert swapped.value.member == "m3" and swapped.value.proved == OTHER_FP
    with pytest.raises(RosterMismatch, match="its own fingerprint"):
        check_roster(ROSTER, ROSTER, host_id="m1", host_fingerprint=HOST_FP, self_id="m2", self_fingerprint=OTHER_FP)
    with pytest.raises(RosterMismatch, match="the host"):
        check_roster(ROSTER, ROSTER, host_id="m1", host_fingerprint=EVIL_FP, self_id="m2", self_fingerprint=JOINER_FP)


def test_out_of_order_and_misdirected_messages_are_protocol_errors() -> None:
    host, joiner = pair()
    host_sent, joiner_sent = run_pair(host, joiner)
    with pytest.raises(TrustProtocolError, match="second SPAKE2"):
        host.receive(joiner_sent[0])
    fresh_host, fresh_joiner = pair()
    fresh_host.start()
    fresh_joiner.start()
    with pytest.raises(TrustProtocolError, match="confirmation out of order"):
        fresh_host.receive(joiner_sent[1])  # a confirmation before any SPAKE2 message
    assert not fresh_host.engaged  # nothing at stake: no key yet, so nothing was guessed
    host_sent += host.receive(joiner_sent[1])
    joiner.receive(host_sent[1])
    roster = host.seal_roster(ROSTER)
    with pytest.raises(TrustProtocolError, match="only the host sends"):
        host.receive(roster)
    with pytest.raises(TrustProtocolError, match="roster out of order"):
        fresh_joiner.receive(roster)
    with pytest.raises(RuntimeError):
        joiner.seal_roster(ROSTER)


def test_reflected_messages_are_refused() -> None:
    host, joiner = pair()
    first = host.start()
    with pytest.raises(TrustProtocolError, match="invalid SPAKE2"):
        host.receive(first)  # our own SPAKE2 message back
    host, joiner = pair()
    _, joiner_sent = run_pair(host, joiner)
    with pytest.raises(CodeMismatch):
        joiner.receive(joiner_sent[1])  # our own confirmation back: the role tag differs


@pytest.mark.parametrize(
    "body",
    [
        "",
        "{",
        "null",
        "[]",
        '{"kind": "pake"}',
        '{"kind": "pake", "version": 1, "message": "53' + "00" * 32 + '"}',  # not a point of the group
        '{"kind": "pake", "version": 1, "message": "53' + "ff" * 32 + '"}',
        '{"kind": "pake", "version": 1, "message": "41' + "11" * 32 + '"}',  # an asymmetric side byte
        '{"kind": "pake", "version": 1, "message": "53' + "11" * 31 + '"}',  # one byte short
        '{"kind": "pake", "version": 3, "message": "53' + "11" * 32 + '"}',  # a version to come
        '{"kind": "confirm", "fingerprint": "xyz", "mac": "00"}',
        '{"kind": "roster", "members": {"bob": "00"}, "mac": ""}',
        '{"kind": "dance"}',
        "[" * 5000,
        b"\xff\xfe",
    ],
)
def test_malformed_messages_are_clear_protocol_errors(body: str | bytes) -> None:
    host, _ = pair()
    host.start()
    with pytest.raises(TrustProtocolError) as caught:
        host.receive(body)
    assert caught.value.member == "m2" and "m2 sent" in str(caught.value)


def test_every_truncation_of_every_message_is_a_trust_error() -> None:
    host, _, host_sent, joiner_sent = confirmed_pair()
    bodies = [*host_sent, *joiner_sent, host.seal_roster(ROSTER), abort_message(CodeMismatch("m2", is_host=False))]
    target, _ = pair()
    target.start()
    for body in bodies:
        for cut in range(len(body)):  # no proper prefix of a JSON object parses, so the target stays fresh
            with pytest.raises(TrustProtocolError):
                target.receive(body[:cut])
    assert target.receive(joiner_sent[0]) == [] and target.engaged  # and it still works


@given(st.text(max_size=200) | st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_garbage_raises_only_trust_errors(body: str | bytes) -> None:
    host, _ = pair()
    host.start()
    with pytest.raises(TrustError):
        host.receive(body)


def test_an_abort_is_reported_as_a_refusal_and_marked_unauthenticated() -> None:
    host, joiner = pair()
    run_pair(host, joiner)
    notice = abort_message(FingerprintMismatch("m1", HOST_FP, EVIL_FP, "it proved"))
    parsed = Abort.model_validate_json(notice)
    assert parsed.reason is AbortReason.FINGERPRINT_MISMATCH and notice.isascii()
    with pytest.raises(PeerRefused) as caught:
        host.receive(notice)
    assert "fingerprint_mismatch" in str(caught.value) and "could have forged" in str(caught.value)
    quoted = Abort.model_validate_json(abort_message(TrustError("the rendezvous said: \x1b[2Jhi\n")))
    assert quoted.reason is AbortReason.REFUSED and quoted.message == "the rendezvous said:  [2Jhi "
    with pytest.raises(TrustProtocolError):  # control characters are refused, not shown to anyone
        host.receive(json.dumps({"kind": "abort", "reason": "refused", "message": "\x1b[2J"}))


def test_an_exchange_needs_the_full_code() -> None:
    with pytest.raises(CodeFormatError, match="only the first half"):
        pair(joiner_code="7-crimson-harbor")
    with pytest.raises(ValueError, match="member id"):
        Exchange(Role.HOST, CODE, host_id="host", joiner_id="m2", own_fingerprint=HOST_FP, peer_fingerprint=JOINER_FP)


# -- through a real rendezvous -------------------------------------------------------------------


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout)

    return asyncio.run(bounded())


def capability(name: str) -> dict[str, Any]:
    return {"name": name, "memory_gib": 8.0}


class Tampering(Rendezvous):
    """The real core, with `tamper(recipient member id, message)` applied to everything it sends."""

    def __init__(self, tamper: Callable[[str | None, Wire], list[Wire]]) -> None:
        super().__init__(rng=random.Random(5))
        self.tamper = tamper
        self.member_of: dict[ConnId, str] = {}
        self.frames: list[str | bytes] = []  # everything members sent, for the secret-never-sent check

    def receive(self, conn: ConnId, data: str | bytes, now: float) -> list[Output]:
        self.frames.append(data)
        outputs: list[Output] = []
        for output in super().receive(conn, data, now):
            if isinstance(output, Send):
                if isinstance(output.message, Opened | Joined):
                    self.member_of[output.conn] = output.message.member_id
                recipient = self.member_of.get(output.conn)
                outputs += [Send(output.conn, m) for m in self.tamper(recipient, output.message)]
            else:
                outputs.append(output)
        return outputs


def honest(recipient: str | None, message: Wire) -> list[Wire]:
    return [message]


def with_fingerprint(members: list[MemberInfo], member_id: str, fingerprint: str) -> list[MemberInfo]:
    return [m.model_copy(update={"fingerprint": fingerprint}) if m.member_id == member_id else m for m in members]


def swap_for(recipient_id: str, member_id: str, fingerprint: str) -> Callable[[str | None, Wire], list[Wire]]:
    """A rendezvous that tells `recipient_id` another fingerprint for `member_id`, everywhere it lists it."""

    def tamper(recipient: str | None, message: Wire) -> list[Wire]:
        if recipient != recipient_id:
            return [message]
        if isinstance(message, Joined | Ready):
            return [message.model_copy(update={"members": with_fingerprint(message.members, member_id, fingerprint)})]
        if isinstance(message, MemberJoined) and message.member.member_id == member_id:
            return [
                message.model_copy(update={"member": message.member.model_copy(update={"fingerprint": fingerprint})})
            ]
        return [message]

    return tamper


async def serve(tamper: Callable[[str | None, Wire], list[Wire]] = honest) -> tuple[RendezvousHandle, Tampering]:
    handle = await start_rendezvous("127.0.0.1", 0, 0)
    core = Tampering(tamper)
    handle.service.core = core  # before any connection: the shell holds nothing of the old one
    return handle, core


async def session(
    handle: RendezvousHandle,
    fingerprints: list[str],
    codes: list[str] | None = None,
    timeout: float = 5,
) -> list[dict[str, str] | BaseException]:
    """A host and joiners, each verifying; what each one's verification returned or raised."""
    codes = codes or [CODE] * len(fingerprints)
    host = await RendezvousClient.open(
        handle.url,
        model="m",
        expected_members=len(fingerprints),
        capability=capability("host"),
        fingerprint=fingerprints[0],
    )
    code = codes[0].replace("7-crimson-harbor", host.code)
    clients, tasks = (
        [host],
        [asyncio.create_task(verify_members(host, code, fingerprints[0], exchange_timeout=timeout, refused=stop))],
    )
    for index, fingerprint in enumerate(fingerprints[1:], start=1):
        theirs = codes[index].replace("7-crimson-harbor", host.code)
        joiner = await RendezvousClient.join(
            handle.url, theirs, capability=capability(f"member{index}"), fingerprint=fingerprint
        )
        clients.append(joiner)
        tasks.append(asyncio.create_task(verify_host(joiner, theirs, fingerprint, exchange_timeout=timeout)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()
    return results


def stop(_member: str, error: TrustError) -> None:
    """A host that gives up at the first joiner refused (`kafila host` drops it and goes on)."""
    raise error


def test_members_agree_on_the_roster_and_the_secret_never_reaches_the_rendezvous() -> None:
    fingerprints = [create_identity(f"member {i}").fingerprint for i in range(3)]

    async def scenario() -> tuple[list[dict[str, str] | BaseException], list[str | bytes]]:
        handle, core = await serve()
        try:
            return await session(handle, fingerprints), core.frames
        finally:
            await handle.close()

    results, frames = run(scenario())
    expected = {f"m{i + 1}": fp for i, fp in enumerate(fingerprints)}
    assert results == [expected] * 3
    assert frames and not any(
        b"lemon-tiger-orbit-cactus" in (f if isinstance(f, bytes) else f.encode()) for f in frames
    )
    assert any('"type":"signal"' in f.replace(" ", "") for f in frames if isinstance(f, str))


def test_a_member_with_a_wrong_code_secret_is_refused() -> None:
    async def scenario() -> list[dict[str, str] | BaseException]:
        handle, _ = await serve()
        try:
            return await session(handle, [HOST_FP, JOINER_FP], [CODE, WRONG])
        finally:
            await handle.close()

    at_host, at_joiner = run(scenario())
    assert isinstance(at_host, CodeMismatch) and at_host.member == "m2"
    assert isinstance(at_joiner, PeerRefused) and at_joiner.member == "m1" and "code_mismatch" in str(at_joiner)


def test_a_rendezvous_that_swaps_a_joiner_fingerprint_is_refused_by_the_host() -> None:
    async def scenario() -> list[dict[str, str] | BaseException]:
        handle, _ = await serve(swap_for("m1", "m2", EVIL_FP))
        try:
            return await session(handle, [HOST_FP, JOINER_FP])
        finally:
            await handle.close()

    at_host, at_joiner = run(scenario())
    assert isinstance(at_host, FingerprintMismatch) and at_host.member == "m2" and at_host.reported == EVIL_FP
    assert "the rendezvous substituted it" in str(at_host)
    assert isinstance(at_joiner, PeerRefused) and "fingerprint_mismatch" in str(at_joiner)


def test_a_rendezvous_that_swaps_the_host_fingerprint_is_refused_by_the_joiner() -> None:
    async def scenario() -> list[dict[str, str] | BaseException]:
        handle, _ = await serve(swap_for("m2", "m1", EVIL_FP))
        try:
            return await session(handle, [HOST_FP, JOINER_FP])
        finally:
            await handle.close()

    at_host, at_joiner = run(scenario())
    assert isinstance(at_joiner, FingerprintMismatch) and at_joiner.member == "m1"
    assert isinstance(at_host, PeerRefused) and at_host.member == "m2"


def test_a_rendezvous_that_swaps_another_members_fingerprint_is_caught_by_the_roster() -> None:
    async def scenario() -> list[dict[str, str] | BaseException]:
        handle, _ = await serve(swap_for("m2", "m3", EVIL_FP))  # only m2 is lied to, about m3
        try:
            return await session(handle, [HOST_FP, JOINER_FP, OTHER_FP])
        finally:
            await handle.close()

    at_host, at_m2, at_m3 = run(scenario())
    assert isinstance(at_m2, FingerprintMismatch) and at_m2.member == "m3" and at_m2.proved == OTHER_FP
    assert at_m3 == {"m1": HOST_FP, "m2": JOINER_FP, "m3": OTHER_FP}  # its own view is sound
    assert isinstance(at_host, PeerRefused) and at_host.member == "m2"  # the host is done only when all accept


def test_a_member_injected_into_a_joiners_list_is_refused() -> None:
    fake = MemberInfo(
        member_id="m9", name="mallory", host=False, capability=capability("mallory"), candidates=[], fingerprint=EVIL_FP
    )

    def inject(recipient: str | None, message: Wire) -> list[Wire]:
        if recipient == "m2" and isinstance(message, Ready):
            return [message.model_copy(update={"members": [*message.members, fake]})]
        return [message]

    async def scenario() -> list[dict[str, str] | BaseException]:
        handle, _ = await serve(inject)
        try:
            return await session(handle, [HOST_FP, JOINER_FP])
        finally:
            await handle.close()

    _, at_joiner = run(scenario())
    assert isinstance(at_joiner, RosterMismatch) and at_joiner.member == "m9"
    assert "the rendezvous injected it" in str(at_joiner)


def test_a_member_injected_to_the_host_cannot_prove_the_code() -> None:
    """The rendezvous plays a member of its own, guessing the secret half: the host refuses it."""
    fake = MemberInfo(
        member_id="m9", name="mallory", host=False, capability=capability("mallory"), candidates=[], fingerprint=EVIL_FP
    )

    class Impostor(Tampering):
        def __init__(self) -> None:
            super().__init__(self.inject)
            self.exchange: Exchange | None = None
            self.host_conn: ConnId | None = None

        def inject(self, recipient: str | None, message: Wire) -> list[Wire]:
            if recipient != "m1":
                return [message]
            if isinstance(message, MemberJoined) and message.member.member_id == "m3":
                return [message, MemberJoined(member=fake, count=message.count, expected_members=3)]
            if isinstance(message, Ready):
                return [message.model_copy(update={"members": [*message.members, fake]})]
            return [message]

        def receive(self, conn: ConnId, data: str | bytes, now: float) -> list[Output]:
            request = json.loads(data) if isinstance(data, str) and data.startswith("{") else {}
            if request.get("type") == "open":
                self.host_conn = conn
            if request.get("type") != "signal" or request.get("peer") != "m9":
                return super().receive(conn, data, now)
            assert self.host_conn is not None
            answers: list[str] = []
            if self.exchange is None:
                guessed_secret = "-".join(WRONG.split("-")[3:])
                guess = f"{next(iter(self.by_code))}-{guessed_secret}"  # the channel it knows, a secret it guesses
                self.exchange = Exchange(
                    Role.JOINER, guess, host_id="m1", joiner_id="m9", own_fingerprint=EVIL_FP, peer_fingerprint=HOST_FP
                )
                answers.append(self.exchange.start())
            with contextlib.suppress(TrustError):  # the host's refusal, once its check fails
                answers += self.exchange.receive(request["body"])
            return [Send(self.host_conn, SignalFrom(peer="m9", body=body)) for body in answers]

    async def scenario() -> list[dict[str, str] | BaseException]:
        handle = await start_rendezvous("127.0.0.1", 0, 0)
        handle.service.core = Impostor()
        try:
            return await session(handle, [HOST_FP, JOINER_FP, OTHER_FP])
        finally:
            await handle.close()

    at_host, *at_joiners = run(scenario())
    assert isinstance(at_host, CodeMismatch) and at_host.member == "m9"
    assert all(isinstance(r, PeerRefused) and "m9" in str(r) for r in at_joiners)


def test_silence_is_a_timeout_not_a_hang() -> None:
    async def pair_of_clients(handle: RendezvousHandle) -> tuple[RendezvousClient, RendezvousClient, str]:
        host = await RendezvousClient.open(
            handle.url, model="m", expected_members=2, capability=capability("h"), fingerprint=HOST_FP
        )
        code = CODE.replace("7-crimson-harbor", host.code)
        joiner = await RendezvousClient.join(handle.url, code, capability=capability("j"), fingerprint=JOINER_FP)
        return host, joiner, code

    async def scenario() -> None:
        handle, _ = await serve()
        try:
            host, joiner, code = await pair_of_clients(handle)  # a joiner that never answers
            with pytest.raises(TrustTimeout, match=r"member m2 did not prove the session code within 0\.5 s"):
                await verify_members(host, code, HOST_FP, exchange_timeout=0.5, refused=stop)
            await host.close()
            await joiner.close()
            host, joiner, code = await pair_of_clients(handle)  # a host that never answers
            with pytest.raises(ValueError, match="channel half"):
                await verify_host(joiner, "2-calm-river-lemon-tiger-orbit-cactus", JOINER_FP)
            with pytest.raises(TrustTimeout, match=r"the host \(m1\) did not prove the session code within 0\.5 s"):
                await verify_host(joiner, code, JOINER_FP, exchange_timeout=0.5)
            await host.close()
            await joiner.close()
        finally:
            await handle.close()

    run(scenario())


def test_a_joiner_turned_away_before_it_said_anything_hears_the_hosts_reason() -> None:
    """A host that admits no one refuses a joiner the moment it arrives: it tells it why, then frees
    its seat, which closes the joiner's connection before its first message goes out. The joiner
    reports the host's reason, not a closed connection."""

    async def scenario() -> None:
        handle, _ = await serve()
        try:
            host = await RendezvousClient.open(
                handle.url, model="m", expected_members=3, capability=capability("h"), fingerprint=HOST_FP
            )
            code = CODE.replace("7-crimson-harbor", host.code)
            joiner = await RendezvousClient.join(handle.url, code, capability=capability("j"), fingerprint=JOINER_FP)
            await send_abort(host, [joiner.member_id], TrustError("this session admits no more members"))
            await host.remove(joiner.member_id)
            await joiner.wait_closed(5)  # gone before it could start the exchange
            with pytest.raises(PeerRefused, match="admits no more members"):
                await verify_host(joiner, code, JOINER_FP, exchange_timeout=5)
            await host.close()
        finally:
            await handle.close()

    run(scenario())


def test_a_joiner_that_fails_its_part_is_dropped_and_the_same_code_then_forms_the_session() -> None:
    """A wrong secret, garbage, an abort, silence, and a joiner that takes the last seat and leaves:
    each is dropped (told why and removed at the rendezvous, its seat free again) and reported;
    the session then forms with the same code, for the honest joiner that comes next."""
    refused: list[tuple[str, type[TrustError]]] = []

    async def scenario() -> tuple[dict[str, str], dict[str, str]]:
        handle, _ = await serve()
        host = await RendezvousClient.open(
            handle.url, model="m", expected_members=2, capability=capability("host"), fingerprint=HOST_FP
        )
        code = CODE.replace("7-crimson-harbor", host.code)
        forming = asyncio.create_task(
            verify_members(host, code, HOST_FP, exchange_timeout=1.0, refused=lambda m, e: refused.append((m, type(e))))
        )
        try:

            async def joiner(name: str, with_code: str = code) -> RendezvousClient:
                client = await RendezvousClient.join(
                    handle.url, with_code, capability=capability(name), fingerprint=OTHER_FP
                )
                await client.wait_ready(5)
                return client

            async def until_dropped(count: int) -> None:
                while len(refused) < count:
                    assert not forming.done(), forming
                    await asyncio.sleep(0.02)

            guesser = await joiner("guesser", WRONG.replace("7-crimson-harbor", host.code))
            with contextlib.suppress(TrustError):
                await verify_host(guesser, WRONG.replace("7-crimson-harbor", host.code), OTHER_FP, exchange_timeout=5)
            await until_dropped(1)
            assert await guesser.wait_closed(5) is None  # removed at the rendezvous
            garbler = await joiner("garbler")
            await garbler.send_signal(host.member_id, "not a trust message at all")
            await until_dropped(2)
            aborter = await joiner("aborter")
            await send_abort(aborter, [host.member_id], TrustError("changed my mind"))
            await until_dropped(3)
            await joiner("silent")  # says nothing: dropped after the exchange's timeout
            await until_dropped(4)
            leaver = await joiner("leaver")
            await leaver.leave()  # the last seat, left at once: forgotten, not refused
            await host.wait_for_left(leaver.member_id, 5)
            honest = await RendezvousClient.join(
                handle.url, code, capability=capability("honest"), fingerprint=JOINER_FP
            )
            at_joiner = await verify_host(honest, code, JOINER_FP, exchange_timeout=5)
            at_host = await asyncio.wait_for(forming, 10)
            await honest.close()
            return at_host, at_joiner
        finally:
            forming.cancel()
            await host.close()
            await handle.close()

    at_host, at_joiner = run(scenario(), timeout=60)
    assert [kind for _, kind in refused] == [CodeMismatch, TrustProtocolError, PeerRefused, TrustTimeout]
    assert at_host == at_joiner and set(at_host.values()) == {HOST_FP, JOINER_FP}


@dataclass
class SeatLeft:
    """A session of three whose members have verified, then m2 left: a seat for a newcomer."""

    handle: RendezvousHandle
    host: RendezvousClient
    code: str
    stayer: RendezvousClient
    trusted: dict[str, str]
    fingerprints: list[str]

    @classmethod
    async def open(cls, handle: RendezvousHandle) -> SeatLeft:
        fingerprints = [create_identity(f"member {i}").fingerprint for i in range(4)]
        host = await RendezvousClient.open(
            handle.url, model="m", expected_members=3, capability=capability("host"), fingerprint=fingerprints[0]
        )
        code = CODE.replace("7-crimson-harbor", host.code)
        joiners = [
            await RendezvousClient.join(handle.url, code, capability=capability(f"j{i}"), fingerprint=fp)
            for i, fp in enumerate(fingerprints[1:3])
        ]
        trusted, *_ = await asyncio.gather(
            verify_members(host, code, fingerprints[0]),
            *(verify_host(j, code, fp) for j, fp in zip(joiners, fingerprints[1:3], strict=True)),
        )
        await joiners[0].close()
        await host._until(lambda: "m2" not in host.members, 5)
        return cls(handle, host, code, joiners[1], trusted, fingerprints)

    async def newcomer(self, member_id: str, code: str | None = None) -> tuple[object, object]:
        """A newcomer (with `code`, or the right one) and the host verify each other; what each
        returned or raised. The newcomer then leaves, freeing the seat again."""
        theirs = self.code if code is None else code.replace("7-crimson-harbor", self.host.code)
        joiner = await RendezvousClient.join(
            self.handle.url, theirs, capability=capability(member_id), fingerprint=self.fingerprints[3]
        )
        await self.host._until(lambda: member_id in self.host.members, 5)
        at_host, at_newcomer = await asyncio.gather(
            verify_newcomer(self.host, self.code, self.fingerprints[0], member_id, self.trusted, exchange_timeout=5),
            verify_host(joiner, theirs, self.fingerprints[3], exchange_timeout=5),
            return_exceptions=True,
        )
        await joiner.close()
        await self.host._until(lambda: member_id not in self.host.members, 5)
        return at_host, at_newcomer

    async def close(self) -> None:
        for client in (self.host, self.stayer):
            await client.close()


def test_a_newcomer_to_a_left_seat_proves_the_code_and_gets_who_is_here() -> None:
    """Host and two members verify; one leaves; a newcomer takes its seat and the host verifies it
    alone: its roster lists the host, the member still here and itself, as the rendezvous does.
    A second newcomer with a wrong secret is refused on both sides, the host told it was a guess."""

    async def scenario() -> tuple[list[str], tuple[object, object], tuple[object, object]]:
        handle, _ = await serve()
        try:
            seat = await SeatLeft.open(handle)
            right = await seat.newcomer("m4")
            wrong = await seat.newcomer("m5", WRONG)
            await seat.close()
            return seat.fingerprints, right, wrong
        finally:
            await handle.close()

    fingerprints, (proved, roster), (at_host, at_guesser) = run(scenario())
    assert proved == fingerprints[3]
    assert roster == {"m1": fingerprints[0], "m3": fingerprints[2], "m4": fingerprints[3]}
    assert isinstance(at_host, CodeMismatch) and at_host.member == "m5"
    # The guesser hears only the host's notice, after its guess was counted: no proof came from the host.
    assert isinstance(at_guesser, PeerRefused) and at_guesser.member == "m1" and "code_mismatch" in str(at_guesser)


def test_a_newcomer_that_proves_the_code_but_refuses_the_roster_is_no_guess() -> None:
    """A rendezvous hides a member from the newcomer's ready list: the newcomer refuses the host's
    roster (`RosterMismatch`), and the host hears a refusal after proof, not a possible guess."""

    def hide_m3_from_m4(recipient: str | None, message: Wire) -> list[Wire]:
        if recipient == "m4" and isinstance(message, Joined | Ready):
            return [message.model_copy(update={"members": [m for m in message.members if m.member_id != "m3"]})]
        return [message]

    async def scenario() -> tuple[object, object]:
        handle, _ = await serve(hide_m3_from_m4)
        try:
            seat = await SeatLeft.open(handle)
            answers = await seat.newcomer("m4")
            await seat.close()
            return answers
        finally:
            await handle.close()

    at_host, at_newcomer = run(scenario())
    assert isinstance(at_newcomer, RosterMismatch) and "hiding" in str(at_newcomer)
    assert isinstance(at_host, ProvenButRefused) and at_host.member == "m4"
