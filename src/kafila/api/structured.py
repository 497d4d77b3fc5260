"""Structured output: JSON schemas to GBNF grammars (tool calls build theirs on the same rules).

Pure: nothing here touches llama.cpp's native library. A grammar built here is checked against
the model's vocabulary by `sampling.check_grammar` before its request is queued, and constrains
sampling on whichever machine draws the token (`SamplingSettings.grammar`).
"""

from __future__ import annotations

import functools
import json
import re._parser as regex_parser  # type: ignore[import-not-found]  # the standard library's own reading of a pattern
from re import error as RegexError
from typing import Any

from kafila.runtime.engine.sampling import MAX_GRAMMAR_CHARS

# What a client's schema may be: its JSON text, how deeply it nests, and the largest count a
# length or item bound may name (llama.cpp expands `x{0,n}` into n rules, so a bound of 10^6
# would make one request's grammar cost gigabytes).
MAX_SCHEMA_BYTES = 16 << 10
MAX_TOOL_SCHEMA_BYTES = 32 << 10  # one tool's parameters (agents describe their tools at length)
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
MAX_PATTERN_EXPANSION = 4096  # a pattern's repetition counts, multiplied through its nesting
_DIGITS = "([1-9] [0-9]{0,15})"
_ANY = {"type": ["string", "number", "boolean", "object", "array", "null"]}
# Keywords that say what a value may be; a schema with none of them (only a description, say)
# accepts any value, which the converter does not know.
_SHAPING = frozenset(
    {
        "type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "properties", "additionalProperties",
        "required", "items", "prefixItems", "pattern", "format", "minLength", "maxLength", "minItems", "maxItems",
        "minimum", "maximum",
    }
)  # fmt: skip


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
    if isinstance(schema.get("pattern"), str):
        check_pattern(schema["pattern"], what)
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


def check_pattern(pattern: str, what: str) -> None:
    """SchemaRefused for a pattern whose grammar would hold llama.cpp's sampler without bound: a
    repetition of something that may match nothing (`(a?){256}`, `(a*)+`: each character could be
    any of the repetitions', and the sampler follows every reading of every candidate token), or
    repetition counts whose product passes MAX_PATTERN_EXPANSION (the converter writes each
    repetition out as rules)."""
    try:
        parsed = regex_parser.parse(pattern)
    except (RegexError, RecursionError, OverflowError) as error:
        raise SchemaRefused(f"{what}: the pattern {pattern[:60]!r} is no regular expression ({error})") from None
    _check_repeats(list(parsed), pattern, what, 1)


def _check_repeats(items: list[Any], pattern: str, what: str, outer: int) -> None:
    for op, value in items:
        if op in (regex_parser.MAX_REPEAT, regex_parser.MIN_REPEAT):
            low, high, inner = value
            count = low if high == regex_parser.MAXREPEAT else high
            if high > 1 and _may_be_empty(list(inner)):
                raise SchemaRefused(
                    f"{what}: the pattern {pattern[:60]!r} repeats something that may match nothing, which llama.cpp's "
                    "grammar follows in every way at once; write the repetition once (a{0,n}, not (a?){n})"
                )
            if outer * max(count, 1) > MAX_PATTERN_EXPANSION:
                raise SchemaRefused(
                    f"{what}: the pattern {pattern[:60]!r} repeats more than {MAX_PATTERN_EXPANSION} times in all"
                )
            _check_repeats(list(inner), pattern, what, outer * max(count, 1))
        elif op == regex_parser.SUBPATTERN:
            _check_repeats(list(value[3]), pattern, what, outer)
        elif op == regex_parser.BRANCH:
            for branch in value[1]:
                _check_repeats(list(branch), pattern, what, outer)


def _may_be_empty(items: list[Any]) -> bool:
    """Whether this part of a parsed pattern can match the empty string."""
    for op, value in items:
        if op in (regex_parser.MAX_REPEAT, regex_parser.MIN_REPEAT):
            if value[0] > 0 and not _may_be_empty(list(value[2])):
                return False
        elif op == regex_parser.SUBPATTERN:
            if not _may_be_empty(list(value[3])):
                return False
        elif op == regex_parser.BRANCH:
            if not any(_may_be_empty(list(branch)) for branch in value[1]):
                return False
        elif op != regex_parser.AT:  # anchors match nothing; anything else takes a character
            return False
    return True


def relaxed(schema: Any) -> Any:
    """`schema` without the constraints the grammar cannot keep, for a tool's parameters.

    A response format is the client's demand on the answer, so a constraint it cannot keep is a
    400. A tool's parameters are the agent's description of its own function, which it checks
    itself when the call comes (Claude Code's and Codex's tools carry `exclusiveMinimum`, bounds
    on numbers and strings of half a million characters): refusing them would turn the agent away,
    so the grammar holds the call to everything else (types, properties, required keys, enums,
    integer ranges it can write, patterns it can follow) and drops what it cannot keep."""
    if isinstance(schema, list):
        return [relaxed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: relaxed(value) for key, value in schema.items() if key not in UNFOLLOWED}
    for key in _COUNTS:
        if isinstance(out.get(key), int | float) and out[key] > MAX_SCHEMA_COUNT:
            del out[key]
    if isinstance(out.get("pattern"), str):
        try:
            check_pattern(out["pattern"], "a pattern")
        except SchemaRefused:
            del out["pattern"]
    kind = out.get("type")
    if kind == "number" or (isinstance(kind, list) and "number" in kind):
        out.pop("minimum", None)
        out.pop("maximum", None)
    elif kind == "integer" and ("minimum" in out or "maximum" in out):
        try:
            _integer_rule(out.get("minimum"), out.get("maximum"))
        except SchemaRefused:
            out.pop("minimum", None)
            out.pop("maximum", None)
    return out


@functools.cache
def _converter_class() -> Any:
    """llama-cpp-python's converter, which ignores integer bounds, taught the ones it can keep:
    a range of up to MAX_INTEGER_CHOICES values, or at least 0 or 1.

    Imported at first use, not with this module: importing any part of llama_cpp loads llama.cpp,
    whose OpenMP settings a session's process makes first (`load_llama`), and every command must
    still start, to say so in one line, where llama.cpp is not installed."""
    from llama_cpp import llama_grammar
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    # A pattern's escaped `.`, `^` and `$` are literal characters, as llama.cpp's own converter
    # has them; llama-cpp-python's list lacks them and writes `\.` into a GBNF literal, which
    # llama.cpp cannot parse (`^[a-z]+\.com$` was a 400).
    llama_grammar.ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS.update("^$.")

    class Converter(SchemaConverter):
        def _format_literal(self, literal: str) -> str:
            """A GBNF literal with its backslashes escaped too, as llama.cpp's own converter writes
            it: llama-cpp-python's leaves them bare, so a property name or enum value holding `"`
            or `\\` (JSON escapes it with one) broke the grammar or let invalid JSON through."""
            return '"' + "".join(_LITERAL_ESCAPES.get(char, char) for char in literal) + '"'

        def visit(self, schema: Any, name: str) -> Any:
            if isinstance(schema, dict) and schema.get("items") in ({}, True):  # "any items": its KeyError
                schema = {**schema, "items": _ANY}
            if isinstance(schema, dict) and schema and not schema.keys() & _SHAPING:  # annotations only: any value
                schema = {**schema, **_ANY}
            if (
                isinstance(schema, dict)
                and schema.get("type") == "integer"
                and ("minimum" in schema or "maximum" in schema)
            ):
                rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                return self._add_rule(rule_name, _integer_rule(schema.get("minimum"), schema.get("maximum")))
            return super().visit(schema, name)

    return Converter


_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\r": "\\r", "\n": "\\n"}


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


def new_converter() -> Any:
    return _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


# llama-cpp-python's string character allows raw control characters, which JSON forbids in a
# string (llama.cpp's own converter excludes them), and code points that are no characters
# (surrogates, past U+10FFFF), which byte tokens can spell: swapped for one that excludes them.
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U7FFFFFFF] |'


def grammar_text(converter: Any) -> str:
    grammar = str(converter.format_grammar()).replace(_LOOSE_CHAR, _JSON_CHAR)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise SchemaRefused(
            f"the grammar for this schema would be {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}"
        )
    return grammar


def visit_schema(converter: Any, schema: dict[str, Any], name: str, what: str) -> str:
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


def schema_grammar(schema: dict[str, Any], what: str = "the response_format schema", prefix: str = "") -> str:
    """GBNF (root "root") for JSON text that `schema` accepts, after `prefix` (a harmony model's
    final-channel header) where one is given."""
    converter = new_converter()
    rule = visit_schema(converter, bounded_schema(schema, what), "answer" if prefix else "", what)
    if prefix:
        converter._add_rule("root", f"{json.dumps(prefix)} {rule}")
    return grammar_text(converter)


JSON_OBJECT_GRAMMAR_SCHEMA: dict[str, Any] = {"type": "object"}
