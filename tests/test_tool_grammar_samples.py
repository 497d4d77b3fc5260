"""Every reply a tool-call grammar allows is read back as the calls it wrote: calls to tools on the
request's list, with arguments that validate against their schemas. Replies are drawn from the
grammar itself (tests/helpers/grammar_samples.py), not from a model, so no verdict rests on what one seed
happens to sample on one CPU; llama.cpp's own grammar engine confirms each draw, token by token,
and that the reply may end there."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
from grammar_samples import Sampler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tool_calls import SETTINGS
from test_tool_syntaxes import FAMILIES, _model

from kafila.api.harmony import HarmonyReader
from kafila.api.structured import SchemaRefused
from kafila.api.tool_calls import ReplyReader, ToolCallStream, ToolSpec, single_call_only, tool_call_grammar
from kafila.runtime.engine.engines import Engine
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.serving.chat_template import ReplySyntax

DRAWS = 12  # replies drawn from each grammar (one hypothesis example: a syntax, tools and a seed)
ARGUMENTS_RULE = re.compile(r"tool(\d+)-arguments")  # how tool_call_grammar names each tool's arguments
SPECIALS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|constrain|>", "<|python_tag|>",
            "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool_call>", "</tool_call>")  # fmt: skip

# Names that begin one another (a reader must not run past one into the next) and any others.
names = st.sampled_from(["get", "get_time", "get_time_zone", "f", "f-2", "lookup"]) | st.from_regex(
    r"[A-Za-z0-9_-]{1,16}", fullmatch=True
)
key_text = st.text(alphabet='abz_ "\\<|é{', min_size=1, max_size=6)
leaves = st.one_of(
    st.sampled_from([
        {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
        {"type": "string", "pattern": "^[A-Za-z/]{0,5}$"}, {"type": "integer", "minimum": 0},
    ]),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-3, 3), st.integers(0, 9)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.lists(key_text, min_size=1, max_size=3, unique=True).map(lambda values: {"type": "string", "enum": values}),
)  # fmt: skip


def _objects(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def with_required(properties: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        required = st.lists(st.sampled_from(sorted(properties)), unique=True) if properties else st.just([])
        return required.map(lambda keys: {"type": "object", "properties": properties, "required": keys})

    return st.dictionaries(key_text, inner, max_size=3).flatmap(with_required)


values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        _objects(inner),
        st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)
tool_lists = st.lists(st.tuples(names, _objects(values)), min_size=1, max_size=3, unique_by=lambda t: t[0]).map(
    lambda tools: [ToolSpec(name, parameters) for name, parameters in tools]
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[ReplySyntax], Engine]]:
    """The tiny model of the family that writes each syntax, with its special tokens; opened once."""
    opened: dict[ReplySyntax, Engine] = {}

    def engine(syntax: ReplySyntax) -> Engine:
        if syntax not in opened:
            name, family = next((n, f) for n, f in FAMILIES.items() if f.syntax is syntax)
            opened[syntax] = open_engine(_model(family, tmp_path_factory.mktemp(name) / "m.gguf"), [2], SETTINGS)
        return opened[syntax]

    yield engine
    for each in opened.values():
        each.close()


def spelled(engine: Engine, text: str) -> list[int]:
    """`text` as tokens a model could write: its special tokens where the vocabulary has them,
    every other character byte by byte (tokens whose text is that one byte)."""
    specials = {s: ids[0] for s in SPECIALS if len(ids := engine.tokenize(s, False, True)) == 1}
    single = {engine.piece(t): t for t in range(engine.n_vocab()) if len(engine.piece(t)) == 1}
    tokens, at = [], 0
    while at < len(text):
        special = next((s for s in specials if text.startswith(s, at)), None)
        if special is not None:
            tokens.append(specials[special])
            at += len(special)
        else:
            tokens += [single[bytes([b])] for b in text[at].encode()]
            at += 1
    return tokens


def assert_llama_accepts(engine: Engine, grammar: str, text: str) -> None:
    """llama.cpp's grammar sampler lets each token of `text` through, in order, then an end."""
    sampler = engine.sampler(SamplingSettings(temperature=1.0, top_k=0, seed=1, grammar=grammar))
    try:
        for index, token in enumerate(spelled(engine, text)):
            logits = np.zeros(engine.n_vocab(), dtype=np.float32)
            logits[token] = 100.0
            assert sampler.sample(logits) == token, f"llama.cpp's grammar refuses token {index} of {text!r}"
        ending = np.zeros(engine.n_vocab(), dtype=np.float32)
        ending[[t for t in range(engine.n_vocab()) if engine.is_end(t)]] = 100.0
        assert engine.is_end(sampler.sample(ending)), f"llama.cpp's grammar does not let {text!r} end"
    finally:
        sampler.close()


def reader_for(syntax: ReplySyntax, tools: list[ToolSpec], parallel: bool) -> ReplyReader:
    if syntax is ReplySyntax.HARMONY:
        return HarmonyReader([t.name for t in tools], parallel)
    return ToolCallStream(syntax, parallel)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    syntax=st.sampled_from(list(ReplySyntax)),
    tools=tool_lists,
    forced=st.booleans(),
    parallel=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_reply_the_grammar_allows_reads_back_as_the_calls_it_wrote(
    engines: Callable[[ReplySyntax], Engine],
    syntax: ReplySyntax,
    tools: list[ToolSpec],
    forced: bool,
    parallel: bool,
    seed: int,
) -> None:
    parallel = parallel and not single_call_only(syntax)
    try:
        grammar = tool_call_grammar(syntax, tools, parallel, forced)
    except SchemaRefused:  # a 400 for the request; the strategy draws few of these
        return
    sampler, rng, schemas = Sampler(grammar), random.Random(seed), {t.name: t.parameters for t in tools}
    for _ in range(DRAWS):
        drawn = sampler.draw(rng, ARGUMENTS_RULE)
        written = [(tools[int(ARGUMENTS_RULE.fullmatch(rule).group(1))].name, json.loads(text))  # type: ignore[union-attr]
                   for rule, text in drawn.spans]  # fmt: skip
        assert written or not forced, drawn.text
        assert len(written) <= 1 or parallel, drawn.text
        assert_llama_accepts(engines(syntax), grammar, drawn.text)

        _, _, calls = reader_for(syntax, tools, parallel).read_whole(drawn.text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == written, drawn.text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_the_sampler_draws_what_a_grammar_says() -> None:
    """The oracle itself: classes, escapes, repetition bounds and alternatives drawn as written."""
    grammar = 'root ::= "a\\n" [x-z] b{2,3} (c | "d")? [^a-y]\nb ::= "\\x41"\nc ::= "\\u00e9" # a comment'
    seen = {Sampler(grammar).draw(random.Random(seed)).text for seed in range(200)}
    pattern = re.compile("a\n[x-z]A{2,3}(é|d)?[^a-y]")
    assert all(pattern.fullmatch(text) for text in seen), seen
    assert any("é" in t for t in seen) and any("d" in t for t in seen) and any("AAA" in t for t in seen)
