"""`<think>…</think>` before the answer (Qwen 3, QwQ, DeepSeek-R1 and their distills) read as
`reasoning_content`, as llama.cpp's and vLLM's servers send it; the answer after it goes on to
the tool-call reader, or is the content."""

from __future__ import annotations

from kafila.api.tool_calls import Piece, Reasoning, ReplyReader, ToolCallStream, partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ThinkReader(ReplyReader):
    """Splits a reply into its reasoning and the rest, as it comes. `opened`: the prompt ended in
    `<think>` (some templates open it for the model), so the reply starts inside it."""

    def __init__(self, answer: ToolCallStream | None, opened: bool) -> None:
        super().__init__()
        self.answer = answer
        self._state = "thinking" if opened else "start"  # then "after" (whitespace), "answer"

    @property
    def calls(self) -> int:
        return self.answer.calls if self.answer is not None else 0

    def _flush(self, out: list[Piece]) -> None:
        if self._state == "thinking" and self._buffer:
            out.append(Reasoning(self._buffer))
        if self.answer is not None:
            out += self.answer.finish()

    def _step(self, out: list[Piece], final: bool) -> bool:
        if self._state == "start":
            start = self._buffer.lstrip()
            if start.startswith(THINK_OPEN):
                self._buffer, self._state = start[len(THINK_OPEN) :], "thinking"
                return True
            if not final and THINK_OPEN.startswith(start):
                return False
            self._state = "answer"
            return True
        if self._state == "thinking":
            end = self._buffer.find(THINK_CLOSE)
            if end < 0:
                keep = partial_suffix(self._buffer, (THINK_CLOSE,))
                if len(self._buffer) > keep:
                    out.append(Reasoning(self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            if end:
                out.append(Reasoning(self._buffer[:end]))
            self._buffer, self._state = self._buffer[end + len(THINK_CLOSE) :], "after"
            return True
        if self._state == "after":  # the blank lines between the reasoning and the answer
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._state = "answer"
            return True
        text, self._buffer = self._buffer, ""
        if text:
            out += self.answer.feed(text) if self.answer is not None else [text]
        return False
