"""HOST:PORT as the commands take it (`--rendezvous`), in a module of its own: `kafila join` and
`kafila host` read one without importing the rendezvous server that `kafila rendezvous` runs."""

from __future__ import annotations

from kafila.session.presence import NatTests


def parse_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    host, separator, port = text.rpartition(":")
    if not separator:
        if default_port is None:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return text, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port from 1 to 65535, got {text!r}")
    return host.strip("[]"), int(port)


def nat_tests_begun(rendezvous: str | None) -> NatTests | None:
    """The NAT tests against the rendezvous `--rendezvous` names, begun as `kafila host` or `kafila
    join` starts, so that they overlap loading llama.cpp, reading the model's header and measuring
    this machine (behind a filtering NAT they wait out a silence). None without one (the embedded
    rendezvous starts later; a member finds its host on the LAN first), and for an address the
    command refuses later, saying why."""
    if rendezvous is None:
        return None
    try:
        return NatTests(parse_host_port(rendezvous.strip(), 8470))
    except ValueError:
        return None
