"""Choosing the next token from logits: greedy, or llama.cpp's own sampler chain with a seed, held
to a GBNF grammar where the request asks for structured output or a tool call."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Annotated, Any, Protocol

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kafila.runtime.llama.loading import llama, load_llama
from kafila.validation import one_line
from kafila.wire.frames import MAX_SAMPLER_START_BYTES, SAMPLE_ON_HEAD

# The layout of llama_token_data: id (int32), logit (float), p (float).
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
# A GBNF grammar's text: the JSON schemas the API admits convert to a few KiB; this bounds what a
# SAMPLER frame or a request can make llama.cpp parse.
MAX_GRAMMAR_CHARS = 1 << 18


class SamplingSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(default=64, ge=0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int = Field(default=0, ge=0, lt=2**32)
    # GBNF (root rule "root") that every generated token must keep matching: structured output and
    # tool calls. llama.cpp's grammar sampler needs the whole row and the model's vocabulary.
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def top_logits(self) -> int:
        """How many of the largest logits this sampler can pick from, or 0 for all of them: a head on
        a member sends the host only these.

        The chain keeps k tokens (1 for greedy, else top_k) after the penalties. Penalties that
        only lower a logit (repeat ≥ 1, frequency and presence ≥ 0) touch at most `repeat_last_n`
        distinct tokens, so the k kept are among the k + repeat_last_n largest before them: for
        a token outside those, at least k unpenalised tokens stay above it. A penalty that raises
        logits, or top_k 0 with a temperature, needs the whole row.
        """
        if self.grammar is not None:  # the grammar may allow none of the largest: it needs them all
            return 0
        keep = 1 if self.temperature == 0.0 else self.top_k
        if keep == 0:
            return 0
        if self.penalised and self.repeat_last_n > 0:
            if self.repeat_penalty < 1.0 or self.frequency_penalty < 0.0 or self.presence_penalty < 0.0:
                return 0
            keep += self.repeat_last_n
        return keep if keep < SAMPLE_ON_HEAD else 0

    @property
    def needs_whole_row(self) -> bool:
        """Whether only the whole row of logits will do: a head on a member then samples itself."""
        return self.top_logits == 0

    @property
    def greedy(self) -> bool:
        """A plain argmax: temperature zero and no penalty to apply first."""
        return self.temperature == 0.0 and not self.penalised and self.grammar is None


class TokenSampler(Protocol):
    """One request's sampler on the host: what the scheduler calls for each token. `portable`:
    whether its whole state is here, so that it can go on on another ring."""

    portable: bool

    def accept(self, tokens: Iterable[int]) -> None: ...
    def sample(self, logits: npt.NDArray[np.float32]) -> int: ...
    def distribution(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64] | None:
        """The distribution `sample` draws from for this row (speculative sampling's p), where
        this sampler can say it; None where it cannot."""
        ...

    def close(self) -> None: ...


class GrammarRefused(ValueError):
    """llama.cpp could not parse a grammar (the client's fault where the client wrote it)."""


def grammar_sampler(vocab: Any, grammar: str) -> Any:
    """llama.cpp's grammar sampler over `vocab` (a `llama_vocab *`); the caller frees it."""
    lib = load_llama()
    sampler = lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not sampler:
        raise GrammarRefused("llama.cpp could not parse the grammar")
    return sampler


def check_grammar(vocab: Any, grammar: str) -> None:
    """Raises GrammarRefused unless llama.cpp parses `grammar`: before a request is queued."""
    load_llama().llama_sampler_free(grammar_sampler(vocab, grammar))


class Sampler:
    """One sequence's sampler. Greedy is an argmax; otherwise llama.cpp's chain does the work:
    repeat penalty, top-k, top-p, temperature, then a seeded draw. A grammar, when set, masks the
    row first (so top-k and top-p pick among what it allows) and sees only generated tokens, not
    the prompt; it needs the model's `vocab` (`llama_vocab *`)."""

    portable = True

    def __init__(self, settings: SamplingSettings, n_vocab: int, vocab: Any = None) -> None:
        self.settings = settings
        self._chain = None
        self._llama = None
        self._grammar = None
        self._shape = None  # the chain without its draw: what `distribution` applies
        self._end = -1
        if settings.grammar is not None:
            if vocab is None:
                raise GrammarRefused("a grammar needs the model's vocabulary, which this sampler was not given")
            self._grammar = grammar_sampler(vocab, settings.grammar)
            lib = load_llama()
            self._end = int(lib.llama_vocab_eos(vocab))
            if self._end < 0:
                self._end = int(lib.llama_vocab_eot(vocab))
        if not settings.greedy:
            self._llama = llama()
            lib = self._llama
            params = lib.llama_sampler_chain_default_params()
            chain = lib.llama_sampler_chain_init(params)
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    n_vocab,
                    settings.repeat_last_n,
                    settings.repeat_penalty,
                    settings.frequency_penalty,
                    settings.presence_penalty,
                ),
            )
            if settings.temperature == 0.0:  # penalties, then the most likely token
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            else:
                if settings.top_k > 0:
                    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(settings.top_k))
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(settings.top_p, 1))
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(settings.temperature))
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(settings.seed))
                if settings.grammar is None:
                    self._shape = self._shaping_chain(lib, settings, n_vocab)
            self._chain = chain
            self._candidates = np.zeros(n_vocab, dtype=_TOKEN_DATA)
            self._ids = np.arange(n_vocab, dtype=np.int32)

    @staticmethod
    def _shaping_chain(lib: Any, settings: SamplingSettings, n_vocab: int) -> Any:
        """The sampled chain's penalties, top-k, top-p and temperature, without the seeded draw:
        the row it leaves is the distribution the draw is made from."""
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        penalties = lib.llama_sampler_init_penalties(
            n_vocab, settings.repeat_last_n, settings.repeat_penalty, settings.frequency_penalty,
            settings.presence_penalty,
        )  # fmt: skip
        lib.llama_sampler_chain_add(chain, penalties)
        if settings.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(settings.top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(settings.top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(settings.temperature))
        return chain

    def accept(self, tokens: Iterable[int]) -> None:
        """Tell the chain what the sequence holds, so the repeat penalty sees it."""
        if self._chain is not None and self._llama is not None:
            for token in tokens:
                self._llama.llama_sampler_accept(self._chain, token)
                if self._shape is not None:
                    self._llama.llama_sampler_accept(self._shape, token)

    def distribution(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64] | None:
        """The probabilities the seeded draw would pick each token with, from this row, after the
        penalties, top-k, top-p and temperature (the chain's state is unchanged); None for greedy
        decoding and under a grammar, whose draw is not one distribution's (`sample`)."""
        if self._shape is None or self._llama is None:
            return None
        candidates = self._candidates
        candidates["id"] = self._ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = self._array(candidates)
        self._llama.llama_sampler_apply(self._shape, ctypes.byref(array))
        kept = candidates[: array.size]
        scores = kept["logit"].astype(np.float64)
        finite = np.isfinite(scores)
        weights = np.zeros(len(scores))
        weights[finite] = np.exp(scores[finite] - scores[finite].max())
        probabilities = np.zeros(len(logits))
        probabilities[kept["id"]] = weights / weights.sum()
        return probabilities

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        """The chain's token; with a grammar, as llama.cpp's own samplers do it: the chain draws
        from the whole row, and only if the grammar refuses that token does it draw again from
        what the grammar allows (masking a 262k vocabulary each token costs more than one check)."""
        if self._chain is None or self._llama is None:
            return int(np.argmax(logits))
        token = self._draw(logits, grammar_first=False)
        if self._grammar is not None and not self._allows(token):
            token = self._draw(logits, grammar_first=True)
            if token < 0:
                # Only a vocabulary that cannot spell what the grammar needs gets here: end the
                # sequence rather than hand llama.cpp a token its grammar would abort on.
                return self._end if self._end >= 0 else int(np.argmax(logits))
        self._llama.llama_sampler_accept(self._chain, token)
        if self._shape is not None:
            self._llama.llama_sampler_accept(self._shape, token)
        if self._grammar is not None:
            self._llama.llama_sampler_accept(self._grammar, token)
        return token

    def _array(self, candidates: npt.NDArray[np.void]) -> Any:
        assert self._llama is not None
        return self._llama.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(self._llama.llama_token_data)),
            size=len(candidates),
            selected=-1,
            sorted=False,
        )

    def _draw(self, logits: npt.NDArray[np.float32], grammar_first: bool) -> int:
        """The chain's pick from the row (masked by the grammar first if asked); -1 where the
        grammar allows nothing."""
        assert self._llama is not None
        candidates = self._candidates
        candidates["id"] = self._ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = self._array(candidates)
        if grammar_first:
            self._llama.llama_sampler_apply(self._grammar, ctypes.byref(array))
            if not np.isfinite(candidates["logit"]).any():
                return -1
        self._llama.llama_sampler_apply(self._chain, ctypes.byref(array))
        return int(candidates["id"][array.selected])

    def _allows(self, token: int) -> bool:
        assert self._llama is not None
        single = np.zeros(1, dtype=_TOKEN_DATA)
        single["id"] = token
        self._llama.llama_sampler_apply(self._grammar, ctypes.byref(self._array(single)))
        return bool(np.isfinite(single["logit"][0]))

    def close(self) -> None:
        if self._chain is not None and self._llama is not None:
            self._llama.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None and self._llama is not None:
            self._llama.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._shape is not None and self._llama is not None:
            self._llama.llama_sampler_free(self._shape)
            self._shape = None


class SamplerStart(BaseModel):
    """What a head on a member needs to sample a sequence exactly as the host would: the settings
    (the seed among them) and the prompt, which the repeat penalty looks back on.

    Sent once per request, before its first prompt chunk, when the request needs the whole row
    of logits (top_k 0 with a temperature, or a penalty that raises logits): a 262k vocabulary's
    row is 1 MiB a token, the chosen token 8 bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settings: SamplingSettings
    prompt: list[Annotated[int, Field(ge=0, lt=1 << 31)]]

    def payload(self) -> bytes:
        """Without a null grammar, so that a member from before grammars takes what it always did."""
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes) -> SamplerStart:
        """Raises ValueError, naming the first field at fault, on anything but a valid start."""
        if len(payload) > MAX_SAMPLER_START_BYTES:
            raise ValueError(f"a sampler start of {len(payload)} bytes exceeds {MAX_SAMPLER_START_BYTES}")
        try:
            return cls.model_validate_json(payload)
        except ValidationError as error:
            raise ValueError(one_line(error)) from None


class TokenChosenOnHead:
    """The host's side of a sequence that a head on a member samples: the row that comes back
    holds the chosen token alone (every other entry -inf), so taking it is an argmax."""

    portable = False  # the sampler's state is on the member

    def accept(self, tokens: Iterable[int]) -> None:
        """The head's sampler has seen the prompt and every token it chose."""

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        return int(np.argmax(logits))

    def distribution(self, logits: npt.NDArray[np.float32]) -> None:
        """The head's draw is made there, from a distribution this host never sees."""
        return None

    def close(self) -> None:
        pass
