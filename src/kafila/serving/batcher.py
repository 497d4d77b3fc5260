"""Continuous batching: which rows of which requests go into the next engine step.

Every step carries one row for each sequence that is generating, and spends what is left of
the batch on prompt chunks of newly admitted requests, so a long prompt neither stalls the
others nor waits for them to finish. Requests beyond the concurrency limit queue in order.
Each admitted request holds one KV slot (a llama.cpp sequence id) until it ends.

Steps go out in waves. On a ring of n stages one wave keeps one stage busy at a time, so the
engine loop keeps several waves in flight (as many as planner/waves.py prices fastest), each
with a share of the running requests: while one wave is at the second stage the next is at the
first. A generating sequence is in at most one wave at a time (its next row needs its last
token), and waves land in the order they left.

Pipelined prefill (`prefill_chunks` > 1): a prompt's chunks need no token back, so a prefilling
sequence may ride in successive waves, up to `prefill_chunks` of them out at once: chunk i+1 is
at the first stage while chunk i is at the second. It is safe because every stage runs a
sequence's frames in the order they left (one stream round a local ring, one QUIC stream per
sequence), so chunk i's rows are in each stage's cache before chunk i+1's run there. Sequences
not in flight are planned first, decode rows before any chunk, so a pipelined prompt never
takes a decoding sequence's row; its further chunks ride in what is left of the wave's rows.
A pipelined prompt's chunks are as long as `chunk_rows` says for it when it is admitted (the
cost model's choice: short enough that the stages overlap, long enough that each chunk's fixed
costs and the ring's trip do not dominate; a prompt too short to gain is not split).

A slot keeps its cache when its request ends, and the host keeps, per slot, the tokens whose
KV every stage holds there. A new request takes the free slot whose tokens share the longest
prefix with its prompt, where that keeps at least as much of the cache as it throws away, else
the least recently used slot (a cache nobody comes back to is the one evicted); the engine cuts
that slot's cache after the common prefix, and prefill starts there: a chat's next turn or an
agent's repeated system prompt is computed once, and a history edited in the middle resumes
from the edit (a sliding window's too, `PrefixCut`). Where a family's cache cannot be cut (a
recurrent state), nothing is reused. When a ring breaks, the requests it held are kept
(`suspend_all`) for the next ring to take on where they stopped (`resume`).

Speculative decoding (`runtime.engine.speculation`): a generating sequence's decode row may carry
drafted tokens behind it, which the head answers row by row (`EngineStep.every_row`). The
sequence's own sampler then samples each row in turn, as it would the rows of successive trips,
and a draft is kept only while it equals the token sampled before it; the first token that
differs is emitted in its place, and the rejected rows' cache is cut on every stage (a `Trim`,
taken before the sequence's next wave), so the output, the sampler's state, grammars, stop
strings and log probabilities are those of decoding without drafts. Where the engine cannot
answer every row, or a family's cache cannot be cut back (a recurrent state), nothing is drafted.

Drafts in flight (`draft_waves` > 1, on a ring whose waves overlap): while a sequence's drafted
wave travels the ring, its next wave may go behind it, its rows the n-gram continuation past
the guesses out, on the guess that the wave ahead is kept whole (its first row the guess for the
token the wave ahead brings). It is safe for the same reason as pipelined prefill. Where the wave
ahead keeps fewer, or brings another token, the waves behind it are stale: the `Trim` taken
before the sequence's next wave (a CANCEL that follows their rows round the ring) cuts their rows
with the rejected ones at every stage, and their answers are dropped unread, so no sampler, stop
string or grammar ever sees their rows. A reject then costs the stale rows' compute, not a trip;
`draft_cost.rows_behind` sends only rows whose expected tokens pay for it.

Pure: the engine and the samplers are passed in as callables, and nothing here blocks, so the
whole policy is testable without a model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kafila.planner.waves import WaveCosts, idle_behind_ms
from kafila.runtime.engine.draft_cost import MIN_EVIDENCE, TripClock, best_window, rows_behind
from kafila.runtime.engine.engines import EngineStep, EveryRowLogits, PrefixCut, SequenceFailed, StepResult
from kafila.runtime.engine.logprobs import HeadRow, TokenLogprob, token_logprob
from kafila.runtime.engine.sampling import SamplerStart, SamplingSettings, TokenSampler
from kafila.runtime.engine.speculation import (
    ACCEPT_DRAW,
    DRAFT_ROWS_PER_WAVE,
    MAX_DRAFT,
    RESIDUAL_DRAW,
    Drafter,
    DraftWindow,
    NgramDrafter,
    Speculate,
    SpeculationStats,
    draft_shares,
    speculative_pick,
    uniform,
)
from kafila.serving.text import StopAwareText
from kafila.wire.frames import NO_LOGPROBS


@dataclass
class Suspended:
    """A request whose ring broke under it, kept to go on where it stopped on the next ring: its
    sampler, its text so far and the tokens it generated, as they were. With no sampler it had
    sampled nothing yet, and starts again as it came."""

    job: Job
    sampler: TokenSampler | None = None
    text: StopAwareText | None = None
    generated: list[int] = field(default_factory=list)
    cached: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of drawn tokens whose text is held back


@dataclass(frozen=True)
class Trim:
    """Cut slot `slot`'s cache on every stage to its first `keep` positions (0: drop it all)."""

    slot: int
    keep: int


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens, or the context is full


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSettings
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives per token to report log probabilities with; None: none


@dataclass(frozen=True)
class TextDelta:
    """Text released, with the log probabilities (where the request asked) of the tokens generated
    since the last delta: a token whose text is held back (part of a character, or perhaps of a
    stop string) goes with the delta that releases it."""

    request_id: str
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those whose cache an earlier request left
    stop: str | None = None  # the stop string that ended it, where one did (Anthropic's `stop_sequence`)


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    message: str
    code: str = "ring_failed"  # the API's error code: the whole ring, or "stage_error" for this request alone


RequestEvent = TextDelta | Finished | RequestFailed

# A common prefix of one token (the BOS every prompt starts with) is not kept: it saves one row of
# prefill, while the rows resumed after it read a key that another request's batch rounded its own
# way (gemma-3-270m: a BOS reused moved a prompt's logits by 0.94 and broke a 0.05 tie).
MIN_REUSED = 2


@dataclass
class _Sequence:
    job: Job
    slot: int
    sampler: TokenSampler
    text: StopAwareText
    fed: int = 0  # rows of `prefill` already in the KV cache
    generated: list[int] = field(default_factory=list)
    out: int = 0  # waves holding its rows that have not landed yet
    chunk: int | None = None  # rows of its prompt a wave carries at most (pipelined prefill); None: what fits
    sent: int = 0  # rows of `prefill` planned into waves, landed or not (>= fed)
    cached: int = 0  # prompt tokens an earlier request's cache held: prefill started after them
    held: int = 0  # rows landed in the cache: prompt tokens, then generated ones fed back
    trimmed: bool = True  # False until the engine has cut the slot's cache to `cached`
    replayed: int = 0  # generated tokens prefilled again after the prompt: a request resumed on a new ring
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens whose text is held back
    drafter: Drafter | None = None  # None: this sequence drafts nothing
    window: DraftWindow = field(default_factory=DraftWindow)
    drawn_from: npt.NDArray[np.float64] | None = None  # the q rows of the drafts out, where drawn from one
    shadow: int | None = None  # its n-gram guess on a wave that carried no drafts (`DraftWindow.shadowed`)
    drafted_trips: float = 0.0  # what its drafts out add to their wave, in trips, as the cost rule priced them
    guesses_out: list[int] = field(default_factory=list)  # the tokens its waves out guess, past its last token
    end: int = 0  # the position after its waves out's rows, where a wave behind them goes (drafts in flight)
    stale: int = 0  # its waves out behind a reject, whose rows the next wave's cut removes: dropped as they land

    @property
    def prefill(self) -> list[int]:
        """The rows prefilled before decoding: the prompt, and on a resumed request what it had generated."""
        return self.job.prompt + self.generated[: self.replayed]

    @property
    def position(self) -> int:
        """Where the next row goes: after the rows prefilled and the generated tokens fed back since."""
        return self.fed + max(0, len(self.generated) - self.replayed - 1)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.prompt) + self.replayed

    @property
    def in_flight(self) -> bool:
        """Whether its rows are out in a wave that has not landed yet."""
        return self.out > 0

    @property
    def live(self) -> int:
        """Its waves out that are not stale."""
        return self.out - self.stale

    @property
    def unsent(self) -> int:
        """Prefill rows not yet planned into any wave."""
        return len(self.job.prompt) + self.replayed - self.sent

    def tokens_held(self) -> list[int]:
        """The tokens whose rows every stage holds for this sequence, in position order."""
        return (self.job.prompt + self.generated)[: self.held]


def _asked(job: Job) -> int:
    """The alternatives a step asks a head on a member for, or NO_LOGPROBS."""
    return NO_LOGPROBS if job.logprobs is None else job.logprobs


def _row_by_row(job: Job) -> bool:
    """Whether a request's drafted rows go one row a decode at every stage (`EngineStep.row_by_row`):
    where its sampler picks a token as a function of the row (temperature 0, penalties and
    grammars included), so that its text is exactly the one decoding without drafts gives, where
    llama.cpp's product of several rows rounds otherwise than its product of one. A sampled
    request's rule is a distribution, which rounding does not break: its rows go together, one
    decode for k + 1 rows where a GPU takes them in about the time of one."""
    return job.sampling.temperature == 0.0


def _job_of(waiting: Job | Suspended) -> Job:
    return waiting.job if isinstance(waiting, Suspended) else waiting


class Batcher:
    def __init__(
        self,
        concurrency: int,
        batch_rows: int,
        context_per_sequence: int,
        make_sampler: Callable[[SamplingSettings], TokenSampler],
        piece: Callable[[int], bytes],
        is_end: Callable[[int], bool],
        prefix_cut: PrefixCut = PrefixCut.ANYWHERE,
        speculate: Speculate = Speculate.OFF,
        speculation_refused: str | None = None,
        every_row_whole: bool = True,
        prefill_chunks: int = 1,
        chunk_rows: Callable[[int], int] | None = None,
        make_drafter: Callable[[int, list[int], SamplingSettings], Drafter] | None = None,
        draft_together: Callable[[Sequence[tuple[Drafter, int]]], list[list[int]]] | None = None,
        draft_waves: int = 1,
    ) -> None:
        """`speculate`: what to draft with; `speculation_refused`: why the engine cannot check
        drafts (`Engine.speculation_refused`), None where it can; `every_row_whole`: whether it
        answers drafted rows whole, or with each row's largest logits only (`Engine.every_row_whole`);
        `prefill_chunks`: how many chunks of one prompt may be out in waves at once (1: one wave
        at a time, no pipelined prefill); `chunk_rows`: with pipelined prefill, the length of a
        prompt's chunks for the rows it has to prefill (the cost model's,
        `planner.prefill.prefill_chunk_rows`); None: as many as a wave has room for;
        `make_drafter`: a drafter on the draft model for a request admitted to a slot with its
        tokens and settings (`DraftModel.drafter`), which `Speculate.DRAFT` needs; `draft_together`:
        its drafters' drafts for a wave at once (`DraftModel.draft_many`); `draft_waves`: how many
        waves of one sequence's drafts may be out at once (drafts in flight; 1: one, as on an
        engine that runs a wave only as it lands), none behind until the ring's measured costs
        (`ring_costs`) price it."""
        if concurrency < 1 or batch_rows < concurrency:
            raise ValueError(f"a step of {batch_rows} rows cannot serve {concurrency} sequences")
        if prefill_chunks < 1:
            raise ValueError(f"at least one chunk of a prompt must be allowed in flight, not {prefill_chunks}")
        self.prefill_chunks = prefill_chunks
        # Drafts in flight only where the cache holds every position a cut back may need: a KV
        # cache, full or windowed (a stage's windowed cache keeps its cells until a cut drops
        # them, `LlamaModel.keeps_window_cells`, so a wave behind drafts takes none a reject
        # ahead of it needs again); not a recurrent state, which is never drafted.
        self.draft_waves = max(1, draft_waves) if prefix_cut is not PrefixCut.NOWHERE else 1
        # What the ring's stages and wire cost (planner/waves.py), from the stages' reports: what a
        # wave behind may take of the ring unseen (`idle_behind_ms`), as the engine loop sets them.
        # None: not measured, so no wave goes behind.
        self.ring_costs: WaveCosts | None = None
        self._behind_steps: set[int] = set()  # the steps out that went behind a wave of their sequence (by id)
        self.last_wave_plain = True  # whether the wave landed last was one trip of its own: no wave behind, none stale
        self._chunk_rows = chunk_rows if prefill_chunks > 1 else None
        self.last_chunk_rows: int | None = None  # the chunk length chosen for the last prompt admitted
        self.most_chunks_out = 0  # the most chunks of one prompt seen out at once, over the batcher's life
        self.concurrency, self.batch_rows, self.context = concurrency, batch_rows, context_per_sequence
        self._make_sampler, self._piece, self._is_end = make_sampler, piece, is_end
        self.prefix_cut = prefix_cut
        self._queue: deque[Job | Suspended] = deque()
        self._active: dict[str, _Sequence] = {}
        self._free_slots = list(range(concurrency))  # least recently used first
        self._held: dict[int, list[int]] = {}  # free slot → the tokens its cache holds on every stage
        self._to_trim: list[Trim] = []
        self._waves: deque[list[tuple[_Sequence, EngineStep, bool]]] = deque()  # planned, not landed, oldest first
        # why no sequence drafts, or None
        self.speculation_off = _speculation_off(speculate, speculation_refused, prefix_cut, make_drafter)
        self._make_drafter = make_drafter if speculate is Speculate.DRAFT else None
        self._draft_together = draft_together if self._make_drafter is not None else None
        self.every_row_whole = every_row_whole
        self.speculation = SpeculationStats()
        self.trip_clock = TripClock()  # what a wave and a drafted row cost on this ring (the cost rule)
        self.tokens_generated = 0  # tokens sampled, over the batcher's life (several per trip where drafts are kept)

    # --- requests in and out ----------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if not job.prompt:
            raise ValueError("the prompt is empty")
        if len(job.prompt) >= self.context:
            raise ValueError(f"the prompt has {len(job.prompt)} tokens; the context holds {self.context}")
        self._queue.append(job)

    def cancel(self, request_id: str) -> bool:
        """Drop a request, queued or running; its slot is free again, with what its cache holds."""
        for waiting in self._queue:
            if _job_of(waiting).request_id == request_id:
                self._queue.remove(waiting)
                if isinstance(waiting, Suspended) and waiting.sampler is not None:
                    waiting.sampler.close()
                return True
        sequence = self._active.pop(request_id, None)
        if sequence is None:
            return False
        self._release(sequence)
        return True

    def fail_all(self, message: str) -> list[RequestEvent]:
        """The engine broke: every running and queued request ends with `message`."""
        events: list[RequestEvent] = [RequestFailed(s.job.request_id, message) for s in self._active.values()]
        events += [RequestFailed(_job_of(waiting).request_id, message) for waiting in self._queue]
        for waiting in self._queue:
            if isinstance(waiting, Suspended) and waiting.sampler is not None:
                waiting.sampler.close()
        for sequence in list(self._active.values()):
            sequence.sampler.close()
            if sequence.drafter is not None:
                sequence.drafter.close()
        self._active.clear()
        self._queue.clear()
        self._waves.clear()
        self._behind_steps.clear()
        self._free_slots = list(range(self.concurrency))
        self._held.clear()  # the ring that held those caches is gone
        self._to_trim.clear()
        return events

    def suspend_all(self, message: str) -> tuple[list[Suspended], list[RequestEvent]]:
        """The ring broke: every request is kept to go on on the next ring (`resume`), in the order
        they came, but one whose sampler ran on the lost ring (a head on a member sampling it),
        which ends with `message` and the reason. The batcher is left empty, as `fail_all` leaves it."""
        kept: list[Suspended] = []
        events: list[RequestEvent] = []
        for sequence in self._active.values():
            if not sequence.generated:  # nothing drawn yet: it starts again as it came
                sequence.sampler.close()
                kept.append(Suspended(sequence.job))
            elif sequence.sampler.portable:
                job, sampler, text = sequence.job, sequence.sampler, sequence.text
                kept.append(Suspended(job, sampler, text, sequence.generated, sequence.cached, sequence.logprobs))
            else:
                sequence.sampler.close()
                why = "its sampler ran on the member that holds the head, whose state is gone with the ring"
                events.append(RequestFailed(sequence.job.request_id, f"{message}; {why}"))
        for sequence in self._active.values():
            if sequence.drafter is not None:  # the next ring's admission makes another
                sequence.drafter.close()
        kept += [w if isinstance(w, Suspended) else Suspended(w) for w in self._queue]
        self._active.clear()
        self._queue.clear()
        self._waves.clear()
        self._behind_steps.clear()
        self._free_slots = list(range(self.concurrency))
        self._held.clear()
        self._to_trim.clear()
        return kept, events

    def resume(self, suspended: Suspended) -> None:
        """Take a request another ring lost back, ahead of those that came later: it prefills its
        prompt and what it had generated, then samples on with its own sampler."""
        self._queue.appendleft(suspended)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def idle(self) -> bool:
        return not self._queue and not self._active

    @property
    def trimming(self) -> bool:
        """Whether admitted requests wait for the engine to cut their slots' caches."""
        return bool(self._to_trim)

    def drafters(self) -> list[Drafter]:
        """The running sequences' drafters (a draft model catches them up while a wave is out)."""
        return [sequence.drafter for sequence in self._active.values() if sequence.drafter is not None]

    def take_trims(self) -> list[Trim]:
        """Caches the engine must cut, in this order, before the next step: the requests admitted
        to those slots run from then on."""
        trims, self._to_trim = self._to_trim, []
        for sequence in self._active.values():
            sequence.trimmed = True
        return trims

    def _reusable(self, held: list[int], prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens a slot holding `held` can keep: their common
        prefix, short of the prompt's last token (whose logits the request needs), where the
        engine's cache can be cut at all and the prefix is more than a BOS (`MIN_REUSED`)."""
        if self.prefix_cut is PrefixCut.NOWHERE:
            return 0
        common = 0
        for a, b in zip(held, prompt[:-1], strict=False):
            if a != b:
                break
            common += 1
        return common if common >= MIN_REUSED else 0

    def _slot_for(self, prompt: list[int]) -> int:
        """The free slot whose cache holds most of `prompt`, where reusing it keeps at least as
        much of that cache as it throws away (a chat's next turn, a shared system prompt); else
        the least recently used one, so that a prompt sharing little (only its BOS, say) does not
        evict a cache another request will come back to."""
        best, best_reused = self._free_slots[0], 0
        for slot in self._free_slots:
            held = self._held.get(slot) or []
            reused = self._reusable(held, prompt)
            if reused > best_reused and 2 * reused >= len(held):
                best, best_reused = slot, reused
        return best

    def _admit(self, waiting: Job | Suspended) -> None:
        """Start a request in the slot `_slot_for` picks, once the engine has cut that slot's
        cache after what it keeps; a resumed one with its own sampler and text."""
        job = _job_of(waiting)
        resumed = waiting if isinstance(waiting, Suspended) and waiting.sampler is not None else None
        rows = job.prompt + (resumed.generated if resumed else [])
        slot = self._slot_for(rows)
        self._free_slots.remove(slot)
        held = self._held.pop(slot, None)  # None: a slot that never held anything needs no cut
        keep = 0 if held is None else self._reusable(held, rows)
        if held is not None:
            self._to_trim.append(Trim(slot, keep))
        if resumed is not None and resumed.text is not None:
            assert resumed.sampler is not None
            sequence = _Sequence(
                job, slot, resumed.sampler, resumed.text, fed=keep, sent=keep, generated=resumed.generated,
                cached=resumed.cached, held=keep, trimmed=held is None, replayed=len(resumed.generated),
                logprobs=resumed.logprobs,
            )  # fmt: skip
        else:
            sampler = self._make_sampler(job.sampling)
            sampler.accept(job.prompt)
            sequence = _Sequence(
                job, slot, sampler, StopAwareText(job.stop), fed=keep, sent=keep, cached=keep, held=keep,
                trimmed=held is None,
            )  # fmt: skip
        if self.speculation_off is None:
            make = self._make_drafter
            sequence.drafter = make(slot, rows, job.sampling) if make is not None else NgramDrafter(rows)
        if self._chunk_rows is not None and sequence.unsent > 0:
            sequence.chunk = self.last_chunk_rows = max(1, self._chunk_rows(sequence.unsent))
        self._active[job.request_id] = sequence

    # --- the step ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Waves planned and not landed yet."""
        return len(self._waves)

    @property
    def pipelining(self) -> bool:
        """Whether a prompt has chunks out round the ring and more to send: letting the ring empty
        now would stall its pipeline, every stage idle while it refills."""
        return any(s.out > 0 and s.unsent > 0 for s in self._active.values())

    def plan(self, waves: int = 1, ahead_only: bool = False) -> list[EngineStep]:
        """The next wave: admit what fits, then one row per generating sequence and prompt chunks in the rest.

        Sequences with no rows in flight take part, at most 1/`waves` of the running ones
        (rounded up), so that on a ring of several stages the running requests split into
        `waves` waves that follow one another round it and keep every stage busy. With pipelined
        prefill, a prompt already out in fewer than `prefill_chunks` waves, and not whole, sends
        its next chunk too, in the rows those leave. An empty wave is not recorded.

        `ahead_only`: a wave beyond the `waves` the running requests split into, for drafts in
        flight alone (`drafting_ahead`): waves behind sequences' own, and the next wave of each
        sequence whose waves out are all stale; nothing admitted, no prompt chunk.
        """
        while self._queue and self._free_slots and not ahead_only:
            self._admit(self._queue.popleft())
        share = math.ceil(len(self._active) / max(1, waves))  # this wave's part of the running requests
        if ahead_only:
            ready = [s for s in self._active.values() if s.stale and not s.live and s.trimmed and not s.prefilling]
        else:
            ready = [s for s in self._active.values() if not s.live and s.trimmed][:share]
            ready += [s for s in self._active.values() if s.in_flight and s.trimmed and self._sends_more(s)]
        planned: list[tuple[_Sequence, EngineStep, bool]] = []
        budget = self.batch_rows
        decoding = [s for s in ready if not s.prefilling]
        budget -= len(decoding)
        drafts = self._drafts(decoding, min(budget, DRAFT_ROWS_PER_WAVE))
        for sequence, drafted in zip(decoding, drafts, strict=True):
            token = sequence.generated[-1]
            top = sequence.job.sampling.top_logits
            step = EngineStep(
                sequence.slot, sequence.position, [token, *drafted], decode=True, top=top,
                logprobs=_asked(sequence.job), every_row=bool(drafted),
                row_by_row=bool(drafted) and _row_by_row(sequence.job),
            )  # fmt: skip
            planned.append((sequence, step, True))
            budget -= len(drafted)
            sequence.guesses_out, sequence.end = list(drafted), sequence.position + len(step.tokens)
        for sequence in self._active.values():
            guesses = self._behind(sequence, budget)
            if guesses:
                step = EngineStep(
                    sequence.slot, sequence.end, guesses, decode=True, top=sequence.job.sampling.top_logits,
                    logprobs=_asked(sequence.job), every_row=True, row_by_row=_row_by_row(sequence.job),
                )  # fmt: skip
                planned.append((sequence, step, True))
                self._behind_steps.add(id(step))
                budget -= len(guesses)
                sequence.guesses_out += guesses
                sequence.end += len(guesses)
                self.speculation.waves_behind += 1
        for sequence in ready:
            if sequence.unsent > 0 and budget > 0:
                prefill = sequence.prefill
                chunk = prefill[sequence.sent : sequence.sent + min(budget, sequence.chunk or budget)]
                ends = sequence.sent + len(chunk) == len(prefill)
                sampling = sequence.job.sampling
                start = None  # a head on a member samples a request that needs the whole row itself
                # (but a resumed one, whose sampler this host keeps, takes the whole row instead)
                if sequence.sent == sequence.cached and sampling.needs_whole_row and not sequence.replayed:
                    start = SamplerStart(settings=sampling, prompt=list(sequence.job.prompt))
                top = sampling.top_logits
                step = EngineStep(
                    sequence.slot, sequence.sent, chunk, False, logits=ends, top=top, sampler=start,
                    logprobs=_asked(sequence.job),
                )  # fmt: skip
                planned.append((sequence, step, ends))
                sequence.sent += len(chunk)
                budget -= len(chunk)
        if planned:
            self._waves.append(planned)
            for sequence, step, _ in planned:
                sequence.out += 1
                if not step.decode:
                    self.most_chunks_out = max(self.most_chunks_out, sequence.out)
        return [step for _, step, _ in planned]

    @property
    def drafting_ahead(self) -> bool:
        """Whether a sequence may send a wave while one of its own is out (drafts in flight): one
        whose live waves out are fewer than `draft_waves`, or one whose waves out are all stale,
        whose next wave goes at once, behind them."""
        if self.draft_waves < 2:
            return False
        return any(s.stale or 0 < s.live < self.draft_waves for s in self._active.values() if not s.prefilling)

    def _sends_more(self, sequence: _Sequence) -> bool:
        """Whether a prompt already out in a wave sends its next chunk too (pipelined prefill): it
        is out in fewer waves than `prefill_chunks`, with rows left to send."""
        return sequence.unsent > 0 and sequence.out < self.prefill_chunks

    def advance(self, logits: Sequence[StepResult]) -> list[RequestEvent]:
        """Land the oldest wave: sample from its logits; return the text it released and the requests it ended.

        A sequence that a stage refused (`SequenceFailed`) ends its request with the stage's
        reason and gives up its slot; the others carry on.
        """
        planned = self._waves[0] if self._waves else []
        if len(logits) != len(planned):
            raise ValueError(f"{len(logits)} results for a wave of {len(planned)} sequences")
        if self._waves:
            self._waves.popleft()
        events: list[RequestEvent] = []
        self.last_wave_plain = True
        for (sequence, step, wanted), row in zip(planned, logits, strict=True):
            sequence.out -= 1
            if id(step) in self._behind_steps:
                self._behind_steps.discard(id(step))
                self.last_wave_plain = False
            if self._active.get(sequence.job.request_id) is not sequence:
                continue  # cancelled while the step ran
            if step.decode and sequence.stale:
                sequence.stale -= 1
                self.last_wave_plain = False
                continue  # behind a reject: cut with the rejected rows, its answer unread (cancelled on a ring)
            if isinstance(row, SequenceFailed):
                events.append(self._fail(sequence, f"this request failed: {row.message}"))
                continue
            if step.every_row:
                if not isinstance(row, EveryRowLogits) or row.rows.shape[0] != len(step.tokens):
                    raise ValueError(f"the engine did not answer every row of sequence {step.sequence_id}'s drafts")
                events += self._verify(sequence, step, row)
                continue
            if not step.decode:
                sequence.fed += len(step.tokens)
            sequence.held += len(step.tokens)
            if not wanted:
                continue
            if row is None or isinstance(row, EveryRowLogits):
                raise ValueError(f"the engine returned no logits for sequence {step.sequence_id}")
            token = sequence.sampler.sample(row.logits if isinstance(row, HeadRow) else row)
            if sequence.shadow is not None and step.decode:
                sequence.window.shadowed(token == sequence.shadow)
            sequence.shadow = None
            alternatives = sequence.job.logprobs
            if alternatives is not None and not self._is_end(token):
                sequence.logprobs.append(token_logprob(row, token, alternatives, self._piece))
            events += self._next_token(sequence, token)
        return events

    def _drafts(self, decoding: Sequence[_Sequence], rows: int) -> list[list[int]]:
        """Each decoding sequence's drafts for this wave, `rows` of them at most in all, shared
        fairly (`draft_shares`); none where speculation is off or a sequence's window rests. A
        sequence is never drafted past its max_tokens or its context."""
        if self.speculation_off is not None:
            return [[] for _ in decoding]
        rooms: list[int] = []
        for sequence in decoding:
            if self._drafts_refused(sequence.job) is not None:
                rooms.append(0)
                continue
            guesses = sequence.drafter is not None and sequence.drafter.guesses_free
            room = min(
                self._paying(sequence.window, len(decoding), guesses),
                sequence.job.max_tokens - len(sequence.generated) - 1,
                self.context - sequence.position - 1,
                MAX_DRAFT,
            )
            rooms.append(room)
        if self._draft_together is not None:  # a draft model: as many as asked, so share the rows first
            proposed = self._draft_all(decoding, draft_shares(rooms, max(0, rows)))
        else:
            proposed = [self._draft(sequence, room) for sequence, room in zip(decoding, rooms, strict=True)]
        shares = draft_shares([len(p) for p in proposed], max(0, rows))
        drafts = [p[:share] for p, share in zip(proposed, shares, strict=True)]
        for sequence, drafted in zip(decoding, drafts, strict=True):
            drawn_from = sequence.drafter.drawn_from if sequence.drafter is not None and drafted else None
            sequence.drawn_from = drawn_from[: len(drafted)] if drawn_from is not None else None
            sequence.drafted_trips = self._added_trips(len(drafted), len(decoding))
            sequence.shadow = None
            if not drafted:
                sequence.window.skip()
                sequence.shadow = self._guess(sequence)
        return drafts

    def _behind(self, sequence: _Sequence, rows: int) -> list[int]:
        """The rows of a wave behind the sequence's waves out (drafts in flight), at most `rows`:
        the n-gram continuation past the guesses out, as many of its tokens as pay
        (`draft_cost.rows_behind`). None unless it has live waves out, fewer than `draft_waves`,
        the first of them with drafts; none before the ring's rows and its stages' costs
        (`ring_costs`) are measured, where the lookup no longer continues the guesses
        out, or on a ring of one stage (`idle_behind_ms`: a wave behind would only wait there).
        The rows' time is priced less what the ring idles while the waves out travel: across
        homes most of a trip, on loopback none. Only n-gram drafts, whose guesses are free: a
        draft model's are decodes on the host before the wave leaves, and keeping a sampled
        request's drafts from it needs their q rows (`drawn_from`), one set out at a time."""
        drafter, cost = sequence.drafter, self.trip_clock.cost
        if (
            not 0 < sequence.live < self.draft_waves or sequence.prefilling or not sequence.trimmed
            or not sequence.guesses_out or drafter is None or not drafter.guesses_free or cost is None or cost.stale
            or self.speculation_off is not None or self._drafts_refused(sequence.job) is not None
        ):  # fmt: skip
            return []
        out = len(sequence.guesses_out)
        room = min(
            rows,
            MAX_DRAFT + 1,
            sequence.job.max_tokens - len(sequence.generated) - (sequence.end - sequence.position),
            self.context - sequence.end - 1,
        )
        if room <= 0 or self.ring_costs is None:
            return []
        rows_out = [len(step.tokens) for wave in self._waves for s, step, _ in wave if s is sequence and step.decode]
        idle_ms = idle_behind_ms(self.ring_costs, rows_out, _row_by_row(sequence.job))
        if idle_ms is None:
            return []
        continuation = drafter.draft(out + room)
        if continuation[:out] != sequence.guesses_out:
            return []
        guesses = continuation[out:]
        return guesses[: rows_behind(sequence.window.accept.rate, out, len(guesses), cost, MAX_DRAFT, idle_ms)]

    def _guess(self, sequence: _Sequence) -> int | None:
        """The token its drafter would have drafted first, for a sequence that sends none on this
        wave though its request could draft, where the drafter guesses for free (an n-gram lookup):
        checked when its token lands."""
        drafter = sequence.drafter
        if drafter is None or not drafter.guesses_free or self._drafts_refused(sequence.job) is not None:
            return None
        guess = drafter.draft(1)
        return guess[0] if guess else None

    def _draft_all(self, decoding: Sequence[_Sequence], limits: Sequence[int]) -> list[list[int]]:
        """The drafts of every sequence of a wave from the draft model at once (each round of
        drafted tokens one decode); none for the wave where it failed to run."""
        proposed: list[list[int]] = [[] for _ in decoding]
        asked: list[tuple[int, Drafter, int]] = []
        for index, (sequence, limit) in enumerate(zip(decoding, limits, strict=True)):
            if sequence.drafter is not None and limit > 0:
                asked.append((index, sequence.drafter, limit))
        if not asked or self._draft_together is None:
            return proposed
        try:
            drafted = self._draft_together([(drafter, limit) for _, drafter, limit in asked])
        except (RuntimeError, ValueError):
            return proposed
        for (index, _, _), tokens in zip(asked, drafted, strict=True):
            proposed[index] = tokens
        return proposed

    @staticmethod
    def _draft(sequence: _Sequence, room: int) -> list[int]:
        """The sequence's drafter's proposal: none where it has no drafter, or where a draft
        model failed to run (a draft is a guess: the request goes on without one)."""
        if sequence.drafter is None or room <= 0:
            return []
        try:
            return sequence.drafter.draft(room)
        except (RuntimeError, ValueError):
            return []

    def _drafts_refused(self, job: Job) -> str | None:
        """Why this request drafts nothing on this engine, where one request's features rule drafts out."""
        if self.every_row_whole:
            return None
        # A head on a member answers drafted rows with each row's largest logits (a ROWS frame):
        if job.sampling.needs_whole_row:
            return "its sampler needs whole rows, which the head on a member samples itself, one row a trip"
        return None

    def _paying(self, window: DraftWindow, sharing: int, guesses: bool = True) -> int:
        """The drafts `window` allows, but no more than pay on this ring once its waves have been
        timed (`draft_cost.best_window`, the sequence's accept rate against the measured trip,
        drafted rows and, with a draft model, its decodes; `sharing`: the sequences of the wave
        its rows would delay). A draft model's decodes, measured from its first draft on, are
        weighed before the ring's rows are, against the quickest wave yet (no shorter than a trip),
        and a measure of them trusted less while nothing drafted is tried again with one draft.
        Only drafts the sequence can afford to lose are weighed (`DraftLedger`): what its drafts
        may lose it, net of the trips they saved, is bounded whatever its accept rate says.
        `guesses`: whether the sequence's drafter guesses for free while it drafts nothing (n-gram
        lookups, `_guess`), so that a cost shrunk while nothing drafted waits for their evidence;
        a draft model's guess costs a decode, so its sequences try one draft on hope instead (else
        one dear measure, a prompt's catch-up or a busy moment, would stop its drafts for good)."""
        clock, cost = self.trip_clock, self.trip_clock.cost
        if window.allowed == 0 or (cost is None and not (clock.drafts and clock.waves)):
            return window.allowed
        shrunk = clock.draft_stale or (cost is not None and cost.stale)
        if shrunk and guesses and window.accept.seen < MIN_EVIDENCE:
            return 0  # a cost shrunk while nothing drafted is tried again on evidence, not on hope
        # A sequence's first drafts on hope alone: one; on its free guesses' evidence, its window
        # (where carrying drafts at all costs about a trip, one draft never pays and a copy's
        # guesses that land would otherwise wait for a stale measure to draft at all).
        limit = window.allowed if window.trips or window.accept.seen >= MIN_EVIDENCE else 1
        if clock.draft_stale:
            limit = min(limit, 1)  # its first draft measures the decode afresh
        afford = window.ledger.affordable * (1 + 1e-9)  # in trips; what its drafts may still lose it
        if shrunk and window.accept.seen < MIN_EVIDENCE:
            # On hope, one draft, and only where the sequence could lose it at the draft's decode
            # as last measured, not as shrunk: a draft model that costs a trip is tried again once
            # an answer, not every time the shrinking measure dips below what pays.
            trip_ms = cost.trip_ms if cost is not None else clock.quickest_ms
            row_ms = max(0.0, cost.drafted_ms(1)) * sharing if cost is not None else 0.0
            if afford * trip_ms < row_ms + clock.draft_measured_ms:
                return 0
            limit = min(limit, 1)
        rate = window.accept.rate
        if cost is None:
            trip_ms = clock.quickest_ms
            return best_window(rate, trip_ms, 0.0, limit, sharing, draft_ms=clock.draft_ms, afford_ms=afford * trip_ms)
        return best_window(
            rate, cost.trip_ms, cost.row_ms, limit, sharing, cost.drafted_ms, cost.draft_ms, afford * cost.trip_ms
        )

    def _added_trips(self, drafts: int, sharing: int) -> float:
        """What a sequence's `drafts` drafts add to a wave of `sharing` sequences, in trips, as the
        cost rule prices them: before the ring's rows are measured, a draft model's decodes alone
        against the quickest wave yet (0 for n-gram drafts, and before any wave has landed)."""
        clock = self.trip_clock
        if clock.cost is not None:
            return clock.cost.added_trips(drafts, sharing)
        return max(0, drafts) * clock.draft_ms / clock.quickest_ms if clock.waves else 0.0

    def _verify(self, sequence: _Sequence, step: EngineStep, row: EveryRowLogits) -> list[RequestEvent]:
        """Land a token and its drafts: sample each row in turn, as decoding without drafts would
        sample successive trips' rows, keeping drafts while each equals the token sampled before
        it; the first token that differs (or the one after the last draft) is emitted too. The
        rows of rejected drafts are cut on every stage before the sequence's next wave.

        Drafts drawn from a draft model's distribution q (a sampled request: `drawn_from`) are
        kept by speculative sampling's rule instead (`speculative_pick`), its uniform draws a
        function of the request's seed and the position. A draft that is a point mass (n-gram,
        or a greedy draft model's) needs no rule of its own: drawing from p and keeping the
        draft iff the draw equals it is min(1, p/q) with q = 1, and a draw that differs is the
        residual's."""
        drafts = step.tokens[1:]
        sequence.guesses_out = sequence.guesses_out[len(drafts) :]  # those behind this wave's, if any
        drawn_from, sequence.drawn_from = sequence.drawn_from, None
        accepted = 0
        events: list[RequestEvent] = []
        sequence.held += 1  # the last token's row
        alternatives = sequence.job.logprobs
        for index, logits in enumerate(row.rows):
            token = self._pick(sequence, logits, drafts, drawn_from, index, step.position + index + 1)
            if alternatives is not None and not self._is_end(token):
                sequence.logprobs.append(token_logprob(row.for_logprobs(index), token, alternatives, self._piece))
            events += self._next_token(sequence, token)
            if self._active.get(sequence.job.request_id) is not sequence:
                break  # it ended: its slot's cache is cut by whoever takes the slot next
            if index < len(drafts) and token == drafts[index]:
                accepted += 1
                sequence.held += 1  # the draft's row holds the token just emitted
                continue
            break
        sequence.window.landed(len(drafts), accepted, sequence.drafted_trips)
        sequence.drafted_trips = 0.0  # a wave behind this one added rows to the ring's work, not to a trip
        self.speculation.record(len(drafts), accepted)
        if self._active.get(sequence.job.request_id) is not sequence:
            return events
        behind = sequence.guesses_out
        if accepted < len(drafts) or (behind and behind[0] != sequence.generated[-1]):
            self._to_trim.append(Trim(sequence.slot, sequence.position))
            sequence.trimmed = False
            sequence.stale, sequence.guesses_out = sequence.out, []  # the waves behind it guessed otherwise
            self.speculation.waves_stale += sequence.out
        elif behind:
            sequence.guesses_out = behind[1:]  # the wave behind fed the token this one brought
        return events

    @staticmethod
    def _pick(
        sequence: _Sequence,
        logits: npt.NDArray[np.float32],
        drafts: Sequence[int],
        drawn_from: npt.NDArray[np.float64] | None,
        index: int,
        position: int,
    ) -> int:
        """The token row `index` of a drafted step gives (at `position`): the sampler's draw, or
        where that row's draft was drawn from q, speculative sampling's pick between it and the
        residual."""
        if drawn_from is None or index >= len(drafts) or index >= len(drawn_from):
            return sequence.sampler.sample(logits)
        target = sequence.sampler.distribution(logits)
        if target is None:  # a sampler whose p this host cannot know (a head on a member draws)
            return sequence.sampler.sample(logits)
        seed = sequence.job.sampling.seed
        draw = (uniform(seed, position, ACCEPT_DRAW), uniform(seed, position, RESIDUAL_DRAW))
        token, _ = speculative_pick(target, drawn_from[index], drafts[index], *draw)
        sequence.sampler.accept((token,))
        return token

    def _next_token(self, sequence: _Sequence, token: int) -> list[RequestEvent]:
        self.tokens_generated += 1
        if self._is_end(token):
            return self._finish(sequence, FinishReason.STOP, [])
        sequence.generated.append(token)
        if sequence.drafter is not None:
            sequence.drafter.extend((token,))
        update = sequence.text.feed(self._piece(token))
        events: list[RequestEvent] = [self._delta(sequence, update.delta)] if update.delta else []
        if update.stopped:
            return self._finish(sequence, FinishReason.STOP, events)
        if len(sequence.generated) >= sequence.job.max_tokens or sequence.position >= self.context:
            return self._finish(sequence, FinishReason.LENGTH, events)
        return events

    def _finish(self, sequence: _Sequence, reason: FinishReason, events: list[RequestEvent]) -> list[RequestEvent]:
        rest = sequence.text.flush()
        if rest or sequence.logprobs:
            events.append(self._delta(sequence, rest))
        del self._active[sequence.job.request_id]
        self._release(sequence)
        prompt, generated = len(sequence.job.prompt), len(sequence.generated)
        stop = sequence.text.matched
        events.append(Finished(sequence.job.request_id, reason, prompt, generated, sequence.cached, stop))
        return events

    @staticmethod
    def _delta(sequence: _Sequence, text: str) -> TextDelta:
        logprobs, sequence.logprobs = tuple(sequence.logprobs), []
        return TextDelta(sequence.job.request_id, text, logprobs)

    def _fail(self, sequence: _Sequence, message: str) -> RequestFailed:
        del self._active[sequence.job.request_id]
        self._release(sequence, kept=False)  # the stages' caches of it may disagree: none is reused
        return RequestFailed(sequence.job.request_id, message, "stage_error")

    def _release(self, sequence: _Sequence, kept: bool = True) -> None:
        """Free the slot, remembering what its cache holds for a later request to reuse (rows
        still out in a wave land after it and are cut off with what the next request does not keep)."""
        sequence.sampler.close()
        if sequence.drafter is not None:
            sequence.drafter.close()
        self._held[sequence.slot] = sequence.tokens_held() if kept and sequence.trimmed else []
        self._free_slots.append(sequence.slot)


def _speculation_off(
    speculate: Speculate, refused: str | None, prefix_cut: PrefixCut, make_drafter: object = None
) -> str | None:
    """Why no sequence drafts, or None where they may."""
    if speculate is Speculate.OFF:
        return "speculation is off (--speculate off)"
    if speculate is Speculate.DRAFT and make_drafter is None:
        return "no draft model is loaded (--draft MODEL)"
    if refused is not None:
        return f"the engine cannot check drafts: {refused}"
    if prefix_cut is PrefixCut.NOWHERE:
        return "the model keeps a recurrent state, which cannot be cut back to drop rejected drafts"
    return None
