"""Trust without trusting the rendezvous: SPAKE2 on the session code, then fingerprint confirmation.

The rendezvous introduces members with their certificate fingerprints, which QUIC links then
pin. A rendezvous that lied about a fingerprint could sit in the middle of every link, so no
member takes a fingerprint on the rendezvous's word. Instead (star topology, host in the middle):

1. The host and each joiner run SPAKE2 (`spake2.SPAKE2_Symmetric`) over `signal` messages, with
   the full session code as the password. The rendezvous knows only the channel half, so it
   cannot learn the key, and cannot test guesses of the secret half offline: a wrong guess is a
   failed exchange that the host sees. The channel and both member ids are the SPAKE2 identity,
   so the exchange is bound to this session and this pair.
2. The joiner proves first: once it has the host's SPAKE2 message it sends `confirm`, its own
   fingerprint and an HMAC over it, keyed by the SPAKE2 key and tagged with its role. The host
   checks that MAC (a bad MAC means the two keys differ: `CodeMismatch`) and that the
   fingerprint proved is the one the rendezvous reported (`FingerprintMismatch`), and only then
   sends its own `confirm`, which the joiner checks the same way. So a joiner that guessed the
   secret learns nothing from the host before it has proved its guess, and the host sees every
   guess: an exchange whose SPAKE2 message came and that did not end in a valid proof, for
   whatever reason (a wrong MAC, garbage, an abort, silence, leaving), is counted against the
   host's budget (`Exchange.at_stake`, marked `TrustError.guess` by `rendezvous_client`).
3. Once every joiner has confirmed, the host sends each one the roster (member id →
   fingerprint), MAC'd with that pair's key. A joiner trusts another member's fingerprint only
   through this roster, and refuses if the rendezvous's member list differs from it
   (`RosterMismatch`: an injected or hidden member) or disagrees on a fingerprint
   (`FingerprintMismatch`).
4. Each joiner that accepts the roster says so with `accepted`, a MAC over the roster; the host
   is done only when every joiner has, so it never goes ahead with a member that refused.

Everything here is sans-IO: bodies (strings) in, bodies out, exceptions for refusals. Every
refusal is a `TrustError`; nothing a peer or the rendezvous sends can raise anything else.
Anyone who holds the full code is trusted as a member; this protects against the rendezvous
and against people who know only the channel half, not against a member.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError
from spake2 import SPAKE2_Symmetric  # type: ignore[import-untyped]

from kafila.contracts import MAX_MEMBERS
from kafila.network.rendezvous import Fingerprint, MemberId, Wire
from kafila.network.session_codes import split_code
from kafila.validation import first_problem

PROTOCOL = b"kafila-trust-v2"  # v2: the joiner confirms first; v1's host confirmed at once (an oracle)
_MEMBER_ID = re.compile(r"^m[1-9][0-9]{0,3}$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ADVICE = "this session cannot be trusted: the host must start over with a new code"


class Role(StrEnum):
    HOST = "host"
    JOINER = "joiner"


# ---------------------------------------------------------------------------------------------
# Refusals


class TrustError(Exception):
    """A refusal to trust a member; `member` is the member id it concerns, when there is one.
    `guess`: the host counts it against its guess budget (a joiner began the exchange and did
    not prove the code, however it ended)."""

    def __init__(self, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member
        self.guess = False


class CodeMismatch(TrustError):
    """The SPAKE2 keys differ: a wrong code secret, or a rendezvous tampering with the exchange.

    The two look the same from here, by design: SPAKE2 tells a member only that the other side
    did not derive the same key, never why.
    """

    def __init__(self, member: str, is_host: bool) -> None:
        who = f"the host ({member})" if is_host else f"member {member}"
        super().__init__(
            f"{who} could not prove it holds the same session code: either the code's secret half "
            "differs (a mistyped code, or someone who knows only the rendezvous half), or the rendezvous is "
            f"tampering with the exchange; the two cannot be told apart. Refused; {_ADVICE}",
            member,
        )


class FingerprintMismatch(TrustError):
    """A member proved one certificate fingerprint and the rendezvous reported another."""

    def __init__(self, member: str, reported: str, proved: str, proved_by: str) -> None:
        super().__init__(
            f"member {member}'s certificate fingerprint does not match what {proved_by}: the rendezvous "
            f"reported {reported[:16]}…, but {proved[:16]}… is the one proved with the session code, so the "
            f"rendezvous substituted it. Refused; {_ADVICE}",
            member,
        )
        self.reported, self.proved = reported, proved


class RosterMismatch(TrustError):
    """The host's verified roster and the rendezvous's member list disagree, or the roster was altered."""


class TrustProtocolError(TrustError):
    """A trust message that is malformed, truncated or out of order."""


class PeerRefused(TrustError):
    """The other side said it refused the exchange (an unauthenticated notice, so only advisory)."""


# ---------------------------------------------------------------------------------------------
# Wire (the bodies of `signal` messages)

Mac = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PakeMessage(Wire):
    """This side's SPAKE2 message: the symmetric side byte `S` (0x53) and a 32-byte group element."""

    kind: Literal["pake"] = "pake"
    version: Literal[2] = 2
    message: Annotated[str, Field(pattern=r"^53[0-9a-f]{64}$")]


class Confirm(Wire):
    """The sender's own fingerprint, MAC'd with the SPAKE2 key under its role's tag."""

    kind: Literal["confirm"] = "confirm"
    fingerprint: Fingerprint
    mac: Mac


class RosterMessage(Wire):
    """Host → joiner: every member's verified fingerprint, MAC'd with that pair's key."""

    kind: Literal["roster"] = "roster"
    members: Annotated[dict[MemberId, Fingerprint], Field(min_length=2, max_length=MAX_MEMBERS)]
    mac: Mac


class Accepted(Wire):
    """Joiner → host: the roster checked out against the rendezvous's list, MAC'd so only the joiner can say so."""

    kind: Literal["accepted"] = "accepted"
    mac: Mac


class AbortReason(StrEnum):
    CODE_MISMATCH = "code_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    ROSTER_MISMATCH = "roster_mismatch"
    PROTOCOL = "protocol"
    REFUSED = "refused"


class Abort(Wire):
    """Why this side gave up, so the other learns at once instead of timing out."""

    kind: Literal["abort"] = "abort"
    reason: AbortReason
    message: Annotated[str, Field(max_length=600, pattern=r"^[^\x00-\x1f\x7f]*$")] = ""  # shown to people


TrustMessage = Annotated[PakeMessage | Confirm | RosterMessage | Accepted | Abort, Field(discriminator="kind")]
TRUST_MESSAGE: TypeAdapter[TrustMessage] = TypeAdapter(TrustMessage)


def encode(message: Wire) -> str:
    """Compact JSON, ASCII only (the rendezvous carries printable ASCII)."""
    return json.dumps(message.model_dump(mode="json"), separators=(",", ":"))


def parse_message(body: str | bytes, sender: str) -> TrustMessage:
    """One trust message from `sender`; `TrustProtocolError` for anything else."""
    try:
        return TRUST_MESSAGE.validate_json(body)
    except ValidationError as error:
        where, what = first_problem(error)
        raise TrustProtocolError(
            f"{sender} sent an unreadable trust message ({where or 'message'}: {what}); refused", sender
        ) from None
    except (ValueError, TypeError, UnicodeError, RecursionError):
        raise TrustProtocolError(f"{sender} sent an unreadable trust message; refused", sender) from None


def abort_message(error: TrustError) -> str:
    """The body that tells the other side why this side refused."""
    reason = {
        CodeMismatch: AbortReason.CODE_MISMATCH,
        FingerprintMismatch: AbortReason.FINGERPRINT_MISMATCH,
        RosterMismatch: AbortReason.ROSTER_MISMATCH,
        TrustProtocolError: AbortReason.PROTOCOL,
    }.get(type(error), AbortReason.REFUSED)
    text = _CONTROL.sub(" ", str(error))[:600]  # it may quote what the rendezvous said
    return encode(Abort(reason=reason, message=text))


# ---------------------------------------------------------------------------------------------
# MACs and rosters (pure)


def _context(channel: str, host_id: str, joiner_id: str) -> bytes:
    return b"|".join((PROTOCOL, channel.encode(), host_id.encode(), joiner_id.encode()))


def confirm_mac(key: bytes, context: bytes, role: Role, fingerprint: str) -> str:
    """What `role` sends to prove it derived `key` and owns `fingerprint` (role-tagged: no reflection)."""
    data = b"\0".join((PROTOCOL + b" confirm", role.value.encode(), context, fingerprint.encode()))
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _member_index(member_id: str) -> int:
    return int(member_id[1:])


def canonical_roster(roster: Mapping[str, str]) -> bytes:
    """One byte string per roster, whatever the order of its mapping."""
    return "\n".join(f"{m}={roster[m]}" for m in sorted(roster, key=_member_index)).encode()


def roster_mac(key: bytes, context: bytes, roster: Mapping[str, str], label: bytes = b"roster") -> str:
    """The host's MAC on the roster it sends (`roster`), or the joiner's on the one it accepts (`accepted`)."""
    data = b"\0".join((PROTOCOL + b" " + label, context, canonical_roster(roster)))
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def check_roster(
    roster: Mapping[str, str],
    reported: Mapping[str, str],
    *,
    host_id: str,
    host_fingerprint: str,
    self_id: str,
    self_fingerprint: str,
) -> dict[str, str]:
    """The roster, if the rendezvous's member list (`reported`: id → fingerprint) agrees with it.

    `roster` must already be authenticated; `host_fingerprint` is the one the host proved and
    `self_fingerprint` this member's own.
    """
    host_fingerprint, self_fingerprint = host_fingerprint.lower(), self_fingerprint.lower()
    if roster.get(self_id) != self_fingerprint:
        raise RosterMismatch(f"the host's roster does not list this member ({self_id}) with its own fingerprint")
    if roster.get(host_id) != host_fingerprint:
        raise RosterMismatch(f"the host's roster does not list the host ({host_id}) with the fingerprint it proved")
    injected = sorted(set(reported) - set(roster), key=_member_index)
    if injected:
        raise RosterMismatch(
            f"member {', '.join(injected)} is in the rendezvous's member list but not in the host's verified "
            f"roster: the rendezvous injected it. Refused; {_ADVICE}",
            injected[0],
        )
    hidden = sorted(set(roster) - set(reported), key=_member_index)
    if hidden:
        raise RosterMismatch(
            f"member {', '.join(hidden)} is in the host's verified roster but the rendezvous did not introduce it "
            f"to this member: the rendezvous is hiding it. Refused; {_ADVICE}",
            hidden[0],
        )
    for member in sorted(roster, key=_member_index):
        if reported[member].lower() != roster[member]:
            raise FingerprintMismatch(member, reported[member].lower(), roster[member], "the host verified")
    return dict(roster)


# ---------------------------------------------------------------------------------------------
# One host ↔ joiner exchange


class Exchange:
    """One side of the exchange between the host and one joiner. Sans-IO.

    `start()` gives the first body to send; `receive()` takes each body from the peer and gives
    the bodies to send back. The host is `engaged` once the joiner's SPAKE2 message has come
    (from then on, an exchange that ends unproven may have been a guess). Once `confirmed`, the
    peer has proved the code and `peer_fingerprint` (the joiner proves first, then the host).
    The host then calls `seal_roster()`; the joiner's `receive()` of it sets `roster`
    (authenticated, not yet compared with the rendezvous: see `check_roster`); once that check
    passes the joiner sends `accept()`, and the host's `receive()` of it sets `accepted`.
    """

    def __init__(
        self,
        role: Role,
        code: str,
        *,
        host_id: str,
        joiner_id: str,
        own_fingerprint: str,
        peer_fingerprint: str,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        channel, secret = split_code(code)  # normalised: what a person typed still matches
        for member in (host_id, joiner_id):
            if not _MEMBER_ID.match(member):
                raise ValueError(f"{member!r} is not a member id")
        if host_id == joiner_id:
            raise ValueError("the host and the joiner must be different members")
        own_fingerprint, peer_fingerprint = own_fingerprint.lower(), peer_fingerprint.lower()
        for fingerprint in (own_fingerprint, peer_fingerprint):
            if not _FINGERPRINT.match(fingerprint):
                raise ValueError("a fingerprint is 64 hex digits")
        self.role = role
        self.host_id, self.joiner_id = host_id, joiner_id
        self.peer_id = joiner_id if role is Role.HOST else host_id
        self.own_fingerprint, self.peer_fingerprint = own_fingerprint, peer_fingerprint
        self.context = _context(channel, host_id, joiner_id)
        self._spake = SPAKE2_Symmetric(f"{channel}-{secret}".encode(), idSymmetric=self.context, entropy_f=entropy)
        self._key: bytes | None = None
        self._started = False
        self.engaged = False  # the peer's SPAKE2 message came: a key to prove is at stake
        self.confirmed = False
        self.roster: dict[str, str] | None = None  # joiner: received; host: sealed
        self.accepted = False

    @property
    def at_stake(self) -> bool:
        """The peer began the exchange and has not proved the code: if it ends now, it may have
        been a guess."""
        return self.engaged and not self.confirmed

    def start(self) -> str:
        if self._started:
            raise RuntimeError("start() once per exchange")
        self._started = True
        return encode(PakeMessage(message=self._spake.start().hex()))

    def receive(self, body: str | bytes) -> list[str]:
        """The peer's next message; bodies to send back. Raises only `TrustError`."""
        if not self._started:
            raise RuntimeError("start() the exchange before receiving")
        message = parse_message(body, self.peer_id)
        if isinstance(message, Abort):
            raise PeerRefused(
                f"{self.peer_id} refused the exchange ({message.reason.value}); its notice, which the rendezvous "
                f"could have forged, says: {message.message or 'nothing more'}",
                self.peer_id,
            )
        if isinstance(message, PakeMessage):
            return self._on_pake(message)
        if isinstance(message, Confirm):
            return self._on_confirm(message)
        if isinstance(message, RosterMessage):
            self._on_roster(message)
        else:
            self._on_accepted(message)
        return []

    def _out_of_order(self, what: str) -> TrustProtocolError:
        return TrustProtocolError(f"{self.peer_id} sent {what} out of order; refused", self.peer_id)

    def _on_pake(self, message: PakeMessage) -> list[str]:
        if self._key is not None:
            raise self._out_of_order("a second SPAKE2 message")
        self.engaged = True  # even a message SPAKE2 refuses: whoever sent it tried
        try:
            self._key = bytes(self._spake.finish(bytes.fromhex(message.message)))
        except Exception as error:  # the library's errors (bad point, reflection) are all a bad peer message
            raise TrustProtocolError(
                f"{self.peer_id} sent an invalid SPAKE2 message ({type(error).__name__}); refused", self.peer_id
            ) from None
        return [self._confirmation()] if self.role is Role.JOINER else []  # the host waits for the joiner's

    def _confirmation(self) -> str:
        assert self._key is not None
        mac = confirm_mac(self._key, self.context, self.role, self.own_fingerprint)
        return encode(Confirm(fingerprint=self.own_fingerprint, mac=mac))

    def _on_confirm(self, message: Confirm) -> list[str]:
        if self._key is None or self.confirmed:
            raise self._out_of_order("a confirmation")
        peer_role = Role.JOINER if self.role is Role.HOST else Role.HOST
        expected = confirm_mac(self._key, self.context, peer_role, message.fingerprint)
        if not hmac.compare_digest(expected, message.mac):
            raise CodeMismatch(self.peer_id, is_host=self.role is Role.JOINER)
        if message.fingerprint != self.peer_fingerprint:
            raise FingerprintMismatch(self.peer_id, self.peer_fingerprint, message.fingerprint, "it proved")
        self.confirmed = True
        return [self._confirmation()] if self.role is Role.HOST else []  # proved: now the host proves too

    def _on_roster(self, message: RosterMessage) -> None:
        if self.role is Role.HOST:
            raise TrustProtocolError(f"{self.peer_id} sent a roster, which only the host sends; refused", self.peer_id)
        if not self.confirmed or self.roster is not None:
            raise self._out_of_order("a roster")
        assert self._key is not None
        if not hmac.compare_digest(roster_mac(self._key, self.context, message.members), message.mac):
            raise RosterMismatch(
                f"the roster from the host ({self.peer_id}) failed its integrity check: the rendezvous altered it. "
                f"Refused; {_ADVICE}",
                self.peer_id,
            )
        self.roster = dict(message.members)

    def _on_accepted(self, message: Accepted) -> None:
        if self.role is Role.JOINER:
            raise TrustProtocolError(
                f"{self.peer_id} sent an acceptance, which only joiners send; refused", self.peer_id
            )
        if self.roster is None or self.accepted:
            raise self._out_of_order("an acceptance")
        assert self._key is not None
        if not hmac.compare_digest(roster_mac(self._key, self.context, self.roster, b"accepted"), message.mac):
            raise RosterMismatch(
                f"member {self.peer_id}'s acceptance of the roster failed its integrity check: the rendezvous "
                f"altered it. Refused; {_ADVICE}",
                self.peer_id,
            )
        self.accepted = True

    def seal_roster(self, roster: Mapping[str, str]) -> str:
        """Host: the roster for this joiner, MAC'd with this pair's key (once, and only once it has confirmed)."""
        if self.role is not Role.HOST or not self.confirmed or self._key is None or self.roster is not None:
            raise RuntimeError("only the host seals a roster, once, and only for a confirmed joiner")
        message = RosterMessage(members=dict(roster), mac="0" * 64)  # validates ids and fingerprints
        self.roster = dict(message.members)
        return encode(message.model_copy(update={"mac": roster_mac(self._key, self.context, self.roster)}))

    def accept(self) -> str:
        """Joiner: tell the host the roster checked out (call only after `check_roster` passed)."""
        if self.role is not Role.JOINER or self.roster is None or self._key is None or self.accepted:
            raise RuntimeError("only a joiner accepts a roster, once, after receiving it")
        self.accepted = True
        return encode(Accepted(mac=roster_mac(self._key, self.context, self.roster, b"accepted")))
