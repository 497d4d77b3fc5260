"""Stages: a contiguous range of blocks on llama.cpp, driven by frames of hidden states.

A stage is `(sequence id, first position, hidden states) -> hidden states`, with no transport in
sight, so the same object serves local sockets now and QUIC links later. Three kinds exist:

- `BlockStage` holds blocks only. It is fed hidden states and returns the residual after its
  last block, caught in the running graph by the eval callback (no public call returns the
  pre-norm residual); the callback then stops the graph, so the stand-in output is never
  computed.
- `HeadStage` holds the last blocks and the output. It embeds token ids itself, runs its blocks
  on the hidden states that come back round the ring, and returns logits.
- `WholeModel` runs an unsplit model on token ids: the one-member session and the reference
  every split is checked against.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kafila.contracts import MAX_DECODE_ROWS, MAX_REPORTED_ROW_COUNTS, StageReport
from kafila.runtime.engine.row_split import RowSplit
from kafila.runtime.engine.sampling import Sampler, SamplerStart
from kafila.runtime.engine.speculation import DRAFT_ROWS_PER_WAVE
from kafila.runtime.gguf.families import FAMILIES, family_of
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.slicer import IDENTITY_BLOCKS_KEY
from kafila.runtime.llama.loading import GGMLBase
from kafila.runtime.llama.model import ContextSettings, LlamaModel, VocabularyOnly

FloatRows = npt.NDArray[np.float32]
T = TypeVar("T")
R = TypeVar("R")


class BatchFailed(RuntimeError):
    """A forward failed; every row it wrote is out of the cache again, so each sequence can be retried alone.

    `spoiled`: sequences that must not be, because their cache may not be as it was. llama.cpp
    writes a decode whole or not at all, and the rows of the decodes that did complete are
    removed again; but a recurrent state (qwen3next's delta-net blocks) keeps no earlier
    positions, so a sequence whose state a completed decode advanced cannot go back (only from
    position 0, by dropping it whole). And a window's cache without a keeper
    (`LlamaModel.keeps_window_cells`; every windowed model has one unless it also keeps a
    recurrent state) gives a later decode of the same forward cells that left the window of the
    sequence's new last position, and drops the positions below them, which a retry from its
    original position still needs. With a keeper no cell is taken, so a windowed sequence is
    retried as any other.
    """

    def __init__(self, message: str, spoiled: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.spoiled = spoiled


def run_isolating(
    items: Sequence[T],
    run: Callable[[Sequence[T]], list[R]],
    refuse: Callable[[T, Exception], R],
    sequence_of: Callable[[T], int],
) -> list[R]:
    """`run` over all the items as one batch; if it fails, over each item alone, so that a fault in
    one sequence's rows fails only that sequence (`refuse` makes its answer) and the others go on.
    `run` must leave the cache as it found it when it raises, as every stage's forward does."""
    try:
        return run(items)
    except Exception as error:
        if len(items) == 1:
            return [refuse(items[0], error)]
        failed = error
    spoiled = failed.spoiled if isinstance(failed, BatchFailed) else frozenset()
    out: list[R] = []
    for item in items:
        if sequence_of(item) in spoiled:
            out.append(refuse(item, failed))
            continue
        try:
            out += run([item])
        except Exception as error:
            out.append(refuse(item, error))
    return out


def _undo(model: LlamaModel, starts: dict[int, int], completed: set[int], error: Exception) -> BatchFailed:
    """Take a failed forward's rows out of the cache: each sequence back to where it started."""
    stuck = {sequence for sequence, start in starts.items() if not model.truncate(sequence, start)}
    cells_taken = model.sliding_window > 0 and not model.keeps_window_cells  # `BatchFailed.spoiled`
    spoiled = frozenset(completed) if cells_taken else frozenset()
    return BatchFailed(str(error), spoiled | stuck)


@dataclass(frozen=True)
class StepInput:
    """One sequence's rows in a step: tokens at positions position .. position + n - 1."""

    sequence_id: int
    position: int
    states: FloatRows  # (n, hidden)


@dataclass(frozen=True)
class TokenStep:
    """One sequence's token ids in a step, at positions position .. position + n - 1."""

    sequence_id: int
    position: int
    tokens: list[int]


# A stage's time per token alone is the mean of the middle half of its most recent single-row
# decodes (`interquartile_mean`): a machine whose load changes (a game started on the gaming PC an
# hour in) shows it within a few requests, where a figure over the whole session would take as
# long again to move; and a few decodes that the operating system delayed (a shared, busy machine)
# do not make a stage look slow.
RECENT_ALONE_STEPS = 256
# Recent decodes of each size, for the line a + r·p the waves in flight are priced by
# (planner/waves.py): each size's own window, so sizes the load no longer makes keep their last
# figures; the sizes seen least recently go first beyond MAX_REPORTED_ROW_COUNTS.
RECENT_SIZED_STEPS = 64


def interquartile_mean(samples: Iterable[float]) -> float:
    """The mean of the middle half of `samples` (a quarter cut from each end; the median of fewer
    than four): as robust as the median to a tail of held-up decodes, but not as jumpy where the
    decodes fall in two groups. On a busy machine a short stage's decode either runs through
    (its own cost) or is preempted and waits for a core (several times that), about as often
    each; the median then lands in one group or the other from one run to the next (a 6-block
    stage's median 2.1 ms in one quick ring, 8.8 in the next, at a load average of 11), where this
    moves with the share of each."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    if len(ordered) < 4:
        return statistics.median(ordered)
    cut = len(ordered) / 4  # fractional ends weigh in part, so every count gives the middle half
    total, weight = 0.0, 0.0
    for index, value in enumerate(ordered):
        share = min(index + 1, len(ordered) - cut) - max(index, cut)
        if share > 0:
            total, weight = total + share * value, weight + share
    return total / weight


@dataclass
class StageTimer:
    """Compute time spent and rows processed, so stages can report ms per token.

    Decodes of a single row are also counted apart: batched rows cost less each, and only the
    time of a decode alone compares with the planner's price of a stage (one token at a time).
    """

    seconds: float = 0.0
    rows: int = 0
    decode_seconds: float = 0.0
    decode_rows: int = 0
    alone_steps: int = 0
    alone_recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_ALONE_STEPS))
    sized_recent: dict[int, deque[float]] = field(default_factory=dict)  # rows → recent seconds, least recent first

    def add(self, seconds: float, rows: int, decode: bool) -> None:
        self.seconds += seconds
        self.rows += rows
        if decode:
            self.decode_seconds += seconds
            self.decode_rows += rows
            if rows == 1:
                self.alone_recent.append(seconds)
                self.alone_steps += 1
            if 1 <= rows <= MAX_DECODE_ROWS:
                recent = self.sized_recent.pop(rows, None) or deque(maxlen=RECENT_SIZED_STEPS)
                recent.append(seconds)
                self.sized_recent[rows] = recent  # now the most recently seen size
                if len(self.sized_recent) > MAX_REPORTED_ROW_COUNTS:
                    del self.sized_recent[next(iter(self.sized_recent))]

    def add_forward(
        self, seconds: float, decode: bool, timings: Sequence[tuple[int, float]], row_by_row: Sequence[bool] | None
    ) -> None:
        """A forward of `seconds` run as the decodes in `timings` (rows, seconds). One holding a
        step decoded a row a decode (`_decodes`' `row_by_row`: a greedy token and k drafts are
        k + 1 decodes of a row at every stage) counts each decode as one of its own rows, which the
        figures that price drafts (`decode_ms_by_rows`, planner.waves) must show. Any other forward
        counts as one decode of all its rows (`add`), as the planner prices a wave."""
        if row_by_row is not None and any(row_by_row):
            for rows, spent in timings:
                self.add(spent, rows, decode)
        else:
            self.add(seconds, sum(rows for rows, _ in timings), decode)

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 * self.decode_seconds / self.decode_rows if self.decode_rows else None

    @property
    def prefill_ms_per_token(self) -> float | None:
        """Time per row of the steps that were not decodes: prompts' chunks, which the chunk size of
        pipelined prefill is priced with (planner/prefill.py)."""
        rows = self.rows - self.decode_rows
        return 1e3 * (self.seconds - self.decode_seconds) / rows if rows else None

    @property
    def ms_per_token_alone(self) -> float | None:
        """The interquartile mean of the last RECENT_ALONE_STEPS decodes of one row (fewer, early on)."""
        return 1e3 * interquartile_mean(self.alone_recent) if self.alone_recent else None

    @property
    def decode_ms_by_rows(self) -> list[tuple[int, float]]:
        """The median of each decode size's recent times, by rows."""
        return [(rows, 1e3 * statistics.median(times)) for rows, times in sorted(self.sized_recent.items())]

    def report(self, blocks: tuple[int, int], totals: bool = False) -> StageReport:
        """What the stage holding `blocks` reports of this timer; with `totals`, its whole time and rows."""
        return StageReport(
            range=blocks,
            ms_per_token=self.ms_per_token,
            ms_per_token_alone=self.ms_per_token_alone,
            steps_alone=self.alone_steps,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_ms_by_rows=self.decode_ms_by_rows,
            seconds=self.seconds if totals else None,
            rows=self.rows if totals else None,
        )


class _Rows(Protocol):
    """A sequence's rows at consecutive positions: hidden states, or token ids as a column."""

    @property
    def sequence_id(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def states(self) -> npt.NDArray[Any]: ...


@dataclass(frozen=True)
class _Piece:
    """A run of one step's rows that fits in a single decode."""

    sequence_id: int
    position: int
    states: npt.NDArray[Any]
    ends_step: bool
    step: int  # index of the step it came from


@dataclass(frozen=True)
class _TokenRows:
    sequence_id: int
    position: int
    states: npt.NDArray[np.int32]


def _decodes(
    steps: Sequence[_Rows],
    limit: int,
    one_sequence_each: bool = False,
    max_ends: int | None = None,
    every_row: Sequence[bool] | None = None,
    row_by_row: Sequence[bool] | None = None,
) -> list[list[_Piece]]:
    """Group steps into decodes of at most `limit` rows; a long prompt spans several. With
    `one_sequence_each`, no decode holds rows of two steps; with `max_ends`, no decode holds the
    ends of more steps than that (each end may ask for logits). A step marked in `every_row` (a
    token and its drafts) asks for logits after each of its rows: each counts as an end.

    Any other step may be split between two decodes, a token and its drafts on a block stage
    among them. A cut back into the first part then needs the positions before it, whose cells a
    window's cache would give the second part once they left the window of the drafts before it;
    but every windowed cache's cells also belong to a keeper (`LlamaModel.keeps_window_cells`),
    and one without (that keeps a recurrent state too) never drafts, so is never cut back.

    A step marked in `row_by_row` (a greedy request's token and its drafts) goes one row a
    decode: no decode holds two of its rows, so each row is computed by the kernels that compute
    it without drafts, where llama.cpp's product of several columns rounds otherwise than its
    product of one, and a near-tie would part the greedy text (`_row_rounds`)."""
    if row_by_row is not None and any(row_by_row):
        return _row_rounds(steps, limit, one_sequence_each, max_ends, every_row, row_by_row)
    if one_sequence_each:
        alone = (_decodes([step], limit) for step in steps)
        return [[replace(piece, step=index) for piece in d] for index, ds in enumerate(alone) for d in ds]
    decodes: list[list[_Piece]] = [[]]
    room, ends = limit, 0
    for index, step in enumerate(steps):
        n, start = step.states.shape[0], 0
        if every_row is not None and every_row[index]:
            if n > limit or (max_ends is not None and n > max_ends):
                raise ValueError(f"a step of {n} rows, each asking for logits, exceeds what one decode returns")
            if n > room or (max_ends is not None and ends + n > max_ends):
                decodes.append([])
                room, ends = limit, 0
            decodes[-1].append(_Piece(step.sequence_id, step.position, step.states, True, index))
            room -= n
            ends += n
            continue
        while start < n:
            if room == 0 or (max_ends is not None and ends == max_ends):
                decodes.append([])
                room, ends = limit, 0
            take = min(room, n - start)
            ends += start + take == n
            piece = _Piece(
                step.sequence_id, step.position + start, step.states[start : start + take], start + take == n, index
            )
            decodes[-1].append(piece)
            start += take
            room -= take
    return [d for d in decodes if d]


def _row_rounds(
    steps: Sequence[_Rows],
    limit: int,
    one_sequence_each: bool,
    max_ends: int | None,
    every_row: Sequence[bool] | None,
    row_by_row: Sequence[bool],
) -> list[list[_Piece]]:
    """`_decodes` where some steps go one row a decode: the other steps grouped as ever, then
    round i holding row i of every row-by-row step (one row a sequence, as a wave of several
    sequences without drafts holds: a greedy text is exact as far as decoding without drafts is,
    and k drafts cost k + 1 decodes, not k + 1 per sequence), its first round joining the last
    of the others' decodes where it fits. Each round's row counts as an end (it may ask for
    logits); a round larger than a decode allows goes in parts. A row-by-row step must be its
    sequence's only step in the batch (a wave holds one step of a sequence)."""
    split = [index for index, marked in enumerate(row_by_row) if marked]
    others = [index for index, marked in enumerate(row_by_row) if not marked]
    split_sequences = {steps[index].sequence_id for index in split}
    if len(split_sequences) < len(split) or any(steps[index].sequence_id in split_sequences for index in others):
        raise ValueError("a step decoded one row a decode shares its batch with another step of its sequence")
    wants = None if every_row is None else [every_row[index] for index in others]
    grouped = _decodes([steps[index] for index in others], limit, one_sequence_each, max_ends, wants)
    decodes = [[replace(piece, step=others[piece.step]) for piece in d] for d in grouped]
    width = 1 if one_sequence_each else min(limit, max_ends or limit)
    for row in range(max(steps[index].states.shape[0] for index in split)):
        pieces = [
            _Piece(step.sequence_id, step.position + row, step.states[row : row + 1], row + 1 == n, index)
            for index, step, n in ((i, steps[i], steps[i].states.shape[0]) for i in split)
            if row < n
        ]
        last = decodes[-1] if decodes and row == 0 and not one_sequence_each else None
        if last is not None:
            used = sum(piece.states.shape[0] for piece in last)
            ended = sum(
                piece.states.shape[0] if every_row is not None and every_row[piece.step] else piece.ends_step
                for piece in last
            )
            if used + len(pieces) <= limit and (max_ends is None or ended + len(pieces) <= max_ends):
                last += pieces
                continue
        decodes += [pieces[start : start + width] for start in range(0, len(pieces), width)]
    return decodes


def head_outputs(settings: ContextSettings) -> int:
    """Rows of logits a head's decode may return: one per sequence, and the drafted rows of a wave."""
    return settings.n_seq_max + DRAFT_ROWS_PER_WAVE


def _bounds(pieces: Sequence[_Piece]) -> list[int]:
    """Where each piece's rows start in its decode, and where the last ends."""
    return [0, *itertools.accumulate(piece.states.shape[0] for piece in pieces)]


def _rows(pieces: Sequence[_Piece]) -> tuple[list[int], list[int], npt.NDArray[Any]]:
    sequences: list[int] = []
    positions: list[int] = []
    for piece in pieces:
        n = piece.states.shape[0]
        sequences += [piece.sequence_id] * n
        positions += range(piece.position, piece.position + n)
    states = np.concatenate([p.states for p in pieces]) if len(pieces) > 1 else pieces[0].states
    return sequences, positions, states


def _outputs(
    pieces: Sequence[_Piece], wanted: Sequence[bool] | None, every_row: Sequence[bool] | None
) -> tuple[list[bool], list[tuple[int, int]]]:
    """A decode's rows that ask for logits, and whose they are: (row in the decode, step) pairs
    in row order. The last row of each wanted step ending here, and every row of a step marked in
    `every_row`, which may span several decodes (one row a decode: `_row_rounds`), so its rows are
    gathered across them in order."""
    outputs = [False] * sum(piece.states.shape[0] for piece in pieces)
    owners: list[tuple[int, int]] = []
    end = 0
    for piece in pieces:
        first, end = end, end + piece.states.shape[0]
        if every_row is not None and every_row[piece.step]:
            outputs[first:end] = [True] * (end - first)
            owners += [(row, piece.step) for row in range(first, end)]
        elif piece.ends_step and (wanted is None or wanted[piece.step]):
            outputs[end - 1] = True
            owners.append((end - 1, piece.step))
    return outputs, owners


def _logits_of_steps(
    model: LlamaModel,
    steps: Sequence[_Rows],
    wanted: Sequence[bool] | None,
    as_tokens: bool,
    every_row: Sequence[bool] | None = None,
    one_by_one: bool = False,
    row_by_row: Sequence[bool] | None = None,
    timings: list[tuple[int, float]] | None = None,
) -> list[npt.NDArray[np.float32] | None]:
    """Run the steps in as few decodes as the batch allows (with `one_by_one`, a decode each; a
    step marked in `row_by_row`, a decode a row: `_decodes`); logits after each wanted step's
    last row, or, for a step marked in `every_row`, after each of its rows (a matrix, row by
    row). `timings` gets each decode's rows and seconds."""
    out: list[npt.NDArray[np.float32] | None] = [None] * len(steps)
    gathered: dict[int, list[npt.NDArray[np.float32]]] = {}  # every_row steps' rows so far
    starts = {s.sequence_id: model.next_position(s.sequence_id) for s in steps}
    completed: set[int] = set()
    try:
        max_ends = 1 if one_by_one else model.settings.max_outputs
        decodes = _decodes(steps, model.settings.n_batch, max_ends=max_ends, every_row=every_row, row_by_row=row_by_row)
        for pieces in decodes:
            started = time.perf_counter()
            sequences, positions, rows = _rows(pieces)
            outputs, owners = _outputs(pieces, wanted, every_row)
            if as_tokens:
                model.decode(sequences, positions, outputs, tokens=[int(t) for t in rows[:, 0]])
            else:
                model.decode(sequences, positions, outputs, states=rows)
            completed.update(sequences)
            for row, step in owners:
                if every_row is not None and every_row[step]:
                    gathered.setdefault(step, []).append(model.logits(row))
                else:
                    out[step] = model.logits(row)
            if timings is not None:
                timings.append((len(sequences), time.perf_counter() - started))
    except Exception as error:
        raise _undo(model, starts, completed, error) from error
    for step, logits in gathered.items():
        out[step] = np.stack(logits)
    return out


def _following_positions(model: LlamaModel, held: dict[int, int], steps: Sequence[StepInput]) -> dict[int, int]:
    """Where each sequence's rows will end once `steps` run, refusing (ValueError, before anything
    runs) rows that do not continue where the sequence's last ones ended: llama.cpp would take a
    gap or a repeat silently and corrupt that sequence's cache."""
    following = dict(held)
    for step in steps:
        model.check_sequence(step.sequence_id)
        expected = following.get(step.sequence_id, 0)
        if step.position != expected:
            raise ValueError(
                f"sequence {step.sequence_id} sent rows at position {step.position}; "
                f"this stage holds it up to position {expected}"
            )
        following[step.sequence_id] = step.position + step.states.shape[0]
    return following


def _cut(held: dict[int, int], sequence_id: int, keep: int) -> int:
    """Record a sequence cut to its first `keep` rows, no more than it holds; returns where the
    cut falls, so that the next rows, which must start there, are refused if they do not."""
    kept = max(0, min(keep, held.get(sequence_id, 0)))
    if kept:
        held[sequence_id] = kept
    else:
        held.pop(sequence_id, None)
    return kept


def _slice_range(reader: FastGGUFReader) -> tuple[int, int, int]:
    """The first block a stage file holds, in the whole model's numbering, how many of the model's
    it holds, and how many blocks its graph runs (identity blocks first: `families.SliceRules`)."""
    arch = reader.scalar("general.architecture")
    runs = int(reader.scalar(f"{arch}.block_count"))
    return int(reader.scalar("kafila.slice.first_block", 0)), runs - int(reader.scalar(IDENTITY_BLOCKS_KEY, 0)), runs


def _input_restored_at(reader: FastGGUFReader) -> str | None:
    """Where a stage of this file's family puts the hidden states it is fed back into the graph
    (`Family.input_restored_at`), or None where llama.cpp takes them as they are."""
    family = FAMILIES.get(str(reader.scalar("general.architecture")))
    return family.input_restored_at if family is not None else None


def _last_block_capture(target: bytes, captured: list[FloatRows]) -> Callable[[int, bool, object], bool]:
    """The graph callback of a block stage: it asks ggml for the node named `target` alone, appends
    its rows to `captured`, and stops the graph there.

    ggml's scheduler asks it about every node in order until it asks for one (685 times a decode
    for gemma-3-270m's 17 blocks), then computes all the nodes up to that one at once, and stops
    if the callback answers False once it has seen its data (ggml_backend_sched_compute_splits).
    So every node costs a call from C into Python: a closure over locals, with the name read
    while holding the GIL (`GGMLBase`), costs the least there (docs/benchmarks.md, helper-59)."""
    ggml = GGMLBase.load()
    get_name, nbytes, tensor_get = ggml.get_name, ggml.nbytes, ggml.tensor_get

    def on_tensor(tensor: int, ask: bool, _user: object) -> bool:
        if get_name(tensor) != target:
            return not ask  # not ours: do not ask for it, and let the graph go on
        if ask:
            return True
        size = nbytes(tensor)
        rows = np.empty(size // 4, dtype=np.float32)
        tensor_get(tensor, rows.ctypes.data, 0, size)
        captured.append(rows)
        return False  # stop here: nothing after the last block is needed

    return on_tensor


class BlockStage:
    """Blocks only: hidden states in, the residual after the last block out."""

    def __init__(self, path: str | os.PathLike[str], settings: ContextSettings) -> None:
        header = FastGGUFReader(path)  # read once: a large vocabulary's header takes ~0.07 s to parse
        self.first_block, n_layers, runs = _slice_range(header)
        self.n_layers = n_layers
        self._captured: list[FloatRows] = []
        self.model = LlamaModel(
            path,
            settings,
            eval_callback=_last_block_capture(f"l_out-{runs - 1}".encode(), self._captured),
            input_restored_at=_input_restored_at(header),
        )
        self.hidden = self.model.n_embd
        self.timer = StageTimer()
        self.name = f"the stage holding blocks {self.first_block}-{self.first_block + n_layers - 1}"
        self._next_position: dict[int, int] = {}  # per sequence: where its next rows must start

    def forward(
        self, steps: Sequence[StepInput], decode: bool = False, row_by_row: Sequence[bool] | None = None
    ) -> list[FloatRows]:
        """Hidden states after this stage's last block, one matrix per step; a step marked in
        `row_by_row` (a greedy request's token and drafts) decoded a row a decode (`_decodes`).

        Each sequence's rows must continue where its last ones ended (from 0 after `forget`):
        llama.cpp would take a gap or a repeat silently and corrupt that sequence's cache, so a
        frame out of order is refused with ValueError before anything runs. A forward that fails
        once running raises BatchFailed, with what it wrote taken out of the cache again.
        """
        following = _following_positions(self.model, self._next_position, steps)
        started = time.perf_counter()
        pieces_out: list[list[FloatRows]] = [[] for _ in steps]  # each step's rows, decode by decode
        timings: list[tuple[int, float]] = []
        completed: set[int] = set()
        # The capture reads one graph per decode; where blocks keep a recurrent state, llama.cpp
        # runs each sequence of a decode whose rows are all outputs as a graph of its own
        # (llama_memory_hybrid::init_batch, split_seq), so there each sequence decodes alone.
        alone = self.model.keeps_recurrent_state
        try:
            for pieces in _decodes(steps, self.model.settings.n_batch, one_sequence_each=alone, row_by_row=row_by_row):
                decode_started = time.perf_counter()
                sequences, positions, states = _rows(pieces)
                self._captured.clear()
                self.model.decode(sequences, positions, [True] * len(sequences), states=states)
                if len(self._captured) != 1 or self._captured[0].shape[0] != len(sequences) * self.hidden:
                    raise RuntimeError("the stage's last block output was not captured whole")
                completed.update(sequences)
                captured = self._captured[0].reshape(len(sequences), self.hidden)
                for piece, (a, b) in zip(pieces, itertools.pairwise(_bounds(pieces)), strict=True):
                    pieces_out[piece.step].append(captured[a:b])
                timings.append((len(sequences), time.perf_counter() - decode_started))
        except Exception as error:
            starts = {s.sequence_id: self._next_position.get(s.sequence_id, 0) for s in steps}
            raise _undo(self.model, starts, completed, error) from error
        self._next_position = following
        self.timer.add_forward(time.perf_counter() - started, decode, timings, row_by_row)
        empty = np.empty((0, self.hidden), dtype=np.float32)
        return [np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else empty for parts in pieces_out]

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        """Cut a sequence to its first `keep` rows (all gone by default): the next request in its
        slot goes on from there."""
        self.model.forget(sequence_id, _cut(self._next_position, sequence_id, keep))

    def close(self) -> None:
        self.model.close()


class Vocabulary:
    """Tokenizer and detokenizer over a model that holds the full vocabulary."""

    def __init__(self, model: LlamaModel | VocabularyOnly) -> None:
        self._model = model
        self._llama = model._llama
        self._shown: frozenset[int] = frozenset()  # special tokens written out as text

    def show_special(self, texts: Sequence[str]) -> None:
        """Write these special tokens (where the vocabulary has them, as one token each) into the
        text, as a reply's syntax needs (`[TOOL_CALLS]`, harmony's `<|channel|>`); other special
        tokens stay unwritten."""
        shown = set()
        for text in texts:
            ids = self.tokenize(text, add_special=False, parse_special=True)
            if len(ids) == 1 and self.piece_special(ids[0]) == text:
                shown.add(ids[0])
        self._shown = frozenset(shown)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buffer = (self._llama.llama_token * capacity)()
        n = self._llama.llama_tokenize(self._model.vocab, data, len(data), buffer, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buffer = (self._llama.llama_token * capacity)()
            n = self._llama.llama_tokenize(
                self._model.vocab, data, len(data), buffer, capacity, add_special, parse_special
            )
        return list(buffer[:n])

    def piece(self, token: int) -> bytes:
        special = token in self._shown
        buffer = ctypes.create_string_buffer(64)
        n = self._llama.llama_token_to_piece(self._model.vocab, token, buffer, 64, 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self._llama.llama_token_to_piece(self._model.vocab, token, buffer, -n, 0, special)
        return buffer.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_end(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self._model.vocab, token))

    def chat_template(self) -> str | None:
        """The model's own Jinja chat template, from its GGUF metadata, if it has one."""
        text = self._llama.llama_model_chat_template(self._model.model, None)
        return text.decode("utf-8", errors="replace") if text else None

    def special_text(self) -> tuple[str, str]:
        """The beginning- and end-of-sequence tokens as text, which chat templates write out."""
        lib, vocab = self._llama, self._model.vocab
        bos, eos = lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab)
        return (self.piece_special(bos) if bos >= 0 else "", self.piece_special(eos) if eos >= 0 else "")

    def piece_special(self, token: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        n = self._llama.llama_token_to_piece(self._model.vocab, token, buffer, 256, 0, True)
        return buffer.raw[: max(0, n)].decode("utf-8", errors="replace")


Q8_0_BLOCK_BYTES = 34  # an f16 scale, then 32 int8


def q8_0_rows(raw: npt.NDArray[np.uint8]) -> FloatRows:
    """Q8_0 blocks dequantized as gguf's `dequantize` does (each int8 times its block's scale, in
    f32), without its generic splitting and grouping, which cost several times the arithmetic:
    the host embeds each token on the ring's critical path (docs/benchmarks.md, issue 38)."""
    blocks = raw.reshape(-1, Q8_0_BLOCK_BYTES)
    scales = blocks[:, :2].view(np.float16).astype(np.float32)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * scales


class TokenEmbedding:
    """Rows of token_embd, dequantized as llama.cpp would, plus the family's input transform."""

    def __init__(self, source: str | os.PathLike[str] | FastGGUFReader) -> None:
        """`source`: the model's (or a stage's) file, or its header already read."""
        reader = source if isinstance(source, FastGGUFReader) else FastGGUFReader(source)
        arch = str(reader.scalar("general.architecture"))
        tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tensor is None:
            raise ValueError(f"{reader.data.filename} has no token_embd.weight")
        self._reader = reader  # keeps the memory map open
        # A plain array over the map: np.memmap's indexing runs Python of its own on every row taken.
        self._rows = tensor.data.view(np.ndarray)
        self._type = GGMLQuantizationType(tensor.tensor_type)
        self.n_embd = int(tensor.shape[0])
        self._scale = family_of(arch).token_input_scale(self.n_embd)

    def __call__(self, tokens: Sequence[int]) -> FloatRows:
        raw = self._rows[np.asarray(tokens, dtype=np.int64)]
        if self._type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            rows = raw.astype(np.float32)
        elif self._type == GGMLQuantizationType.Q8_0:
            rows = q8_0_rows(raw)
        else:
            rows = dequantize(raw, self._type).astype(np.float32, copy=False)
        rows = rows.reshape(len(tokens), self.n_embd)
        return rows * self._scale if self._scale is not None else rows


class HeadStage:
    """The last blocks and the output: hidden states in, logits out; embeds tokens itself."""

    def __init__(self, path: str | os.PathLike[str], settings: ContextSettings) -> None:
        settings = replace(settings, max_outputs=head_outputs(settings))
        # Read once for all that needs it: a 262k-token vocabulary's header takes ~0.07 s to parse,
        # and the head loads after the host's own stage's last byte, on the way to serving.
        self.header = FastGGUFReader(path)
        self.model = LlamaModel(path, settings, input_restored_at=_input_restored_at(self.header))
        self.embed = TokenEmbedding(self.header)
        self.vocabulary = Vocabulary(self.model)
        self.hidden = self.model.n_embd
        self.timer = StageTimer()
        self.row_split = RowSplit()  # a wave's rows together or one decode each, as they cost here
        self.first_block, self.n_layers, _runs = _slice_range(self.header)
        self.name = f"the head (blocks {self.first_block}-{self.first_block + self.n_layers - 1})"
        self._next_position: dict[int, int] = {}  # per sequence: where its next rows must start
        self._samplers: dict[int, Sampler] = {}  # sequences the host has this head sample (on a member)
        self._refused_samplers: dict[int, str] = {}  # sequences whose sampler could not start: why

    def start_sampling(self, sequence_id: int, start: SamplerStart) -> None:
        """Sample this sequence here from now on, as the host would have: same chain, same seed,
        the prompt accepted first. Replaces any sampler the slot had."""
        n_vocab = self.model.n_vocab
        if any(token >= n_vocab for token in start.prompt):
            raise ValueError(f"the prompt names a token outside this model's {n_vocab}")
        self.stop_sampling(sequence_id)
        self._refused_samplers.pop(sequence_id, None)
        sampler = Sampler(start.settings, n_vocab, self.model.vocab)
        sampler.accept(start.prompt)
        self._samplers[sequence_id] = sampler

    def refuse_sampling(self, sequence_id: int, reason: str) -> None:
        """A start that could not be honoured: the sequence's rows are refused, with `reason`."""
        self.stop_sampling(sequence_id)
        self._refused_samplers[sequence_id] = reason

    def samples(self, sequence_id: int) -> bool:
        return sequence_id in self._samplers

    def why_not_sampling(self, sequence_id: int) -> str:
        reason = self._refused_samplers.get(sequence_id)
        return f"its sampler could not start: {reason}" if reason else "no sampler was started for it"

    def sample(self, sequence_id: int, logits: npt.NDArray[np.float32]) -> int:
        """The next token of a sequence sampled here; the sampler remembers it for its penalties."""
        return self._samplers[sequence_id].sample(logits)

    def stop_sampling(self, sequence_id: int) -> None:
        sampler = self._samplers.pop(sequence_id, None)
        if sampler is not None:
            sampler.close()

    def forward(
        self,
        steps: Sequence[StepInput],
        decode: bool = False,
        wanted: Sequence[bool] | None = None,
        every_row: Sequence[bool] | None = None,
        row_by_row: Sequence[bool] | None = None,
    ) -> list[npt.NDArray[np.float32] | None]:
        """Logits for the last row of every wanted step (all by default); None for the others; for
        a step marked in `every_row` (a token and its drafts), logits after each row, as a matrix,
        and one marked in `row_by_row` too (a greedy request's) decoded a row a decode (`_decodes`).

        Rows out of position order are refused with ValueError before anything runs, as a
        block stage refuses them: on a member, the head is fed by the ring, not by the engine.
        """
        following = _following_positions(self.model, self._next_position, steps)
        rows = sum(s.states.shape[0] for s in steps)
        single_rows = decode and rows == len(steps) and not any(every_row or ())
        one_by_one = single_rows and self.row_split.one_by_one(rows)
        started = time.perf_counter()
        timings: list[tuple[int, float]] = []
        logits = _logits_of_steps(self.model, steps, wanted, False, every_row, one_by_one, row_by_row, timings)
        seconds = time.perf_counter() - started
        self._next_position = following
        self.timer.add_forward(seconds, decode, timings, row_by_row)
        if single_rows:
            self.row_split.record(rows, seconds, one_by_one)
        return logits

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        """As `BlockStage.forget`; the sequence's sampler ends with its request either way."""
        self.stop_sampling(sequence_id)
        self._refused_samplers.pop(sequence_id, None)
        self.model.forget(sequence_id, _cut(self._next_position, sequence_id, keep))

    def close(self) -> None:
        for sequence_id in list(self._samplers):
            self.stop_sampling(sequence_id)
        self.model.close()


class WholeModel:
    """An unsplit model on token ids: one-member sessions, and the reference for every split."""

    def __init__(self, path: str | os.PathLike[str], settings: ContextSettings) -> None:
        settings = replace(settings, max_outputs=head_outputs(settings))
        self.model = LlamaModel(path, settings)
        self.vocabulary = Vocabulary(self.model)
        self.timer = StageTimer()
        self.path = Path(path)

    def forward_tokens(
        self, sequence_id: int, position: int, tokens: Sequence[int], decode: bool = False
    ) -> npt.NDArray[np.float32]:
        """Logits after the last of the tokens."""
        (logits,) = self.forward_steps([TokenStep(sequence_id, position, list(tokens))], decode)
        assert logits is not None
        return logits

    def forward_steps(
        self,
        steps: Sequence[TokenStep],
        decode: bool = False,
        wanted: Sequence[bool] | None = None,
        every_row: Sequence[bool] | None = None,
        row_by_row: Sequence[bool] | None = None,
    ) -> list[npt.NDArray[np.float32] | None]:
        """Logits after the last token of every wanted step (after each token, as a matrix, for a
        step marked in `every_row`, decoded a row a decode where marked in `row_by_row`: `_decodes`);
        the steps of many sequences share decodes."""
        started = time.perf_counter()
        rows = [_TokenRows(s.sequence_id, s.position, np.asarray(s.tokens, dtype=np.int32)[:, None]) for s in steps]
        timings: list[tuple[int, float]] = []
        logits = _logits_of_steps(
            self.model, rows, wanted, as_tokens=True, every_row=every_row, row_by_row=row_by_row, timings=timings
        )
        self.timer.add_forward(time.perf_counter() - started, decode, timings, row_by_row)
        return logits

    def forget(self, sequence_id: int, keep: int = 0) -> None:
        self.model.forget(sequence_id, keep)

    def close(self) -> None:
        self.model.close()
