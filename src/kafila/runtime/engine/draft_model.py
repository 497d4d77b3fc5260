"""A draft model on the host (`kafila host --speculate draft --draft MODEL`): a small model with
the target's vocabulary, run by this process's llama.cpp, whose guesses ride behind each
sequence's token as drafted rows and are checked in the same trip round the ring.

The draft model keeps one sequence of its own cache per slot of the target's, holding the
tokens it last saw there. Before each draft it catches up on what the sequence emitted since,
cutting its cache back to where they agree first: rejected drafts are cut there, and a next
request in the slot reuses the prefix it shares, as the target's cache does. A greedy request
is drafted greedily (q a point mass); a sampled one is drafted by drawing from the draft's
distribution after the request's own top-k, top-p and temperature, whose rows go with the draft
(`drawn_from`) for the speculative sampling rule (`speculation.speculative_pick`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kafila.runtime.engine.sampling import Sampler, SamplingSettings
from kafila.runtime.engine.speculation import DRAFT_DRAW, MAX_DRAFT, Drafter, uniform
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.model import ContextSettings, LlamaModel

TOKENS_KEY = "tokenizer.ggml.tokens"


class DraftRefused(ValueError):
    """A draft model that cannot draft for this target: the message says why."""


def check_draft(target: FastGGUFReader, target_name: str, draft: Path) -> None:
    """Raises DraftRefused, saying why, unless `draft` can draft for the target: the same tokens
    id for id, and a cache that can be cut back."""
    if not draft.is_file():
        raise DraftRefused(f"no draft model file at {draft}")
    reader = FastGGUFReader(draft)
    why = vocabulary_mismatch(target, reader)
    if why is not None:
        raise DraftRefused(
            f"the draft model {draft.name} cannot draft for {target_name}: their vocabularies differ ({why}); a "
            "draft model must have the target's tokens, id for id (a small model of the same family: "
            "gemma-3-270m for gemma-3-27b, Qwen3-0.6B for Qwen3-32B)"
        )


def vocabulary_mismatch(target: FastGGUFReader, draft: FastGGUFReader) -> str | None:
    """Why the draft's tokens are not the target's, or None where they are the same, id for id:
    a draft proposes token ids, which the target reads as its own."""
    target_count, draft_count = target.array_length(TOKENS_KEY), draft.array_length(TOKENS_KEY)
    if target_count is None or draft_count is None:
        return "a model's header has no vocabulary (tokenizer.ggml.tokens)"
    if target_count != draft_count:
        return f"the target has {target_count:,} tokens and the draft {draft_count:,}"
    for token_id, (ours, theirs) in enumerate(zip(target.strings(TOKENS_KEY), draft.strings(TOKENS_KEY), strict=True)):
        if ours != theirs:
            return f"token {token_id} is {ours!r} in the target and {theirs!r} in the draft"
    return None


def draft_footprint(path: Path, context: int, sequences: int) -> int:
    """Bytes a draft model holds beside the target's blocks: its weights, its cache for `sequences`
    of `context` tokens, and a row of logits a sequence (see `DraftModel`)."""
    manifest = read_manifest(path)
    vocabulary = manifest.context.n_vocab if manifest.context is not None else 0
    return path.stat().st_size + sum(manifest.cache_bytes(context, sequences)) + 4 * vocabulary * sequences


class DraftModel:
    """The draft model's llama.cpp context, a sequence per slot of the target's.

    Only the engine thread uses it (the batcher drafts while it plans a wave)."""

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        self.path = path
        # A row of logits a sequence per decode at most (each round, and a catch-up's last row):
        # llama.cpp's default reserves n_batch rows, 512 MiB at n_batch 512 for a 262k vocabulary.
        self.model = LlamaModel(path, replace(settings, max_outputs=settings.n_seq_max))
        if not self.model.holds_positions:
            self.model.close()
            raise DraftRefused(f"{path.name} keeps a recurrent state, which cannot be cut back to drop rejected drafts")
        self.n_vocab = self.model.n_vocab
        self._held: dict[int, list[int]] = {}  # slot → the tokens its cache holds, in position order
        self.decodes = 0  # llama_decode calls, over the model's life
        # Of them, those that caught a cache up on more than a trip brings (a prompt, a resumed
        # request), and their seconds: a one-off prefill, not what a drafted token costs.
        self.prompt_decodes = 0
        self.prompt_s = 0.0

    def drafter(self, slot: int, tokens: Sequence[int], sampling: SamplingSettings) -> ModelDrafter:
        """A drafter for the request that starts in `slot` with `tokens` (its prompt, and on a
        resumed request what it had generated)."""
        self.model.check_sequence(slot)
        return ModelDrafter(self, slot, tokens, sampling)

    def close(self) -> None:
        self.model.close()

    def draft_many(self, asked: Sequence[tuple[Drafter, int]]) -> list[list[int]]:
        """Each drafter's drafts (this model's `ModelDrafter`s), as many as its limit: its
        sequence's cache caught up first, then one drafted token a round, every sequence's row
        of a round in one decode. On a failed decode the slots it touched are dropped (drafted
        afresh next time) and it raises."""
        wanted = [(drafter, limit) for drafter, limit in asked if isinstance(drafter, ModelDrafter)]
        if len(wanted) != len(asked):
            raise TypeError("only this draft model's drafters draft here")
        drafted: list[list[int]] = [[] for _ in wanted]
        rows: list[list[npt.NDArray[np.float64]]] = [[] for _ in wanted]
        live = [(index, drafter, limit) for index, (drafter, limit) in enumerate(wanted) if limit > 0]
        for drafter, _ in wanted:
            drafter._drawn_from = None
        if not live:
            return drafted
        try:
            # Catch up: the tokens each cache lacks (at least the last, whose row gives the logits).
            pending = [
                (index, drafter._slot, position, token)
                for index, drafter, _ in live
                for position, token in self._behind(drafter._slot, drafter._tokens)
            ]
            logits = self._decode(pending, prompt=_more_than_a_trip_brings(len(pending), len(live)))
            for round_ in range(max(limit for _, _, limit in live)):
                pending = []
                for index, drafter, limit in live:
                    if round_ >= limit:
                        continue
                    position = len(drafter._tokens) + round_
                    token, q = drafter._choose(logits[index], position)
                    drafted[index].append(token)
                    if q is not None:
                        rows[index].append(q)
                    if round_ + 1 < limit:
                        pending.append((index, drafter._slot, position, token))
                if not pending:
                    break
                logits.update(self._decode(pending))
        except Exception:
            for _, drafter, _ in live:
                self.model.forget(drafter._slot)
                self._held[drafter._slot] = []
            raise
        for index, drafter, _ in live:
            if rows[index]:
                drafter._drawn_from = np.stack(rows[index])
        return drafted

    def catch_up(self, drafters: Sequence[Drafter]) -> None:
        """Catch the caches of `drafters` (this model's) up on what they lack, all but the last
        token (whose logits their next draft takes), where that is more than a trip brings (a
        prompt): called while the prompt's own prefill is out round the ring, so that the
        draft's prefill overlaps that trip instead of delaying the sequence's first drafted
        wave. On a failed decode the slots it touched are dropped (caught up when drafting) and
        it raises."""
        pending: list[tuple[int, int, int, int]] = []
        touched: list[int] = []
        for index, drafter in enumerate(drafters):
            if not isinstance(drafter, ModelDrafter):
                raise TypeError("only this draft model's drafters catch up here")
            if not _more_than_a_trip_brings(len(drafter._tokens) - len(self._held.get(drafter._slot, []))):
                continue
            behind = self._behind(drafter._slot, drafter._tokens)
            if _more_than_a_trip_brings(len(behind)):
                pending += [(index, drafter._slot, position, token) for position, token in behind[:-1]]
                touched.append(drafter._slot)
        if not pending:
            return
        try:
            self._decode(pending, prompt=True)
        except Exception:
            for slot in touched:
                self.model.forget(slot)
                self._held[slot] = []
            raise

    def _behind(self, slot: int, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Cut `slot`'s cache to the prefix it shares with `tokens` (short of their last token,
        whose logits are wanted) and return the (position, token) rows it lacks."""
        held = self._held.get(slot, [])
        common = len(held) if list(tokens[: len(held)]) == held else _common_prefix(held, tokens)
        common = min(common, len(tokens) - 1)
        if not self.model.truncate(slot, common):
            self.model.forget(slot)
            common = 0
        self._held[slot] = list(tokens[:common])
        return list(enumerate(tokens))[common:]

    def _decode(
        self, pending: Sequence[tuple[int, int, int, int]], prompt: bool = False
    ) -> dict[int, npt.NDArray[np.float32]]:
        """Decode rows (drafter index, slot, position, token), n_batch at a time; the logits of
        each drafter's last row. `prompt`: the rows catch caches up on more than a trip brings,
        and their decodes and seconds are counted so (`prompt_decodes`, `prompt_s`)."""
        decodes, started = self.decodes, time.perf_counter()
        last = {index: row for row, (index, _, _, _) in enumerate(pending)}
        logits: dict[int, npt.NDArray[np.float32]] = {}
        size = self.model.settings.n_batch
        for start in range(0, len(pending), size):
            chunk = pending[start : start + size]
            outputs = [last[index] == start + i for i, (index, _, _, _) in enumerate(chunk)]
            slots = [slot for _, slot, _, _ in chunk]
            positions = [position for _, _, position, _ in chunk]
            self.model.decode(slots, positions, outputs, tokens=[token for _, _, _, token in chunk])
            self.decodes += 1
            for i, (index, slot, _, token) in enumerate(chunk):
                self._held[slot].append(token)
                if outputs[i]:
                    logits[index] = self.model.logits(i)
        if prompt:
            self.prompt_decodes += self.decodes - decodes
            self.prompt_s += time.perf_counter() - started
        return logits


def _more_than_a_trip_brings(rows: int, sequences: int = 1) -> bool:
    """Whether `rows` for `sequences` to catch up on are more than a trip brings them (a token and
    its drafts each): a prompt or a resumed request, not what the last wave emitted."""
    return rows > sequences * (MAX_DRAFT + 1)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common


class ModelDrafter:
    """One sequence's drafter on the draft model (`speculation.Drafter`)."""

    def __init__(self, model: DraftModel, slot: int, tokens: Sequence[int], sampling: SamplingSettings) -> None:
        self._model, self._slot = model, slot
        self._tokens = list(tokens)
        self._seed = sampling.seed
        # A greedy request, or one held to a grammar (whose draw is not one distribution's), is
        # drafted greedily; a sampled one from the draft's own distribution with its settings.
        self._shape: Sampler | None = None
        if not sampling.greedy and sampling.temperature > 0.0 and sampling.grammar is None:
            self._shape = Sampler(sampling, model.n_vocab)
            self._shape.accept(self._tokens)
        self._drawn_from: npt.NDArray[np.float64] | None = None

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def drawn_from(self) -> npt.NDArray[np.float64] | None:
        return self._drawn_from

    @property
    def guesses_free(self) -> bool:
        """A draft costs a decode of the draft model."""
        return False

    @property
    def samples(self) -> bool:
        """Whether drafts are drawn from the draft's distribution (a sampled request)."""
        return self._shape is not None

    def extend(self, tokens: Iterable[int]) -> None:
        added = list(tokens)
        self._tokens += added
        if self._shape is not None:
            self._shape.accept(added)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens the draft model writes after the sequence's tokens
        (`DraftModel.draft_many`, for this sequence alone)."""
        return self._model.draft_many([(self, limit)])[0]

    def _choose(self, logits: npt.NDArray[np.float32], position: int) -> tuple[int, npt.NDArray[np.float64] | None]:
        """The drafted token at `position` from the draft's logits there: greedy, or drawn from q
        (the draft's row with the request's penalties, top-k, top-p and temperature), with q."""
        if self._shape is None:
            return int(np.argmax(logits)), None
        q = self._shape.distribution(logits)
        assert q is not None, "a sampled request's drafter has a distribution"
        token = int(np.searchsorted(np.cumsum(q), uniform(self._seed, position, DRAFT_DRAW) * q.sum(), "right"))
        return min(token, int(np.flatnonzero(q)[-1])), q

    def close(self) -> None:
        if self._shape is not None:
            self._shape.close()
            self._shape = None
