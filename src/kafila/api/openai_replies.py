"""OpenAI's reply shapes: chat completions (content, reasoning and tool-call deltas) and the
legacy text completions, whole or as server-sent chunks, with log probabilities and usage."""

from __future__ import annotations

import codecs
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kafila.api.replies import sse
from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, whole_reply
from kafila.runtime.engine.logprobs import Alternative, TokenLogprob
from kafila.serving.batcher import Finished, FinishReason, RequestFailed, TextDelta

DONE = b"data: [DONE]\n\n"


def usage(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


def finish_reason(finished: Finished, called: bool) -> str:
    """OpenAI's "tool_calls" where the model ended its turn with calls; "length" stays."""
    return "tool_calls" if called and finished.reason is FinishReason.STOP else finished.reason.value


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
class TokenTexts:
    """Which generated tokens each piece a reader makes of the text came from, so that the text
    that reaches a message's content (chat completions' `content`, the Responses API's
    `output_text`) carries its own tokens' log probabilities, and reasoning, call arguments and
    the readers' markers carry none. A token sits where its text starts in the generated text; a
    piece is found there from where the last one ended (readers pass text on as the model wrote
    it, less their markers) and owns the tokens that start within it."""

    _text: str = ""  # the generated text from where the last piece ended
    _base: int = 0  # where `_text` starts in the whole
    _offsets: TextOffsets = field(default_factory=TextOffsets)
    _tokens: deque[tuple[int, TokenLogprob]] = field(default_factory=deque)

    def add(self, text: str, tokens: Sequence[TokenLogprob]) -> None:
        self._text += text
        self._tokens.extend((self._offsets.next(token.piece), token) for token in tokens)

    def of(self, piece: Piece) -> tuple[TokenLogprob, ...]:
        """The tokens the reader's next piece carries: text its own; reasoning and a call's
        arguments none (theirs are passed over)."""
        if isinstance(piece, str):
            return self._owned(piece)
        self._owned(piece.text if isinstance(piece, Reasoning) else piece.arguments)
        return ()

    def _owned(self, piece: str) -> tuple[TokenLogprob, ...]:
        """The tokens that start within `piece`; none where it is not in the text (a reader that
        rewrote it), and then the text it would have passed stays to be found."""
        found = self._text.find(piece)
        if found < 0:
            return ()
        start, end = self._base + found, self._base + found + len(piece)
        self._text, self._base = self._text[found + len(piece) :], end
        out = []
        while self._tokens and self._tokens[0][0] < end:
            offset, token = self._tokens.popleft()
            if offset >= start:
                out.append(token)
        return tuple(out)


@dataclass
class _OpenAIWriter:
    """What both of OpenAI's shapes share: the envelope, usage, the error event and `[DONE]`."""

    request_id: str
    model: str
    logprobs: bool  # the request asked for log probabilities
    include_usage: bool = False  # a stream ends with a usage chunk
    created: int = field(default_factory=lambda: int(time.time()))
    media_type = "text/event-stream"

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = self.object_chunk if chunk else self.object_whole
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _closing(self, finished: Finished) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        return [sse({**self._envelope(True), "choices": [], "usage": usage(finished)}), DONE]

    def failed(self, failure: RequestFailed) -> list[bytes]:
        error = {"message": failure.message, "type": "server_error", "param": None, "code": failure.code}
        return [sse({"error": error}), DONE]


@dataclass
class ChatWriter(_OpenAIWriter):
    """`chat.completion` and its chunks; the reader, where there is one, splits the text into
    content, reasoning (`reasoning_content`, as llama.cpp's and vLLM's servers send it) and tool
    calls, and only the content carries its tokens' log probabilities (`tokens` finds them), as
    OpenAI's."""

    reader: ReplyReader | None = None
    tokens: TokenTexts = field(default_factory=TokenTexts)

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = finished.reason.value
        if self.reader is not None:
            self.tokens.add(text, logprobs)
            pieces = self.reader.feed(text) + self.reader.finish()
            logprobs = [token for piece in pieces for token in self.tokens.of(piece)]
            message["content"], reasoning, calls = whole_reply(pieces)
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [c.wire() for c in calls]
                reason = finish_reason(finished, True)
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": self._logprobs(logprobs)}
        return {**self._envelope(False), "choices": [choice], "usage": usage(finished)}

    def opening(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, delta: TextDelta) -> list[bytes]:
        if self.reader is None:
            return [self._chunk({"content": delta.text}, self._logprobs(delta.logprobs))]
        self.tokens.add(delta.text, delta.logprobs)
        return self._pieces(self.reader.feed(delta.text))

    def end(self, finished: Finished) -> list[bytes]:
        out, reason = [], finished.reason.value
        if self.reader is not None:
            out += self._pieces(self.reader.finish())
            reason = finish_reason(finished, self.reader.calls > 0)
        return [*out, self._chunk({}, None, reason), *self._closing(finished)]

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        out = []
        for piece in pieces:
            tokens = self.tokens.of(piece)
            if isinstance(piece, str):
                out.append(self._chunk({"content": piece}, self._logprobs(tokens)))
            elif isinstance(piece, Reasoning):
                out.append(self._chunk({"reasoning_content": piece.text}, None))
            else:
                out.append(self._chunk({"tool_calls": [piece.wire()]}, None))
        return out

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return sse({**self._envelope(True), "choices": [choice]})

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": token_logprobs(tokens), "refusal": None}


@dataclass
class CompletionWriter(_OpenAIWriter):
    """`text_completion` and its chunks, with the legacy parallel lists of log probabilities."""

    offsets: TextOffsets = field(default_factory=TextOffsets)
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def whole(self, text: str, finished: Finished, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        logprobs_of = self._logprobs(logprobs)
        choice = {"index": 0, "text": text, "finish_reason": finished.reason.value, "logprobs": logprobs_of}
        return {**self._envelope(False), "choices": [choice], "usage": usage(finished)}

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: TextDelta) -> list[bytes]:
        return [self._chunk(delta.text, self._logprobs(delta.logprobs))]

    def end(self, finished: Finished) -> list[bytes]:
        return [self._chunk("", None, finished.reason.value), *self._closing(finished)]

    def _chunk(self, text: str, logprobs: dict[str, Any] | None, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return sse({**self._envelope(True), "choices": [choice]})

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {
            "tokens": [token_text(t.piece) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [by_text(t.top) for t in tokens],
            "text_offset": [self.offsets.next(t.piece) for t in tokens],
        }


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


def token_logprobs(tokens: Sequence[TokenLogprob], with_bytes: bool = True) -> list[dict[str, Any]]:
    """Each token with its bytes and its alternatives', as chat completions, the Responses API's
    `output_text` parts and Ollama's replies carry them; without bytes (`with_bytes` False) as the
    Responses API's `output_text` delta and done events do, as OpenAI's."""

    def one(piece: bytes, logprob: float) -> dict[str, Any]:
        entry = {"token": token_text(piece), "logprob": logprob}
        return {**entry, "bytes": list(piece)} if with_bytes else entry

    return [{**one(t.piece, t.logprob), "top_logprobs": [one(a.piece, a.logprob) for a in t.top]} for t in tokens]
