"""Speculative decoding's pure parts: n-gram drafts and the window that decides how many to send.

Across homes a token costs a round trip of the ring. A sequence's drafted tokens ride behind its
last token as extra rows of the same wave; the head answers every row, and the host samples row
by row, keeping a draft only while it equals the token sampled there (`Batcher.advance`). The
sampler sees exactly the rows and tokens it would without drafts, so the output is the one
decoding without speculation gives, greedy or seeded (with a draft that is one token, q is a
point mass: drawing from p and accepting iff the draw equals the draft is the min(1, p/q) rule,
and the draw that disagrees is the residual's). A rejected draft costs only its rows in the trip
it rode on; the rejected rows' cache is cut before the sequence's next wave.

`NgramDrafter` proposes the tokens that followed the latest earlier occurrence of the sequence's
last few tokens (prompt lookup): where a model writes back text it was shown (a file with one
change, a JSON document, a quoted passage) they are what it writes. `DraftWindow` adapts how many
to send per sequence: it grows while drafts are accepted, shrinks on rejects, and rests where
drafts do not pay.

Pure: no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kafila.planner.types import DRAFT_ROWS
from kafila.runtime.engine.draft_cost import AcceptRate, DraftLedger

# Drafted tokens per sequence per trip, at most: with its token's row, 8 rows. Batched products
# tile rows by fours and eights (llama.cpp's CPU kernels; a GPU's vector kernels take up to 8), so
# on gemma-3-270m's CPU head 8 rows of logits cost less than 5, and 9 a third more than 8.
MAX_DRAFT = 7
# Drafted rows in one wave, all sequences together: the head reserves a row of logits for each
# (`ContextSettings.max_outputs`, and the planner counts them), and sequences share them fairly
# (`draft_shares`).
DRAFT_ROWS_PER_WAVE = DRAFT_ROWS
MIN_NGRAM, MAX_NGRAM = 2, 4  # a suffix of one token matches too often to be worth a row


class Speculate(StrEnum):
    """What `kafila host --speculate` drafts with."""

    NGRAM = "ngram"  # prompt lookup over the prompt and the tokens generated so far
    DRAFT = "draft"  # a small model with the target's vocabulary, on the host (`draft_model`)
    OFF = "off"


class Drafter(Protocol):
    """One sequence's source of drafts: told every token the sequence emits, asked for up to
    `limit` tokens to follow them. `drawn_from`: the distributions the last draft's tokens were
    drawn from, a row each (speculative sampling's q), or None where each is a point mass.
    `guesses_free`: whether a draft costs nothing worth counting (a lookup, not a decode), so that
    the batcher may look a guess up on a wave where the sequence sends no drafts."""

    @property
    def drawn_from(self) -> npt.NDArray[np.float64] | None: ...
    @property
    def guesses_free(self) -> bool: ...
    def extend(self, tokens: Iterable[int]) -> None: ...
    def draft(self, limit: int) -> list[int]: ...
    def close(self) -> None: ...


class NgramDrafter:
    """Drafts from a sequence's own history: the tokens that followed the latest earlier
    occurrence of its last n tokens, trying the longest n (MAX_NGRAM) first.

    The index maps each n-gram to where the tokens after its latest occurrence start; it grows
    by O(MAX_NGRAM) per token, so a draft costs a few dictionary lookups, not a scan.
    """

    def __init__(self, tokens: Iterable[int] = (), min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._tokens: list[int] = []
        # n-gram → the index just past its latest occurrence, among those ending before the last token
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    @property
    def drawn_from(self) -> None:
        """Drafts looked up, not drawn: each is a point mass."""
        return None

    @property
    def guesses_free(self) -> bool:
        """A draft is a few dictionary lookups."""
        return True

    def close(self) -> None:
        """Nothing held but the index."""

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            end = len(self._tokens)  # the n-grams ending here now have a token after them
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._after[tuple(self._tokens[end - n : end])] = end
            self._tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens to follow the history; empty where no suffix occurred before. Where
        they reach the end of the history, the text goes on repeating from its match (a loop of
        end - start tokens, which a small model's greedy text often falls into): the draft copies
        what it has drafted, as an overlapping copy does."""
        if limit <= 0:
            return []
        tokens, end = self._tokens, len(self._tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self._after.get(tuple(tokens[end - n :]))
            if start is not None:
                drafted = tokens[start : min(start + limit, end)]
                while len(drafted) < limit:
                    drafted.append(drafted[start + len(drafted) - end])
                return drafted
        return []


# How the window moves. It starts small (a first draft is a guess), goes to 2k + 1 after a trip
# whose k drafts were all accepted (2, 5, then MAX_DRAFT: a trip of 8 rows, a count that batches
# well; `draft_cost` prices the counts between as measured), and falls to one more than what was
# accepted otherwise. Free guesses that land g in a row open it to 2g + 1 as kept drafts would:
# where one drafted row costs about a trip (loopback) a window of one never pays, though the copy
# under way would pay a longer one, and a window that only grows on drafts sent stays at one.
# Trips whose drafts are all rejected
# count against the sequence; after MISSES_TO_REST in a row it rests (sends no drafts) for a
# number of trips that doubles each time, up to MAX_REST, then tries again.
FIRST_WINDOW = 2
MISSES_TO_REST = 3
FIRST_REST, MAX_REST = 4, 64
# A rest ends early once this many free guesses in a row (`DraftWindow.shadowed`) were the tokens
# that landed: text that turned to copying or looping, whose drafts would be kept.
GUESSES_TO_WAKE = 2


@dataclass
class DraftWindow:
    """One sequence's draft window: how many drafted tokens its next trip may carry."""

    size: int = FIRST_WINDOW
    misses: int = 0  # trips in a row whose drafts were all rejected
    resting: int = 0  # trips left without drafts
    guessed: int = 0  # free guesses in a row that were the token landed
    rest: int = FIRST_REST  # how long the next rest lasts
    drafted: int = 0
    accepted: int = 0
    trips: int = 0  # trips that carried drafts
    accept: AcceptRate = field(default_factory=AcceptRate)  # what the cost rule weighs (`draft_cost`)
    ledger: DraftLedger = field(default_factory=DraftLedger)  # what its drafts have lost it, in trips

    @property
    def allowed(self) -> int:
        """Drafted tokens the next trip may carry (0 while resting)."""
        return 0 if self.resting else self.size

    def skip(self) -> None:
        """A trip without drafts (none found, resting, or not paying): one less to rest."""
        self.resting = max(0, self.resting - 1)
        self.accept.landed(0, 0)
        self.ledger.landed(0, 0, 0.0)

    def shadowed(self, kept: bool) -> None:
        """A trip that carried no drafts, its drafter's guess checked against the token it brought:
        evidence for the accept rate at no row's cost, so a sequence whose drafts stopped paying
        sees its text turn to copying, or stay free. GUESSES_TO_WAKE right in a row end a rest;
        outside one, right guesses in a row open the window as kept drafts do."""
        self.accept.guessed(kept)
        self.guessed = self.guessed + 1 if kept else 0
        if kept and not self.resting:
            self.size = min(MAX_DRAFT, max(self.size, 2 * self.guessed + 1))
        if self.resting and self.guessed >= GUESSES_TO_WAKE:
            self.resting = 0

    def landed(self, drafted: int, accepted: int, drafted_trips: float = 0.0) -> None:
        """A trip that carried `drafted` tokens, of which the first `accepted` were kept; its drafts
        added `drafted_trips` to it, as the cost rule priced them (0 where not yet measured)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} accepted of {drafted} drafted")
        if drafted == 0:
            self.skip()
            return
        self.drafted += drafted
        self.accepted += accepted
        self.trips += 1
        self.guessed = 0
        self.accept.landed(drafted, accepted)
        self.ledger.landed(drafted, accepted, drafted_trips)
        if accepted == drafted:
            self.size = min(MAX_DRAFT, max(self.size, 2 * drafted + 1))
            self.misses, self.rest = 0, FIRST_REST
        elif accepted > 0:
            self.size = max(1, accepted + 1)
            self.misses, self.rest = 0, FIRST_REST
        else:
            self.size = max(1, self.size // 2)
            self.misses += 1
            if self.misses >= MISSES_TO_REST:
                self.resting, self.misses = self.rest, 0
                self.rest = min(MAX_REST, 2 * self.rest)
                self.size = FIRST_WINDOW


def draft_shares(wanted: Sequence[int], rows: int = DRAFT_ROWS_PER_WAVE) -> list[int]:
    """How many drafted rows each sequence of a wave gets, of `rows` in all: each what it wants,
    but where they want more than there is, the rows go round one at a time, so every sequence
    that drafts gets its share before any gets more."""
    shares = [0] * len(wanted)
    left = rows
    while left > 0:
        gave = False
        for index, want in enumerate(wanted):
            if left > 0 and shares[index] < want:
                shares[index] += 1
                left -= 1
                gave = True
        if not gave:
            break
    return shares


@dataclass
class SpeculationStats:
    """What /status and /metrics report of speculation, over the server's life."""

    drafted: int = 0  # drafted tokens sent round the ring
    accepted: int = 0  # of those, kept
    trips: int = 0  # trips that carried drafts
    window_sum: int = 0  # the windows those trips carried, summed
    waves_behind: int = 0  # waves sent behind another of the same sequence's still out (drafts in flight)
    waves_stale: int = 0  # of them, those a reject ahead made stale: their rows cut unread

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.trips += 1
            self.window_sum += drafted

    @property
    def accepted_per_trip(self) -> float:
        """Drafted tokens kept per trip that carried drafts: what a trip gave beyond its one token."""
        return self.accepted / self.trips if self.trips else 0.0

    @property
    def mean_window(self) -> float:
        return self.window_sum / self.trips if self.trips else 0.0


# Which uniform draw a position's randomness is for (a draft model's draw of a token from q, the
# rule's accept test, its draw from the residual): each a function of the request's seed and the
# position alone, so a request's tokens do not hang on what else shared its waves.
DRAFT_DRAW, ACCEPT_DRAW, RESIDUAL_DRAW = 0, 1, 2


def uniform(seed: int, position: int, draw: int) -> float:
    """One uniform draw in [0, 1) for a request's `draw` at `position`."""
    return float(np.random.default_rng([seed, position, draw]).random())


def speculative_pick(
    target: npt.NDArray[np.float64], drawn_from: npt.NDArray[np.float64], draft: int, accept: float, residual: float
) -> tuple[int, bool]:
    """Speculative sampling's rule for one drafted token: keep `draft` with probability
    min(1, p/q), else draw from the normalised residual max(0, p - q), so the token has the
    target's distribution p whatever q the draft was drawn from. `accept` and `residual` are
    uniform draws in [0, 1). Returns the token and whether it is the draft."""
    p, q = target[draft], drawn_from[draft]
    if accept * q < p:  # u < p/q, without dividing by a q of 0 (a draft never drawn from it)
        return draft, True
    rest = np.maximum(target - drawn_from, 0.0)
    total = rest.sum()
    if not total > 0.0:  # p <= q nowhere above: only rounding rejects; the draft is p's token
        return draft, True
    cumulative = np.cumsum(rest)
    token = int(np.searchsorted(cumulative, residual * cumulative[-1], side="right"))
    if token >= len(target):  # a draw at the very top, past the last sum by rounding
        token = int(np.flatnonzero(rest)[-1])
    return token, False
