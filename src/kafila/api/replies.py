"""Replies in OpenAI's shapes, pure but for reading the engine loop's queue: a whole reply or its
stream of chunks, text split into content, reasoning and tool-call deltas, log probabilities,
usage."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafila.api.errors import TRY_AGAIN, ApiError
from kafila.api.telemetry import Metrics
from kafila.api.tool_calls import (
    Piece,
    Reasoning,
    ReplyReader,
)
from kafila.runtime.engine.logprobs import Alternative, TokenLogprob
from kafila.serving.batcher import Finished, FinishReason, RequestEvent, TextDelta


class TextOffsets:
    """Where each token's text starts in the completion's text, in characters. A token that is
    whole UTF-8 starts where its own text does (after any replacement characters that bytes
    left pending before it turn into); one that is part of a character, where that character
    does (a stray byte's replacement character included)."""

    def __init__(self) -> None:
        self.characters = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, piece: bytes) -> int:
        before = self.characters
        added = len(self.decoder.decode(piece))
        self.characters += added
        try:
            return before + added - len(piece.decode("utf-8"))
        except UnicodeDecodeError:  # part of a character: the one it leaves pending, or the last it completed
            pending = bool(self.decoder.getstate()[0])
            return self.characters if pending else max(before, self.characters - 1)


@dataclass
class Reply:
    """Shapes one request's events as OpenAI chat or text completion objects."""

    request_id: str
    model: str
    chat: bool
    started: float
    metrics: Metrics
    logprobs: bool = False  # the request asked for log probabilities
    created: int = field(default_factory=lambda: int(time.time()))
    first_text: bool = True
    gathered: list[TokenLogprob] = field(default_factory=list)  # a whole reply's log probabilities
    offsets: TextOffsets = field(default_factory=TextOffsets)
    reader: ReplyReader | None = None  # content, reasoning and calls out of the text

    async def collect(self, queue: asyncio.Queue[RequestEvent]) -> tuple[str, Finished]:
        parts = []
        while True:
            event = await queue.get()
            if isinstance(event, TextDelta):
                self.observe_text()
                parts.append(event.text)
                self.gathered += event.logprobs
            elif isinstance(event, Finished):
                self.observe_end(event)
                return "".join(parts), event
            elif event.code == "ring_failed":  # the host replans: a retry shortly may well be served
                raise ApiError(503, event.message, "server_error", event.code, headers=TRY_AGAIN)
            else:
                raise ApiError(500, event.message, "server_error", event.code)

    def observe_text(self) -> None:
        if self.first_text:
            self.first_text = False
            self.metrics.first_token.observe(time.monotonic() - self.started)

    def observe_end(self, finished: Finished) -> None:
        self.metrics.prompt_tokens.inc(finished.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(finished.cached_tokens)
        self.metrics.computed_prompt_tokens.inc(finished.prompt_tokens - finished.cached_tokens)
        self.metrics.completion_tokens.inc(finished.completion_tokens)

    @staticmethod
    def usage(finished: Finished) -> dict[str, Any]:
        return {
            "prompt_tokens": finished.prompt_tokens,
            "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finished: Finished) -> dict[str, Any]:
        logprobs = self.logprobs_of(self.gathered)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = finished.reason.value
            if self.reader is not None:
                message["content"], reasoning, calls = self.reader.read_whole(text)
                if reasoning:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [c.wire() for c in calls]
                    reason = self.finish_reason(finished, True)
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finished.reason.value, "logprobs": logprobs}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(finished)}

    def chunk(
        self, text: str | None, finish: str | None, role: bool = False, tokens: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        logprobs = self.logprobs_of(tokens) if text is not None and finish is None and not role else None
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return {**self._envelope(True), "choices": [choice]}

    @staticmethod
    def finish_reason(finished: Finished, called: bool) -> str:
        """OpenAI's "tool_calls" where the model ended its turn with calls; "length" stays."""
        return "tool_calls" if called and finished.reason is FinishReason.STOP else finished.reason.value

    def read_chunks(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """Content, reasoning and tool-call deltas as OpenAI's chunks (reasoning as llama.cpp's
        and vLLM's servers send it, `reasoning_content`)."""
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(self.chunk(piece, None))
                continue
            delta: dict[str, Any] = (
                {"reasoning_content": piece.text} if isinstance(piece, Reasoning) else {"tool_calls": [piece.wire()]}
            )
            choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
            out.append({**self._envelope(True), "choices": [choice]})
        return out

    def logprobs_of(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's `logprobs` object for these tokens, or None where the request asked for none:
        chat's `content` list, or the legacy completion's parallel lists."""
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {**chat_token(t.piece, t.logprob), "top_logprobs": [chat_token(a.piece, a.logprob) for a in t.top]}
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [token_text(t.piece) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [by_text(t.top) for t in tokens],
            "text_offset": [self.offsets.next(t.piece) for t in tokens],
        }

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage(finished)}


def token_text(piece: bytes) -> str:
    """A token as text; one that is not whole UTF-8 (part of a character) as OpenAI writes it,
    `bytes:` and its bytes escaped."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def by_text(top: Sequence[Alternative]) -> dict[str, float]:
    """The legacy completion's alternatives, keyed by text, most likely first: of two tokens that
    read the same, the likelier."""
    out: dict[str, float] = {}
    for alternative in top:
        out.setdefault(token_text(alternative.piece), alternative.logprob)
    return out


def chat_token(piece: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token_text(piece), "logprob": logprob, "bytes": list(piece)}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def stream_reply(
    queue: asyncio.Queue[RequestEvent], reply: Reply, include_usage: bool, cancel: Callable[[], None]
) -> AsyncIterator[bytes]:
    """Server-sent events: a role chunk, text chunks, a finish chunk, usage if asked, then [DONE].

    Events that queued up while the last write went out leave in one write: each is still its
    own SSE event, but a busy loop pays the response machinery once for them, not per token."""
    try:
        if reply.chat:
            yield sse(reply.chunk("", None, role=True))
        ended = False
        while not ended:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            out: list[bytes] = []
            for event in events:
                if isinstance(event, TextDelta):
                    reply.observe_text()
                    if reply.reader is not None:  # content, reasoning and calls as the reader releases them
                        out += read_sse(reply, reply.reader.feed(event.text))
                    else:
                        out.append(sse(reply.chunk(event.text, None, tokens=event.logprobs)))
                    continue
                if isinstance(event, Finished):
                    reply.observe_end(event)
                    reason = event.reason.value
                    if reply.reader is not None:
                        out += read_sse(reply, reply.reader.finish())
                        reason = reply.finish_reason(event, reply.reader.calls > 0)
                    out.append(sse(reply.chunk(None if reply.chat else "", reason)))
                    if include_usage:
                        out.append(sse(reply.usage_chunk(event)))
                else:
                    error = {"message": event.message, "type": "server_error", "param": None, "code": event.code}
                    out.append(sse({"error": error}))
                ended = True
                break
            if ended:
                out.append(b"data: [DONE]\n\n")
            yield b"".join(out)
    finally:
        cancel()  # the client went away, or the stream ended: either way the slot is free


def read_sse(reply: Reply, pieces: list[Piece]) -> list[bytes]:
    """SSE events for what a reply's reader released."""
    return [sse(chunk) for chunk in reply.read_chunks(pieces)]
