"""HOST:PORT as the commands take it (`--rendezvous`), in a module of its own: `kafila join` and
`kafila host` read one without importing the rendezvous server that `kafila rendezvous` runs."""

from __future__ import annotations


def parse_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    host, separator, port = text.rpartition(":")
    if not separator:
        if default_port is None:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return text, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port from 1 to 65535, got {text!r}")
    return host.strip("[]"), int(port)
