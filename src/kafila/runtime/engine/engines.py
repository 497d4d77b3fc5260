"""The engines: a whole model in this process (`UnsplitEngine`), or the head here and the other
stages round a ring (`RingEngine`, over any `RingTransport`). An engine takes a wave of steps
(prompt rows or one decode row per sequence) and gives each its token, or its failure.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kafila.contracts import StageReport
from kafila.runtime.engine.logprobs import HeadRow
from kafila.runtime.engine.ring import RingTransport, StageFailed, pipeline_depth
from kafila.runtime.engine.sampling import (
    Sampler,
    SamplerStart,
    SamplingSettings,
    TokenChosenOnHead,
    TokenSampler,
    check_grammar,
)
from kafila.runtime.engine.stage import (
    HeadStage,
    StepInput,
    TokenEmbedding,
    TokenStep,
    Vocabulary,
    WholeModel,
    run_isolating,
)
from kafila.runtime.gguf.families import FAMILIES
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.slicer import StageFile
from kafila.runtime.llama.model import ContextSettings, LlamaModel, VocabularyOnly
from kafila.wire.frames import NO_LOGPROBS, SAMPLE_ON_HEAD, DType, Frame, Kind


class PrefixCut(StrEnum):
    """Where an engine's cache of a sequence can be cut so that prefill resumes after it."""

    # A KV cache holds every position: drop [P, end) and go on from P. A sliding-window cache
    # too: llama.cpp takes a cell whose position has left its sequence's window only where no
    # other sequence holds it (find_slot), and purges a sequence's positions only below a cell
    # it took (apply_ubatch); every cell of a windowed cache here also belongs to a keeper
    # (`LlamaModel.keeps_window_cells`), so none is taken and the window before any cut is whole.
    ANYWHERE = "anywhere"
    NOWHERE = "nowhere"  # a recurrent state holds no positions at all: every request starts afresh


# Metadata of a recurrent state (mamba, rwkv, lfm2's convolutions, the linear layers of a hybrid).
_RECURRENT_KEYS = (".ssm.", ".wkv.", ".shortconv.")


def prefix_cut(recurrent: bool) -> PrefixCut:
    """Where a cache can be cut, from what the model keeps: one rule, whether the facts come from a
    loaded model (`UnsplitEngine`) or from a header (`prefix_cut_of`). A window does not matter:
    the keeper holds its cells (`PrefixCut.ANYWHERE`)."""
    return PrefixCut.NOWHERE if recurrent else PrefixCut.ANYWHERE


def speculation_refused_for(source: Path | FastGGUFReader) -> str | None:
    """Why drafts must not be checked on the model whose (stage) file is `source` (or whose header
    it is, already read): its family's reason (`Family.speculation_refused`), or None."""
    reader = source if isinstance(source, FastGGUFReader) else FastGGUFReader(source)
    arch = str(reader.scalar("general.architecture", ""))
    family = FAMILIES.get(arch)
    return (family.speculation_refused or None) if family is not None else None


def prefix_cut_of(model: Path) -> PrefixCut:
    """Where a cache of `model` can be cut, from its header alone: a ring's host holds no stage
    that sees the whole model, so it reads the whole model's file (or a file with all its
    metadata: `slicer.VocabularyPiece`)."""
    return prefix_cut_from(FastGGUFReader(model))


def prefix_cut_from(reader: FastGGUFReader) -> PrefixCut:
    """`prefix_cut_of` an open model, a header alone included (a model on the hub)."""
    arch = str(reader.scalar("general.architecture", ""))
    recurrent = any(key.startswith(arch) and any(mark in key for mark in _RECURRENT_KEYS) for key in reader.fields)
    return prefix_cut(recurrent)


@dataclass(frozen=True)
class EngineStep:
    """One sequence's next rows: a prompt chunk (decode False) or the last sampled token."""

    sequence_id: int
    position: int
    tokens: list[int]
    decode: bool
    logits: bool = True  # False for a prompt chunk that does not end its prompt: no output row
    top: int = 0  # how many of the largest logits the sampler needs (`SamplingSettings.top_logits`); 0: all
    # On a request's first prompt chunk: its sampler's settings and prompt, for an engine whose
    # head is on a member to start the sampler there (`RingEngine`); other engines ignore it.
    sampler: SamplerStart | None = None
    # A request that asks for log probabilities: how many alternatives per token (0..20), else
    # NO_LOGPROBS. A head on a member then sends the row's log-sum-exp and top entries (`HeadRow`).
    logprobs: int = NO_LOGPROBS
    # A token and its drafted successors (speculative decoding): logits after each row, so the
    # host can check every draft in this one trip (`EveryRowLogits`). Only where the engine can
    # (`Engine.speculation_refused` is None).
    every_row: bool = False
    # An `every_row` step of a greedy request: decoded one row a decode at every stage, so its
    # tokens are exactly those decoding without drafts gives (`stage._decodes`), and sent round a
    # ring one frame a row (`rows_as_decoded`); a sampled request's rows go together, in one
    # decode where they fit.
    row_by_row: bool = False

    def __post_init__(self) -> None:
        if self.row_by_row and not self.every_row:
            raise ValueError(
                f"sequence {self.sequence_id}'s step goes one row a decode but asks for no logits after each row: "
                "only a token and its drafts (every_row) do"
            )


Logits = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EveryRowLogits:
    """The answer to an `every_row` step: row i holds the logits that follow the step's token i."""

    rows: Logits  # (the step's rows, vocabulary)
    # From a head on a member, for a request that asks for log probabilities: each row's
    # log-sum-exp and largest entries, since `rows` holds only each row's top entries.
    head_rows: tuple[HeadRow, ...] | None = None

    def for_logprobs(self, index: int) -> Logits | HeadRow:
        """Row `index` as `token_logprob` reads it: the whole row, or a head on a member's summary."""
        return self.rows[index] if self.head_rows is None else self.head_rows[index]

    @classmethod
    def joined(cls, parts: Sequence[EveryRowLogits]) -> EveryRowLogits:
        """A step's answers, one for each frame it went round as (`rows_as_decoded`), as one."""
        heads = [part.head_rows for part in parts]
        whole = None if any(h is None for h in heads) else tuple(row for h in heads if h is not None for row in h)
        return cls(np.concatenate([part.rows for part in parts]), whole)


@dataclass(frozen=True)
class SequenceFailed:
    """A stage could not run this sequence's rows; the other sequences of the step went on.

    The sequence's request must end with `message`, and its slot be forgotten: its caches on
    the stages that did run its rows are ahead of those that did not.
    """

    sequence_id: int
    message: str
    cancelled: bool = False  # its request had ended: dropped by the head, no stage's fault


# None: a step that asked for no logits; a HeadRow: a head on a member's answer to a step that
# asked for log probabilities.
StepResult = Logits | HeadRow | EveryRowLogits | SequenceFailed | None


@dataclass(frozen=True)
class Launched:
    """A wave of steps on its way: what `Engine.land` collects, in the order waves were launched."""

    steps: tuple[EngineStep, ...]
    wave: int = 0
    frames: tuple[tuple[Frame, ...], ...] = ()  # each step's frames round a ring: one, or one a row (`rows_as_decoded`)


@dataclass(frozen=True)
class StagesReport:
    """An engine's stage report: each stage's timings, and the trip that fetched them round the
    ring (ms, one way: the wire's, which pricing adds to every wave's; 0 where no wire is crossed)."""

    stages: list[StageReport]
    trip_ms: float


class Engine(Protocol):
    """What generation needs: logits for many sequences' next rows at once, and a tokenizer.

    `launch` sends a wave of steps on its way and `land` waits for its results, oldest wave
    first; up to `depth` waves may be in flight at once (1 where nothing overlaps).
    """

    depth: int
    machines: int  # the distinct machines its stages run on
    # The machine of each stage in the stage report's order, where known (else `machines` tells:
    # one machine holds them all, or each stage is a machine of its own).
    stage_machines: tuple[int, ...] | None
    head_here: bool  # whether the head runs in this process (the last stage reported), or on a member
    # Why this engine cannot answer `every_row` steps (speculative decoding), or None where it can.
    speculation_refused: str | None
    # Whether it answers them with whole rows (a head here), or with each row's `top` largest
    # logits only (a head on a member), which serves no sampler that needs the whole row.
    every_row_whole: bool

    def launch(self, steps: Sequence[EngineStep]) -> Launched: ...
    def land(self, launched: Launched) -> list[StepResult]: ...
    def step_many(self, steps: Sequence[EngineStep]) -> list[StepResult]: ...
    def step(self, sequence_id: int, position: int, tokens: Sequence[int], decode: bool) -> npt.NDArray[np.float32]: ...
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def piece(self, token: int) -> bytes: ...
    def is_end(self, token: int) -> bool: ...
    def n_vocab(self) -> int: ...
    def check_grammar(self, grammar: str) -> None: ...
    def sampler(self, settings: SamplingSettings) -> TokenSampler: ...
    def chat_template(self) -> str | None: ...
    def special_text(self) -> tuple[str, str]: ...
    def show_special(self, texts: Sequence[str]) -> None: ...
    def forget(self, sequence_id: int, keep: int = 0) -> None: ...
    @property
    def prefix_cut(self) -> PrefixCut: ...
    def stage_report(self) -> StagesReport: ...
    def close(self) -> None: ...


class _Readers:
    """Threads inside the vocabulary, which `close` waits out before the model is freed.

    The HTTP server tokenizes long prompts on worker threads while the host may be closing this
    engine to replan; freeing llama.cpp's vocabulary under a running tokenization would crash
    the process. Readers do not exclude one another (the engine's thread detokenizes while a
    long prompt is tokenized), and once closed, a reader is refused with StageFailed."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._changed:
            if self._closed:
                raise StageFailed("the model has been closed (the host is replanning or stopping)")
            self._inside += 1
        try:
            yield
        finally:
            with self._changed:
                self._inside -= 1
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: self._inside == 0)


class _Vocabulary:
    """Tokenizer calls, answered by whichever stage holds the full vocabulary."""

    vocabulary: Vocabulary
    llama_model: LlamaModel | VocabularyOnly
    depth = 1
    machines = 1
    stage_machines: tuple[int, ...] | None = None
    head_here = True
    speculation_refused: str | None = None
    every_row_whole = True
    _readers: _Readers

    def launch(self, steps: Sequence[EngineStep]) -> Launched:
        """Nothing overlaps in one process: the wave runs when it lands."""
        return Launched(tuple(steps))

    def land(self, launched: Launched) -> list[StepResult]:
        return self.step_many(launched.steps)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Safe on any thread, even while the engine is being closed (it then raises StageFailed)."""
        with self._readers.reading():
            return self.vocabulary.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.vocabulary.detokenize(tokens)

    def piece(self, token: int) -> bytes:
        return self.vocabulary.piece(token)

    def is_end(self, token: int) -> bool:
        return self.vocabulary.is_end(token)

    def n_vocab(self) -> int:
        return self.llama_model.n_vocab

    def check_grammar(self, grammar: str) -> None:
        """Raises GrammarRefused unless llama.cpp parses `grammar` over this model's vocabulary."""
        with self._readers.reading():
            check_grammar(self.llama_model.vocab, grammar)

    def sampler(self, settings: SamplingSettings) -> TokenSampler:
        """The host's sampler for one request: llama.cpp's chain on the logits that come back."""
        return Sampler(settings, self.n_vocab(), self.llama_model.vocab)

    def chat_template(self) -> str | None:
        return self.vocabulary.chat_template()

    def special_text(self) -> tuple[str, str]:
        return self.vocabulary.special_text()

    def show_special(self, texts: Sequence[str]) -> None:
        """Write these special tokens into replies' text (a reply syntax's markers)."""
        self.vocabulary.show_special(texts)

    def step(self, sequence_id: int, position: int, tokens: Sequence[int], decode: bool) -> Logits:
        (logits,) = self.step_many([EngineStep(sequence_id, position, list(tokens), decode)])
        if isinstance(logits, SequenceFailed):
            raise StageFailed(logits.message)
        assert logits is not None and not isinstance(logits, HeadRow | EveryRowLogits)  # a plain step
        return logits

    def step_many(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        raise NotImplementedError


def _failure(where: str) -> Callable[[EngineStep, Exception], StepResult]:
    def fail(step: EngineStep, error: Exception) -> StepResult:
        return SequenceFailed(step.sequence_id, f"{where} refused sequence {step.sequence_id}: {error}")

    return fail


def _sequence(step: EngineStep) -> int:
    return step.sequence_id


def rows_as_decoded(frame: Frame) -> tuple[Frame, ...]:
    """The frames a step's frame goes round the ring as: itself, or where it is decoded one row a
    decode (a greedy token and its drafts, `Frame.row_by_row`) one frame a row, each answered on
    its own. Every stage then passes a row on as soon as it has decoded it (`worker.as_decoded`),
    so the stages decode a step's rows one behind the other, at once, where each would otherwise
    decode all of them before the next stage began."""
    if not frame.row_by_row or frame.n_tokens <= 1:
        return (frame,)
    width = len(frame.payload) // frame.n_tokens
    return tuple(
        replace(
            frame, position=frame.position + row, n_tokens=1, payload=frame.payload[row * width : (row + 1) * width]
        )
        for row in range(frame.n_tokens)
    )


def landing_rounds(parts: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The order a wave's answers are taken in, for steps that went round as `parts[i]` frames
    each (`rows_as_decoded`): round r holds (step, r) for every step that went as more than r, so
    round 0 holds every step whole but for the rows after the first of a step sent a frame a row,
    and round r the r-th of those, as a stage's decodes group them (`stage._row_rounds`). A head
    here runs each round as soon as its frames are back, while the stages decode the rows behind."""
    if any(count < 1 for count in parts):
        raise ValueError(f"a step goes round as one frame at least, not {list(parts)}")
    return [[(step, row) for step, count in enumerate(parts) if count > row] for row in range(max(parts, default=0))]


def _answer(step: EngineStep, logits: Logits | None) -> StepResult:
    """A head's logits as the step asked for them: a row, None, or every row's."""
    return EveryRowLogits(logits) if step.every_row and logits is not None else logits


class UnsplitEngine(_Vocabulary):
    """The original file, unchanged, on one llama.cpp context: a one-member session."""

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        self._readers = _Readers()
        self.model = WholeModel(path, settings)
        self.vocabulary, self.llama_model = self.model.vocabulary, self.model.model
        self._blocks = int(self.model.model._llama.llama_model_n_layer(self.model.model.model))
        self.prefix_cut = prefix_cut(not self.model.model.holds_positions)
        self.speculation_refused = speculation_refused_for(path)

    def step_many(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        """All the steps in one decode; if that fails, each alone, so a fault fails only its sequence."""
        return run_isolating(steps, self._forward, _failure("the model"), _sequence)

    def _forward(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        decode = all(s.decode for s in steps)
        token_steps = [TokenStep(s.sequence_id, s.position, s.tokens) for s in steps]
        every_row = [s.every_row for s in steps]
        row_by_row = [s.row_by_row for s in steps]
        rows = self.model.forward_steps(token_steps, decode, [s.logits for s in steps], every_row, row_by_row)
        return [_answer(step, row) for step, row in zip(steps, rows, strict=True)]

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        self.model.forget(sequence_id, keep)

    def stage_report(self) -> StagesReport:
        """The model's timings; no wire, so no trip."""
        return StagesReport([self.model.timer.report((0, self._blocks))], trip_ms=0.0)

    def close(self) -> None:
        self._readers.close()
        self.model.close()


class StageSpan(Protocol):
    """A stage known by its blocks alone: one on the ring whose file this machine need not hold."""

    @property
    def first_block(self) -> int: ...
    @property
    def end_block(self) -> int: ...


class RingEngine(_Vocabulary):
    """Frames round a ring transport, with the head here or on the ring itself.

    With the head here, this engine embeds each step's tokens, sends the rows round the ring and
    runs the head's blocks and output on what comes back. With the head on the ring (`model`
    given: a host that cannot hold the head), it embeds from the model's file, or a file of its
    metadata and token embedding alone (`slicer.VocabularyPiece`), which it reads only row by row,
    and the ring's last stage answers each step with a LOGITS frame; this engine keeps only the
    vocabulary, to tokenize and sample.
    """

    def __init__(
        self,
        stages: Sequence[StageFile | StageSpan],
        settings: ContextSettings,
        dtype: DType = DType.F32,
        *,
        ring: RingTransport,
        depth: int = 1,
        model: Path | None = None,
        prefix_cut: PrefixCut = PrefixCut.NOWHERE,
        stage_machines: Sequence[int] | None = None,
    ) -> None:
        """`stages` in chain order, head last; `ring` reaches all but the head (with `model`, all of
        them: the head is on the ring). `depth`: the distinct machines the ring spans (local
        processes: this one). `model`: the whole model, whose head is on the ring. `prefix_cut`:
        where the stages' caches can be cut (`prefix_cut_of` the whole model); by default they
        are never cut, only dropped. `stage_machines`: which machine runs each stage of the whole
        ring, in chain order, head last (the waves in flight are priced with it)."""
        self._readers = _Readers()
        self.prefix_cut = prefix_cut
        self.head: HeadStage | None = None
        self._vocabulary_only: VocabularyOnly | None = None
        if model is None:
            head = stages[-1]
            if not isinstance(head, StageFile):
                raise TypeError("with the head here, its stage file")
            self.head = HeadStage(head.path, settings)
            self.speculation_refused = speculation_refused_for(self.head.header)
            self.vocabulary, self.llama_model = self.head.vocabulary, self.head.model
            self._embed: Callable[[Sequence[int]], npt.NDArray[np.float32]] = self.head.embed
        else:
            header = FastGGUFReader(model)  # read once: a large vocabulary's header takes ~0.07 s to parse
            self._embed = TokenEmbedding(header)  # first: it holds nothing to free if the vocabulary fails
            self._vocabulary_only = VocabularyOnly(model)
            self.vocabulary, self.llama_model = Vocabulary(self._vocabulary_only), self._vocabulary_only
            self.speculation_refused = speculation_refused_for(header)
            self.every_row_whole = False  # a ROWS frame: each row's top entries
        self._head_range = (stages[-1].first_block, stages[-1].end_block)
        self._dtype = dtype
        self.depth = pipeline_depth(depth)
        self.machines = max(1, depth)
        self.stage_machines = None if stage_machines is None else tuple(stage_machines)
        self.head_here = self.head is not None
        self._waves = itertools.count()
        self._expected: defaultdict[int, deque[int | None]] = defaultdict(deque)  # per sequence: wave or CANCEL out
        self._arrived: dict[tuple[int, int], list[Frame]] = {}  # (wave, sequence) → its frames, until the wave lands
        self._forgotten_at: dict[int, int] = {}  # sequence → first wave after it was forgotten mid-flight
        self._sampled_on_head: set[int] = set()  # sequences whose sampler runs on the head (a member)
        self.ring = ring

    def step_many(self, steps: Sequence[EngineStep]) -> list[StepResult]:
        return self.land(self.launch(steps))

    def launch(self, steps: Sequence[EngineStep]) -> Launched:
        """Embed the wave and send one frame per sequence round the ring (one a row where a step goes
        one row a decode: `rows_as_decoded`); stages run frames that arrive together as one decode,
        so while this wave is at one stage the next can be at another."""
        if self.speculation_refused is not None and any(s.every_row for s in steps):
            raise ValueError(f"this engine cannot answer every row of a step: {self.speculation_refused}")
        if self.head is None and any(s.every_row and s.top == 0 for s in steps):
            raise ValueError("a head on a member answers every row of a step with its largest logits, not whole rows")
        wave = next(self._waves)
        starts = self._sampler_starts(steps)
        frames = tuple(rows_as_decoded(self._frame(s)) for s in steps)
        sent = [frame for step_frames in frames for frame in step_frames]
        self.ring.send([*starts, *sent])  # a start goes ahead of its sequence's rows; it has no answer
        for frame in sent:
            self._expected[frame.sequence_id].append(wave)
        return Launched(tuple(steps), wave, frames)

    def _frame(self, step: EngineStep) -> Frame:
        """A step's embedded rows as the frame that carries them round the ring."""
        return Frame.of_hidden(
            Kind.VERIFY if step.every_row else Kind.DECODE if step.decode else Kind.PREFILL,
            step.sequence_id,
            step.position,
            self._embed(step.tokens),
            self._dtype,
            self._top(step),
            step.logprobs if step.logits else NO_LOGPROBS,
            step.row_by_row,
        )

    def _sampler_starts(self, steps: Sequence[EngineStep]) -> list[Frame]:
        """SAMPLER frames for the requests this wave starts whose sampler needs the whole row,
        when the head is on the ring: from then on the head samples them."""
        if self.head is not None:
            return []
        starts = []
        for step in steps:
            if step.sampler is not None and step.sampler.settings.needs_whole_row:
                starts.append(Frame(Kind.SAMPLER, step.sequence_id, payload=step.sampler.payload()))
                self._sampled_on_head.add(step.sequence_id)
        return starts

    def _top(self, step: EngineStep) -> int:
        """The `top` a step's frame carries. A head on the ring answers every step, with the least
        it can where the step wants no logits, and samples itself where the sampler needs the
        whole row: one token back instead of the row (`TokenChosenOnHead` takes it)."""
        if not step.logits:
            return 1
        if step.top == 0 and step.sequence_id in self._sampled_on_head:
            return SAMPLE_ON_HEAD
        return step.top

    def sampler(self, settings: SamplingSettings) -> TokenSampler:
        if self.head is None and settings.needs_whole_row:
            return TokenChosenOnHead()
        return Sampler(settings, self.n_vocab(), self.llama_model.vocab)

    def land(self, launched: Launched) -> list[StepResult]:
        """The wave's frames back from the ring, through the head: logits, or a sequence's failure.

        A sequence that a stage refused comes back as an ERROR frame and fails alone
        (`SequenceFailed`); the head runs only the sequences that came back whole, and a fault in
        its own forward fails only its sequence too. A ring that breaks raises StageFailed. The
        frames are taken a round at a time (`landing_rounds`): a head here runs the first row of
        a step sent a frame a row while the stages still decode the rows behind it.
        """
        steps, sent = launched.steps, launched.frames
        results: list[StepResult] = [None] * len(steps)
        settled: set[int] = set()  # the steps whose result is final
        rows: dict[int, list[EveryRowLogits]] = {}  # the rows answered so far of each step sent a frame a row
        for round_ in landing_rounds([len(frames) for frames in sent]):
            ready = self._await_round(launched, round_, results, settled)
            for (index, part), answer in zip(ready, self._run_round(launched, ready), strict=True):
                if isinstance(answer, SequenceFailed):
                    results[index] = answer
                    settled.add(index)
                elif len(sent[index]) == 1:
                    results[index] = answer
                else:
                    assert isinstance(answer, EveryRowLogits)  # a frame a row: only an every_row step's
                    rows.setdefault(index, []).append(answer)
                    if part + 1 == len(sent[index]):
                        results[index] = EveryRowLogits.joined(rows[index])
        while left := sum(len(frames) - len(self._came(launched.wave, frames[0])) for frames in sent):
            self._take(left)  # the rows of a step that failed before they were all back
        for frames in sent:
            del self._arrived[(launched.wave, frames[0].sequence_id)]
        return results

    def _came(self, wave: int, sent: Frame) -> list[Frame]:
        """The answers back so far to a step's frames, in the order they left."""
        return self._arrived.get((wave, sent.sequence_id), [])

    def _await_round(
        self, launched: Launched, round_: Sequence[tuple[int, int]], results: list[StepResult], settled: set[int]
    ) -> list[tuple[int, int]]:
        """The frames of a round (`landing_rounds`: (step, frame) pairs), once back: those of the
        steps not settled. A step whose request ended while its rows were out, or whose frame a
        stage refused (an ERROR back for any of its frames), is settled with its failure at once."""
        while True:
            missing = 0
            for index, part in round_:
                if index in settled:
                    continue
                first = launched.frames[index][0]
                came = self._came(launched.wave, first)
                refused = next((frame for frame in came if frame.kind is Kind.ERROR), None)
                if launched.wave < self._forgotten_at.get(first.sequence_id, -1):
                    ended = "the request ended while its rows were in the ring"
                    results[index] = SequenceFailed(first.sequence_id, ended, cancelled=True)
                    settled.add(index)  # its cache is gone everywhere: the head must not write it again
                elif refused is not None:
                    results[index] = SequenceFailed(first.sequence_id, refused.text())
                    settled.add(index)
                elif len(came) <= part:
                    missing += 1
            if not missing:
                return [(index, part) for index, part in round_ if index not in settled]
            self._take(missing)

    def _run_round(self, launched: Launched, ready: Sequence[tuple[int, int]]) -> list[StepResult]:
        """Each of a round's frames' answer (`_await_round`): from a head on the ring as it came, or
        through the head here, in one forward (a step at a time where that fails)."""
        steps, wave = launched.steps, launched.wave
        frames = [(index, launched.frames[index][part], self._came(wave, launched.frames[index][part])[part])
                  for index, part in ready]  # fmt: skip
        local_head = self.head
        if local_head is None:
            return [self._remote_logits(came, sent, steps[index]) for index, sent, came in frames]
        for _, sent, came in frames:
            if came.kind is not sent.kind or came.position != sent.position or came.n_tokens != sent.n_tokens:
                raise StageFailed(
                    f"the ring returned a {came.kind.name} frame at position {came.position}, {came.n_tokens} rows "
                    f"for sequence {sent.sequence_id}, sent as {sent.kind.name} at position {sent.position}"
                )
        if not frames:
            return []
        inputs = {index: StepInput(came.sequence_id, came.position, came.hidden_states()) for index, _, came in frames}

        def head(indices: Sequence[int]) -> list[StepResult]:
            decode = all(steps[i].decode for i in indices)
            wanted = [steps[i].logits for i in indices]
            every_row = [steps[i].every_row for i in indices]
            row_by_row = [steps[i].row_by_row for i in indices]
            rows = local_head.forward([inputs[i] for i in indices], decode, wanted, every_row, row_by_row)
            return [_answer(steps[i], row) for i, row in zip(indices, rows, strict=True)]

        fail = _failure(f"the head (blocks {self._head_range[0]}-{self._head_range[1] - 1})")
        return run_isolating(list(inputs), head, lambda i, e: fail(steps[i], e), lambda i: steps[i].sequence_id)

    def _remote_logits(self, came: Frame, sent: Frame, step: EngineStep) -> StepResult:
        """A step's answer from a head on the ring: its LOGITS row (or None, if the step asked for
        none), or for a token and its drafts the ROWS of every row's largest logits."""
        if step.every_row:
            if (
                came.kind is not Kind.ROWS or came.position != sent.position or came.hidden != self.llama_model.n_vocab
                or came.n_tokens != sent.n_tokens or came.top != sent.top or came.logprobs != sent.logprobs
            ):  # fmt: skip
                raise StageFailed(
                    f"the ring's head answered sequence {sent.sequence_id}'s {sent.n_tokens} drafted rows at position "
                    f"{sent.position} with a {came.kind.name} frame of {came.n_tokens} rows, top {came.top}, at "
                    f"position {came.position}, width {came.hidden}, {came.logprobs} log probability alternatives "
                    f"(asked: {sent.logprobs})"
                )
            rows, summaries = came.rows(), came.rows_logprobs()
            if summaries is None:
                return EveryRowLogits(rows)
            heads = tuple(
                HeadRow(row, float(lse), ids, values) for row, lse, ids, values in zip(rows, *summaries, strict=True)
            )
            return EveryRowLogits(rows, heads)
        if came.kind is not Kind.LOGITS or came.position != sent.position or came.hidden != self.llama_model.n_vocab:
            raise StageFailed(
                f"the ring's head answered sequence {sent.sequence_id} at position {sent.position} with a "
                f"{came.kind.name} frame at position {came.position} of width {came.hidden}, not "
                f"{self.llama_model.n_vocab} logits"
            )
        if not step.logits:
            return None
        if came.logprobs != step.logprobs:
            raise StageFailed(
                f"the ring's head answered sequence {sent.sequence_id} with {came.logprobs} log probability "
                f"alternatives; the host asked for {step.logprobs}"
            )
        trailer = came.logprob_trailer()
        if trailer is None:
            return came.logits()
        logsumexp, ids, values = trailer
        return HeadRow(came.logits(), logsumexp, ids, values)

    def _take(self, count: int) -> None:
        """Receive `count` frames and file each under the wave that sent it. Each sequence's frames
        come back in the order they left (one stream per sequence, stages in order), while
        sequences may overtake one another: so the next frame of a sequence answers the oldest
        thing still out for it, a wave's rows or a CANCEL."""
        for frame in self.ring.receive(count):
            expected = self._expected.get(frame.sequence_id)
            if not expected:
                raise StageFailed(f"the ring returned a {frame.kind.name} frame for sequence {frame.sequence_id}, "
                                  "which has nothing out")  # fmt: skip
            wave = expected.popleft()
            if wave is not None:
                self._arrived.setdefault((wave, frame.sequence_id), []).append(frame)

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        """Cut a sequence everywhere after its first `keep` rows (all by default): a CANCEL round
        the ring, after any of its rows still out. Its answer (the CANCEL back, or an ERROR from a
        stage that cannot hold the sequence either) is taken with the waves that follow, so
        forgetting never stalls the pipeline."""
        self.ring.send([Frame(Kind.CANCEL, sequence_id, position=keep)])
        self._sampled_on_head.discard(sequence_id)
        if any(w is not None for w in self._expected[sequence_id]):
            self._forgotten_at[sequence_id] = next(self._waves)  # waves before this one are stale for it
        self._expected[sequence_id].append(None)
        if self.head is not None:
            self.head.forget(sequence_id, keep)

    def _settle(self) -> None:
        """Take every CANCEL's answer still out; only between waves."""
        while out := sum(len(q) for q in self._expected.values()):
            if any(w is not None for q in self._expected.values() for w in q):
                raise RuntimeError("a stage report was asked for while a wave was in the ring")
            self._take(out)

    def stage_report(self) -> StagesReport:
        """The stages' timings, fetched by a PING round the ring, and that PING's trip alone: a
        CANCEL still out (a draft's rejected rows, a reused slot's cut) comes round before the
        clock starts, else its own whole trip would count as the wire's."""
        self._settle()
        started = time.perf_counter()
        stages = self.ring.stats()  # the head's own report comes round with the others where it is not here
        trip_ms = 1e3 * (time.perf_counter() - started)
        if self.head is not None:
            stages = [*stages, self.head.timer.report(self._head_range, totals=True)]
        return StagesReport(stages, trip_ms)

    def _close_head(self) -> None:
        if self.head is not None:
            self.head.close()
        if self._vocabulary_only is not None:
            self._vocabulary_only.close()

    def close(self) -> None:
        self._readers.close()
        self.ring.close()
        self._close_head()
