"""What the environment sets for serving, read apart from the engine loop that serves: every
command checks these as it starts (a typo said at once), and `kafila join` does not import the
loop to do it."""

from __future__ import annotations

from collections.abc import Mapping

PREFILL_CHUNKS_SETTING = "KAFILA_PREFILL_CHUNKS"


def prefill_chunks_setting(environ: Mapping[str, str]) -> int | None:
    """KAFILA_PREFILL_CHUNKS: how many chunks of one prompt may be out round the ring at once, 1
    turning pipelined prefill off; None where unset. ValueError naming it for anything but a whole
    number of at least 1, so a typo is said at once rather than taken for off."""
    raw = environ.get(PREFILL_CHUNKS_SETTING, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"{PREFILL_CHUNKS_SETTING}={environ[PREFILL_CHUNKS_SETTING]!r} is not a whole number of at least 1 "
            "(chunks of one prompt out round the ring at once; 1 turns pipelined prefill off)"
        )
    return int(raw)
