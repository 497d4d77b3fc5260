"""Price one model's stages on this machine by running the model itself as a small local ring.

The generic probe times wide synthetic blocks, which are bandwidth-bound by design. A narrow
model is not: gemma-3-270m's 640-wide blocks spend their time in per-kernel work, its head's
output projection streams much nearer peak bandwidth than its blocks do, and a stage that sits
idle between tokens (as every ring stage does) pays to wake its threads. A stage timed in a
tight loop sees none of that, so it predicted ring stage times 30 to 60 per cent short.

This probe measures on the serving path instead: it runs the model as two-stage rings over
loopback sockets under two calibration divisions, one with a short block stage and one with
a long one, and reads every stage's own decode time. A host pricing the model before its first
plan runs the quick form (`quick=True`): one three-stage ring, a short block stage, a long one
and the head, once, which times the same three kinds of stage with one load. From those it
derives the planner's three numbers:
- o and b, the line through the two block stages' (bytes, time) points;
- b_head, the head's output-projection bytes over what the head stages spent beyond o + bytes / b.

The derivation is pure (`derive_costs`); only `probe_model_stages` touches llama.cpp.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field

from kafila.contracts import ModelPricing, Strict
from kafila.planner.types import ModelManifest
from kafila.runtime.engine.local_ring import generate, open_engine
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import block_range_file
from kafila.runtime.llama.loading import BOUND_TEAMS_OPENMP, computed_as_served, load_llama
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.machine.probe import (
    GB,
    LineFit,
    ProbeError,
    ProgressFn,
    fit_line,
    fit_through_origin,
    load_llama_cpp,
    significant,
)
from kafila.runtime.machine.probe_child import PROBE_TIMEOUT_S, child_main, run_in_child
from kafila.runtime.machine.this_machine import cache_dir, cached_model_pricings, save_model_pricing
from kafila.units import human_bytes

CALIBRATION_PROMPT = "The history of the printing press begins"
CALIBRATION_TOKENS = 48
CALIBRATION_REPEATS = 3
QUICK_TOKENS = 64  # the quick form's one run: enough decodes that a burst of other work does not set their figure
# A stage whose decodes' mean is this much above their interquartile mean was timed on a busy
# machine: many of its decodes waited for a core (quiet, the two are within a few per cent).
BUSY_SPREAD = 1.25


class StageTime(Strict):
    """One stage of one calibration ring: its blocks, whether it held the head, its decode ms per token."""

    first_block: Annotated[int, Field(ge=0)]
    end_block: Annotated[int, Field(ge=1)]
    is_head: bool
    ms_per_token: Annotated[float, Field(gt=0)]


class ModelStageProbe(Strict):
    """The cost model's numbers for one model on this machine, with the measurements behind them."""

    model: str
    bandwidth_gb_s: Annotated[float, Field(gt=0)]
    head_bandwidth_gb_s: Annotated[float, Field(gt=0)]
    head_measured: bool  # False: the head's extra time was lost in noise and b_head is b
    overhead_us: Annotated[float, Field(ge=0)]
    divisions: list[list[int]]
    stages: list[StageTime]
    # 0: the rings held the whole model. Otherwise they held blocks from this one to the last, with
    # the head, as a small model of their own (the whole did not fit); `stages` count from it.
    first_priced_block: Annotated[int, Field(ge=0)] = 0
    # The largest over the stages of their mean decode over its interquartile mean (`busy_spread`);
    # None where not read (the full calibration).
    spread: Annotated[float, Field(gt=0)] | None = None

    @property
    def busy(self) -> bool:
        """Whether the machine was busy while the stages were timed (`BUSY_SPREAD`)."""
        return self.spread is not None and self.spread > BUSY_SPREAD


class FlatLine(ProbeError):
    """The block stages' times did not grow with their blocks: waiting, not computing, set them."""


MIN_CALIBRATION_BLOCKS = 3  # a short and a long block stage, and the head's
MEMORY_SHARE = 0.75  # of the available memory, what the calibration rings may hold


def blocks_that_fit(manifest: ModelManifest, memory_bytes: int, share: float = MEMORY_SHARE) -> int | None:
    """How many of the model's last blocks, with the head, the calibration can hold in `share` of
    the memory: all of them where the model fits, None where not even three do. They begin where
    a stage may (`ModelManifest.stage_starts`)."""
    room = memory_bytes * share - manifest.head_bytes
    kept, used = 0, 0
    for size in reversed(manifest.block_bytes):
        if used + size > room:
            break
        kept, used = kept + 1, used + size
    kept = max(manifest.n_blocks - p for p in manifest.cut_positions() if manifest.n_blocks - p <= kept)
    return kept if kept >= MIN_CALIBRATION_BLOCKS else None


def calibration_divisions(n_blocks: int, starts: Sequence[int] | None = None) -> list[list[int]]:
    """A short and a long block stage, each followed by the head: [k, n - k] and [n - k, k].

    k is about a ninth of the model, so the two block stages span most of the range the planner
    will price, while neither calibration ring is a division anyone is likely to check against.
    Where the head may start only at some blocks (`ModelManifest.stage_starts`), the two nearest.
    """
    if n_blocks < 3:
        raise ProbeError(f"the model has {n_blocks} blocks; pricing its stages needs at least 3")
    short = max(1, n_blocks // 9)
    if starts is None:
        return [[short, n_blocks - short], [n_blocks - short, short]]
    if len(starts) < 2:
        raise ProbeError(f"the model may be cut at {len(starts)} block(s) only; pricing its stages needs 2 cuts")
    first = min(starts, key=lambda cut: (abs(cut - short), cut))
    last = min((cut for cut in starts if cut != first), key=lambda cut: (abs(cut - (n_blocks - short)), cut))
    return [[first, n_blocks - first], [last, n_blocks - last]]


def quick_division(n_blocks: int, starts: Sequence[int] | None = None) -> list[int] | None:
    """One ring that times a short block stage, a long one and the head (with short blocks):
    [k, n - 2k, k], k about a ninth of the model, at the cuts nearest where the model may only be
    cut at some blocks. None where no such ring has two block stages of different lengths."""
    short = max(1, n_blocks // 9)
    cuts = list(range(1, n_blocks)) if starts is None else sorted(c for c in starts if 0 < c < n_blocks)
    if len(cuts) < 2:
        return None
    first = min(cuts, key=lambda cut: (abs(cut - short), cut))
    later = [cut for cut in cuts if cut > first]
    if not later:
        return None
    second = min(later, key=lambda cut: (abs(cut - (n_blocks - short)), -cut))
    division = [first, second - first, n_blocks - second]
    return division if division[0] != division[1] else None


def quick_ring(n_blocks: int, served_blocks: int) -> list[int] | None:
    """The quick ring sized like the stages a session will serve: [k, s, k], s about the blocks a
    served stage holds (`served_blocks`), timed on the model's last 2k + s blocks cut as a small
    model of their own. A stage's time is linear in its blocks on a quiet machine, but where other
    work shares the cores a long stage is preempted mid-token and a short one is not: timed at the
    length it will serve, the line is read where it was measured. None where s cannot exceed k."""
    short = max(1, n_blocks // 9)
    long = min(max(served_blocks, short + 1), n_blocks - 2 * short)
    return [short, long, short] if long > short else None


def busy_spread(means: Sequence[float], typical: Sequence[float]) -> float:
    """The largest over the stages of their mean decode over its typical one (the interquartile mean):
    about 1 where every decode ran through, well above where many waited for a core."""
    if not means or len(means) != len(typical) or min(typical) <= 0:
        raise ValueError("each stage needs a mean and a typical decode time above 0")
    return max(mean / usual for mean, usual in zip(means, typical, strict=True))


def stage_times(divisions: Sequence[Sequence[int]], runs: Sequence[Sequence[float]]) -> list[StageTime]:
    """Each run's per-stage ms per token, labelled with the blocks that stage held."""
    out = []
    for counts, times in zip(divisions, runs, strict=True):
        start = 0
        for i, (count, ms) in enumerate(zip(counts, times, strict=True)):
            out.append(
                StageTime(first_block=start, end_block=start + count, is_head=i == len(counts) - 1, ms_per_token=ms)
            )
            start += count
    return out


def derive_costs(
    manifest: ModelManifest, stages: Sequence[StageTime], through_origin: bool = False
) -> tuple[LineFit, float | None]:
    """(o, 1/b) as a line through the block stages, and b_head from what the heads spent beyond it;
    `through_origin`, the blocks' time in proportion to their bytes (o = 0), for stages whose line
    came out flat (`FlatLine`): there waiting set their times, and a stage waits about in
    proportion to what it computes, where a line through two such points can point anywhere.

    b_head is None when the heads took no longer than their blocks: a head too small to time
    (a tiny vocabulary) is then priced at b, as the generic probe prices every head.
    """
    blocks = [s for s in stages if not s.is_head]
    heads = [s for s in stages if s.is_head]
    if not heads:
        raise ProbeError("no head stage was timed")

    read = manifest.read_bytes()  # a MoE block's time goes with the experts a token reads, not all it holds

    def weight(stage: StageTime) -> int:
        return sum(read[stage.first_block : stage.end_block])

    weights, seconds = [weight(s) for s in blocks], [s.ms_per_token * 1e-3 for s in blocks]
    try:
        fit = fit_through_origin(weights, seconds) if through_origin else fit_line(weights, seconds)
    except ValueError:
        raise ProbeError("the block stages must hold at least two different numbers of blocks") from None
    if fit.slope <= 0:
        raise FlatLine("stage time did not grow with the number of blocks; the device is too busy to measure")
    overhead = max(0.0, fit.intercept)
    extra = statistics.median(s.ms_per_token * 1e-3 - overhead - weight(s) * fit.slope for s in heads)
    if extra <= 0 or manifest.head_bytes == 0:
        return fit, None
    return fit, manifest.head_bytes / extra


def _quiet(_stage: str, _fraction: float) -> None:
    pass


def probe_model_stages(
    model: Path,
    progress: ProgressFn = _quiet,
    repeats: int = CALIBRATION_REPEATS,
    n_threads: int | None = None,
    memory_bytes: int | None = None,
    quick: bool = False,
    served_blocks: int | None = None,
) -> ModelStageProbe:
    """Run the calibration rings `repeats` times, interleaved, and derive o, b and b_head from the medians;
    `quick`, one three-stage ring once: sized like a served stage (`quick_ring`) given
    `served_blocks` where the model may be cut at every block, else `quick_division`.

    This process is the rings' head: load llama.cpp with `load_llama(shared_machine=True)` before
    anything else does, or its threads keep spinning while the other stage computes.

    The rings hold the model on this machine. Given the memory this machine has (`memory_bytes`),
    a model that does not fit is priced on the part of it that does: its last blocks with the
    head, cut into a file that is a whole small model (`blocks_that_fit`). Run from a disk, the
    whole model would page in every token, and the pricing would measure the disk.
    """
    whole = read_manifest(model)
    kept = whole.n_blocks if memory_bytes is None else blocks_that_fit(whole, memory_bytes)
    if kept is None:
        raise ProbeError(
            f"pricing {model.name} runs at least {MIN_CALIBRATION_BLOCKS} of its blocks with its head on this "
            f"machine, and they do not fit in the {human_bytes(memory_bytes or 0)} available; sessions price this "
            "machine with the generic probe instead"
        )
    sized = quick_ring(whole.n_blocks, served_blocks) if quick and served_blocks and not whole.stage_starts else None
    if sized is not None and sum(sized) <= kept:
        kept = sum(sized)
    else:
        sized = None
    load_llama_cpp()
    settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1)
    if n_threads is not None:
        settings = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1, n_threads=n_threads)
    scratch = cache_dir()  # the rings' stage files are a copy of the model: on the disk KAFILA_CACHE names
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=scratch) as cache:
        source, manifest = model, whole
        if kept < whole.n_blocks:
            why = "to time stages as long as it will serve" if sized is not None else "to fit in memory"
            progress(f"cutting the last {kept} of {whole.n_blocks} blocks, with the head, {why}", 0.0)
            first = whole.n_blocks - kept
            source = block_range_file(model, first, whole.n_blocks, Path(cache) / "part", is_head=True).path
            manifest = read_manifest(source)
        starts = manifest.stage_starts
        one_ring = sized or (quick_division(manifest.n_blocks, starts) if quick else None)
        divisions = [one_ring] if one_ring is not None else calibration_divisions(manifest.n_blocks, starts)
        repeats, tokens = (1, QUICK_TOKENS) if one_ring is not None else (repeats, CALIBRATION_TOKENS)
        runs: list[list[list[float]]] = [[] for _ in divisions]
        spreads: list[float] = []

        def timed(counts: Sequence[int]) -> list[float]:
            engine = open_engine(source, counts, settings, Path(cache))
            try:
                run = functools.partial(generate, engine, CALIBRATION_PROMPT, tokens, SamplingSettings())
                generation = computed_as_served(run)  # bound teams (the demo's) from a thread of their own
            finally:
                engine.close()
            # The quick form's one run: the median of its decodes, as a session's stages report
            # them, so the first decodes after the load (pages faulted in) weigh no more than one.
            times = [
                (stage.ms_per_token_alone if one_ring is not None else None) or stage.ms_per_token
                for stage in generation.stages
            ]
            decoded = [t for t in times if t is not None and t > 0]
            if len(decoded) != len(times):
                raise ProbeError(f"a stage of {counts} reported no decode time: {times}")
            means = [stage.ms_per_token or 0.0 for stage in generation.stages]
            if one_ring is not None and min(means) > 0:
                spreads.append(busy_spread(means, decoded))
            return decoded

        total = repeats * len(divisions)
        for repeat in range(repeats):  # interleaved, so a change in load hits both divisions alike
            for index, counts in enumerate(divisions):
                progress(f"timing {counts} as a local ring", (repeat * len(divisions) + index) / total)
                runs[index].append(timed(counts))
        stages = stage_times(divisions, _medians(divisions, runs))
        try:
            fit, head_bandwidth = derive_costs(manifest, stages)
        except FlatLine:
            if one_ring is None:
                raise
            progress("its block stages' times did not grow with their blocks: priced in proportion to them", 1.0)
            fit, head_bandwidth = derive_costs(manifest, stages, through_origin=True)
    spread = max(spreads) if spreads else None
    if spread is not None and spread > BUSY_SPREAD:
        progress(
            f"the machine was busy while they were timed (a stage's mean decode {spread:.1f} times its typical one): "
            "the first plan's prices follow that load, and what the stages then serve reprices them",
            1.0,
        )
    progress("fitting", 1.0)
    bandwidth = 1.0 / fit.slope
    return ModelStageProbe(
        model=whole.name,
        first_priced_block=whole.n_blocks - manifest.n_blocks,
        bandwidth_gb_s=bandwidth / GB,
        head_bandwidth_gb_s=(head_bandwidth or bandwidth) / GB,
        head_measured=head_bandwidth is not None,
        overhead_us=max(0.0, fit.intercept) * 1e6,
        divisions=divisions,
        stages=stages,
        spread=spread,
    )


def _medians(divisions: Sequence[Sequence[int]], runs: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Each division's per-stage median over its runs."""
    return [
        [statistics.median(run[i] for run in per_division) for i in range(len(counts))]
        for counts, per_division in zip(divisions, runs, strict=True)
    ]


def model_pricing(stages: ModelStageProbe, model_sha256: str) -> ModelPricing:
    """The probe's three numbers, rounded as a fleet file shows them, for the model with this hash."""
    return ModelPricing(
        model_sha256=model_sha256,
        bandwidth_gb_s=significant(stages.bandwidth_gb_s),
        head_bandwidth_gb_s=significant(stages.head_bandwidth_gb_s),
        overhead_us=significant(stages.overhead_us),
    )


MEASURED_BEFORE_THE_FIRST_PLAN = "measured by a host before its first plan"


def host_prices_model() -> bool:
    """Whether a host measures its model's stages before the first plan and keeps what its stage
    measured serving it: yes, unless KAFILA_PRICE_MODEL is off (the test suite's default, where
    hosts of one model file would otherwise price each other's plans through a shared cache)."""
    return os.environ.get("KAFILA_PRICE_MODEL", "on").strip().lower() not in ("off", "0", "no", "false")


def probe_child_env(environ: Mapping[str, str], bound_teams: bool) -> dict[str, str]:
    """The environment of `model_probe_in_child`'s child and of its ring's stages: with
    `bound_teams` (the host's own teams are bound: the demo's), bound as the session will serve;
    else free, whatever the host was set up with.

    Bound and free teams answer a busy machine unalike. On the 2-core box the demo's bound block
    stages took about half of what free ones took (the kernel stacks a free team of two on one
    core), and the demo's bound head twice what a free one did under a load average of 9 to 11
    (its threads waited for their own cores three times as long; docs/benchmarks.md, issue 38)."""
    if bound_teams:
        return {**environ, **{name: environ.get(name, value) for name, value in BOUND_TEAMS_OPENMP.items()}}
    return {name: value for name, value in environ.items() if name not in BOUND_TEAMS_OPENMP}


def model_probe_in_child(
    model: Path,
    memory_bytes: int,
    n_threads: int | None = None,
    progress: ProgressFn = _quiet,
    timeout_s: float = PROBE_TIMEOUT_S,
    served_blocks: int | None = None,
    bound_teams: bool = False,
) -> ModelStageProbe:
    """`probe_model_stages` in its quick form, in a child process (`probe_child.run_in_child`): a
    native crash there is explained, not the host's death; its teams bound or free as
    `probe_child_env` says."""
    command = [sys.executable, "-m", __name__, "--model", str(model), "--memory", str(memory_bytes)]
    if n_threads is not None:
        command += ["--threads", str(n_threads)]
    if served_blocks is not None:
        command += ["--served-blocks", str(served_blocks)]
    return run_in_child(ModelStageProbe, command, progress, timeout_s, probe_child_env(os.environ, bound_teams))


def price_model_here(
    model: Path,
    model_sha256: str,
    memory_bytes: int,
    n_threads: int | None = None,
    progress: ProgressFn = _quiet,
    served_blocks: int | None = None,
    bound_teams: bool = False,
) -> tuple[ModelPricing, ModelStageProbe | None]:
    """This machine's pricing of the model: the one kept (`this_machine.cached_model_pricings`:
    measured before, by `kafila probe --model`, or by serving it), or measured now in the quick
    form and kept, so that a second start does not pay for it; `served_blocks`, about the blocks a
    stage of the session will hold (`quick_ring`); `bound_teams`, whether its stages will compute
    with bound teams (`probe_child_env`). With the stages it was measured from, where it was
    measured now. ProbeError where it cannot be measured."""
    for kept in cached_model_pricings():
        if kept.model_sha256 == model_sha256:
            return kept, None
    stages = model_probe_in_child(
        model, memory_bytes, n_threads, progress, served_blocks=served_blocks, bound_teams=bound_teams
    )
    pricing = model_pricing(stages, model_sha256)
    try:
        save_model_pricing(pricing, MEASURED_BEFORE_THE_FIRST_PLAN)
    except OSError as error:  # the pricing still serves this session
        progress(f"cannot keep the pricing for later sessions: {error}", 1.0)
    return pricing, stages


def _child(arguments: Sequence[str]) -> None:
    """The child of `model_probe_in_child`: `--model PATH --memory BYTES [--threads N] [--served-blocks N]`."""
    options = dict(zip(arguments[::2], arguments[1::2], strict=False))
    threads, served = options.get("--threads"), options.get("--served-blocks")

    def work(progress: ProgressFn) -> ModelStageProbe:
        load_llama(shared_machine=True)  # the rings' head runs here; bound or free as the environment says
        try:
            return probe_model_stages(
                Path(options["--model"]),
                progress,
                n_threads=int(threads) if threads is not None else None,
                memory_bytes=int(options["--memory"]),
                quick=True,
                served_blocks=int(served) if served is not None else None,
            )
        except (OSError, ValueError, RuntimeError) as error:  # a stage that failed to load, say
            if isinstance(error, ProbeError):
                raise
            raise ProbeError(f"pricing {Path(options['--model']).name} failed: {error}") from None

    child_main(work)


if __name__ == "__main__":
    _child(sys.argv[1:])
