"""Sizes people type: `--memory 8G`, `--memory 12GiB`, `--memory 512MB`."""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter, ValidationError

_BYTES: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)

MEMORY_HELP = "Lend at most this much of this machine's memory (e.g. 8G, 12GiB); default: what is free."


def parse_memory(text: str | None) -> int | None:
    """Bytes, or None when not given; ValueError with the text's fault otherwise."""
    if text is None:
        return None
    try:
        size = int(_BYTES.validate_python(text.strip()))
    except ValidationError:
        raise ValueError(f"--memory {text!r} is not a size: write it like 8G, 12GiB or 512MB") from None
    if size < 1 << 20:
        raise ValueError(f"--memory {text!r} is under 1 MiB: no stage fits in that")
    return size
