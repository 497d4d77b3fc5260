"""Continuous batching: which rows of which requests go into the next engine step.

Every step carries one row for each sequence that is generating, and spends what is left of
the batch on prompt chunks of newly admitted requests, so a long prompt neither stalls the
others nor waits for them to finish. Requests beyond the concurrency limit queue in order.
Each admitted request holds one KV slot (a llama.cpp sequence id) until it ends.

Steps go out in waves. On a ring of n stages one wave keeps one stage busy at a time, so the
engine loop keeps up to n waves in flight, each with a share of the running requests: while
one wave is at the second stage the next is at the first. A sequence is in at most one wave
at a time (its next row needs its last token), and waves land in the order they left.

Pure: the engine and the samplers are passed in as callables, and nothing here blocks, so the
whole policy is testable without a model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kafila.runtime.pipeline import EngineStep, SequenceFailed, StepResult
from kafila.runtime.sampling import SamplerStart, SamplingSettings, TokenSampler
from kafila.runtime.text import StopAwareText


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


@dataclass(frozen=True)
class TextDelta:
    request_id: str
    text: str


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    request_id: str
    message: str
    code: str = "ring_failed"  # the API's error code: the whole ring, or "stage_error" for this request alone


Event = TextDelta | Finished | Failed


@dataclass
class _Sequence:
    job: Job
    slot: int
    sampler: TokenSampler
    text: StopAwareText
    fed: int = 0  # prompt tokens already in the KV cache
    generated: list[int] = field(default_factory=list)
    in_flight: bool = False  # its rows are out in a wave that has not landed yet

    @property
    def position(self) -> int:
        """Where the next row goes: after the prompt rows fed and the generated tokens fed back."""
        return self.fed + max(0, len(self.generated) - 1)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.prompt)


class Batcher:
    def __init__(
        self,
        concurrency: int,
        batch_rows: int,
        context_per_sequence: int,
        make_sampler: Callable[[SamplingSettings], TokenSampler],
        piece: Callable[[int], bytes],
        is_end: Callable[[int], bool],
    ) -> None:
        if concurrency < 1 or batch_rows < concurrency:
            raise ValueError(f"a step of {batch_rows} rows cannot serve {concurrency} sequences")
        self.concurrency, self.batch_rows, self.context = concurrency, batch_rows, context_per_sequence
        self._make_sampler, self._piece, self._is_end = make_sampler, piece, is_end
        self._queue: deque[Job] = deque()
        self._active: dict[str, _Sequence] = {}
        self._free_slots = list(range(concurrency - 1, -1, -1))
        self._to_forget: list[int] = []
        self._waves: deque[list[tuple[_Sequence, EngineStep, bool]]] = deque()  # planned, not landed, oldest first

    # --- requests in and out ----------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if not job.prompt:
            raise ValueError("the prompt is empty")
        if len(job.prompt) >= self.context:
            raise ValueError(f"the prompt has {len(job.prompt)} tokens; the context holds {self.context}")
        self._queue.append(job)

    def cancel(self, request_id: str) -> bool:
        """Drop a request, queued or running; its slot is forgotten before the next step."""
        for job in self._queue:
            if job.request_id == request_id:
                self._queue.remove(job)
                return True
        sequence = self._active.pop(request_id, None)
        if sequence is None:
            return False
        self._release(sequence)
        return True

    def fail_all(self, message: str) -> list[Event]:
        """The engine broke: every running and queued request ends with `message`."""
        events: list[Event] = [Failed(s.job.request_id, message) for s in self._active.values()]
        events += [Failed(job.request_id, message) for job in self._queue]
        for sequence in list(self._active.values()):
            sequence.sampler.close()
        self._active.clear()
        self._queue.clear()
        self._waves.clear()
        self._free_slots = list(range(self.concurrency - 1, -1, -1))
        self._to_forget.clear()
        return events

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
    def forgetting(self) -> bool:
        """Whether ended requests' slots wait to be forgotten by the engine."""
        return bool(self._to_forget)

    def take_forgotten(self) -> list[int]:
        """Slots whose KV cache the engine must drop before the next step."""
        slots, self._to_forget = self._to_forget, []
        self._free_slots += slots  # reusable only once the engine has been told to drop them
        return slots

    # --- the step ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Waves planned and not landed yet."""
        return len(self._waves)

    def plan(self, waves: int = 1) -> list[EngineStep]:
        """The next wave: admit what fits, then one row per generating sequence and prompt chunks in the rest.

        Only sequences with no rows in flight take part, at most 1/`waves` of the running ones
        (rounded up), so that on a ring of several stages the running requests split into
        `waves` waves that follow one another round it and keep every stage busy. An empty wave
        is not recorded.
        """
        while self._queue and self._free_slots:
            job = self._queue.popleft()
            sampler = self._make_sampler(job.sampling)
            sampler.accept(job.prompt)
            self._active[job.request_id] = _Sequence(job, self._free_slots.pop(), sampler, StopAwareText(job.stop))
        share = math.ceil(len(self._active) / max(1, waves))  # this wave's part of the running requests
        ready = [s for s in self._active.values() if not s.in_flight][:share]
        planned: list[tuple[_Sequence, EngineStep, bool]] = []
        budget = self.batch_rows
        for sequence in ready:
            if not sequence.prefilling:
                token = sequence.generated[-1]
                top = sequence.job.sampling.top_logits
                step = EngineStep(sequence.slot, sequence.position, [token], decode=True, top=top)
                planned.append((sequence, step, True))
                budget -= 1
        for sequence in ready:
            if sequence.prefilling and budget > 0:
                chunk = sequence.job.prompt[sequence.fed : sequence.fed + budget]
                ends = sequence.fed + len(chunk) == len(sequence.job.prompt)
                sampling = sequence.job.sampling
                start = None  # a head on a member samples a request that needs the whole row itself
                if sequence.fed == 0 and sampling.needs_whole_row:
                    start = SamplerStart(settings=sampling, prompt=list(sequence.job.prompt))
                top = sampling.top_logits
                step = EngineStep(sequence.slot, sequence.fed, chunk, False, logits=ends, top=top, sampler=start)
                planned.append((sequence, step, ends))
                budget -= len(chunk)
        if planned:
            self._waves.append(planned)
            for sequence, _, _ in planned:
                sequence.in_flight = True
        return [step for _, step, _ in planned]

    def advance(self, logits: Sequence[StepResult]) -> list[Event]:
        """Land the oldest wave: sample from its logits; return the text it released and the requests it ended.

        A sequence that a stage refused (`SequenceFailed`) ends its request with the stage's
        reason and gives up its slot; the others carry on.
        """
        planned = self._waves[0] if self._waves else []
        if len(logits) != len(planned):
            raise ValueError(f"{len(logits)} results for a wave of {len(planned)} sequences")
        if self._waves:
            self._waves.popleft()
        events: list[Event] = []
        for (sequence, step, wanted), row in zip(planned, logits, strict=True):
            sequence.in_flight = False
            if self._active.get(sequence.job.request_id) is not sequence:
                continue  # cancelled while the step ran
            if isinstance(row, SequenceFailed):
                events.append(self._fail(sequence, f"this request failed: {row.message}"))
                continue
            if not step.decode:
                sequence.fed += len(step.tokens)
            if not wanted:
                continue
            if row is None:
                raise ValueError(f"the engine returned no logits for sequence {step.sequence_id}")
            events += self._next_token(sequence, sequence.sampler.sample(row))
        return events

    def _next_token(self, sequence: _Sequence, token: int) -> list[Event]:
        request_id = sequence.job.request_id
        if self._is_end(token):
            return self._finish(sequence, FinishReason.STOP, [])
        sequence.generated.append(token)
        update = sequence.text.feed(self._piece(token))
        events: list[Event] = [TextDelta(request_id, update.delta)] if update.delta else []
        if update.stopped:
            return self._finish(sequence, FinishReason.STOP, events)
        if len(sequence.generated) >= sequence.job.max_tokens or sequence.position >= self.context:
            return self._finish(sequence, FinishReason.LENGTH, events)
        return events

    def _finish(self, sequence: _Sequence, reason: FinishReason, events: list[Event]) -> list[Event]:
        rest = sequence.text.flush()
        if rest:
            events.append(TextDelta(sequence.job.request_id, rest))
        del self._active[sequence.job.request_id]
        self._release(sequence)
        events.append(Finished(sequence.job.request_id, reason, len(sequence.job.prompt), len(sequence.generated)))
        return events

    def _fail(self, sequence: _Sequence, message: str) -> Failed:
        del self._active[sequence.job.request_id]
        self._release(sequence)  # forgotten everywhere before its slot is used again
        return Failed(sequence.job.request_id, message, "stage_error")

    def _release(self, sequence: _Sequence) -> None:
        sequence.sampler.close()
        self._to_forget.append(sequence.slot)
