"""gpt-oss's harmony replies read as OpenAI's: the final channel is the content, the analysis
channel the reasoning (`reasoning_content`), a message to `functions.name` a tool call.

A reply continues the prompt's `<|start|>assistant`: messages, each a header (`<|channel|>analysis`,
`<|channel|>commentary to=functions.f <|constrain|>json`, or the recipient before the channel),
`<|message|>`, a body, and `<|end|>` before the next `<|start|>assistant`. The turn ends on
`<|return|>` or, after a call, `<|call|>`: both end the sequence, so neither is in the text.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCallDelta, openai_call_id, partial_suffix

_MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")
_HEADER_STARTS = ("<|", "assistant", "to=")  # how a header may begin, the prompt's `<|start|>` aside
# A recipient runs to a delimiter: whitespace (before the content type) or a special token.
_RECIPIENT = re.compile(r"to=([^\s<]{1,80})")
# A header is short; text that has gone on this long without `<|message|>` is no header.
MAX_HEADER_CHARS = 256


def offered_tool(recipient: str, tools: Collection[str]) -> str | None:
    """The offered tool a message to `recipient` calls: `functions.` and a name on the list, read no
    further than that name (the longest that fits, where text ran on past it); None where the
    recipient is no function or none of `tools`, so a client is never sent a call it did not offer."""
    if not recipient.startswith("functions."):
        return None
    name = recipient.removeprefix("functions.")
    if name in tools:
        return name
    return max((tool for tool in tools if tool and name.startswith(tool)), key=len, default=None)


class HarmonyReader(ReplyReader):
    """Splits a harmony reply into content, reasoning and tool-call deltas as it comes.
    `tools`: the names of the functions the request offered; a message to one of them is a call,
    messages to any other recipient are dropped, as turns the client did not ask for."""

    def __init__(self, tools: Collection[str] = (), parallel: bool = True) -> None:
        super().__init__()
        self.tools = frozenset(tools)
        self.parallel = parallel
        self._state = "header"  # "header" or "body"
        self._kind = "content"  # the body's: "content", "reasoning", "call" or "dropped"

    def _flush(self, out: list[Piece]) -> None:
        if self._state == "body":
            self._emit(out, self._buffer)

    def _step(self, out: list[Piece], final: bool) -> bool:
        if self._state == "header":
            return self._in_header(out, final)
        ends = [i for i in (self._buffer.find(tag) for tag in _BODY_ENDS) if i >= 0]
        if not ends:
            keep = 0 if final else partial_suffix(self._buffer, _BODY_ENDS)
            self._emit(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        end = min(ends)
        self._emit(out, self._buffer[:end])
        tag = next(t for t in _BODY_ENDS if self._buffer.startswith(t, end))
        self._buffer = self._buffer[end + len(tag) :]
        self._state = "header"
        return True

    def _in_header(self, out: list[Piece], final: bool) -> bool:
        """A header: text that begins as one and reaches `<|message|>` within MAX_HEADER_CHARS;
        anything else is content with no harmony around it."""
        start = self._buffer.lstrip()
        looks_like_header = any(start.startswith(h) or h.startswith(start) for h in _HEADER_STARTS)
        found = self._buffer.find(_MESSAGE, 0, MAX_HEADER_CHARS + len(_MESSAGE)) if looks_like_header else -1
        if found < 0:
            if looks_like_header and not final and len(self._buffer) < MAX_HEADER_CHARS + len(_MESSAGE):
                return False
            self._state, self._kind = "body", "content"
            return True
        header, self._buffer = self._buffer[:found], self._buffer[found + len(_MESSAGE) :]
        # A header never spans a message's end or start: one cut short there is no header at all.
        header = header[max(header.rfind(tag) + len(tag) if tag in header else 0 for tag in _BODY_ENDS) :]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._state = "body"
        if recipient is not None and recipient.group(1) != "assistant":
            name = offered_tool(recipient.group(1), self.tools)
            if name is not None:
                self._kind = "call"
                if self.parallel or not self.calls:
                    out.append(ToolCallDelta(self.calls, "", openai_call_id(), name))
                self._calls += 1
            else:
                self._kind = "dropped"
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"
        return True

    def _emit(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self._kind == "content":
            out.append(text)
        elif self._kind == "reasoning":
            out.append(Reasoning(text))
        elif self._kind == "call" and (self.parallel or self.calls == 1):
            out.append(ToolCallDelta(self.calls - 1, text))
