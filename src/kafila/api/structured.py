"""Structured output and tool calls: JSON schemas to GBNF grammars, and tool calls out of text.

Pure: nothing here touches llama.cpp's native library. A grammar built here is checked against
the model's vocabulary by `sampling.check_grammar` before its request is queued, and constrains
sampling on whichever machine draws the token (`SamplingSettings.grammar`).

Tool calls use the Hermes syntax that Qwen 2.5 and Qwen 3 templates write and read:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kafila.runtime.sampling import MAX_GRAMMAR_CHARS

# What a client's schema may be: its JSON text, how deeply it nests, and the largest count a
# length or item bound may name (llama.cpp expands `x{0,n}` into n rules, so a bound of 10^6
# would make one request's grammar cost gigabytes).
MAX_SCHEMA_BYTES = 16 << 10
MAX_TOOLS_SCHEMA_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 12
MAX_SCHEMA_COUNT = 256
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

# Keywords that constrain values in ways llama-cpp-python's converter would silently drop, so that
# output could break the schema: refused instead (integer bounds are handled below).
UNFOLLOWED = frozenset(
    {
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "not", "if", "then", "else",
        "contains", "minContains", "maxContains", "patternProperties", "propertyNames", "dependentRequired",
        "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "minProperties",
        "maxProperties",
    }
)  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
MAX_INTEGER_CHOICES = 1024  # a bounded integer becomes an alternation of its values
_DIGITS = "([1-9] [0-9]{0,15})"
_ANY = {"type": ["string", "number", "boolean", "object", "array", "null"]}

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Where a call may come or not ("auto"), its grammar waits for the model to open a block, and
# holds from just after this tag (`tool_call_grammar(..., opened=True)`).
TOOL_CALL_TRIGGER = TOOL_CALL_OPEN


class SchemaRefused(ValueError):
    """A schema (or a tool's parameters) that this server will not turn into a grammar: a 400."""


def bounded_schema(schema: Any, what: str, max_bytes: int = MAX_SCHEMA_BYTES) -> dict[str, Any]:
    """`schema` if it is a JSON object within the bounds above, else SchemaRefused naming `what`."""
    if not isinstance(schema, dict):
        raise SchemaRefused(f"{what} must be a JSON Schema object")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > max_bytes:
        raise SchemaRefused(f"{what} is {size} bytes of JSON; at most {max_bytes} are accepted")
    _check_nesting(schema, what, 0)
    return schema


def _check_nesting(node: Any, what: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaRefused(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _COUNTS and isinstance(value, int | float) and value > MAX_SCHEMA_COUNT:
                raise SchemaRefused(f"{what}: {key} {value} exceeds {MAX_SCHEMA_COUNT}, the largest accepted")
            _check_nesting(value, what, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _check_nesting(value, what, depth + 1)


def _check_followed(schema: Any, what: str) -> None:
    """SchemaRefused where `schema` (or a schema inside it) uses a keyword the grammar cannot keep."""
    if not isinstance(schema, dict):
        return
    for key in schema.keys() & UNFOLLOWED:
        raise SchemaRefused(f"{what} uses '{key}', which this server cannot enforce while generating")
    kind = schema.get("type")
    if kind == "number" and ("minimum" in schema or "maximum" in schema):
        raise SchemaRefused(f"{what}: bounds on a number are not enforced here; use an integer or none")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for inner in schema[key]:
                _check_followed(inner, what)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for inner in schema[key].values():
                _check_followed(inner, what)
    for key in ("items", "additionalProperties"):
        _check_followed(schema.get(key), what)


@functools.cache
def _converter_class() -> Any:
    """llama-cpp-python's converter, which ignores integer bounds, taught the ones it can keep:
    a range of up to MAX_INTEGER_CHOICES values, or at least 0 or 1.

    Imported at first use, not with this module: importing any part of llama_cpp loads llama.cpp,
    whose OpenMP settings a session's process makes first (`load_llama`), and every command must
    still start, to say so in one line, where llama.cpp is not installed."""
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):
        def visit(self, schema: Any, name: str) -> Any:
            if isinstance(schema, dict) and schema.get("items") in ({}, True):  # "any items": its KeyError
                schema = {**schema, "items": _ANY}
            if (
                isinstance(schema, dict)
                and schema.get("type") == "integer"
                and ("minimum" in schema or "maximum" in schema)
            ):
                rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                return self._add_rule(rule_name, _integer_rule(schema.get("minimum"), schema.get("maximum")))
            return super().visit(schema, name)

    return Converter


def _integer_rule(low: Any, high: Any) -> str:
    for bound in (low, high):
        if bound is not None and (not isinstance(bound, int | float) or bound != int(bound)):
            raise SchemaRefused(f"an integer's bound {str(bound)[:40]} is not an integer")
    if low is not None and high is not None:
        low, high = int(low), int(high)
        if high < low:
            raise SchemaRefused(f"an integer's minimum {low} is above its maximum {high}")
        if high - low >= MAX_INTEGER_CHOICES:
            raise SchemaRefused(f"an integer range of more than {MAX_INTEGER_CHOICES} values is not enforced here")
        return "(" + " | ".join(f'"{value}"' for value in range(low, high + 1)) + ") space"
    if high is None and low in (0, 1):
        return ('("0" | ' if low == 0 else "(") + _DIGITS + ") space"
    raise SchemaRefused("an integer bounded on one side only is enforced here for minimum 0 or 1 alone")


def _converter() -> Any:
    return _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


# llama-cpp-python's string character allows raw control characters, which JSON forbids in a
# string (llama.cpp's own converter excludes them), and code points that are no characters
# (surrogates, past U+10FFFF), which byte tokens can spell: swapped for one that excludes them.
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U7FFFFFFF] |'


def _grammar_text(converter: Any) -> str:
    grammar = str(converter.format_grammar()).replace(_LOOSE_CHAR, _JSON_CHAR)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise SchemaRefused(
            f"the grammar for this schema would be {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}"
        )
    return grammar


def _visit(converter: Any, schema: dict[str, Any], name: str, what: str) -> str:
    """The rule that matches `schema`, added to `converter`; SchemaRefused where it cannot convert."""
    _check_followed(schema, what)
    try:
        resolved = converter.resolve_refs(schema, "input")
        return str(converter.visit(resolved, name))
    except SchemaRefused as refused:
        raise SchemaRefused(f"{what}: {refused}") from None
    except RecursionError:
        raise SchemaRefused(f"{what} refers to itself too deeply to convert") from None
    except Exception as error:  # the converter asserts and raises on what it does not know
        raise SchemaRefused(f"{what} cannot be turned into a grammar: {str(error)[:300]}") from None


def schema_grammar(schema: dict[str, Any], what: str = "the response_format schema") -> str:
    """GBNF (root "root") for JSON text that `schema` accepts."""
    converter = _converter()
    _visit(converter, bounded_schema(schema, what), "", what)
    return _grammar_text(converter)


JSON_OBJECT_GRAMMAR_SCHEMA: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def tool_call_grammar(tools: list[ToolSpec], parallel: bool, opened: bool = False) -> str:
    """GBNF for one (or, with `parallel`, one or more) Hermes tool-call blocks, each naming one of
    `tools` with arguments its schema accepts, and nothing else; `opened`: from just after the
    first block's opening tag (the model wrote it before the grammar began), whitespace optional."""
    converter = _converter()
    alternatives = []
    for index, tool in enumerate(tools):
        what = f"the parameters of tool '{tool.name}'"
        rule = _visit(converter, bounded_schema(tool.parameters, what), f"tool{index}-arguments", what)
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        alternatives.append(f'{head} {rule} "}}"')
    converter._add_rule("call", " | ".join(alternatives))
    block = json.dumps(TOOL_CALL_OPEN + "\n") + " call " + json.dumps("\n" + TOOL_CALL_CLOSE)
    first = '[ \\t\\n]? call "\\n" ' + json.dumps(TOOL_CALL_CLOSE) if opened else block
    converter._add_rule("root", f"{first} ({json.dumps(chr(10))} {block})*" if parallel else first)
    return _grammar_text(converter)


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of the model's text, as OpenAI's `message.tool_calls` carries it."""

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


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_call(body: str) -> tuple[str, str] | None:
    """A whole block's name and arguments (JSON text), where it is a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


# The start of a block as the template's example writes it (and the grammar forces): the name,
# then the arguments object, whose text then streams as it comes.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ToolCallStream:
    """Splits generated text into content and tool-call deltas as it comes.

    Text that may begin a `<tool_call>` block is held back until it is known not to. In a block
    that starts `{"name": ..., "arguments": {`, the call's id and name leave at once and its
    arguments stream, all but their last `}` (which may be the block's own) held back until more
    comes. Any other block is read whole at its closing tag, and stays content if it is no call.
    Without `parallel`, blocks after the first call are dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls = 0
        self._buffer = ""
        self._state = "text"  # "text", "header" (in a block, before its arguments), "arguments"
        self._sent = 0  # of the buffer's arguments text, what has left already

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        self._buffer += text
        out: list[str | ToolCallDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[str | ToolCallDelta]:
        """What is left at the end: an unclosed block's arguments, or a block read whole if it parses."""
        out: list[str | ToolCallDelta] = []
        if self._state == "arguments":  # cut off (max_tokens): less a closing tag begun and the block's "}"
            body = self._buffer[: len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_CLOSE)].rstrip()
            self._emit_arguments(out, len(body) - 1 if body.endswith("}") and _is_json(body[:-1]) else len(body))
        elif self._state == "header":
            self._whole_block(out, self._buffer, closed=False)
        else:
            self._emit_text(out, self._buffer)
        self._buffer, self._state, self._sent = "", "text", 0
        return out

    def _step(self, out: list[str | ToolCallDelta]) -> bool:
        """One move through the buffer; False once it must wait for more text."""
        if self._state == "text":
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
                self._emit_text(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            self._emit_text(out, self._buffer[:start])
            self._buffer, self._state = self._buffer[start + len(TOOL_CALL_OPEN) :], "header"
            return True
        end = self._buffer.find(TOOL_CALL_CLOSE)
        if self._state == "header":
            header = _HEADER.match(self._buffer)
            if header is not None and (end < 0 or header.end() < end):
                if self.parallel or not self.calls:
                    out.append(ToolCallDelta(self.calls, "", _call_id(), header.group(1)))
                self.calls += 1
                self._buffer, self._state, self._sent = self._buffer[header.end() :], "arguments", 0
                return True
            if end < 0:
                return False
            self._whole_block(out, self._buffer[:end], closed=True)
        else:
            if end < 0:  # all but the last "}" and what may begin the closing tag
                last = self._buffer.rfind("}")
                self._emit_arguments(
                    out, last if last >= 0 else len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_CLOSE)
                )
                return False
            body = self._buffer[:end].rstrip()
            self._emit_arguments(out, len(body) - 1 if body.endswith("}") else len(body))  # less the block's "}"
        self._buffer, self._state, self._sent = self._buffer[end + len(TOOL_CALL_CLOSE) :], "text", 0
        return True

    def _emit_arguments(self, out: list[str | ToolCallDelta], upto: int) -> None:
        upto = len(self._buffer[:upto].rstrip())  # whitespace waits: it may be all before the block's "}"
        if upto > self._sent:
            if self.parallel or self.calls == 1:
                out.append(ToolCallDelta(self.calls - 1, self._buffer[self._sent : upto]))
            self._sent = upto

    def _emit_text(self, out: list[str | ToolCallDelta], text: str) -> None:
        if text and not (self.calls and text.isspace()):  # the newlines between calls are no content
            out.append(text)

    def _whole_block(self, out: list[str | ToolCallDelta], body: str, closed: bool) -> None:
        call = _parse_call(body)
        if call is None:
            self._emit_text(out, TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
            return
        if self.parallel or not self.calls:
            out.append(ToolCallDelta(self.calls, "", _call_id(), call[0]))
            out.append(ToolCallDelta(self.calls, call[1]))
        self.calls += 1


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if there is none besides the calls) and its tool calls:
    the same deltas a stream of it sends, put together."""
    stream = ToolCallStream(parallel)
    pieces = stream.feed(text) + stream.finish()
    calls: list[ToolCall] = []
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            if piece.id is not None:
                calls.append(ToolCall(piece.id, piece.name or "", ""))
            else:
                calls[-1] = ToolCall(calls[-1].id, calls[-1].name, calls[-1].arguments + piece.arguments)
    content = "".join(p for p in pieces if isinstance(p, str))
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls
