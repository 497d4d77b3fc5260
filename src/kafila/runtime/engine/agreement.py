"""How close a split ring stays to the unsplit model, by tolerance rather than bit equality.

Stages on different backends (CUDA, Metal, CPU) or with different kernels (flash attention on
or off) add, multiply and round in different orders: their floats differ slightly, and a greedy
run may part from the unsplit model's at a near-tie. The split-correctness tests demand identical
tokens from identical kernels; this module says whether a ring whose kernels differ is still the
same model:

- hidden states at each cut, and the final logits, by relative error per row against the same
  positions of the unsplit model;
- top tokens, teacher-forced: the ring is fed the unsplit model's greedy tokens, and each
  position's top token is compared; where the unsplit model's own two candidates lie within a
  small margin, a disagreement is a near-tie, reported and not failed;
- where free-running greedy texts first part (reported only: after a near-tie they may).

Pure statistics over numpy arrays; `agreement_ring` drives real stages to collect them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float32] | npt.NDArray[np.float64]


@dataclass(frozen=True)
class Tolerance:
    """What a ring may differ by and still pass.

    Measured on CPU, flash attention off in one stage of a ring whose other stage and unsplit
    model have it on moves the hidden states at the cut by up to 4.5% and the logits by up to 8%
    (tiny random llama and gemma3, gemma-3-270m). A wrong weight that moves them by more is
    flagged: on the tiny llama one norm weight scaled by 1.1 gives 20% and 33%; on gemma-3-270m,
    whose residual is dominated by a few large dimensions, one block's FFN output scaled by 1.5
    gives 13% and 19% (by 1.1 it stays within, about as far off as flash attention off). The
    defaults leave room for other kernels, not for such a weight; tighten them for one backend."""

    hidden_relative_error: float = 0.1  # at any cut, any row
    logit_relative_error: float = 0.15  # at any position
    # Where the unsplit model's top two candidates lie closer than this many standard deviations
    # of its logits over the vocabulary, a ring choosing the other one is a near-tie.
    near_tie_margin: float = 0.1
    disagreements: int = 0  # teacher-forced top tokens that may differ beyond a near-tie


@dataclass(frozen=True)
class ErrorSpread:
    """Relative errors over rows: ||ring - unsplit|| / ||unsplit||, row by row."""

    rows: int
    max: float
    median: float


@dataclass(frozen=True)
class CutError:
    """The hidden states a stage sends across a cut, against the unsplit model's at that block."""

    after_block: int  # the whole model's index of the last block before the cut
    spread: ErrorSpread


@dataclass(frozen=True)
class TopTokenAgreement:
    """Teacher-forced top tokens: positions compared, how many agree, and where they do not."""

    positions: int
    agreeing: int
    near_ties: tuple[int, ...]  # differing positions whose unsplit candidates lie within the margin
    disagreements: tuple[int, ...]  # differing positions beyond it

    @property
    def fraction(self) -> float:
        return self.agreeing / self.positions if self.positions else 1.0


@dataclass(frozen=True)
class AgreementReport:
    cuts: tuple[CutError, ...]
    logits: ErrorSpread
    top_tokens: TopTokenAgreement
    free_run_tokens: int  # greedy tokens each side generated on its own
    free_run_divergence: int | None  # the first index where they differ; None: identical

    def problems(self, tolerance: Tolerance) -> list[str]:
        """Why the ring is out of tolerance, one line each; empty when it is within."""
        out = [
            f"hidden states after block {cut.after_block}: relative error up to {cut.spread.max:.3g} "
            f"(tolerance {tolerance.hidden_relative_error:g})"
            for cut in self.cuts
            if not cut.spread.max <= tolerance.hidden_relative_error
        ]
        if not self.logits.max <= tolerance.logit_relative_error:
            out.append(
                f"logits: relative error up to {self.logits.max:.3g} (tolerance {tolerance.logit_relative_error:g})"
            )
        wrong = self.top_tokens.disagreements
        if len(wrong) > tolerance.disagreements:
            out.append(
                f"top tokens differ beyond a near-tie at {len(wrong)} of {self.top_tokens.positions} positions "
                f"(first at {wrong[0]}; {tolerance.disagreements} allowed)"
            )
        return out

    def lines(self) -> list[str]:
        """The report, for a person."""
        out = [
            f"hidden states after block {cut.after_block}: relative error max {cut.spread.max:.3g}, "
            f"median {cut.spread.median:.3g} over {cut.spread.rows} rows"
            for cut in self.cuts
        ]
        out.append(
            f"logits: relative error max {self.logits.max:.3g}, median {self.logits.median:.3g} "
            f"over {self.logits.rows} positions"
        )
        top = self.top_tokens
        out.append(
            f"top tokens (teacher-forced): {top.agreeing}/{top.positions} agree ({top.fraction:.1%}); "
            f"near-ties at {list(top.near_ties)}; beyond a near-tie at {list(top.disagreements)}"
        )
        parted = "never" if self.free_run_divergence is None else f"at token {self.free_run_divergence}"
        out.append(f"free-running greedy, {self.free_run_tokens} tokens: the texts part {parted}")
        return out


def relative_errors(ring: Floats, unsplit: Floats) -> npt.NDArray[np.float64]:
    """Per row, the L2 norm of the difference over the unsplit row's (rows of zeros count as 1)."""
    a, b = np.asarray(ring, dtype=np.float64), np.asarray(unsplit, dtype=np.float64)
    if a.shape != b.shape or a.ndim not in (1, 2):
        raise ValueError(f"ring rows of shape {a.shape} against unsplit rows of shape {b.shape}")
    a, b = np.atleast_2d(a), np.atleast_2d(b)  # one row given as a vector
    scale = np.linalg.norm(b, axis=1)
    return np.asarray(np.linalg.norm(a - b, axis=1) / np.where(scale > 0, scale, 1.0), dtype=np.float64)


def spread(errors: npt.NDArray[np.float64]) -> ErrorSpread:
    if errors.size == 0:
        raise ValueError("no rows to compare")
    return ErrorSpread(rows=int(errors.size), max=float(np.max(errors)), median=float(np.median(errors)))


def top_token_agreement(ring: Floats, unsplit: Floats, margin: float) -> TopTokenAgreement:
    """Row by row, whether the ring's top token is the unsplit model's; a differing row is a near-tie
    when the unsplit model puts the ring's choice within `margin` standard deviations of its row
    (scale-free: a model's logits may span 5 or 50) of its own."""
    a, b = np.asarray(ring), np.asarray(unsplit)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"logits of shapes {a.shape} and {b.shape}; expected two equal (positions, vocabulary)")
    ring_top, unsplit_top = np.argmax(a, axis=1), np.argmax(b, axis=1)
    near: list[int] = []
    beyond: list[int] = []
    for position in np.flatnonzero(ring_top != unsplit_top):
        row = b[position]
        gap = float(row[unsplit_top[position]]) - float(row[ring_top[position]])
        (near if gap <= margin * float(np.std(row)) else beyond).append(int(position))
    agreeing = int(np.count_nonzero(ring_top == unsplit_top))
    return TopTokenAgreement(a.shape[0], agreeing, tuple(near), tuple(beyond))


def first_divergence(ring: Sequence[int], unsplit: Sequence[int]) -> int | None:
    """The first index where two token runs differ (a run ending early differs there); None if equal."""
    for index, (x, y) in enumerate(zip(ring, unsplit, strict=False)):
        if x != y:
            return index
    return None if len(ring) == len(unsplit) else min(len(ring), len(unsplit))
