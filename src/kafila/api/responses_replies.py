"""The Responses API's reply: output items (reasoning, a message, function calls) built as the
reply's pieces come, whole or as the API's named events with their sequence numbers; the text
that reaches a message's `output_text` carries its own tokens' log probabilities where the
request asked for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafila.api.front import new_id
from kafila.api.openai_replies import TokenTexts, token_logprobs
from kafila.api.replies import sse
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCallDelta
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta

Event = tuple[str, dict[str, Any]]


@dataclass
class OutputItems:
    """The response's output items, built as the reply's pieces come (reasoning, text, calls),
    with the events that tell a stream of each: an item opens when its first piece comes and
    closes when a piece of another kind does, or at the end. Whitespace before an item is
    dropped unless a message follows it."""

    items: list[dict[str, Any]] = field(default_factory=list)
    tokens: TokenTexts = field(default_factory=TokenTexts)
    _open: dict[str, Any] | None = None
    _space: str = ""
    _space_tokens: tuple[TokenLogprob, ...] = ()

    def feed(self, pieces: Sequence[Piece]) -> list[Event]:
        """Events for the reader's `pieces` of the text last added to `tokens`."""
        events: list[Event] = []
        for piece in pieces:
            tokens = self.tokens.of(piece)
            if isinstance(piece, str):
                events += self._text(piece, tokens)
            elif isinstance(piece, Reasoning):
                events += self._reasoning(piece.text)
            else:
                events += self._call(piece)
        return events

    def finish(self, complete: bool) -> list[Event]:
        """Close what is open (incomplete where the reply was cut short); a reply with no item at
        all is a message of what whitespace it wrote, or empty."""
        events = self._text("", force=True) if not self.items else []
        return events + self._close("completed" if complete else "incomplete")

    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"])

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _index(self) -> int:
        return len(self.items) - 1

    def _text(self, text: str, tokens: Sequence[TokenLogprob] = (), force: bool = False) -> list[Event]:
        if self._kind() != "message" and not force and not text.strip():
            self._space += text
            self._space_tokens += tuple(tokens)
            return []
        events: list[Event] = []
        if self._kind() != "message":
            events += self._begin({"id": new_id("msg_"), "type": "message", "status": "in_progress",
                                   "role": "assistant", "content": []})  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
            text, self._space = self._space + text, ""
            tokens, self._space_tokens = (*self._space_tokens, *tokens), ()
        assert self._open is not None
        self._open["_text"] = self._open.get("_text", "") + text
        self._open["_tokens"] = (*self._open.get("_tokens", ()), *tokens)
        if text:
            logprobs = token_logprobs(tokens, with_bytes=False)
            delta = {**self._where(), "content_index": 0, "delta": text, "logprobs": logprobs}
            events.append(("response.output_text.delta", delta))
        return events

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._kind() != "reasoning":
            events += self._begin({"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []})
            part = {"type": "reasoning_text", "text": ""}
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
        assert self._open is not None
        self._open["_text"] = self._open.get("_text", "") + text
        events.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text}))
        return events

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if delta.id is not None:
            events += self._begin({"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                                   "call_id": delta.id, "name": delta.name or "", "arguments": ""})  # fmt: skip
        if self._kind() != "function_call" or not delta.arguments:
            return events
        assert self._open is not None
        self._open["arguments"] += delta.arguments
        events.append(("response.function_call_arguments.delta", {**self._where(), "delta": delta.arguments}))
        return events

    def _begin(self, item: dict[str, Any]) -> list[Event]:
        events = self._close("completed")
        self._space, self._space_tokens = "", ()
        self.items.append(item)
        self._open = item
        return [*events, ("response.output_item.added", {"output_index": self._index(), "item": dict(item)})]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index()}

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        item, where = self._open, self._where()
        self._open = None
        events: list[Event] = []
        if item["type"] == "message":
            text, tokens = item.pop("_text", ""), item.pop("_tokens", ())
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": token_logprobs(tokens)}
            done = {**where, "content_index": 0, "text": text, "logprobs": token_logprobs(tokens, with_bytes=False)}
            events.append(("response.output_text.done", done))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            text = item.pop("_text", "")
            part = {"type": "reasoning_text", "text": text}
            events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item["content"] = [part]
        else:
            done = {**where, "name": item["name"], "arguments": item["arguments"]}
            events.append(("response.function_call_arguments.done", done))
        item["status"] = status
        events.append(("response.output_item.done", {"output_index": where["output_index"], "item": dict(item)}))
        return events


@dataclass
class ResponsesWriter:
    """A response, whole or as the API's named server-sent events, each with its sequence number:
    `response.created` and `response.in_progress`, each output item's events, then
    `response.completed` (or `response.incomplete` past max_output_tokens, or `response.failed`).
    `keep`: told the finished response (to store it); `count_tokens`: how many tokens a text is,
    for the usage's reasoning tokens."""

    request_id: str
    model: str
    echo: dict[str, Any]
    reader: ReplyReader | None = None
    keep: Callable[[dict[str, Any]], None] | None = None
    count_tokens: Callable[[str], int] | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: OutputItems = field(default_factory=OutputItems)
    sequence: int = 0
    _closing: list[Event] = field(default_factory=list)  # the output's last events, once it ended
    media_type = "text/event-stream"

    def response(
        self, status: str, finished: Finished | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": None, "model": self.model, "output": [],
            "usage": None, **self.echo,
        }  # fmt: skip
        if finished is not None:
            body["output"] = [dict(item) for item in self.output.items]
            body["usage"] = self._usage(finished)
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            else:
                body["completed_at"] = int(time.time())
        return body

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        self.output.tokens.add(text, logprobs)
        self._pieces(self.reader.feed(text) + self.reader.finish() if self.reader is not None else [text])
        return self._ended(finished)[1]

    def opening(self) -> list[bytes]:
        return [self._event("response.created", {"response": self.response("in_progress")}),
                self._event("response.in_progress", {"response": self.response("in_progress")})]  # fmt: skip

    def delta(self, delta: TextDelta) -> list[bytes]:
        self.output.tokens.add(delta.text, delta.logprobs)
        return self._events(self._pieces(self.reader.feed(delta.text) if self.reader is not None else [delta.text]))

    def end(self, finished: Finished) -> list[bytes]:
        out = self._events(self._pieces(self.reader.finish())) if self.reader is not None else []
        kind, response = self._ended(finished)
        return [*out, *self._events(self._closing), self._event(kind, {"response": response})]

    def failed(self, failure: RequestFailed) -> list[bytes]:
        error = {"code": "server_error", "message": failure.message}
        return [self._event("response.failed", {"response": self.response("failed", error=error)})]

    def _pieces(self, pieces: Sequence[Piece]) -> list[Event]:
        return self.output.feed(pieces)

    def _ended(self, finished: Finished) -> tuple[str, dict[str, Any]]:
        complete = finished.reason is FinishReason.STOP
        self._closing = self.output.finish(complete)
        response = self.response("completed" if complete else "incomplete", finished)
        if self.keep is not None:
            self.keep(response)
        return ("response.completed" if complete else "response.incomplete"), response

    def _usage(self, finished: Finished) -> dict[str, Any]:
        reasoning = self.output.reasoning_text()
        reasoning_tokens = self.count_tokens(reasoning) if reasoning and self.count_tokens is not None else 0
        return {
            "input_tokens": finished.prompt_tokens,
            # what this prompt computed stays in the cache for the next request that shares it
            "input_tokens_details": {
                "cached_tokens": finished.cached_tokens,
                "cache_write_tokens": finished.prompt_tokens - finished.cached_tokens,
            },
            "output_tokens": finished.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, finished.completion_tokens)},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        }

    def _events(self, events: Sequence[Event]) -> list[bytes]:
        return [self._event(kind, payload) for kind, payload in events]

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse(body, kind)
