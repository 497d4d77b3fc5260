"""What `kafila host` and `kafila join` begin before they import the rest of themselves.

`kafila host` imports about 1,250 modules (the API server, the session, llama.cpp's bindings) and
then loads llama.cpp: seconds on a busy machine, and the members cannot start before its join
line. Two things on the way to that line wait mostly on the network: the model's header from the
hub (`HeaderRead`) and the NAT tests against the rendezvous (`session.presence.NatTests`). So the
entry point (`commands.main`) calls `begin` with the command line before it imports the command's
module, and they run beside those imports. The command line is read here as the command reads it
(`--model`, `--members`, `--demo`, `--rendezvous`, `KAFILA_RENDEZVOUS` for `join`); the command
takes what was begun (`header_read_begun`, `nat_tests_begun`) only where it is for the same model
or rendezvous, and begins its own otherwise.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kafila.background import in_background
from kafila.cli.addresses import parse_host_port
from kafila.hub.reference import HubReference, ModelNameError, parse_reference
from kafila.hub.remote import HeaderBytes, read_header_bytes
from kafila.session.presence import NatTests

DEMO_MEMBERS = 3  # `kafila host --demo`'s members by default
_HOST_OPTIONS = ("--model", "--members", "--rendezvous")


class HeaderRead:
    """A model's header read from the hub (`read_header_bytes`: the listing, each part's file asked
    for, its header's bytes) in a thread of its own, begun as soon as the command knows the model's
    name, for `model_source` to read (`read_hub_header`): the read then overlaps the command's
    imports, llama.cpp's load and the NAT tests rather than following them. This module imports no
    more than that read needs (huggingface_hub, not the GGUF reader or numpy), so it begins early."""

    def __init__(self, reference: HubReference, endpoint: str | None = None) -> None:
        self.reference = reference
        self._done = in_background("hub-header", functools.partial(read_header_bytes, reference, endpoint=endpoint))

    def result(self) -> HeaderBytes:
        """The header's bytes, or what `read_header_bytes` raised."""
        return self._done.result()


@dataclass
class _Begun:
    """What `begin` began, until the command takes it."""

    header: HeaderRead | None = None
    nat_tests: NatTests | None = None


_BEGUN = _Begun()  # one command a process


@dataclass(frozen=True)
class EarlyWork:
    """What a command line will wait on: a model's header (`--model` as given), NAT tests against a
    rendezvous (`--rendezvous` as given); None: not that."""

    model: str | None = None
    rendezvous: str | None = None


def early_work(command: str, arguments: Sequence[str], environ: Mapping[str, str]) -> EarlyWork:
    """What `command` (host or join) will wait on, read from its `arguments` (those after its name)
    as it reads them: a host with members, its header and NAT tests; a member, its NAT tests.
    Nothing for anything else, or a command line it will refuse."""
    options = _options(arguments, _HOST_OPTIONS if command == "host" else ("--rendezvous",))
    if command == "join":
        return EarlyWork(rendezvous=options.get("--rendezvous") or environ.get("KAFILA_RENDEZVOUS"))
    members = options.get("--members")
    if command != "host" or (members is not None and not members.isdigit()):
        return EarlyWork()
    n_members = int(members) if members is not None else (DEMO_MEMBERS if "--demo" in arguments else 1)
    if n_members < 2:
        return EarlyWork()
    return EarlyWork(model=options.get("--model"), rendezvous=options.get("--rendezvous"))


def begin(command: str, arguments: Sequence[str], endpoint: str | None = None) -> None:
    """Begin, each in a thread of its own, what `command` will wait on (`early_work`)."""
    work = early_work(command, arguments, os.environ)
    _BEGUN.nat_tests = _nat_tests(work.rendezvous)
    _BEGUN.header = _header_read(work.model, endpoint)


def header_read_begun(value: str | None, for_members: bool) -> HeaderRead | None:
    """The header's read begun, where `value` names a model on the hub for a host with members
    (`model_source` reads it then): the one `begin` began for it, or one begun now; None for
    anything else, or a name `model_source` refuses."""
    early, _BEGUN.header = _BEGUN.header, None
    reference = _reference(value) if for_members else None
    if reference is None:
        return None
    return early if early is not None and early.reference == reference else HeaderRead(reference)


def nat_tests_begun(rendezvous: str | None) -> NatTests | None:
    """The NAT tests against the rendezvous `--rendezvous` names (`NatTests`), so that they overlap
    loading llama.cpp, reading the model's header and measuring this machine (behind a filtering
    NAT they wait out a silence): those `begin` began against it, or tests begun now. None without
    one (the embedded rendezvous starts later; a member finds its host on the LAN first), and for an
    address the command refuses later, saying why."""
    early, _BEGUN.nat_tests = _BEGUN.nat_tests, None
    address = _address(rendezvous)
    if address is None:
        return None
    return early if early is not None and early.rendezvous == address else NatTests(address)


def _options(arguments: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """The values of the options `names` in `arguments`, as `--name VALUE` or `--name=VALUE`."""
    found: dict[str, str] = {}
    tokens = iter(arguments)
    for token in tokens:
        if token == "--":
            break
        name, equals, value = token.partition("=")
        if name in names:
            found[name] = value if equals else next(tokens, "")
    return found


def _reference(value: str | None) -> HubReference | None:
    if value is None:
        return None
    try:
        return parse_reference(value, local_file_exists=Path(value).expanduser().is_file())
    except ModelNameError:
        return None


def _address(rendezvous: str | None) -> tuple[str, int] | None:
    if rendezvous is None:
        return None
    try:
        return parse_host_port(rendezvous.strip(), 8470)
    except ValueError:
        return None


def _header_read(value: str | None, endpoint: str | None) -> HeaderRead | None:
    reference = _reference(value)
    return HeaderRead(reference, endpoint) if reference is not None else None


def _nat_tests(rendezvous: str | None) -> NatTests | None:
    address = _address(rendezvous)
    return NatTests(address) if address is not None else None
