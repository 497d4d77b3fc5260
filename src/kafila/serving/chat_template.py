"""Chat messages to one prompt string, as the model was trained to read them.

A GGUF that carries a Jinja chat template is rendered with llama-cpp-python's sandboxed Jinja
formatter, as its own server would. Many quantised files ship without one (the bundled
gemma-3-270m among them), so the fallback is llama.cpp's built-in template for the model's
family, and ChatML when the family has none.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafila.runtime.llama.loading import load_llama

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

    @property
    def opens_thinking(self) -> bool:
        """The template opened `<think>` for the model: its reply starts inside its reasoning."""
        return self.text.rstrip().endswith("<think>")


class ReplySyntax(enum.StrEnum):
    """How a model writes tool calls (and, for harmony, its whole reply), read from its template."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>: Qwen 2.5 and 3, Hermes
    LLAMA3 = "llama3"  # the reply is {"name": ..., "parameters": ...}: Llama 3.1 to 3.3
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name": ..., "arguments": ...}]: Mistral 7B 0.3, Nemo
    MISTRAL_ARGS = "mistral-args"  # [TOOL_CALLS]name[ARGS]{...}: Mistral Small 3.2, Devstral, Magistral
    HARMONY = "harmony"  # gpt-oss: channels, and calls as messages to=functions.name


# Special tokens a reply in each syntax must show as text to be read (llama.cpp's server keeps
# the same ones); others (end of turn and the like) stay unshown.
SHOWN_TOKENS: dict[ReplySyntax, tuple[str, ...]] = {
    ReplySyntax.HERMES: ("<tool_call>", "</tool_call>"),
    ReplySyntax.LLAMA3: ("<|python_tag|>",),
    ReplySyntax.MISTRAL: ("[TOOL_CALLS]",),
    ReplySyntax.MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    ReplySyntax.HARMONY: ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"),
}


def tool_syntax_of(jinja: str | None) -> ReplySyntax | None:
    """The tool-call syntax a template writes, where it is one this server reads."""
    if not jinja:
        return None
    if "<|channel|>" in jinja:
        return ReplySyntax.HARMONY
    if "[TOOL_CALLS]" in jinja:
        return ReplySyntax.MISTRAL_ARGS if "[ARGS]" in jinja else ReplySyntax.MISTRAL
    if "<tool_call>" in jinja and "tools" in jinja:
        return ReplySyntax.HERMES
    if "<|start_header_id|>" in jinja and '"parameters"' in jinja and "tools" in jinja:
        return ReplySyntax.LLAMA3
    return None


class ChatTemplate:
    def __init__(self, jinja: str | None, bos: str, eos: str, architecture: str | None) -> None:
        self.bos, self.eos = bos, eos
        # The syntax tools are written in, where the template shows tools; harmony is also how a
        # gpt-oss without a template of its own replies (llama.cpp's built-in writes its turns).
        self.tool_syntax = tool_syntax_of(jinja)
        self.reply_syntax = self.tool_syntax or (ReplySyntax.HARMONY if architecture == "gpt-oss" else None)
        # Whether replies may reason in <think>…</think> first (Qwen 3, QwQ, DeepSeek-R1).
        self.thinks = jinja is not None and "</think>" in jinja and self.reply_syntax is not ReplySyntax.HARMONY
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
                self.reply_syntax = ReplySyntax.HARMONY if architecture == "gpt-oss" else None

    @property
    def shown_tokens(self) -> tuple[str, ...]:
        shown = SHOWN_TOKENS[self.reply_syntax] if self.reply_syntax is not None else ()
        return (*shown, "<think>", "</think>") if self.thinks else shown

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        call_id: Callable[[str], str] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """The prompt; `tools` (OpenAI's tool objects) go to the template as transformers passes them.
        `call_id` rewrites the calls' ids (and the results' `tool_call_id`) where the template
        takes only ids of its own shape (Mistral's). `options` are variables the template may read
        (`enable_thinking`, `reasoning_effort`); llama.cpp's built-in templates read none."""
        if tools and self._formatter is None:
            raise TemplateError("this model's chat template does not describe tools; it cannot be given any")
        if call_id is not None:
            messages = [_with_call_ids(m, call_id) for m in messages]
        if self._formatter is not None:
            try:
                text = self._formatter(
                    messages=list(messages), tools=list(tools) if tools else None, **(options or {})
                ).prompt
            except Exception as error:  # templates raise their own errors, e.g. on role order
                raise TemplateError(f"the model's chat template rejected the messages: {error}") from None
        else:
            text = _apply_built_in(self.built_in, messages)
        return RenderedPrompt(text, bool(self.bos) and text.startswith(self.bos))


def _with_call_ids(message: dict[str, Any], call_id: Callable[[str], str]) -> dict[str, Any]:
    message = dict(message)
    if "tool_call_id" in message:
        message["tool_call_id"] = call_id(message["tool_call_id"])
    if message.get("tool_calls"):
        message["tool_calls"] = [{**call, "id": call_id(call.get("id") or "")} for call in message["tool_calls"]]
    return message


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
