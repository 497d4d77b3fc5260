"""Log probabilities of generated tokens, as OpenAI reports them.

The values are the model's own distribution: the log-softmax of the raw logits the head
produced for the row, before the repeat, frequency and presence penalties, top-k, top-p or
temperature touch them (OpenAI reports the same; llama.cpp's server can also report the
probabilities after its sampler chain, which this server does not). Computed on the host from the
whole row where it has it; where a head on a member sends less than the whole row (its top
entries, or only the token its own sampler drew), the member sends the row's log-sum-exp and
its largest entries with it (`Frame.with_logprobs`), so the values are the same either way.

Pure: numpy only, so the arithmetic is tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kafila.wire.frames import MAX_TOP_LOGPROBS, top_ids


@dataclass(frozen=True)
class Alternative:
    token: int
    piece: bytes  # the token's bytes as the vocabulary spells them
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and the most likely tokens at its position, most
    likely first (the chosen one among them where it is one of the top k)."""

    token: int
    piece: bytes
    logprob: float
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class HeadRow:
    """A head on a member's answer to a step that asked for log probabilities: the logits it sent
    (the whole row, its top entries, or the chosen token alone, other entries -inf) for the
    sampler, and the whole row's log-sum-exp and largest entries, for the log probabilities."""

    logits: npt.NDArray[np.float32]
    logsumexp: float
    top_ids: npt.NDArray[np.int32]
    top_logits: npt.NDArray[np.float32]


def logsumexp(row: npt.NDArray[np.floating]) -> float:
    values = np.asarray(row, dtype=np.float64)
    peak = float(values.max())
    return peak + float(np.log(np.exp(values - peak).sum()))


def token_logprob(
    row: npt.NDArray[np.floating] | HeadRow, token: int, alternatives: int, piece: Callable[[int], bytes]
) -> TokenLogprob:
    """The chosen `token`'s log probability and the `alternatives` most likely tokens' at its row."""
    if not 0 <= alternatives <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{alternatives} alternatives: at most {MAX_TOP_LOGPROBS}")
    if isinstance(row, HeadRow):
        lse, chosen = row.logsumexp, float(row.logits[token])
        pairs = zip(row.top_ids[:alternatives].tolist(), row.top_logits[:alternatives].tolist(), strict=True)
    else:
        lse, chosen = logsumexp(row), float(row[token])
        ids = top_ids(row, alternatives)
        pairs = zip(ids.tolist(), row[ids].tolist(), strict=True)
    top = tuple(Alternative(i, piece(i), v - lse) for i, v in pairs)
    return TokenLogprob(token, piece(token), chosen - lse, top)
