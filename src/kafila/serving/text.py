"""Generated tokens to text deltas, holding back what might yet become a stop string.

Tokens arrive one at a time, a token can end in the middle of a UTF-8 character, and a stop
string can straddle tokens. So bytes go through an incremental decoder, and the tail of the
text that is still a prefix of some stop string is held until the next token settles it. Pure:
no model, no I/O.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TextUpdate:
    delta: str  # text safe to send now
    stopped: bool  # a stop string was reached; delta ends just before it


class StopAwareText:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.text = ""  # everything sent so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def feed(self, piece: bytes) -> TextUpdate:
        """The text that `piece` (one token's bytes) makes safe to send."""
        if self.stopped:
            return TextUpdate("", True)
        pending = self._held + self._decoder.decode(piece)
        cut = self._first_stop(pending)
        if cut is not None:
            self.stopped = True
            self.matched = next(s for s in self._stop if pending.startswith(s, cut))
            self._held = ""
            return self._send(pending[:cut], True)
        keep = self._longest_partial_stop(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._send(pending[: len(pending) - keep], False)

    def flush(self) -> str:
        """At the end of generation, whatever was held back (it never became a stop string)."""
        if self.stopped:
            return ""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._send(rest, False).delta

    def _send(self, delta: str, stopped: bool) -> TextUpdate:
        self.text += delta
        return TextUpdate(delta, stopped)

    def _first_stop(self, pending: str) -> int | None:
        # A stop string may begin in text already sent only if it was held; held text is in `pending`.
        found = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _longest_partial_stop(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(pending)), best, -1):
                if pending.endswith(stop[:length]):
                    best = length
                    break
        return best
