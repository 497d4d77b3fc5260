"""Random sentences of a GBNF grammar, drawn from the grammar alone: no model, no llama.cpp.

A test oracle for the grammars the server builds (tool calls, structured output): whatever the
grammar allows, its readers must read. Written from llama.cpp's grammar reference
(grammars/README.md: literals, character classes, `.`, rule references, groups, alternatives,
`*` `+` `?` `{m}` `{m,}` `{m,n}`, comments), independent of the code under test; that llama.cpp
itself accepts each sample is checked separately, token by token, against its grammar sampler.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# Characters a negated class or `.` is drawn from: the ones that matter to the readers (the
# syntaxes' delimiters, JSON's), some letters and digits, and a few beyond ASCII.
POOL = '<|>[]{}":,.=_-\\/ \n\tabcdefgnostuxyzAZ0189é中'


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Cls:
    ranges: tuple[tuple[int, int], ...]
    negated: bool

    def matches(self, char: str) -> bool:
        inside = any(low <= ord(char) <= high for low, high in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Rep:
    node: Node
    low: int
    high: int | None


Node = Lit | Cls | Ref | Seq | Alt | Rep
ANY = Cls(((0x0A, 0x0A),), negated=True)  # `.`: any character but a newline

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}
_NAME = re.compile(r"[A-Za-z0-9-]+")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def rules(self) -> dict[str, Node]:
        found: dict[str, Node] = {}
        self.space()
        while self.at < len(self.text):
            name = self.name()
            self.space()
            self.expect("::=")
            found[name] = self.alternatives()
            self.space()
        return found

    def space(self, newlines: bool = True) -> None:
        while self.at < len(self.text):
            char = self.text[self.at]
            if char == "#":
                while self.at < len(self.text) and self.text[self.at] != "\n":
                    self.at += 1
            elif char in " \t\r" or (newlines and char == "\n"):
                self.at += 1
            else:
                return

    def expect(self, token: str) -> None:
        if not self.text.startswith(token, self.at):
            raise ValueError(f"expected {token!r} at {self.at}: {self.text[self.at : self.at + 40]!r}")
        self.at += len(token)

    def name(self) -> str:
        found = _NAME.match(self.text, self.at)
        if found is None:
            raise ValueError(f"expected a rule name at {self.at}: {self.text[self.at : self.at + 40]!r}")
        self.at = found.end()
        return found.group()

    def alternatives(self, nested: bool = False) -> Node:
        options = [self.sequence(nested)]
        while self.text.startswith("|", self.at):
            self.at += 1
            self.space()  # after "|" a rule may go on on the next line
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, nested: bool) -> Node:
        """Items up to "|", ")" or, outside parentheses, the end of the line (llama.cpp's rule)."""
        items: list[Node] = []
        while True:
            self.space(newlines=nested)
            if self.at >= len(self.text) or self.text[self.at] in "|)\n":
                break
            items.append(self.postfix(self.primary()))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def primary(self) -> Node:
        char = self.text[self.at]
        if char == '"':
            self.at += 1
            out = []
            while self.text[self.at] != '"':
                out.append(self.char())
            self.at += 1
            return Lit("".join(out))
        if char == "[":
            self.at += 1
            negated = self.text.startswith("^", self.at)
            self.at += negated
            ranges = []
            while self.text[self.at] != "]":
                low = self.char()
                high = low
                if self.text[self.at] == "-" and self.text[self.at + 1] != "]":
                    self.at += 1
                    high = self.char()
                ranges.append((ord(low), ord(high)))
            self.at += 1
            return Cls(tuple(ranges), negated)
        if char == "(":
            self.at += 1
            self.space()
            inner = self.alternatives(nested=True)
            self.space()
            self.expect(")")
            return inner
        if char == ".":
            self.at += 1
            return ANY
        return Ref(self.name())

    def char(self) -> str:
        char = self.text[self.at]
        if char != "\\":
            self.at += 1
            return char
        kind = self.text[self.at + 1]
        digits = {"x": 2, "u": 4, "U": 8}.get(kind)
        if digits is not None:
            value = int(self.text[self.at + 2 : self.at + 2 + digits], 16)
            self.at += 2 + digits
            return chr(min(value, 0x10FFFF))
        self.at += 2
        return _ESCAPES.get(kind, kind)

    def postfix(self, node: Node) -> Node:
        while self.at < len(self.text):
            char = self.text[self.at]
            if char in "*+?":
                self.at += 1
                node = Rep(node, 1 if char == "+" else 0, 1 if char == "?" else None)
            elif char == "{":
                end = self.text.index("}", self.at)
                low, comma, high = self.text[self.at + 1 : end].partition(",")
                node = Rep(node, int(low), (int(high) if high.strip() else None) if comma else int(low))
                self.at = end + 1
            else:
                return node
        return node


def parse(text: str) -> dict[str, Node]:
    """A GBNF grammar's rules by name."""
    return _Parser(text).rules()


@dataclass(frozen=True)
class Drawn:
    """A sentence, and the text each expansion of a watched rule wrote (in order)."""

    text: str
    spans: list[tuple[str, str]]


class Sampler:
    """Draws sentences of a grammar at random: alternatives and repetition counts uniformly (a
    repetition stops with chance 1/2 at each step), then, past `depth` nested expansions, the
    shortest way to finish, so every draw ends."""

    def __init__(self, grammar: str, depth: int = 24) -> None:
        self.rules = parse(grammar)
        self.depth = depth
        self.shortest = self._shortest_lengths()

    def draw(self, rng: random.Random, watch: re.Pattern[str] | None = None, root: str = "root") -> Drawn:
        """A sentence from `root`; the text written by each rule whose name `watch` matches whole."""
        out: list[str] = []
        spans: list[tuple[str, str]] = []
        self._emit(self.rules[root], rng, 0, out, watch, spans)
        return Drawn("".join(out), spans)

    def _shortest_lengths(self) -> dict[str, float]:
        lengths = {name: float("inf") for name in self.rules}
        changed = True
        while changed:
            changed = False
            for name, node in self.rules.items():
                size = self._min(node, lengths)
                if size < lengths[name]:
                    lengths[name], changed = size, True
        return lengths

    def _min(self, node: Node, lengths: dict[str, float]) -> float:
        if isinstance(node, Lit):
            return len(node.text)
        if isinstance(node, Cls):
            return 1
        if isinstance(node, Ref):
            return lengths[node.name]
        if isinstance(node, Seq):
            return sum(self._min(item, lengths) for item in node.items)
        if isinstance(node, Alt):
            return min(self._min(option, lengths) for option in node.options)
        return node.low * self._min(node.node, lengths) if node.low else 0

    def _emit(
        self,
        node: Node,
        rng: random.Random,
        depth: int,
        out: list[str],
        watch: re.Pattern[str] | None,
        spans: list[tuple[str, str]],
    ) -> None:
        deep = depth > self.depth
        if isinstance(node, Lit):
            out.append(node.text)
        elif isinstance(node, Cls):
            out.append(_draw_char(node, rng))
        elif isinstance(node, Ref):
            watched = watch is not None and watch.fullmatch(node.name) is not None
            if watched:
                index = len(spans)
                spans.append((node.name, ""))
                before = len(out)
            self._emit(self.rules[node.name], rng, depth + 1, out, watch, spans)
            if watched:
                spans[index] = (node.name, "".join(out[before:]))
        elif isinstance(node, Seq):
            for item in node.items:
                self._emit(item, rng, depth, out, watch, spans)
        elif isinstance(node, Alt):
            finite = [o for o in node.options if self._min(o, self.shortest) < float("inf")]
            option = min(finite, key=lambda o: self._min(o, self.shortest)) if deep else rng.choice(finite)
            self._emit(option, rng, depth + 1, out, watch, spans)
        else:
            count = node.low
            while not deep and (node.high is None or count < node.high) and rng.random() < 0.5:
                count += 1
            for _ in range(count):
                self._emit(node.node, rng, depth + 1, out, watch, spans)


def _draw_char(node: Cls, rng: random.Random) -> str:
    if not node.negated:
        low, high = rng.choice(node.ranges)
        return chr(rng.randint(low, min(high, low + 64)))
    allowed = [c for c in POOL if node.matches(c)]
    if not allowed:
        raise ValueError(f"the class {node} allows none of the sampler's characters")
    return rng.choice(allowed)
