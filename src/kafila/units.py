"""Byte counts as people read them in messages (419.0KB, 250.0MB, 12.3GB: powers of ten), and what
to do when a disk lacks them."""

from __future__ import annotations

from pydantic import ByteSize

DISK_ROOM_HINT = "free some space, or set KAFILA_CACHE to a folder on a larger disk"


def human_bytes(n_bytes: int) -> str:
    return ByteSize(n_bytes).human_readable(decimal=True)
