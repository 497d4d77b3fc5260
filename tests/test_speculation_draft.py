"""Speculative decoding with a draft model on the host (`kafila host --speculate draft --draft
MODEL`), on real llama.cpp: greedy text identical with the draft on and off on every tiny family,
the draft's own cache cut back to what it keeps, sampled tokens with the target's distribution by
a chi-square bound whatever the draft proposes, and a draft whose vocabulary is not the target's
refused at the command line in one line."""

from __future__ import annotations

import json
import math
import queue
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import openai
import pytest
from fake_hub import FakeHub, Repo, serving_hub
from host_process import running_host, status_of, until_status
from serving_checks import unsplit_greedy
from test_cli_edges import kafila, one_error_line
from test_speculation_models import GREEDY, REPEATING, SETTINGS, STEPS, cut_in_two, drive, halves
from test_split_correctness import N_BLOCKS, PROMPT
from tiny_models import SUPPORTED_TINY_ARCHS, write_tiny_model

from kafila.contracts import FleetDevice
from kafila.planner.types import PlanRefused, ServingSpec
from kafila.runtime.engine.draft_model import (
    DraftModel,
    DraftRefused,
    check_draft,
    draft_footprint,
    vocabulary_mismatch,
)
from kafila.runtime.engine.engines import Engine, EngineStep, PrefixCut, prefix_cut_of
from kafila.runtime.engine.local_ring import local_ring_engine, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.engine.speculation import Speculate, speculative_pick
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.this_machine import admit_alone
from kafila.serving.batcher import Batcher, Finished, Job, RequestEvent, TextDelta, _Sequence
from kafila.serving.engine_loop import EngineLoop

# --- the rule alone ------------------------------------------------------------------------------


def test_speculative_pick_gives_the_target_s_distribution_whatever_the_draft_s() -> None:
    """Drafts drawn from q and kept or replaced by the rule: the tokens have p's distribution, to
    within a few standard errors over 40,000 draws, where q favours tokens p never gives."""
    rng = np.random.default_rng(7)
    p = np.array([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])
    q = np.array([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    draws = 40_000
    drafts = rng.choice(len(q), size=draws, p=q)
    counts = np.zeros(len(p))
    kept = 0
    for draft, accept, residual in zip(drafts, rng.random(draws), rng.random(draws), strict=True):
        token, was_kept = speculative_pick(p, q, int(draft), float(accept), float(residual))
        counts[token] += 1
        kept += was_kept
    assert counts[4] == counts[5] == 0  # never a token p does not give
    error = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(counts / draws - p) <= 5 * error + 1e-12), counts / draws
    assert kept / draws == pytest.approx(np.minimum(p, q).sum(), abs=0.01)  # the rule's acceptance rate


# --- greedy text, every family -------------------------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_greedy_text_is_the_same_with_a_draft_model_on_and_off(arch: str, tmp_path: Path) -> None:
    """Two requests at once on a two-stage ring of the family's tiny model, without drafts and
    with a draft model: the target itself (its drafts kept), then a model of the same vocabulary
    and other weights (its drafts rejected, both caches cut back): the same text each time. The
    draft's cache holds what it says it holds, no more. gemma2 (a window of 16) parted here while
    llama.cpp's window cache could give one sequence's decode cells of another's that a cut back
    of its drafts needed (`LlamaModel.keeps_window_cells`)."""
    model, engine = cut_in_two(arch, tmp_path)
    try:
        jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        plain, _ = drive(engine, jobs, Speculate.OFF)
        other = write_tiny_model(tmp_path / "draft.gguf", arch, N_BLOCKS[arch], seed=1)
        for path in (model, other):
            try:
                draft = DraftModel(path, SETTINGS)
            except DraftRefused as refused:
                assert engine.prefix_cut is PrefixCut.NOWHERE, refused  # qwen3next: a recurrent state
                assert "recurrent state" in str(refused)
                return
            try:
                texts, batcher = drive(engine, jobs, Speculate.DRAFT, draft_model=draft)
                assert texts == plain, (arch, path.name)
                stats = batcher.speculation
                if engine.speculation_refused is not None:  # gpt-oss
                    assert batcher.speculation_off is not None and stats.drafted == 0
                    return
                assert batcher.speculation_off is None and stats.drafted > 0, arch
                if path == model:
                    assert stats.accepted > stats.drafted // 2, (arch, stats)
                else:
                    assert stats.accepted < stats.drafted, (arch, stats)
                for slot in range(SETTINGS.n_seq_max):
                    assert draft.model.next_position(slot) == len(draft._held.get(slot, [])), (arch, slot)
            finally:
                draft.close()
    finally:
        engine.close()


def test_a_wave_s_drafts_are_drafted_together_as_each_alone(sampling_pair: tuple[Engine, DraftModel]) -> None:
    """Three sequences' drafts from one draft model: caught up together, n_batch rows a decode, then
    one decode a round of drafted tokens, the tokens each drafts alone, greedy or sampled (with its q rows);
    after a reject, the next draft cuts the cache back to what the sequence kept. The prompts'
    catch-up is counted apart (`prompt_decodes`: not what a drafted token costs); a trip's, not."""
    engine, draft = sampling_pair
    prompts = [engine.tokenize(text) for text in (PROMPT, REPEATING, "hello world")]
    settings = [GREEDY, SAMPLED.model_copy(update={"seed": 3}), GREEDY]
    alone = []
    for slot, (prompt, sampling) in enumerate(zip(prompts, settings, strict=True)):
        drafter = draft.drafter(slot, prompt, sampling)
        alone.append((drafter.draft(4), drafter.drawn_from))
        drafter.close()
        draft.model.forget(slot)
        draft._held.pop(slot)
    drafters = [draft.drafter(slot, p, s) for slot, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    before, prompt_before = draft.decodes, draft.prompt_decodes
    together = draft.draft_many([(drafter, 4) for drafter in drafters])
    catch_up = math.ceil(sum(map(len, prompts)) / SAMPLING_CONTEXT.n_batch)  # the prompts, n_batch rows a decode
    assert draft.decodes - before == catch_up + 3  # then rounds 2, 3 and 4 (the last drafted token waits)
    assert draft.prompt_decodes - prompt_before == catch_up
    assert together == [tokens for tokens, _ in alone]
    assert drafters[0].drawn_from is None and drafters[2].drawn_from is None
    q = drafters[1].drawn_from
    assert q is not None and alone[1][1] is not None and q.shape == (4, engine.n_vocab())
    np.testing.assert_allclose(q, alone[1][1], atol=1e-5)
    drafters[0].extend([together[0][0], (together[0][1] + 1) % engine.n_vocab()])  # the second draft rejected
    before, prompt_before = draft.decodes, draft.prompt_decodes
    draft.draft_many([(drafters[0], 2)])
    assert draft.decodes - before == 2 and draft.prompt_decodes == prompt_before  # a trip's catch-up, then a round
    assert draft._held[0] == [*prompts[0], together[0][0], (together[0][1] + 1) % engine.n_vocab(), draft._held[0][-1]]
    assert draft.model.next_position(0) == len(draft._held[0])
    for slot, drafter in enumerate(drafters):
        drafter.close()
        draft.model.forget(slot)
        draft._held.pop(slot)


def test_a_prompt_caught_up_while_its_prefill_is_out_leaves_the_drafts_one_decode_a_round(
    sampling_pair: tuple[Engine, DraftModel],
) -> None:
    """`DraftModel.catch_up` decodes a prompt's tokens but its last (counted as a prompt's
    decodes), so the first draft takes one decode a drafted token and gives the tokens drafting
    it all at once gives; a drafter a trip or less behind is left to its draft."""
    engine, draft = sampling_pair
    prompt = engine.tokenize(PROMPT)
    drafter = draft.drafter(0, prompt, GREEDY)
    alone = drafter.draft(4)
    draft.model.forget(0)
    draft._held.pop(0)
    prompt_before = draft.prompt_decodes
    draft.catch_up([drafter])
    assert draft._held[0] == prompt[:-1] and draft.prompt_decodes > prompt_before
    before = draft.decodes
    assert draft.draft_many([(drafter, 4)]) == [alone]
    assert draft.decodes - before == 4  # the prompt's last token with the first round, then rounds 2-4
    drafter.extend(alone[:2])
    before = draft.decodes
    draft.catch_up([drafter])  # two tokens behind: not a prompt's
    assert draft.decodes == before
    drafter.close()
    draft.model.forget(0)
    draft._held.pop(0)


def test_speculation_off_for_a_draft_model_not_loaded() -> None:
    """`Speculate.DRAFT` without a draft model drafts nothing, and says why."""
    batcher = Batcher(1, 4, 64, lambda _s: None, lambda _t: b"", lambda _t: False, speculate=Speculate.DRAFT)  # type: ignore[arg-type,return-value]
    assert batcher.speculation_off == "no draft model is loaded (--draft MODEL)"


# --- sampled tokens: the target's distribution ---------------------------------------------------

TOP = 8  # tokens each row of the target can give: top-k
SAMPLED = SamplingSettings(temperature=1.5, top_k=TOP, top_p=1.0)
DRAWS = 2000
# One thread: a tiny model's decode is all overhead, which a second thread's handoffs multiply on a
# loaded machine.
SAMPLING_CONTEXT = ContextSettings(n_ctx=8 * 32, n_batch=32, n_seq_max=8, n_threads=1)


def exact(logits: npt.NDArray[np.float32]) -> dict[int, float]:
    """The target's distribution under SAMPLED, from its logits alone: top-k, temperature, softmax."""
    top = np.argsort(logits)[::-1][:TOP]
    scaled = logits[top].astype(np.float64) / SAMPLED.temperature
    weights = np.exp(scaled - scaled.max())
    return {int(t): float(w) for t, w in zip(top, weights / weights.sum(), strict=True)}


def logits_after(engine: Engine, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
    (row,) = engine.step_many([EngineStep(0, 0, list(tokens), decode=False)])
    engine.forget(0)
    assert isinstance(row, np.ndarray)
    return row


class Recording(Batcher):
    """The batcher, noting every token each request emits and the first draft it sends."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.emitted: dict[str, list[int]] = {}
        self.first_draft: dict[str, int] = {}

    def plan(self, waves: int = 1) -> list[EngineStep]:
        steps = super().plan(waves)
        slots = {s.slot: s.job.request_id for s in self._active.values()}
        for step in steps:
            if step.every_row:
                self.first_draft.setdefault(slots[step.sequence_id], step.tokens[1])
        return steps

    def _next_token(self, sequence: _Sequence, token: int) -> list[RequestEvent]:
        self.emitted.setdefault(sequence.job.request_id, []).append(token)
        return super()._next_token(sequence, token)


class PointMass:
    """A drafter that always proposes one token, whatever the target writes (an n-gram draft
    that disagrees): q is a point mass there."""

    drawn_from = None
    guesses_free = False  # the batcher looks up no guesses with it, as with a draft model

    def __init__(self, token: int) -> None:
        self.token = token

    def extend(self, tokens: Iterable[int]) -> None:
        pass

    def draft(self, limit: int) -> list[int]:
        return [self.token] * limit

    def close(self) -> None:
        pass


def chi_square_bound(cells: int) -> float:
    """The chi-square distribution's 0.999 quantile with `cells` - 1 degrees of freedom
    (Wilson-Hilferty)."""
    k, z = cells - 1, 3.0902
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi_square(counts: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float], draws: int) -> float:
    """Pearson's statistic, cells expected fewer than 5 times pooled into one."""
    big = {cell for cell, p in expected.items() if p * draws >= 5}
    statistic = sum((counts[cell] - expected[cell] * draws) ** 2 / (expected[cell] * draws) for cell in big)
    rest_expected = sum(p for cell, p in expected.items() if cell not in big) * draws
    rest = sum(n for cell, n in counts.items() if cell not in big)
    if rest_expected > 0:
        statistic += (rest - rest_expected) ** 2 / rest_expected
    return statistic, len(big) + (rest_expected > 0)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, DraftModel]]:
    directory = tmp_path_factory.mktemp("draft-sampling")
    target = write_tiny_model(directory / "target.gguf", "llama", n_blocks=2)
    draft_path = write_tiny_model(directory / "draft.gguf", "llama", n_blocks=1, seed=1)
    engine = open_engine(target, [2], SAMPLING_CONTEXT)
    draft = DraftModel(draft_path, SAMPLING_CONTEXT)
    try:
        yield engine, draft
    finally:
        draft.close()
        engine.close()


@pytest.mark.parametrize("drafts", ["draft model", "point mass"])
def test_sampled_tokens_have_the_target_s_distribution_with_drafts_that_disagree(
    sampling_pair: tuple[Engine, DraftModel], drafts: str
) -> None:
    """2,000 requests, each its own seed, sampled at temperature 1.5 from the target's top 8, for
    three tokens, eight at a time on the real engine: the second token rides as a draft behind
    the first, drawn from the draft model's own distribution (which gives the target's choices
    little weight) and kept by speculative sampling's rule, or a point mass on one token (an
    n-gram draft that disagrees with the target as often as not). The first two tokens' joint
    counts match the target's exact joint distribution (from its logits) by a chi-square bound;
    the drafts' own do not."""
    engine, draft = sampling_pair
    prompt = engine.tokenize("hello world, the model")
    first = exact(logits_after(engine, prompt))
    joint: dict[tuple[int, ...], float] = {}
    for token, p in first.items():
        if engine.is_end(token):
            joint[(token,)] = p
            continue
        for second, q in exact(logits_after(engine, [*prompt, token])).items():
            joint[(token, second)] = p * q
    likely = max((cell for cell in joint if len(cell) == 2), key=joint.__getitem__)[1]  # kept now and then
    modelled = drafts == "draft model"
    make_drafter = draft.drafter if modelled else (lambda _slot, _rows, _s: PointMass(likely))
    batcher = Recording(
        SAMPLING_CONTEXT.n_seq_max, 32, 32, engine.sampler, engine.piece, engine.is_end, engine.prefix_cut,
        Speculate.DRAFT, engine.speculation_refused, engine.every_row_whole, make_drafter=make_drafter,
        draft_together=draft.draft_many if modelled else None,
    )  # fmt: skip
    for i in range(DRAWS):
        batcher.submit(Job(f"{i}", prompt, 3, SAMPLED.model_copy(update={"seed": i})))
    while not batcher.idle or batcher.trimming:
        for trim in batcher.take_trims():
            engine.forget(trim.slot, trim.keep)
        steps = batcher.plan()
        if steps:
            batcher.advance(engine.step_many(steps))
    for slot in range(SAMPLING_CONTEXT.n_seq_max):
        engine.forget(slot)
    pairs = Counter(
        tuple(tokens[:1] if engine.is_end(tokens[0]) else tokens[:2]) for tokens in batcher.emitted.values()
    )
    statistic, cells = chi_square(pairs, joint, DRAWS)
    assert statistic < chi_square_bound(cells), (statistic, cells)
    drafted = batcher.speculation
    assert drafted.drafted >= DRAWS // 2 and 0 < drafted.accepted < drafted.drafted, drafted
    # The drafts' own tokens, in the second token's place, are far from the target's distribution:
    # the bound above would catch tokens that followed them.
    firsts = {rid: tokens[0] for rid, tokens in batcher.emitted.items()}
    proposed = Counter((firsts[rid], token) for rid, token in batcher.first_draft.items())
    second_only = {cell: p for cell, p in joint.items() if len(cell) == 2}
    scale = sum(second_only.values())
    wrong, wrong_cells = chi_square(proposed, {c: p / scale for c, p in second_only.items()}, sum(proposed.values()))
    assert wrong > 10 * chi_square_bound(wrong_cells), (wrong, wrong_cells)


def test_a_sampled_request_s_tokens_follow_from_its_seed(sampling_pair: tuple[Engine, DraftModel]) -> None:
    """The same sampled request twice with a draft model: the same tokens (the rule's draws are the
    seed's, position by position); another seed, other tokens."""
    engine, draft = sampling_pair
    prompt = engine.tokenize(REPEATING)

    def run(seed: int) -> str:
        job = Job("0", prompt, 24, SAMPLED.model_copy(update={"seed": seed}))
        texts, batcher = drive(engine, [job], Speculate.DRAFT, draft_model=draft)
        assert batcher.speculation.drafted > 0
        return texts["0"]

    assert run(11) == run(11) != run(12)


GRAMMAR = 'root ::= "{\\"a\\": [" item ("," item)? ("," item)? ("," item)? "]}"\nitem ::= [0-9]'


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_grammar_held_request_gives_its_text_without_drafts(
    sampling_pair: tuple[Engine, DraftModel], temperature: float
) -> None:
    """A JSON grammar, greedy or sampled with a seed, with a draft model that knows nothing of it:
    drafted greedily and checked row by row, the text is the one without drafts, and parses."""
    engine, draft = sampling_pair
    held = SamplingSettings(temperature=temperature, top_k=TOP, seed=5, grammar=GRAMMAR)
    job = Job("json", engine.tokenize(REPEATING), 40, held)
    plain, _ = drive(engine, [job], Speculate.OFF)
    drafted, batcher = drive(engine, [job], Speculate.DRAFT, draft_model=draft)
    assert drafted == plain
    assert batcher.speculation.drafted > 0
    assert isinstance(json.loads(drafted["json"])["a"], list)


def test_a_head_on_a_member_checks_a_draft_model_s_drafts(tmp_path: Path) -> None:
    """The head in a stage process, as on a member, answering each drafted row with its largest
    logits (a ROWS frame): with the target as its own draft, greedy text is the text without
    drafts, and a sampled request's drafts are kept by the rule on p from the top k the frame
    carries (p = q there, so nearly all are), its tokens the same run after run."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=N_BLOCKS["llama"])
    stages = cached_slices(model, halves("llama", model), tmp_path / "stages")
    engine = local_ring_engine(stages, SETTINGS, prefix_cut_of(model), model=model)
    draft = DraftModel(model, SETTINGS)
    try:
        assert engine.head is None and not engine.every_row_whole
        jobs = [Job(f"{i}", engine.tokenize(text), STEPS, GREEDY) for i, text in enumerate((PROMPT, REPEATING))]
        plain, _ = drive(engine, jobs, Speculate.OFF)
        drafted, batcher = drive(engine, jobs, Speculate.DRAFT, draft_model=draft)
        assert drafted == plain
        assert batcher.speculation.accepted > batcher.speculation.drafted // 2, batcher.speculation
        sampled = Job("s", jobs[1].prompt, STEPS, SAMPLED.model_copy(update={"seed": 9}))
        first, batcher = drive(engine, [sampled], Speculate.DRAFT, draft_model=draft)
        again, _ = drive(engine, [sampled], Speculate.DRAFT, draft_model=draft)
        assert first == again
        stats = batcher.speculation
        assert stats.drafted > 0 and stats.accepted > stats.drafted // 2, stats
    finally:
        draft.close()
        engine.close()


def test_a_draft_model_whose_drafts_are_all_rejected_stops_drafting_on_the_real_engine(tmp_path: Path) -> None:
    """The engine loop on one machine, a draft model as large as the target and of other weights:
    a decode of the draft costs what a trip does, so no accept rate pays (`draft_cost`). Its
    drafts, all rejected, are tried for a trip or two, timed (`TripClock.drafting`), and then the
    cost rule gives the sequence a window of 0, but for a draft on hope where its ledger could lose
    it (`DraftLedger`: a few percent of its trips, about one such draft in 48 tokens); the greedy
    text is the unsplit model's."""
    model = write_tiny_model(tmp_path / "target.gguf", "llama", n_blocks=2)
    other = write_tiny_model(tmp_path / "draft.gguf", "llama", n_blocks=2, seed=1)
    context = ContextSettings(n_ctx=256, n_batch=32, n_seq_max=1, n_threads=1)
    engine = open_engine(model, [2], context)
    draft = DraftModel(other, context)
    loop = EngineLoop(engine, 1, 16, 256, speculate=Speculate.DRAFT, draft_model=draft)
    events: queue.Queue[RequestEvent] = queue.Queue()
    windows: list[int] = []  # what the cost rule allows the sequence, as each token lands

    def sink(event: RequestEvent) -> None:  # on the engine thread, as the batcher plans the next wave
        sequence = loop.batcher._active.get("0")
        if sequence is not None:
            windows.append(loop.batcher._paying(sequence.window, 1, guesses=False))  # a model: no free guesses
        events.put(event)

    tokens = 48
    loop.start()
    try:
        loop.submit(Job("0", engine.tokenize(PROMPT), tokens, GREEDY), sink)
        text = ""
        while not isinstance(event := events.get(timeout=120), Finished):
            assert isinstance(event, TextDelta), event
            text += event.text
        stats, clock = loop.batcher.speculation, loop.batcher.trip_clock
    finally:
        loop.stop()
        draft.close()
        engine.close()
    assert text == unsplit_greedy(model, PROMPT, tokens)
    assert event.completion_tokens == tokens
    assert stats.drafted > 0 and stats.accepted == 0, stats
    assert 1 <= stats.trips <= 3, stats  # a bounded number of trips tried it
    assert clock.drafts and clock.draft_ms > 0.0
    assert len(windows) >= tokens // 2, windows
    # Then 0, but for one draft at a time on hope: each costs about a trip, and the ledger lets the
    # sequence lose 4% of at least 40 trips, so two at most.
    late = windows[stats.trips + 2 :]
    assert all(w <= 1 for w in late) and sum(late) <= 2, windows


# --- the draft's vocabulary ----------------------------------------------------------------------


HUB_REPO = "tiny-org/Target-GGUF"
VOCABULARY = 330  # tokens, padded: a control token more in one draft shifts the rest, as many in all


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A target, a draft of its family, one of another family (more tokens), and one with one
    token's text changed (as many tokens)."""
    directory = tmp_path_factory.mktemp("vocabularies")
    return {
        "target": write_tiny_model(directory / "target.gguf", "llama", n_blocks=2, n_vocab=VOCABULARY),
        "draft": write_tiny_model(directory / "draft.gguf", "llama", n_blocks=1, seed=1, n_vocab=VOCABULARY),
        "other family": write_tiny_model(directory / "gemma.gguf", "gemma3", n_blocks=1),
        "changed": write_tiny_model(
            directory / "changed.gguf", "llama", n_blocks=1, extra_specials=["<|changed|>"], n_vocab=VOCABULARY
        ),
    }


def test_a_draft_s_vocabulary_is_compared_token_for_token(vocabularies: dict[str, Path]) -> None:
    target = FastGGUFReader(vocabularies["target"])
    assert vocabulary_mismatch(target, FastGGUFReader(vocabularies["draft"])) is None
    counted = vocabulary_mismatch(target, FastGGUFReader(vocabularies["other family"]))
    assert counted is not None and "the target has 330 tokens and the draft 328" in counted, counted
    changed = vocabulary_mismatch(target, FastGGUFReader(vocabularies["changed"]))
    assert changed is not None and "token 3 is" in changed and "'<|changed|>' in the draft" in changed, changed
    with pytest.raises(DraftRefused, match="no draft model file"):
        check_draft(target, "target", vocabularies["target"].parent / "missing.gguf")


@pytest.mark.parametrize("draft", ["other family", "changed"])
def test_kafila_host_refuses_a_draft_whose_vocabulary_differs(vocabularies: dict[str, Path], draft: str) -> None:
    """`kafila host --draft` with a draft of other tokens: one line saying which, before serving."""
    done = kafila("host", "--model", vocabularies["target"], "--draft", vocabularies[draft], "--port", "0")
    line = one_error_line(done)
    assert f"the draft model {vocabularies[draft].name} cannot draft for target" in line, line
    assert "their vocabularies differ" in line and "id for id" in line, line


@pytest.mark.parametrize("draft", ["other family", "draft"])
def test_a_draft_is_checked_against_the_header_of_a_model_on_the_hub(
    vocabularies: dict[str, Path], draft: str, tmp_path: Path
) -> None:
    """`kafila host --model hf://… --draft`: the host plans from the hub model's header alone, and
    the draft's vocabulary is compared with that header's before the session opens; a draft of the
    same tokens passes, and the host goes on to open the session (its join line)."""
    hub = FakeHub({HUB_REPO: Repo({"target-Q8_0.gguf": vocabularies["target"].read_bytes()})})
    env = {"HF_ENDPOINT": "", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf")}
    args = ("host", "--model", f"hf://{HUB_REPO}:Q8_0", "--members", "2", "--draft", vocabularies[draft])
    with serving_hub(hub):
        env["HF_ENDPOINT"] = hub.url
        if draft == "other family":
            line = one_error_line(kafila(*args, "--port", "0", env=env))
            assert f"the draft model {vocabularies[draft].name} cannot draft for" in line, line
            assert "their vocabularies differ" in line, line
            whole = [path for method, path, rng in hub.seen if method == "GET" and path.endswith(".gguf") and not rng]
            assert not whole, hub.seen  # refused from the header: nothing of the model beyond it fetched
            return
        opening = ("--rendezvous-port", "0", "--stun-port", "0", "--threads", "1")
        with running_host(*args[1:], *opening, ready=False, env=env) as host:
            # past the draft's check: the session opened, and it waits for its member to join
            until_status(host, lambda status: bool(status["waiting_for"]), "the session open for members", 120)


def test_kafila_host_serves_with_a_draft_model(vocabularies: dict[str, Path]) -> None:
    """`kafila host --draft` on two local stages: a greedy completion is the unsplit model's, and
    /status says the drafts came from the draft model and were checked, and what its decode costs."""
    model, draft = vocabularies["target"], vocabularies["target"]  # the target as its own draft: kept
    args = ("--model", model, "--draft", draft, "--stages", "2", "--context", "256", "--concurrency", "2")
    with running_host(*args, "--threads", "1") as host:
        client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(model="target", prompt=REPEATING, max_tokens=24, temperature=0)
        speculation = status_of(host)["speculation"]
    assert reply.choices[0].text == unsplit_greedy(model, REPEATING, 24)
    assert speculation["mode"] == "draft" and speculation["off"] is None, speculation
    assert speculation["drafted_tokens"] > 0 and speculation["accepted_tokens"] > 0, speculation
    assert speculation["draft_ms"] > 0, speculation  # its decodes as the cost rule weighs them
    assert speculation["fixed_ms"] >= 0 and speculation["row_ms"] >= 0, speculation  # and the ring's, as measured


def test_kafila_host_s_speculate_and_draft_must_agree(vocabularies: dict[str, Path]) -> None:
    model, draft = vocabularies["target"], vocabularies["draft"]
    line = one_error_line(kafila("host", "--model", model, "--speculate", "draft", "--port", "0"))
    assert "--speculate draft needs --draft MODEL" in line, line
    line = one_error_line(kafila("host", "--model", model, "--speculate", "ngram", "--draft", draft, "--port", "0"))
    assert "--speculate ngram never runs it" in line, line


def test_kafila_host_leaves_the_draft_model_s_memory_out_of_what_the_model_may_use(
    vocabularies: dict[str, Path],
) -> None:
    """A --memory that holds the target alone but not beside its draft model (weights, a cache
    for every slot, a row of logits a sequence) is refused before anything loads, saying so."""
    model, draft = vocabularies["target"], vocabularies["draft"]
    session, manifest = ServingSpec(context=256, concurrency=2), read_manifest(model)
    device = FleetDevice(name="this machine", memory_gib=64.0)

    def fits(lent: int, held: int = 0) -> bool:
        try:
            admit_alone(manifest, device.lending(lent).besides(held), session)
        except PlanRefused:
            return False
        return True

    low, high = 1 << 20, 1 << 34  # the least memory the target alone fits in, to 4 KiB
    assert not fits(low) and fits(high)
    while high - low > 4096:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    held = draft_footprint(draft, 256, 2)
    assert held == draft.stat().st_size + sum(read_manifest(draft).cache_bytes(256, 2)) + 4 * VOCABULARY * 2
    lent = high + held // 2
    assert fits(lent) and not fits(lent, held)
    args = ("--context", "256", "--concurrency", "2", "--memory", str(lent), "--port", "0")
    line = one_error_line(kafila("host", "--model", model, "--draft", draft, *args))
    assert "beside the draft model's" in line, line
