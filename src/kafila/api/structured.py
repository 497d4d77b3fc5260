"""Structured output and tool calls: JSON schemas to GBNF grammars, and tool calls out of text.

Pure: nothing here touches llama.cpp's native library. A grammar built here is checked against
the model's vocabulary by `sampling.check_grammar` before its request is queued, and constrains
sampling on whichever machine draws the token (`SamplingSettings.grammar`).

Tool calls use the Hermes syntax that Qwen 2.5 and Qwen 3 templates write and read:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

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


class _Converter(SchemaConverter):
    """llama-cpp-python's converter, which ignores integer bounds, taught the ones it can keep:
    a range of up to MAX_INTEGER_CHOICES values, or at least 0 or 1."""

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


def _converter() -> SchemaConverter:
    return _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _visit(converter: SchemaConverter, schema: dict[str, Any], name: str, what: str) -> str:
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
    return str(converter.format_grammar())


JSON_OBJECT_GRAMMAR_SCHEMA: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def tool_call_grammar(tools: list[ToolSpec], parallel: bool) -> str:
    """GBNF for one (or, with `parallel`, one or more) Hermes tool-call blocks, each naming one of
    `tools` with arguments its schema accepts, and nothing else."""
    converter = _converter()
    alternatives = []
    for index, tool in enumerate(tools):
        what = f"the parameters of tool '{tool.name}'"
        rule = _visit(converter, bounded_schema(tool.parameters, what), f"tool{index}-arguments", what)
        head = json.dumps('{"name": ' + json.dumps(tool.name) + ', "arguments": ')
        alternatives.append(f'{head} {rule} "}}"')
    converter._add_rule("call", " | ".join(alternatives))
    block = json.dumps(TOOL_CALL_OPEN + "\n") + " call " + json.dumps("\n" + TOOL_CALL_CLOSE)
    converter._add_rule("root", f"{block} ({json.dumps(chr(10))} {block})*" if parallel else block)
    return str(converter.format_grammar())


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of the model's text, as OpenAI's `message.tool_calls` carries it."""

    id: str
    name: str
    arguments: str  # JSON text

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parse_call(body: str) -> ToolCall | None:
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
    return ToolCall("call_" + uuid.uuid4().hex[:24], call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits generated text into content and tool calls as it comes: text that may be the start
    of a `<tool_call>` block is held back until it is known not to be, and a block leaves whole,
    as one `ToolCall`, once its closing tag arrives. A block that does not parse stays content."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls = 0
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
                    self._emit_text(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._emit_text(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
                self._in_call = True
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return out
            self._emit_call(out, self._buffer[:end], closed=True)
            self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE) :]
            self._in_call = False

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end: an unclosed block is taken if it parses."""
        out: list[str | ToolCall] = []
        if self._in_call:
            self._emit_call(out, self._buffer, closed=False)
        else:
            self._emit_text(out, self._buffer)
        self._buffer, self._in_call = "", False
        return out

    def _emit_text(self, out: list[str | ToolCall], text: str) -> None:
        if text and not (self.calls and text.isspace()):  # the newlines between calls are no content
            out.append(text)

    def _emit_call(self, out: list[str | ToolCall], body: str, closed: bool) -> None:
        call = _parse_call(body)
        if call is None:
            self._emit_text(out, TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
        elif self.parallel or not self.calls:  # without parallel calls, the first one only
            self.calls += 1
            out.append(call)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if there is none besides the calls) and its tool calls."""
    stream = ToolCallStream(parallel)
    pieces = stream.feed(text) + stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls
