"""Made-up generated tokens for the reply writers' pure tests: a reply cut into tokens of one
word, space, punctuation or marker each, with log probabilities that tell them apart."""

from __future__ import annotations

import re

from kafila.runtime.engine.logprobs import Alternative, TokenLogprob


def fake_token(index: int, text: str) -> TokenLogprob:
    piece = text.encode()
    return TokenLogprob(index, piece, -index / 10, (Alternative(index, piece, -index / 10), Alternative(0, b"x", -9.0)))


def word_tokens(text: str) -> tuple[list[str], list[TokenLogprob]]:
    """`text` as tokens of one word, space, punctuation or marker each."""
    texts = re.findall(r"</?think>|</?tool_call>|\s+|\w+|[^\w\s]", text)
    assert "".join(texts) == text
    return texts, [fake_token(i, piece) for i, piece in enumerate(texts)]
