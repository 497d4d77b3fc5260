"""Whether drafts pay on this ring: the cost rule of speculative decoding.

A drafted row is not free. Every stage computes it, and the head returns a row of logits for it,
which on a large vocabulary (gemma's 262,144 entries) is most of its cost: a trip that carries k
drafts takes T + k·c, where T is the trip without them (the ring's round trip and one row's
compute) and c what one more row costs. It brings 1 + p + p² + … + pᵏ tokens on average, p being
the chance that a draft is kept once the one before it was. So drafts pay where some k > 0 gives
more tokens a millisecond than none: for one draft, where p·T > c, the expected gain (the accept
rate times the trip) against the measured cost of the extra row. Across homes T is large and any
fair accept rate pays; on loopback T is a row's compute and only a sequence copying text does.
A wave shared by n sequences delays all n by a drafted row, so its cost counts n times.

A draft model's drafts are not free to make either: k drafts are k decodes of the draft on the
host, one after the other (each needs the token before it), made while the host plans the
sequence's wave and before it leaves, so on the sequence's own path round the ring: a trip of k
drafts then takes T + k·c + k·d, d the draft's measured decode. On one machine, with a draft near
the target's size, d alone is about T, and no accept rate pays. The wave's sequences draft in the
same rounds (one decode a round for all of them), so d counts once, not once a sequence.

Rows are not all priced alike: a batched product tiles its rows, so on a CPU head (gemma-3-270m,
llama.cpp's Q8_0 output matrix) a trip of 4 or 8 rows of logits costs less than one of 5 or 9,
and the second row costs twice what the eighth does. And a wave that carries drafts at all costs
more than its rows: on the NAT lab's loopback ring (quiet, a trip of 25 ms) one drafted row added
29 ms, two 40, three 49, so priced through the trip at one row's slope a window of three looked
dearer than it is and only one draft was ever weighed. A count of drafted rows the recent waves
show often enough is priced as they show it; the others on the line through the drafted waves
(what drafting adds once, then a cost a row) where those show one, else at the fitted cost a row.

A greedy request's token and k drafts are k + 1 decodes of a row at every stage (exactly the
text without drafts: `stage._decodes`), a sampled one's one decode of k + 1 rows where they fit:
on a CPU the two cost about the same, on a GPU the first about k + 1 times the second. The greedy
rows go round a frame a row, each passed on as soon as a stage has decoded it
(`engines.rows_as_decoded`), so on machines apart a drafted row costs about the busiest machine's
decode of one row, not every stage's in turn. c is measured, not assumed, so it is what the
ring's waves cost as they ran (where greedy and sampled requests draft at once, the mix of the
two: not priced apart).

`TripClock` measures T and c from the waves the engine loop lands (their drafted rows and wall
times; nothing is sent to measure them) and d from the draft model's decodes as it drafts,
`AcceptRate` a sequence's p from its recent trips, and
`best_window` picks the window. Deciding never costs a trip: a sequence that drafts nothing
simply rides its wave with one row. An estimate of p can be wrong for a few trips at a time, so
`DraftLedger` keeps what a sequence's drafts have lost it, net of the trips they saved, and a trip
carries only drafts that, all missed, keep that within 4% of the trips it has taken (40 at least).

Pure: no model, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kafila.planner.stage_cost import StageCost

# The waves a trip's cost is measured over: recent enough to follow a load that changes, enough
# for a median to shrug off a few waves the operating system delayed.
CLOCK_WAVES = 32
MIN_DRAFTED_WAVES = 3  # of them, those with drafts needed to see what a drafted row costs
MIN_SAME_WAVES = 3  # of them, those of one count of drafted rows that price that count as measured
# While none of them carried drafts, the rows' cost last measured is trusted less each wave: a
# measure taken in a moment of load (or on another ring) would otherwise keep drafts off for good.
STALE_DECAY = 0.95
MIN_EVIDENCE = 4.0  # drafts and guesses weighed (`AcceptRate.seen`) before a stale cost is tried on their rate
# A sequence's accept rate weighs its recent trips: each drafted trip's evidence decays by DECAY,
# and while it drafts nothing (its drafts did not pay) by FORGET a trip, so that a sequence whose
# text turns to copying is tried again. A sequence starts at PRIOR_KEPT kept and none missed:
# optimistic, so its first drafts are tried wherever a draft that is kept pays.
DECAY, FORGET = 0.8, 0.98
PRIOR_KEPT = 1.0
# A guess not sent (`guessed`), checked against the token its trip brought, is evidence too, one a
# trip while a sequence drafts nothing: weighed with a longer memory, so that a lucky guess or two
# among many missed (free text) does not make its drafts look as if they paid.
GUESS_DECAY = 0.95
# What a sequence's drafts may lose it, net of the trips their kept drafts saved (`DraftLedger`):
# LOSS_SHARE of the trips it has taken, counted as no fewer than LOSS_FLOOR_TOKENS, so that an
# answer of that many tokens or more never takes more than 1 + LOSS_SHARE times its time without
# drafts, and its first trips may still try a draft or two on hope.
LOSS_SHARE = 0.04
LOSS_FLOOR_TOKENS = 40


def expected_tokens(accept_rate: float, drafts: int) -> float:
    """Tokens a trip carrying `drafts` drafts brings on average: its own, then each draft while
    all before it were kept (1 + p + … + pᵏ)."""
    return sum(accept_rate**i for i in range(drafts + 1))


def best_window(
    accept_rate: float,
    trip_ms: float,
    row_ms: float,
    limit: int,
    sharing: int = 1,
    drafted_ms: Callable[[int], float] | None = None,
    draft_ms: float = 0.0,
    afford_ms: float = math.inf,
) -> int:
    """How many drafts (0..`limit`) give a sequence the most tokens a millisecond: a trip of k
    drafts takes `trip_ms` + k·`row_ms`·`sharing` (its rows delay the `sharing` sequences of its
    wave; `drafted_ms`(k) in place of k·`row_ms` where given: `TripCost.drafted_ms`) + k·`draft_ms`
    (a draft model's decode a drafted token, before the wave leaves; 0 for n-gram drafts) and
    brings `expected_tokens`. Windows whose drafts add more than `afford_ms` to the trip are not
    weighed (what the sequence can still afford to lose: `DraftLedger`). 0 where no draft pays;
    the smallest of equal windows."""
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"an accept rate of {accept_rate}: need 0..1")
    if trip_ms <= 0 or row_ms < 0 or sharing < 1 or not draft_ms >= 0:
        raise ValueError(
            f"a trip of {trip_ms} ms, {row_ms} ms a row, {sharing} sequences, {draft_ms} ms a draft: "
            "need > 0, >= 0, >= 1, >= 0"
        )
    best, best_rate = 0, 1.0 / trip_ms
    for drafts in range(1, max(0, limit) + 1):
        extra_ms = drafts * row_ms if drafted_ms is None else max(0.0, drafted_ms(drafts))
        extra_ms = extra_ms * sharing + drafts * draft_ms
        rate = expected_tokens(accept_rate, drafts) / (trip_ms + extra_ms)
        if rate > best_rate * (1 + 1e-9) and extra_ms <= afford_ms:
            best, best_rate = drafts, rate
    return best


@dataclass(frozen=True)
class TripCost:
    """What a wave costs: `trip_ms` without drafts, and with k drafted rows `fixed_ms` + k·`row_ms`
    more, or for a count of drafted rows the recent waves showed often enough, what they took
    beyond the trip (`seen`: (rows, ms) pairs)."""

    trip_ms: float
    row_ms: float
    seen: tuple[tuple[int, float], ...] = ()
    stale: bool = False  # no recent wave carried drafts: the rows' cost is an old measure, shrunk
    draft_ms: float = 0.0  # a draft model's decode, a drafted token (`TripClock.drafting`); 0: free drafts
    fixed_ms: float = 0.0  # what a wave's carrying drafts adds beyond its rows' cost

    def drafted_ms(self, rows: int) -> float:
        """What `rows` drafted rows add to a trip: as measured where seen, else on the line."""
        if rows <= 0:
            return 0.0
        return next((ms for count, ms in self.seen if count == rows), self.fixed_ms + rows * self.row_ms)

    def added_trips(self, drafts: int, sharing: int = 1) -> float:
        """What a sequence's `drafts` drafts add to a wave of `sharing` sequences, in trips, as
        `best_window` prices them: their rows, which delay every sequence of the wave, and a draft
        model's decodes."""
        if drafts <= 0:
            return 0.0
        return (max(0.0, self.drafted_ms(drafts)) * sharing + drafts * self.draft_ms) / self.trip_ms


@dataclass
class TripClock:
    """The recent decode waves' drafted rows and wall times, and the trip cost they show: the
    Theil–Sen line through them (the median of the slopes between waves with different drafted
    rows), which a few delayed waves do not move, and the trip the median of the waves without
    drafts (the line's median intercept where there are few). Where the waves with drafts show two
    counts or more and their own line (`StageCost.fit`) meets no drafts above the trip, the rows are
    priced on it: what drafting adds to a wave once (`TripCost.fixed_ms`), then its slope a row.
    None until waves with two different
    numbers of drafted rows have landed, MIN_DRAFTED_WAVES of them with drafts; a row's cost (and
    a count's) then stays as last seen while the recent waves show no more (every sequence
    drafting nothing), shrinking by STALE_DECAY a wave once none of them carried drafts (so that
    a sequence whose drafts would pay tries them again: the first drafted wave then prices the
    rows afresh), and the trip goes on following the waves.

    A draft model's decode (`drafting`) is the median of its recent drafts' time a decode (a
    prompt's catch-up, paid once a request, is not given to it: `EngineLoop._draft_many`); it
    shrinks as the rows' cost does while nothing drafts, and the first draft after that measures
    it afresh."""

    waves: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=CLOCK_WAVES))
    cost: TripCost | None = None
    drafts: deque[float] = field(default_factory=lambda: deque(maxlen=CLOCK_WAVES))  # ms a decode, a draft each
    draft_trust: float = 1.0  # what the drafts' measure is still trusted to: STALE_DECAY a stale wave

    @property
    def draft_ms(self) -> float:
        """A draft model's decode as recent drafts measured it, shrunk while nothing drafted (0
        where none has drafted)."""
        return self.draft_trust * self.draft_measured_ms

    @property
    def draft_measured_ms(self) -> float:
        """A draft model's decode as its recent drafts measured it, not shrunk while nothing drafted."""
        return statistics.median(self.drafts) if self.drafts else 0.0

    @property
    def draft_stale(self) -> bool:
        """Whether a draft model's decode is an old measure, shrunk while no recent wave drafted."""
        return bool(self.drafts) and self.draft_trust < 1.0

    @property
    def quickest_ms(self) -> float:
        """The quickest recent wave: no shorter than a trip, whatever it carried (1 µs with none)."""
        return max(1e-3, min((ms for _, ms in self.waves), default=0.0))

    def drafting(self, decodes: int, seconds: float) -> None:
        """A draft model drafted for a wave in `decodes` decodes (its catch-up on what the last
        trip brought, then one a drafted token after the first) that took `seconds`."""
        if decodes < 1 or not seconds >= 0:
            raise ValueError(f"drafts of {decodes} decodes in {seconds} s")
        if self.draft_trust < 1.0:  # the first draft after a stale spell: measured afresh
            self.drafts.clear()
            self.draft_trust = 1.0
        self.drafts.append(1e3 * seconds / decodes)
        if self.cost is not None:
            self.cost = replace(self.cost, draft_ms=self.draft_ms)

    def record(self, drafted_rows: int, seconds: float) -> None:
        """A decode wave that carried `drafted_rows` drafts (all sequences together) landed after `seconds`."""
        if drafted_rows < 0 or not 0 <= seconds < math.inf:
            raise ValueError(f"a wave of {drafted_rows} drafted rows in {seconds} s")
        wave_ms = 1e3 * seconds
        self.waves.append((drafted_rows, wave_ms))
        last = self.cost
        row_ms = last.row_ms if last is not None else None
        fixed_ms = last.fixed_ms if last is not None else 0.0
        seen = dict(last.seen) if last is not None else {}  # a count no longer drafted: as last seen
        if last is not None and last.stale and drafted_rows > 0:
            # The first drafted wave after a stale spell prices rows at once: every count's old
            # measure scaled by what this one cost against what it was believed to.
            believed, extra = last.drafted_ms(drafted_rows), max(0.0, wave_ms - last.trip_ms)
            scale = extra / believed if believed > 0 else 1.0
            row_ms = last.row_ms * scale if believed > 0 else extra / drafted_rows
            fixed_ms = last.fixed_ms * scale if believed > 0 else 0.0
            seen = {rows: ms * scale for rows, ms in seen.items()} | {drafted_rows: extra}
        stale = len(self.waves) == self.waves.maxlen and not any(rows for rows, _ in self.waves)
        if stale:
            self.draft_trust *= STALE_DECAY
        if stale and row_ms is not None:
            row_ms *= STALE_DECAY
            fixed_ms *= STALE_DECAY
            seen = {rows: STALE_DECAY * ms for rows, ms in seen.items()}
        if sum(rows > 0 for rows, _ in self.waves) >= MIN_DRAFTED_WAVES:
            line = StageCost.fit(self.waves)
            if line is not None:
                row_ms, fixed_ms = line.row_ms, 0.0
        if row_ms is None:
            return
        # The trip follows the waves without drafts where there are some, so that where drafts
        # stopped (they did not pay) a trip that grows (a slower ring) is seen and they start again.
        plain = [ms for rows, ms in self.waves if rows == 0]
        if len(plain) >= MIN_DRAFTED_WAVES:
            trip_ms = statistics.median(plain)
        else:
            trip_ms = statistics.median(ms - row_ms * rows for rows, ms in self.waves)
        trip_ms = max(trip_ms, 1e-3)
        drafted_line = StageCost.fit([(rows, ms) for rows, ms in self.waves if rows > 0])
        if drafted_line is not None and drafted_line.step_ms > trip_ms:
            row_ms, fixed_ms = drafted_line.row_ms, drafted_line.step_ms - trip_ms
        by_count: dict[int, list[float]] = {}
        for rows, ms in self.waves:
            if rows > 0:
                by_count.setdefault(rows, []).append(ms)
        for rows, times in by_count.items():
            if len(times) >= MIN_SAME_WAVES:
                seen[rows] = max(0.0, statistics.median(times) - trip_ms)
        self.cost = TripCost(trip_ms, row_ms, tuple(sorted(seen.items())), stale, self.draft_ms, fixed_ms)


@dataclass
class AcceptRate:
    """A sequence's recent accept rate: of its drafts tried, the share kept given the one before
    it was (a trip's drafts are kept up to the first miss, so a trip adds its kept drafts and, if
    one was missed, one miss), weighed towards recent trips."""

    kept: float = 0.0
    missed: float = 0.0

    @property
    def rate(self) -> float:
        return (self.kept + PRIOR_KEPT) / (self.kept + self.missed + PRIOR_KEPT)

    @property
    def seen(self) -> float:
        """How many drafts and guesses its rate weighs, recent ones counting most."""
        return self.kept + self.missed

    def guessed(self, kept: bool) -> None:
        """A trip without drafts whose drafter's first guess was (or was not) the token it brought."""
        self.kept = GUESS_DECAY * self.kept + kept
        self.missed = GUESS_DECAY * self.missed + (not kept)

    def landed(self, drafted: int, accepted: int) -> None:
        """A trip that carried `drafted` drafts, the first `accepted` kept; one without drafts forgets a little."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} accepted of {drafted} drafted")
        if drafted == 0:
            self.kept, self.missed = FORGET * self.kept, FORGET * self.missed
            return
        self.kept = DECAY * self.kept + accepted
        self.missed = DECAY * self.missed + (accepted < drafted)


@dataclass
class DraftLedger:
    """What a sequence's drafts have cost it so far, in trips: the trips its drafted rows (and a
    draft model's decodes) added, less the trips its kept drafts saved.

    The accept rate the rule weighs is an estimate a few trips can mislead: three drafts kept in
    a row (free text running through "9 8 9 8") make it 1.0, and the next window of five is
    missed whole; a rate just above what pays, drafted on over and over, loses a little each time.
    So a trip may carry only drafts whose cost, were every one missed, keeps the net loss within
    LOSS_SHARE of the trips the sequence has taken (no fewer than LOSS_FLOOR_TOKENS): whatever its
    text, drafting never makes an answer of LOSS_FLOOR_TOKENS tokens or more take more than
    1 + LOSS_SHARE times its time without drafts (as the rows are priced). What kept drafts saved
    (a copy's, a loop's) is the sequence's to risk, so a copy's window lags its own growth only
    where a drafted row costs most of a trip, and there by a trip or so (1, 2, 3, 5, 7 drafts
    kept at 45 + 31 ms, against 1, 2, 5, 7)."""

    tokens: int = 0  # tokens its trips brought: the trips it would have taken without drafts
    lost: float = 0.0  # trips its drafts cost, less the trips they saved

    @property
    def affordable(self) -> float:
        """The trips the next trip's drafts may add, were they all missed (0 or less: none)."""
        return LOSS_SHARE * max(self.tokens, LOSS_FLOOR_TOKENS) - self.lost

    def landed(self, drafted: int, kept: int, drafted_trips: float) -> None:
        """A trip that carried `drafted` drafts, which added `drafted_trips` to it, and kept the first `kept`."""
        if not 0 <= kept <= drafted or not drafted_trips >= 0:
            raise ValueError(f"{kept} kept of {drafted} drafts, which added {drafted_trips} trips")
        self.tokens += kept + 1
        self.lost += drafted_trips - kept


# Drafts in flight: waves of one sequence's drafts out round the ring at once, at most. A second
# goes while the first travels the ring (across homes the stages sit idle for most of a trip); a
# third, on the edit's answers replayed at the lab's measures, adds stale rows for less than it
# gains (docs/benchmarks.md, "Speculative decoding: drafts in flight, simulated").
DRAFT_WAVES_OUT = 2


def rows_behind(
    accept_rate: float, unchecked: int, limit: int, cost: TripCost, window_limit: int, idle_ms: float = 0.0
) -> int:
    """How many guessed rows (0..`limit`) a wave sent behind a sequence's waves still out carries
    (drafts in flight): its row i brings a token where it and the `unchecked` guesses out before
    it are all kept (p^(unchecked + i)), and the rows take the ring a drafted wave's time
    (`TripCost.drafted_ms`) less what the ring idles while the waves ahead travel (`idle_ms`,
    planner.waves.idle_behind_ms: across homes most of a trip, so rows there cost little; on
    loopback none, so each delays the wave ahead, or the next where it turns out stale, by its
    whole time). Rows go where they bring more tokens than that time brings at the best rate one
    wave a trip gives (`best_window`, up to `window_limit` drafts); the count that brings most
    beyond it, 0 where none does."""
    if not 0.0 <= accept_rate <= 1.0 or unchecked < 0 or not idle_ms >= 0:
        raise ValueError(
            f"an accept rate of {accept_rate} behind {unchecked} guesses, {idle_ms} ms idle: need 0..1, >= 0, >= 0"
        )
    drafts = best_window(accept_rate, cost.trip_ms, cost.row_ms, window_limit, drafted_ms=cost.drafted_ms)
    per_ms = expected_tokens(accept_rate, drafts) / (cost.trip_ms + max(0.0, cost.drafted_ms(drafts)))
    best, best_gain, brought = 0, 0.0, 0.0
    for rows in range(1, max(0, limit) + 1):
        brought += accept_rate ** (unchecked + rows)
        gain = brought - per_ms * max(0.0, cost.drafted_ms(rows) - idle_ms)
        if gain > best_gain + 1e-9:
            best, best_gain = rows, gain
    return best
