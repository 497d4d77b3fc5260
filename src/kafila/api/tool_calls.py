"""Tool calls in the syntax each model family was trained to write, read back as OpenAI's API
carries them, and held to the tools' schemas by a grammar while they are written.

Pure: nothing here touches llama.cpp's native library (the grammar's JSON rules come from
`structured`, whose converter is imported at first use).

The syntaxes (`ReplySyntax`, named by the chat template that writes them):
- Hermes (Qwen 2.5 and 3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- Llama 3.x: the whole reply is `{"name": ..., "parameters": {...}}`, one call a turn;
- Mistral (v3: Mistral 7B 0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- Mistral (v7 and later: Small 3.2, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}`, repeated;
- gpt-oss's harmony: messages on channels; a call is a message `to=functions.name` whose body is
  the arguments (`harmony.HarmonyReader`).

A grammar covers the whole reply from its first token: with a call forced, the calls alone; in
"auto", free text that does not write the call's opening, then the calls or nothing. So a call
is held from its first character however the tokenizer cuts the opening.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from kafila.api.structured import (
    MAX_TOOL_SCHEMA_BYTES,
    bounded_schema,
    grammar_text,
    new_converter,
    relaxed,
    visit_schema,
)
from kafila.serving.chat_template import ReplySyntax

_NAME = r"(?P<name>[A-Za-z0-9_.\-]{1,64})"
# How a call's start looks, up to its arguments' "{": the grammar writes the first spelling, a
# model left free (no grammar) may write the others; Hermes and Mistral v3 blocks whose keys come
# in another order are read whole (`_Format.whole`).
_JSON_HEAD = r'\s*\{\s*"name"\s*:\s*"' + _NAME + r'"\s*,\s*"(?:arguments|parameters)"\s*:\s*'


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A call read out of the model's text, as OpenAI's `message.tool_calls` carries it."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the `index`th call, as OpenAI streams it: its id and name first (with empty
    arguments), then pieces of its arguments' text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class Reasoning:
    """Text the model wrote on its reasoning channel: `reasoning_content`, not the answer."""

    text: str


Piece = str | ToolCallDelta | Reasoning


def openai_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates take only ids of 9 letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def mistral_id_of(any_id: str) -> str:
    """A client's call id as Mistral's templates take it: kept if it is 9 letters and digits, else
    9 drawn from its hash (so a call and its result still pair up)."""
    if len(any_id) == 9 and all(c in _ALNUM for c in any_id):
        return any_id
    digest = hashlib.sha256(any_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


# --- grammars --------------------------------------------------------------------------------------


def _lit(text: str) -> str:
    return json.dumps(text)


def _class_char(char: str) -> str:
    return "\\" + char if char in "]\\^-[" else char


def _text_without(literal: str) -> str:
    """GBNF for any text that does not write `literal` (greedy prefixes of it aside: a text that
    overlaps itself, such as "aab" after "a", slips through), ending in any proper prefix of it."""
    alternatives = [f"[^{_class_char(literal[0])}]"]
    alternatives += [f"{_lit(literal[:n])} [^{_class_char(literal[n])}]" for n in range(1, len(literal))]
    endings = " | ".join(_lit(literal[:n]) for n in range(1, len(literal)))
    return f"({' | '.join(alternatives)})* ({endings})?"


def _json_call(tools: Sequence[ToolSpec], rules: Sequence[str], key: str) -> str:
    return " | ".join(
        f'{_lit("{" + json.dumps("name") + ": " + json.dumps(t.name) + ", " + json.dumps(key) + ": ")} {r} "}}"'
        for t, r in zip(tools, rules, strict=True)
    )


@dataclass(frozen=True)
class _Grammar:
    """A syntax's grammar: `call` is one call to whichever tool (over each tool's arguments rule),
    `calls` one or (parallel) more; in "auto" the root is `auto`, where "free" is text that never
    writes `opening`; `rules` are the syntax's own."""

    call: Callable[[Sequence[ToolSpec], Sequence[str]], str]
    calls: Callable[[bool], str]
    auto: str
    opening: str | None = None
    rules: tuple[tuple[str, str], ...] = ()


_GRAMMARS: dict[ReplySyntax, _Grammar] = {
    ReplySyntax.HERMES: _Grammar(
        call=lambda tools, rules: _json_call(tools, rules, "arguments"),
        calls=lambda parallel: 'block ("\\n" block)*' if parallel else "block",
        auto="free calls?",
        opening="<tool_call>",
        rules=(("block", '"<tool_call>\\n" call "\\n</tool_call>"'),),
    ),
    ReplySyntax.LLAMA3: _Grammar(
        call=lambda tools, rules: _json_call(tools, rules, "parameters"),
        calls=lambda parallel: "call",
        auto="[ \\t\\n]* (calls | [^{ \\t\\n] [^\\x00]*)?",  # the call is the whole reply: text must not begin "{"
    ),
    ReplySyntax.MISTRAL: _Grammar(
        call=lambda tools, rules: _json_call(tools, rules, "arguments"),
        calls=lambda parallel: '"[TOOL_CALLS][" call ' + ('(", " call)* ' if parallel else "") + '"]"',
        auto="free calls?",
        opening="[TOOL_CALLS]",
    ),
    ReplySyntax.MISTRAL_ARGS: _Grammar(
        call=lambda tools, rules: " | ".join(
            f"{_lit(t.name + '[ARGS]')} {r}" for t, r in zip(tools, rules, strict=True)
        ),
        calls=lambda parallel: '"[TOOL_CALLS]" call' + (' ("[TOOL_CALLS]" call)*' if parallel else ""),
        auto="free calls?",
        opening="[TOOL_CALLS]",
    ),
    # A call's message header may name its recipient in the role ("<|start|>assistant
    # to=functions.f<|channel|>commentary json<|message|>") or on the channel; both write
    # "to=functions.", from which "auto" holds the call. After the name comes a delimiter, as
    # harmony writes it: the channel (where the recipient came in the role), the content type
    # after a space, or `<|message|>`; never a letter that a reader would take into the name.
    ReplySyntax.HARMONY: _Grammar(
        call=lambda tools, rules: " | ".join(
            f"{_lit(t.name)} recipient-rest {r}" for t, r in zip(tools, rules, strict=True)
        ),
        calls=lambda parallel: '"<|channel|>commentary to=functions." call',
        auto='free | call-header "to=functions." call',
        opening="to=functions.",
        rules=(
            (
                "recipient-rest",
                '("<|channel|>" ("commentary" | "analysis"))? (" <|constrain|>json" | " json")? "<|message|>"',
            ),
            # A call begins a message: the reply's first, or one after `<|start|>assistant` (which an
            # SPM tokenizer may write with a space before the role).
            (
                "call-header",
                '("<|channel|>commentary " | " ")? '
                '| free "<|start|>" " "? "assistant" ("<|channel|>commentary " | " ")',
            ),
        ),
    ),
}


def tool_call_grammar(syntax: ReplySyntax, tools: Sequence[ToolSpec], parallel: bool, forced: bool) -> str:
    """GBNF (root "root") for a reply in `syntax`: with `forced`, one call (or, with `parallel`,
    one or more) to one of `tools` and nothing else; else free text, then calls or none. Every
    call's arguments match its tool's schema, but for what the grammar cannot keep (`relaxed`)."""
    shape = _GRAMMARS[syntax]
    converter = new_converter()
    rules = []
    for index, tool in enumerate(tools):
        what = f"the parameters of tool '{tool.name}'"
        schema = bounded_schema(relaxed(tool.parameters), what, MAX_TOOL_SCHEMA_BYTES)
        rules.append(visit_schema(converter, schema, f"tool{index}-arguments", what))
    converter._add_rule("call", shape.call(tools, rules))
    for name, rule in shape.rules:
        converter._add_rule(name, rule)
    converter._add_rule("calls", shape.calls(parallel))
    converter._add_rule("root", "calls" if forced else shape.auto)
    if shape.opening is not None:  # (a syntax's own rules may name it in either case)
        converter._add_rule("free", _text_without(shape.opening))
    return grammar_text(converter)


def single_call_only(syntax: ReplySyntax) -> bool:
    """Whether the syntax carries one call a turn (Llama 3's templates refuse more; harmony's
    call ends the turn)."""
    return syntax in (ReplySyntax.LLAMA3, ReplySyntax.HARMONY)


# --- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
    """How calls are read in one syntax. `start` matches a call's beginning through its
    arguments' "{" (group "name"); `whole` a whole call block read at once (its own parser);
    after the arguments, `follow` a next call's beginning without a new opening, `close` what
    ends the call. `at_start`: a call only at the reply's start (Llama 3)."""

    start: Any
    close: Any
    follow: Any = None
    whole: Any = None
    parse_whole: Callable[[str], list[tuple[str, str]]] | None = None
    at_start: bool = False
    call_id: Callable[[], str] = openai_call_id


def _parse_call(body: Any) -> tuple[str, str] | None:
    """A call's name and arguments (JSON text) from a parsed or textual JSON object."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return body["name"], json.dumps(arguments, ensure_ascii=False)


def _parse_hermes_block(text: str) -> list[tuple[str, str]]:
    call = _parse_call(text[len("<tool_call>") : -len("</tool_call>")])
    return [call] if call else []


def _parse_mistral_list(text: str) -> list[tuple[str, str]]:
    try:
        calls = json.loads(text[len("[TOOL_CALLS]") :])
    except ValueError:
        return []
    parsed = [_parse_call(c) for c in calls] if isinstance(calls, list) else []
    return [c for c in parsed if c] if all(parsed) else []


_FORMATS: dict[ReplySyntax, _Format] = {
    ReplySyntax.HERMES: _Format(
        start=regex.compile(r"<tool_call>" + _JSON_HEAD + r"(?=\{)"),
        close=regex.compile(r"\s*\}\s*</tool_call>"),
        whole=regex.compile(r"<tool_call>.*?</tool_call>", regex.DOTALL),
        parse_whole=_parse_hermes_block,
    ),
    ReplySyntax.LLAMA3: _Format(
        start=regex.compile(r"\s*(?:<\|python_tag\|>)?" + _JSON_HEAD + r"(?=\{)"),
        close=regex.compile(r"\s*\}"),
        at_start=True,
    ),
    ReplySyntax.MISTRAL: _Format(
        start=regex.compile(r"\[TOOL_CALLS\]\s*\[" + _JSON_HEAD + r"(?=\{)"),
        follow=regex.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}\s*,' + _JSON_HEAD + r"(?=\{)"),
        close=regex.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}\s*\]'),
        whole=regex.compile(r"\[TOOL_CALLS\]\s*\[.*?\}\s*\]", regex.DOTALL),
        parse_whole=_parse_mistral_list,
        call_id=mistral_call_id,
    ),
    ReplySyntax.MISTRAL_ARGS: _Format(
        start=regex.compile(r"\[TOOL_CALLS\]" + _NAME + r"(?:\[CALL_ID\][A-Za-z0-9]{0,64})?\[ARGS\]\s*(?=\{)"),
        close=regex.compile(r""),
        call_id=mistral_call_id,
    ),
}


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (and is not all of it)."""
    for size in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return size
    return 0


class ReplyReader:
    """Reads generated text into pieces as it comes: each subclass's `_step` moves through the
    buffer (False once it must wait for more text, or, when `final`, has nothing more to
    do), and `_flush` says what is left at the end."""

    def __init__(self) -> None:
        self._buffer = ""
        self._calls = 0

    @property
    def calls(self) -> int:
        """How many tool calls have been read so far."""
        return self._calls

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self._buffer and self._step(out, final=True):
            pass
        self._flush(out)
        self._buffer = ""
        return out

    def read_whole(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """A whole reply's content (None if there is none besides the calls), reasoning and calls:
        what a stream of it sends, put together."""
        return whole_reply(self.feed(text) + self.finish())

    def _step(self, out: list[Piece], final: bool) -> bool:
        raise NotImplementedError

    def _flush(self, out: list[Piece]) -> None:
        raise NotImplementedError


class _ObjectEnd:
    """Finds where a JSON object's text ends, fed in pieces: braces counted outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the object: all of it, or up to its closing "}"."""
        for index, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return index + 1
        return len(text)


class ToolCallStream(ReplyReader):
    """Splits generated text into content and tool-call deltas as it comes.

    Text that may begin a call is held back until it is known not to. A call that begins as
    its syntax writes it sends its id and name at once, then its arguments as they come; a block
    in another shape is read whole where the syntax has blocks, and stays content if it is no
    call. Without `parallel`, calls after the first are dropped."""

    def __init__(self, syntax: ReplySyntax, parallel: bool = True) -> None:
        if syntax is ReplySyntax.HARMONY:
            raise ValueError("harmony replies are read by harmony.HarmonyReader")
        super().__init__()
        self.format = _FORMATS[syntax]
        self.parallel = parallel
        self._state = "start" if self.format.at_start else "text"  # "text", "arguments", "after", "done"
        self._object = _ObjectEnd()

    def _flush(self, out: list[Piece]) -> None:
        """Held text is content; a call's arguments cut off have left already."""
        if self._state in ("text", "start", "done"):
            self._emit_text(out, self._buffer)

    def _step(self, out: list[Piece], final: bool) -> bool:
        """One move through the buffer; False once it must wait for more text."""
        if self._state == "arguments":
            used = self._object.feed(self._buffer)
            self._emit_arguments(out, self._buffer[:used])
            self._buffer = self._buffer[used:]
            if self._object.depth > 0:
                return False
            self._state = "after"
            return True
        if self._state == "after":
            return self._after_call(out, final)
        if self._state == "done":  # Llama 3: text after the call is no part of it
            self._emit_text(out, self._buffer)
            self._buffer = ""
            return False
        return self._in_text(out, final)

    def _in_text(self, out: list[Piece], final: bool) -> bool:
        if self._state == "start":
            found = self.format.start.match(self._buffer, partial=not final)
            if found is None or (not found.partial and found.end() == found.start() == 0):
                if self._buffer.strip() or final:
                    self._state = "done"
                    return True
                return False
            if found.partial:
                return False
            self._begin_call(out, found.group("name"))
            self._buffer = self._buffer[found.end() :]
            return True
        starts = [self.format.start.search(self._buffer, partial=not final)]
        if self.format.whole is not None:
            starts.append(self.format.whole.search(self._buffer, partial=not final))
        found = [m for m in starts if m is not None]
        if not found:
            self._emit_text(out, self._buffer)
            self._buffer = ""
            return False
        first = min(m.start() for m in found)
        at_first = [m for m in found if m.start() == first]
        self._emit_text(out, self._buffer[:first])
        self._buffer = self._buffer[first:]
        begun = next((m for m in at_first if m.re is self.format.start and not m.partial), None)
        if begun is not None:
            self._begin_call(out, begun.group("name"))
            self._buffer = self._buffer[begun.end() - first :]
            return True
        if any(m.partial for m in at_first):
            return False
        whole = at_first[0]
        block = self._buffer[: whole.end() - first]
        self._buffer = self._buffer[len(block) :]
        calls = self.format.parse_whole(block) if self.format.parse_whole else []
        if not calls:
            self._emit_text(out, block)
        for name, arguments in calls:
            self._begin_call(out, name)
            self._emit_arguments(out, arguments)
        self._state = "text"
        return True

    def _after_call(self, out: list[Piece], final: bool) -> bool:
        """After a call's arguments: the next call's beginning, or the call's close; either cut
        off by the end of the reply (max_tokens) is dropped, not shown as content."""
        follow = self.format.follow.match(self._buffer, partial=True) if self.format.follow else None
        if follow is not None and not follow.partial:
            self._begin_call(out, follow.group("name"))
            self._buffer = self._buffer[follow.end() :]
            return True
        close = self.format.close.match(self._buffer, partial=True)
        if close is not None and not close.partial:
            self._buffer = self._buffer[close.end() :]
        elif follow is not None or close is not None:  # partly there
            if not final:
                return False
            self._buffer = ""
        self._state = "done" if self.format.at_start else "text"
        return True

    def _begin_call(self, out: list[Piece], name: str) -> None:
        if self.parallel or not self.calls:
            out.append(ToolCallDelta(self.calls, "", self.format.call_id(), name))
        self._calls += 1
        self._state, self._object = "arguments", _ObjectEnd()

    def _emit_arguments(self, out: list[Piece], text: str) -> None:
        if text and (self.parallel or self.calls == 1):
            out.append(ToolCallDelta(self.calls - 1, text))

    def _emit_text(self, out: list[Piece], text: str) -> None:
        if text and not (self.calls and text.isspace()):  # the newlines between calls are no content
            out.append(text)


def whole_reply(pieces: Sequence[Piece]) -> tuple[str | None, str, list[ToolCall]]:
    """A whole reply's content (None if there is none besides the calls), reasoning and calls,
    from all the pieces a reader made of it."""
    content, reasoning, calls = gather(pieces)
    return ((content.strip() or None) if calls else content), reasoning.strip(), calls


def gather(pieces: Sequence[Piece]) -> tuple[str, str, list[ToolCall]]:
    """A whole reply's content, reasoning and calls: the deltas a stream sends, put together."""
    calls: list[ToolCall] = []
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            if piece.id is not None:
                calls.append(ToolCall(piece.id, piece.name or "", ""))
            else:
                calls[-1] = ToolCall(calls[-1].id, calls[-1].name, calls[-1].arguments + piece.arguments)
    content = "".join(p for p in pieces if isinstance(p, str))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return content, reasoning, calls
