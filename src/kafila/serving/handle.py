"""One engine and its loop as a front end serves them: the chat template built for the model,
tokenizing, grammar checks, submitting and cancelling, and the loop's counts. The host hands
the API a new `ServingHandle` with each ring, so a handle is compared by identity: a request
that took one ring's handle can tell that another serves now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kafila.contracts import Incident, PrefillStatus, SpeculationStatus, StageReport, StagesCover
from kafila.runtime.engine.engines import Engine
from kafila.serving.batcher import Job
from kafila.serving.chat_template import ChatTemplate
from kafila.serving.engine_loop import EngineLoop, LoopStats, Sink


@dataclass(eq=False)
class ServingHandle:
    engine: Engine
    loop: EngineLoop
    template: ChatTemplate
    architecture: str | None = None  # the model's (GGUF general.architecture), where known

    @classmethod
    def of(cls, engine: Engine, loop: EngineLoop, architecture: str | None) -> ServingHandle:
        """The handle of a ring: its chat template is the model's own, or a fallback by its
        architecture, and the engine shows the special tokens that template's syntax needs."""
        bos, eos = engine.special_text()
        template = ChatTemplate(engine.chat_template(), bos, eos, architecture)
        engine.show_special(template.shown_tokens)
        return cls(engine, loop, template, architecture)

    # --- requests ---
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.engine.tokenize(text, add_special, parse_special)

    def n_vocab(self) -> int:
        return self.engine.n_vocab()

    def check_grammar(self, grammar: str) -> None:
        """Raises GrammarRefused for a grammar llama.cpp cannot use (StageFailed if the ring is gone)."""
        self.engine.check_grammar(grammar)

    def submit(self, job: Job, sink: Sink) -> None:
        """Raises ValueError for a prompt the batcher refuses, EngineUnavailable when broken or stopped."""
        self.loop.submit(job, sink)

    def cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)

    # --- state and counts ---
    @property
    def error(self) -> str | None:
        """Why this ring stopped serving, once it broke."""
        return self.loop.error

    @property
    def queued(self) -> int:
        return self.loop.queued

    @property
    def running(self) -> int:
        return self.loop.running

    @property
    def waves(self) -> int:
        """Waves the running requests split into along the ring (the engine loop's last count)."""
        return self.loop.decode_waves

    @property
    def stats(self) -> LoopStats:
        return self.loop.stats

    @property
    def stage_report(self) -> list[StageReport]:
        return self.loop.stage_report

    @property
    def covered_report(self) -> tuple[list[StageReport], StagesCover | None]:
        """The stages' report with the requests and tokens done when it was taken (`StagesCover`)."""
        return self.loop.covered_report()

    @property
    def prefill(self) -> PrefillStatus:
        """Pipelined prefill on this ring: chunks of one prompt allowed out at once (no more than
        the waves in flight), the most seen out, and the last chunk length the cost model chose."""
        batcher = self.loop.batcher
        ring_ms = self.loop.ring_ms
        return PrefillStatus(
            chunks=max(1, min(batcher.prefill_chunks, self.engine.depth)), most_chunks_out=batcher.most_chunks_out,
            chunk_rows=batcher.last_chunk_rows, ring_ms=None if ring_ms is None else round(ring_ms, 2),
        )  # fmt: skip

    @property
    def speculation(self) -> SpeculationStatus:
        """Drafted and accepted tokens on this ring (`runtime.engine.speculation`)."""
        batcher = self.loop.batcher
        stats, cost = batcher.speculation, batcher.trip_clock.cost
        trip_ms = row_ms = fixed_ms = None  # the cost rule's figures, once the waves have measured them
        if cost is not None:
            trip_ms, row_ms, fixed_ms = round(cost.trip_ms, 2), round(cost.row_ms, 2), round(cost.fixed_ms, 2)
        return SpeculationStatus(
            mode=self.loop.speculate.value, off=batcher.speculation_off, drafted_tokens=stats.drafted,
            accepted_tokens=stats.accepted, trips=stats.trips, accepted_per_trip=round(stats.accepted_per_trip, 3),
            mean_window=round(stats.mean_window, 3), waves_behind=stats.waves_behind, waves_stale=stats.waves_stale,
            trip_ms=trip_ms, row_ms=row_ms, fixed_ms=fixed_ms,
            draft_ms=round(batcher.trip_clock.draft_ms, 3) if batcher.trip_clock.drafts else None,
        )  # fmt: skip


@dataclass(frozen=True)
class ServedState:
    """What a front end may tell its callers of the host at one moment."""

    ready: bool
    paused: bool = False  # a planned replan runs: requests wait for it rather than be turned away
    failure: str | None = None  # nothing serves, and why
    waiting_for: Sequence[str] = ()
    join_line: str | None = None  # shown to the API key's holder alone
    incidents: Sequence[Incident] = ()
