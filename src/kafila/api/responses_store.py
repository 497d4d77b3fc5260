"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns and what a later
request's `previous_response_id` continues, kept in memory only, bounded in count and in bytes.

The oldest go first once either bound is passed; an id that went (dropped for room, or deleted)
is remembered for a while, so that asking for it says what happened rather than that it never
existed. Nothing survives the host's restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from kafila.api.asks import Turn
from kafila.api.errors import ApiError

MAX_STORED = 256
MAX_STORED_BYTES = 64 << 20
MAX_REMEMBERED_GONE = 4096

Gone = Literal["dropped", "deleted"]


@dataclass(frozen=True)
class StoredResponse:
    """A finished response as `GET` returns it, and the conversation it ends: the turns a request
    that continues it starts from (its input and output; not its instructions, which OpenAI's API
    does not carry over), and the call ids made in them with their functions' names."""

    response: dict[str, Any]
    turns: tuple[Turn, ...]
    calls: dict[str, str]

    def size(self) -> int:
        """Bytes, about: the response as JSON and the conversation's text."""
        text = sum(len(t.content) + len(t.reasoning or "") + sum(len(c.arguments) for c in t.calls) for t in self.turns)
        return len(json.dumps(self.response)) + text


class ResponseStore:
    """Responses by id, oldest first out, within `max_count` and `max_bytes`."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._kept: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._gone: OrderedDict[str, Gone] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        size = stored.size()
        if size > self.max_bytes:  # it alone would not fit: kept nowhere, said so if asked
            self._forget(response_id, "dropped")
            return
        self._kept[response_id] = (stored, size)
        self.bytes += size
        while len(self._kept) > self.max_count or self.bytes > self.max_bytes:
            oldest = next(iter(self._kept))
            self._drop(oldest, "dropped")

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming the id and saying why it is not here."""
        kept = self._kept.get(response_id)
        if kept is not None:
            return kept[0]
        raise self.missing(response_id, param)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id, "deleted")

    def missing(self, response_id: str, param: str | None) -> ApiError:
        shown = response_id[:100]
        gone = self._gone.get(response_id)
        if gone == "deleted":
            why = "it was deleted"
        elif gone == "dropped":
            why = (
                f"it has expired: this server keeps responses in memory only, the last {self.max_count} "
                f"within {self.max_bytes >> 20} MiB, and it was dropped to make room"
            )
        else:
            why = (
                "this server never stored it since it started (it keeps responses in memory only, and "
                "none made with store=false)"
            )
        what = "Previous response" if param == "previous_response_id" else "Response"
        return ApiError(404, f"{what} with id '{shown}' not found: {why}.", "invalid_request_error", "not_found", param)

    def _drop(self, response_id: str, why: Gone) -> None:
        _, size = self._kept.pop(response_id)
        self.bytes -= size
        self._forget(response_id, why)

    def _forget(self, response_id: str, why: Gone) -> None:
        self._gone[response_id] = why
        self._gone.move_to_end(response_id)
        while len(self._gone) > MAX_REMEMBERED_GONE:
            self._gone.popitem(last=False)
