"""The engine loop: one thread that owns the engine and steps every running request together.

llama.cpp contexts and the ring's sockets are not thread-safe, and each step blocks for
milliseconds, so one thread does all engine work while HTTP handlers live on the event loop.
Handlers submit jobs with a sink; the loop calls each sink from its thread, and the server
turns those calls into asyncio queue puts. When the engine fails (a stage dies, a link
breaks), every request in flight fails with the engine's message and the loop stops taking
work until it is given a new engine. When a stage refuses one sequence's rows (the engine
returns `SequenceFailed` for it), only that request fails; its slot is forgotten round the
ring and the others carry on, with `error` left unset: the ring is not broken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kafila.contracts import StageReport, StagesCover
from kafila.planner.prefill import PrefillCosts, costs_from, prefill_chunk_rows
from kafila.planner.waves import WaveCosts, decode_waves, one_row_costs, wave_costs_from
from kafila.runtime.engine.draft_cost import DRAFT_WAVES_OUT
from kafila.runtime.engine.draft_model import DraftModel
from kafila.runtime.engine.engines import Engine, EngineStep, Launched, SequenceFailed, StagesReport, StepResult
from kafila.runtime.engine.ring import StageFailed, waves_override
from kafila.runtime.engine.speculation import Drafter, Speculate
from kafila.serving.batcher import Batcher, Finished, Job, RequestEvent, RequestFailed, Suspended
from kafila.serving.settings import prefill_chunks_setting

log = logging.getLogger("kafila.engine_loop")

Sink = Callable[[RequestEvent], None]
STATS_REFRESH_S = 2.0
REPORT_LATE_S = 30.0  # the most a stage report waits for a pipelined prompt's chunks to be sent
REFUSALS_TO_BREAK = 8  # requests failed by stages in a row, none served between: the ring is broken
LANDED_KEPT = 256  # decode waves' landings kept between stage reports, to measure the period
MIN_PERIODS = 3  # periods seen at one count before they tell the host's own work a wave


def prefill_chunks_in_flight(depth: int) -> int:
    """How many chunks of one prompt may be out round the ring at once (pipelined prefill): one per
    wave the engine keeps in flight (`Engine.depth`), each chunk riding in a wave of its own, so on
    by default wherever a ring keeps several; KAFILA_PREFILL_CHUNKS overrides it (1: off)."""
    setting = prefill_chunks_setting(os.environ)
    return max(1, depth) if setting is None else setting


class EngineUnavailable(RuntimeError):
    """No engine can take work now: still starting, or broken and not yet replaced."""


RATE_WINDOW_S = 10.0  # /status and /metrics report tokens/s over this much recent time


@dataclass
class LoopStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    busy_s: float = 0.0
    finished: int = 0
    failed: int = 0
    # (time, tokens) per step within the last RATE_WINDOW_S. Pruned as steps are recorded, not
    # only when someone reads the rate: a server nobody polls would otherwise keep every step.
    recent_tokens: deque[tuple[float, int]] = field(default_factory=deque)
    _recent_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_step(self, now: float, tokens: int) -> None:
        with self._recent_lock:
            self.recent_tokens.append((now, tokens))
            self._forget_before(now - RATE_WINDOW_S)

    def tokens_per_s(self, now: float) -> float:
        with self._recent_lock:
            self._forget_before(now - RATE_WINDOW_S)
            if not self.recent_tokens:
                return 0.0
            span = max(now - self.recent_tokens[0][0], 1e-3)
            return sum(n for _, n in self.recent_tokens) / span

    def _forget_before(self, oldest: float) -> None:
        while self.recent_tokens and self.recent_tokens[0][0] < oldest:
            self.recent_tokens.popleft()


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        concurrency: int,
        batch_rows: int,
        context_per_sequence: int,
        speculate: Speculate = Speculate.OFF,
        prefill_chunks: int | None = None,
        draft_model: DraftModel | None = None,
    ) -> None:
        """`prefill_chunks`: chunks of one prompt out at once (`prefill_chunks_in_flight` where None);
        `draft_model`: what `Speculate.DRAFT` drafts with, on this machine (the engine thread
        alone runs it, while it plans a wave)."""
        self.engine = engine
        self.speculate = speculate
        self._draft_model = draft_model
        self.prefill_costs: PrefillCosts | None = None  # what the chunks of pipelined prefill are sized by
        self.ring_ms: float | None = None  # the last stage report's trip round the ring, one way
        self.wave_costs: WaveCosts | None = None  # what the decode waves in flight are counted by
        self.decode_waves = engine.depth  # the waves the running requests split into, while two or more run
        self._priced = waves_override() is None  # KAFILA_PIPELINE_WAVES fixes the count: engine.depth
        self._widest_measured = 0  # the largest decode every stage has timed (0: some stage has timed none)
        self._waves_used = engine.depth  # the last count `_waves_now` gave
        self._host_ms: float | None = None  # the host's own work a wave, as a period last showed it
        # Decode waves landed since the last report: (when, rows running, waves in flight).
        self._landed: deque[tuple[float, int, int]] = deque(maxlen=LANDED_KEPT)
        chunks = prefill_chunks_in_flight(engine.depth) if prefill_chunks is None else prefill_chunks
        out_at_once = self._chunks_out = max(1, min(chunks, engine.depth))
        self.batcher = Batcher(
            concurrency,
            batch_rows,
            context_per_sequence,
            make_sampler=engine.sampler,
            piece=engine.piece,
            is_end=engine.is_end,
            prefix_cut=engine.prefix_cut,
            speculate=speculate,
            speculation_refused=engine.speculation_refused,
            every_row_whole=engine.every_row_whole,
            prefill_chunks=chunks,
            chunk_rows=lambda rows: prefill_chunk_rows(rows, self.prefill_costs, out_at_once, batch_rows),
            make_drafter=draft_model.drafter if draft_model is not None else None,
            draft_together=self._draft_many if draft_model is not None else None,
            draft_waves=DRAFT_WAVES_OUT,  # each wave behind priced by the ring's measured idle (`ring_costs`)
        )
        self.stats = LoopStats()
        self.stage_report: list[StageReport] = []
        self.stages_cover: StagesCover | None = None  # what the loop had done when `stage_report` was taken
        self.error: str | None = None
        # Told from the engine thread when the loop breaks: a host replans at once. (Not when it
        # drains: a host that looked at once would take every instant between two requests for
        # a pause in the load, which its patience with newcomers is there to wait out.)
        self.on_break: Callable[[], None] = lambda: None
        self._sinks: dict[str, Sink] = {}
        self._suspended: list[tuple[Suspended, Sink]] = []  # what a broken ring left, for the next loop
        # A landed wave's events while the next wave is launched: delivered after it, or by `_break`
        # if the ring breaks first, before the requests move to wait for the next ring (their
        # tokens go with them, so their text must reach the clients here).
        self._undelivered: list[RequestEvent] = []
        self._lock = threading.Condition()
        self._stopping = False
        self._report_at = 0.0
        self._refusals = 0
        self._thread = threading.Thread(target=self._run, name="kafila-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _draft_many(self, asked: Sequence[tuple[Drafter, int]]) -> list[list[int]]:
        """A wave's drafts from the draft model (`DraftModel.draft_many`), timed for the cost rule
        (`TripClock.drafting`): they are made here, before the wave leaves. A prompt's catch-up is
        left out of the measure: it is paid once a request, and counted as a drafted token's
        decode it priced the first drafts of a 2,000-token prompt at hundreds of ms each."""
        draft = self._draft_model
        assert draft is not None, "drafted together only with a draft model"
        decodes, prompt_decodes, prompt_s = draft.decodes, draft.prompt_decodes, draft.prompt_s
        started = time.perf_counter()
        drafted = draft.draft_many(asked)
        elapsed = time.perf_counter() - started - (draft.prompt_s - prompt_s)
        if made := draft.decodes - decodes - (draft.prompt_decodes - prompt_decodes):
            self.batcher.trip_clock.drafting(made, max(0.0, elapsed))
        return drafted

    def _catch_drafts_up(self) -> None:
        """With a draft model, catch its caches up on the prompts just admitted while their
        prefill is out round the ring (`DraftModel.catch_up`), so that the draft's own prefill
        (seconds for a 2,000-token prompt on a loaded host) overlaps that trip instead of riding
        ahead of the first drafted wave. A failure leaves it to the drafts (a draft is a guess)."""
        if self._draft_model is None:
            return
        with self._lock:
            drafters = self.batcher.drafters()
        with contextlib.suppress(RuntimeError, ValueError):
            self._draft_model.catch_up(drafters)

    def submit(self, job: Job, sink: Sink) -> None:
        """Queue a job; raises ValueError for a prompt the batcher refuses, EngineUnavailable when broken."""
        with self._lock:
            if self.error is not None:
                raise EngineUnavailable(self.error)
            if self._stopping:
                raise EngineUnavailable("the host is shutting down")
            self.batcher.submit(job)
            self._sinks[job.request_id] = sink
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        """Stop a request: in flight, queued, or left by this loop's broken ring for the next."""
        with self._lock:
            self._sinks.pop(request_id, None)
            self.batcher.cancel(request_id)
            for suspended, sink in [held for held in self._suspended if held[0].job.request_id == request_id]:
                self._suspended.remove((suspended, sink))
                if suspended.sampler is not None:
                    suspended.sampler.close()
            self._lock.notify()

    @property
    def queued(self) -> int:
        return self.batcher.queued

    @property
    def running(self) -> int:
        return self.batcher.running

    def covered_report(self) -> tuple[list[StageReport], StagesCover | None]:
        """The stages' report and what it covers, read together: the engine thread replaces both."""
        with self._lock:
            return self.stage_report, self.stages_cover

    def halt(self) -> None:
        """Stop the engine thread; the requests it holds stay, for `suspend` or `stop`."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def suspend(self, reason: str) -> None:
        """After `halt`: the ring is known broken though the thread did not see it fail (the host
        heard first that a member's link went down), so its requests wait for the next ring, as
        they would had it failed under them."""
        if self.error is None:
            self._break(StageFailed(reason))

    def stop(self, message: str = "the host is shutting down") -> None:
        """End the loop; requests still in flight, or left by its ring and not taken on, fail
        with `message`."""
        self.halt()
        for suspended, sink in self.take_suspended():
            fail_suspended(suspended, sink, message)
        with self._lock:
            self._dispatch(self.batcher.fail_all(message))

    def _run(self) -> None:
        """Keep the waves `_waves_now` counts in the ring, landing the oldest; every STATS_REFRESH_S,
        let the ring empty and refresh the stage report (a PING round it costs a few ms, and under
        steady load the ring would otherwise never be empty to ask).

        Nothing that calls the engine runs under the lock: on a QUIC ring an engine call waits
        on the event loop, and the event loop takes the lock to submit and cancel, so holding
        it there would deadlock the two.
        """
        in_flight: deque[tuple[Launched, list[EngineStep], float]] = deque()
        while True:
            with self._lock:
                while not in_flight and self.batcher.idle and not self.batcher.trimming and not self._stopping:
                    if self._report_due():
                        break
                    self._lock.wait(timeout=STATS_REFRESH_S)
                if self._stopping:
                    return
                idle = self.batcher.idle and not in_flight
                trims = self.batcher.take_trims()  # before any step: a reused slot's rows follow its cut
            try:
                for trim in trims:
                    self.engine.forget(trim.slot, trim.keep)
            except Exception as error:  # the ring broke while cutting a reused slot's cache
                self._break(error)
                return
            if not in_flight and self._report_due():  # between waves, busy or not: /status stays current
                try:
                    self._refresh_report()
                except Exception as error:  # the ring broke: say so before the next request finds out
                    self._break(error)
                    return
            if idle:
                continue
            try:
                self._fill(in_flight)
                if not in_flight:  # every running request waits on its slot's cache being cut
                    with self._lock:
                        self._lock.wait(timeout=0.01)
                    continue
                self._catch_drafts_up()
                launched, steps, started = in_flight.popleft()
                results = self.engine.land(launched)
                elapsed = time.perf_counter() - started
            except Exception as error:  # a stage died, a link broke: all requests end
                self._break(error)
                return
            if self._refused_in_a_row(results) >= REFUSALS_TO_BREAK:
                last = next(r.message for r in reversed(results) if isinstance(r, SequenceFailed))
                self._break(StageFailed(f"the ring refused {self._refusals} requests' rows in a row, the last: {last}"))
                return
            with self._lock:
                before = self.batcher.tokens_generated
                self._undelivered = self.batcher.advance(results)
                # What drafted rows cost, for the cost rule: from waves that were a trip of their own.
                if all(step.decode for step in steps) and self.batcher.last_wave_plain:
                    self.batcher.trip_clock.record(sum(len(step.tokens) - 1 for step in steps), elapsed)
                    self._landed.append((time.perf_counter(), self.batcher.running, self._waves_used))
                self._count(
                    steps_rows=sum(len(s.tokens) for s in steps if not s.decode),
                    elapsed=elapsed,
                    decoded=self.batcher.tokens_generated - before,
                )
            # The next wave leaves before the API hears of these tokens: their delivery (the
            # handlers' wake-ups) then overlaps the ring's trip instead of delaying the next token.
            # Not when a stage report is due: the top of the loop lets the ring empty for it first.
            try:
                if not self._report_due():
                    self._fill(in_flight)
            except Exception as error:  # a link broke: the tokens already made still reach their requests
                self._break(error)
                return
            with self._lock:  # unless `_break` delivered them meanwhile
                self._dispatch(self._undelivered)
                self._undelivered = []

    def _fill(self, in_flight: deque[tuple[Launched, list[EngineStep], float]]) -> None:
        """Launch waves while fewer than `_waves_now` are out, unless a stage report is due (the
        ring then empties for its PING round); called without the lock."""
        while not (in_flight and self._report_due()):
            with self._lock:
                waves = self._waves_now()
                out = max(waves, self._chunks_out if self.batcher.pipelining else 1)
                ahead = len(in_flight) >= out  # beyond them, waves of drafts in flight alone
                if ahead and not (self.batcher.drafting_ahead and len(in_flight) < out + self.batcher.draft_waves - 1):
                    break
                steps = self.batcher.plan(waves, ahead_only=ahead)
            if not steps:
                break
            in_flight.append((self.engine.launch(steps), steps, time.perf_counter()))

    def _waves_now(self) -> int:
        """The waves the running requests split into (a prompt pipelining may add its chunks'): the
        count of least time per token for the requests running now, priced from the stages'
        decodes (planner/waves.py), which moves from the last only where that saves enough.
        Where the last report shows every stage has timed decodes, but some stage none of all
        the rows running, one wave until the next report, so that the line each stage is priced
        by spans every count's waves rather than stretching beyond them (once for each number of
        rows); where the decodes do not yet give a line (none, or one size alone), the engine's
        depth, one wave a machine; where KAFILA_PIPELINE_WAVES fixes the count, that depth
        always. Under the lock."""
        if not self._priced:
            return max(1, self.engine.depth)
        rows = min(self.batcher.concurrency, self.batcher.running + self.batcher.queued)  # as `plan` admits
        if 0 < self._widest_measured < rows:
            waves = 1
        else:
            waves = decode_waves(rows, self.wave_costs, self.decode_waves if self.wave_costs else self.engine.depth)
        if rows > 1:
            self.decode_waves = waves
        self._waves_used = waves
        return waves

    def _observed_period_ms(self) -> tuple[int, int, float] | None:
        """(rows, waves, ms): the median period of the decode waves landed since the last report,
        each the time between a wave's landing and the landing W waves before, at the count and
        rows of the last landing; None with fewer than MIN_PERIODS of them."""
        if not self._landed:
            return None
        _, rows, waves = self._landed[-1]
        landed = list(self._landed)
        periods = [
            1e3 * (landed[i][0] - landed[i - waves][0])
            for i in range(waves, len(landed))
            if all(entry[1:] == (rows, waves) for entry in landed[i - waves : i + 1])
        ]
        return (rows, waves, statistics.median(periods)) if len(periods) >= MIN_PERIODS and rows > 1 else None

    def _refused_in_a_row(self, results: list[StepResult]) -> int:
        """Sequences refused by a stage with none served since: a stage that refuses everything
        (a dead GPU context, say) is as broken as a dead link, and the host should replan."""
        for result in results:
            if not isinstance(result, SequenceFailed):
                self._refusals = 0
            elif not result.cancelled:
                self._refusals += 1
        return self._refusals

    def _break(self, error: Exception) -> None:
        """The engine failed as a whole: the loop takes no more work, and every request it held
        waits, with its sink, for the next ring to take it on (`take_suspended`); one that cannot
        go on elsewhere ends now."""
        message = f"the model ring failed: {error}"
        with self._lock:
            self.error = message
            self._dispatch(self._undelivered)  # a landed wave's text, before its requests move (`_undelivered`)
            self._undelivered = []
            kept, failed = self.batcher.suspend_all(message)
            for suspended in kept:
                sink = self._sinks.pop(suspended.job.request_id, None)
                if sink is not None:
                    self._suspended.append((suspended, sink))
            self._dispatch(failed)
        self.on_break()

    def take_suspended(self) -> list[tuple[Suspended, Sink]]:
        """The requests this loop's broken ring left, each with where its events go: for the next
        loop's `resume`. Those not taken end when this loop stops."""
        with self._lock:
            taken, self._suspended = self._suspended, []
        return taken

    def resume(self, requests: Sequence[tuple[Suspended, Sink]]) -> None:
        """Take on requests a broken ring left, ahead of any submitted here: their streams go on."""
        with self._lock:
            for suspended, sink in reversed(requests):
                self._sinks[suspended.job.request_id] = sink
                self.batcher.resume(suspended)
            self._lock.notify()

    def _count(self, steps_rows: int, elapsed: float, decoded: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.busy_s += elapsed
        stats.prompt_tokens += steps_rows
        stats.generated_tokens += decoded
        stats.record_step(time.monotonic(), decoded)

    def _report_due(self) -> bool:
        """Every STATS_REFRESH_S; while a prompt's chunks are pipelining, up to REPORT_LATE_S late:
        the ring must empty for the report's PING, and a long prompt's pipeline would drain and
        refill every STATS_REFRESH_S, its stages idle meanwhile."""
        if self.error is not None:
            return False
        since = time.monotonic() - self._report_at
        if since < STATS_REFRESH_S:
            return False
        with self._lock:  # re-entrant: held already where the loop plans
            return since >= REPORT_LATE_S or not self.batcher.pipelining

    def _refresh_report(self) -> None:
        """The stages' own timings for /status (on a ring, a PING round it); called without the lock.
        The report's round is the ring's: its error breaks the ring. What the pricing rules make of
        the report is the host's own arithmetic: a fault there keeps the last pricing, and serving
        goes on."""
        self._report_at = time.monotonic()
        stats = self.stats  # counted on this thread, and every finished request's steps have landed
        cover = StagesCover(requests=stats.finished + stats.failed, generated_tokens=stats.generated_tokens)
        report = self.engine.stage_report()
        observed = self._observed_period_ms()  # the engine thread's alone, as `_landed`
        self._landed.clear()  # a period across the report's pause would be the pause's
        try:
            costs, waves, widest = self._pricing_from(report, observed)
        except Exception:
            log.exception("the stages' report could not be priced; the last pricing stands")
            costs, waves, widest = None, None, None
        with self._lock:
            self.stage_report, self.stages_cover = report.stages, cover
            self.ring_ms = report.trip_ms
            if costs is not None:
                self.prefill_costs = costs
            if waves is not None:
                self.batcher.ring_costs = waves  # drafts in flight, priced by what the ring idles
                if self._priced and not waves.one_row:  # else KAFILA_PIPELINE_WAVES fixes the count of decode waves
                    self.wave_costs = waves
            if widest is not None:
                self._widest_measured = widest

    def _pricing_from(
        self, report: StagesReport, observed: tuple[int, int, float] | None
    ) -> tuple[PrefillCosts | None, WaveCosts | None, int]:
        """The prompts' chunk prices, the waves' prices (the host's own work a wave read from the
        `observed` period) and the widest decode every stage has timed."""
        stages, trip_ms = report.stages, report.trip_ms
        costs = costs_from([(entry.ms_per_token_alone, entry.prefill_ms_per_token) for entry in stages], trip_ms)
        machines = stage_machines(self.engine, len(stages))
        waves = None
        if machines is not None:  # one row's decodes alone price a greedy request's drafts in flight
            points = [entry.decode_ms_by_rows for entry in stages]
            waves = wave_costs_from(points, machines, trip_ms) or one_row_costs(points, machines, trip_ms)
        widest = min((max((rows for rows, _ in entry.decode_ms_by_rows), default=0) for entry in stages), default=0)
        if waves is not None and machines is not None and self.engine.head_here:
            waves = replace(waves, host_machine=machines[-1], host_ms=self._host_ms or 0.0)
            if observed is not None and not waves.one_row:
                seen = waves.host_work_ms(*observed)
                if seen is not None:
                    self._host_ms = seen
                    waves = replace(waves, host_ms=seen)
        return costs, waves, widest if machines is not None else 0

    def _dispatch(self, events: list[RequestEvent]) -> None:
        for event in events:
            sink = self._sinks.get(event.request_id)
            if isinstance(event, Finished | RequestFailed):
                self._sinks.pop(event.request_id, None)
                if isinstance(event, Finished):
                    self.stats.finished += 1
                else:
                    self.stats.failed += 1
            if sink is not None:
                try:
                    sink(event)
                except RuntimeError:  # the handler's event loop has closed: nobody is listening
                    pass


def stage_machines(engine: Engine, stages: int) -> tuple[int, ...] | None:
    """The machine of each of the `stages` stages an engine reports, in the report's order: as
    the engine knows them, or, where it does not, all on one machine, or each on its own where
    the ring has as many machines as stages; None where neither says."""
    if engine.stage_machines is not None and len(engine.stage_machines) == stages:
        return engine.stage_machines
    if engine.machines <= 1:
        return (0,) * stages
    if engine.machines == stages:
        return tuple(range(stages))
    return None


def fail_suspended(suspended: Suspended, sink: Sink, message: str) -> None:
    """End a request a broken ring left when no ring takes it on."""
    if suspended.sampler is not None:
        suspended.sampler.close()
    try:
        sink(RequestFailed(suspended.job.request_id, message))
    except RuntimeError:  # the handler's event loop has closed: nobody is listening
        pass
