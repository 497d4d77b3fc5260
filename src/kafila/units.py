"""Byte counts as people read them in messages: 419.0KB, 250.0MB, 12.3GB (powers of ten)."""

from __future__ import annotations

from pydantic import ByteSize


def human_bytes(n_bytes: int) -> str:
    return ByteSize(n_bytes).human_readable(decimal=True)
