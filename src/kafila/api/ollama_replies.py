"""The Ollama API's replies: `/api/chat`'s and `/api/generate`'s, whole or as JSON lines, with
Ollama's counters; the answer to a request that only loads the model."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafila.api.openai_replies import token_logprobs
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCall, ToolCallDelta
from kafila.runtime.engine.logprobs import TokenLogprob
from kafila.serving.batcher import Finished, RequestFailed, TextDelta

NDJSON = "application/x-ndjson"


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def call_object(call: ToolCall, index: int) -> dict[str, Any] | None:
    """A call as Ollama carries it, its arguments an object; None where they are not one (the
    token limit cut them)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


@dataclass
class OllamaWriter:
    """`/api/chat`'s and `/api/generate`'s reply, whole or as JSON lines. The reader, where there
    is one, splits the text into content, reasoning (`thinking`, shown where `think` is not
    false) and tool calls, which go out whole, each once its arguments are written, as Ollama's
    do. The last line has `done: true`, the reason, and Ollama's counters (durations in ns).
    Log probabilities cover every generated token, reasoning's, calls' and markers' too, as
    Ollama's server attaches them before its parser splits the text: each delta's ride on the
    first line it makes, or on one of their own (OpenAI's dialects give content its own only)."""

    request_id: str
    model: str  # the name the client asked for
    chat: bool  # /api/chat's shape (`message`), else /api/generate's (`response`)
    reader: ReplyReader | None = None
    show_thinking: bool = True
    logprobs: bool = False
    media_type = NDJSON
    started: int = field(default_factory=time.monotonic_ns)
    first_text: int | None = None
    calls: dict[int, list[str]] = field(default_factory=dict)  # index: id, name, arguments so far
    sent_calls: int = 0

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content: str | None = text
        reasoning, calls = "", list[ToolCall]()
        if self.reader is not None:
            content, reasoning, calls = self.reader.read_whole(text)
        written = [c for c in (call_object(call, i) for i, call in enumerate(calls)) if c is not None]
        reply = self._envelope(content or "", reasoning if self.show_thinking else "", written)
        if self.logprobs:
            reply["logprobs"] = token_logprobs(logprobs)
        return {**reply, **self._closing(finished, streamed=False)}

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: TextDelta) -> list[bytes]:
        if self.first_text is None:
            self.first_text = time.monotonic_ns()
        pieces: list[Piece] = [delta.text] if self.reader is None else self.reader.feed(delta.text)
        out = self._pieces(pieces)
        if self.logprobs and delta.logprobs:
            tokens = token_logprobs(delta.logprobs)
            if out:  # on the first line this delta makes; else on a line of their own
                first = json.loads(out[0])
                out[0] = line({**first, "logprobs": tokens})
            else:
                out.append(line({**self._envelope("", "", []), "logprobs": tokens}))
        return out

    def end(self, finished: Finished) -> list[bytes]:
        out = self._pieces(self.reader.finish()) if self.reader is not None else []
        out += self._calls_done(len(self.calls))
        return [*out, line({**self._envelope("", "", []), **self._closing(finished, streamed=True)})]

    def failed(self, failure: RequestFailed) -> list[bytes]:
        return [line({"error": failure.message})]

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    out.append(line(self._envelope(piece, "", [])))
            elif isinstance(piece, Reasoning):
                if piece.text and self.show_thinking:
                    out.append(line(self._envelope("", piece.text, [])))
            else:
                out += self._call_piece(piece)
        return out

    def _call_piece(self, piece: ToolCallDelta) -> list[bytes]:
        out = []
        if piece.index not in self.calls:
            out = self._calls_done(piece.index)  # a new call: those before it are written
            self.calls[piece.index] = [piece.id or "", piece.name or "", ""]
        self.calls[piece.index][2] += piece.arguments
        return out

    def _calls_done(self, upto: int) -> list[bytes]:
        """The calls before `upto` not yet sent, each on a line of its own."""
        out = []
        while self.sent_calls < upto:
            call_id, name, arguments = self.calls[self.sent_calls]
            written = call_object(ToolCall(call_id, name, arguments), self.sent_calls)
            if written is not None:
                out.append(line(self._envelope("", "", [written])))
            self.sent_calls += 1
        return out

    def _envelope(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        reply: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            reply["message"] = message
        else:
            reply["response"] = text
            if thinking:
                reply["thinking"] = thinking
        reply["done"] = False  # the last line's closing says otherwise
        return reply

    def _closing(self, finished: Finished, streamed: bool) -> dict[str, Any]:
        """`done`, its reason, and the counters. Durations are measured from the request's start;
        a whole reply has no time of its first token, so it splits none between the prompt and
        the reply."""
        ended = time.monotonic_ns()
        counters: dict[str, Any] = {
            "done": True,
            "done_reason": finished.reason.value,
            "total_duration": ended - self.started,
            "load_duration": 0,
            "prompt_eval_count": finished.prompt_tokens,
            "eval_count": finished.completion_tokens,
        }
        if streamed:
            first = self.first_text or ended
            counters["prompt_eval_duration"] = first - self.started
            counters["eval_duration"] = ended - first
        return counters


def loaded(model: str, chat: bool, keep_alive: Any) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate, which clients send to load a model
    (or, with `keep_alive: 0`, to unload it): this one is loaded while the session serves."""
    reason = "unload" if keep_alive in (0, "0", "0s", "0m") else "load"
    reply: dict[str, Any] = {"model": model, "created_at": now_iso()}
    reply |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {**reply, "done": True, "done_reason": reason}
