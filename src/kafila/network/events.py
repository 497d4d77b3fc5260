"""Structured log events for the rendezvous and the relay.

An event is a flat dict, logged as one JSON line with the dict itself in `extra["kafila_event"]`
so that a handler (or a test) can read it without parsing. Events describe what happened to
whom, never what was said: keys that could carry a secret or a payload are dropped here, as a
last guard behind the callers, which never pass them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableSequence
from typing import Any

FORBIDDEN_KEYS = frozenset({"token", "relay_token", "payload", "data", "code", "secret"})


def emit(
    logger: logging.Logger,
    event: str,
    sink: MutableSequence[dict[str, Any]] | None = None,
    level: int = logging.INFO,
    **fields: Any,
) -> dict[str, Any]:
    """Log one event and, if given a sink (a bounded deque), keep it there for inspection."""
    record: dict[str, Any] = {"event": event}
    record.update((key, value) for key, value in fields.items() if key not in FORBIDDEN_KEYS)
    if sink is not None:
        sink.append(record)
    if logger.isEnabledFor(level):
        logger.log(level, "%s", json.dumps(record, sort_keys=True, default=str), extra={"kafila_event": record})
    return record
