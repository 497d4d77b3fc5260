"""Chat messages to one prompt string, as the model was trained to read them.

A GGUF that carries a Jinja chat template is rendered with llama-cpp-python's sandboxed Jinja
formatter, as its own server would. Many quantised files ship without one (the bundled
gemma-3-270m among them), so the fallback is llama.cpp's built-in template for the model's
family, and ChatML when the family has none.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafila.runtime.llama_backend import load_llama

BUILT_IN_BY_ARCHITECTURE = {
    "gemma3": "gemma",
    "gemma2": "gemma",
    "gemma": "gemma",
    "llama": "llama3",
    "gpt-oss": "gpt-oss",  # harmony's turns, without the system block its own template writes
}
DEFAULT_BUILT_IN = "chatml"


class TemplateError(ValueError):
    """The messages cannot be rendered by this model's template (the client's fault: a 400)."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    starts_with_bos: bool  # so the tokenizer must not add a second one


HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>: Qwen 2.5 and 3, Hermes


def tool_syntax_of(jinja: str | None) -> str | None:
    """The tool-call syntax a template writes, where it is one this server parses."""
    if jinja and "<tool_call>" in jinja and "tools" in jinja:
        return HERMES
    return None


class ChatTemplate:
    def __init__(self, jinja: str | None, bos: str, eos: str, architecture: str | None) -> None:
        self.bos, self.eos = bos, eos
        self.tool_syntax = tool_syntax_of(jinja)
        self.built_in = BUILT_IN_BY_ARCHITECTURE.get(architecture or "", DEFAULT_BUILT_IN)
        self._formatter: Any = None
        self.source = f"llama.cpp built-in '{self.built_in}'"
        if jinja:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            try:
                self._formatter = Jinja2ChatFormatter(template=jinja, eos_token=eos, bos_token=bos)
                self.source = "the model's own (GGUF tokenizer.chat_template)"
            except Exception:  # a template Jinja cannot compile: serve with the built-in rather than not at all
                self._formatter = None
                self.tool_syntax = None

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        """The prompt; `tools` (OpenAI's tool objects) go to the template as transformers passes them."""
        if tools and self._formatter is None:
            raise TemplateError("this model's chat template does not describe tools; it cannot be given any")
        if self._formatter is not None:
            try:
                text = self._formatter(messages=list(messages), tools=list(tools) if tools else None).prompt
            except Exception as error:  # templates raise their own errors, e.g. on role order
                raise TemplateError(f"the model's chat template rejected the messages: {error}") from None
        else:
            text = _apply_built_in(self.built_in, messages)
        return RenderedPrompt(text, bool(self.bos) and text.startswith(self.bos))


def _apply_built_in(name: str, messages: Sequence[dict[str, Any]]) -> str:
    llama_cpp = load_llama()

    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
    array = (llama_cpp.llama_chat_message * len(encoded))(
        *[llama_cpp.llama_chat_message(role=role, content=content) for role, content in encoded]
    )
    size = 2 * sum(len(r) + len(c) for r, c in encoded) + 1024
    for _ in range(2):
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), array, len(encoded), True, buffer, size)
        if n < 0:
            raise TemplateError(f"llama.cpp's '{name}' chat template cannot render these messages")
        if n <= size:
            return buffer.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    raise TemplateError("the rendered chat prompt kept growing")
