"""Measure this device for the planner with llama.cpp itself, the engine that will serve on it.

The planner prices a stage as c = o + bytes / b. Rather than trust a synthetic memory benchmark,
the probe asks llama.cpp: it writes block-only llama models of four sizes (3 MB to 328 MB of Q8_0
weights), times single-token decode steps on each, and fits time against the weight bytes read
per token. The slope is 1 / b and the intercept is o, exactly the two numbers the cost model
needs, measured on the code path that will run. A prompt-processing batch on a one-block model
gives arithmetic throughput for the planner's lower tier.

The fit, the size arithmetic and the /proc parsers are pure functions; everything that touches
llama.cpp, files or the clock sits below them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFWriter
from pydantic import Field, ValidationError

from kafila.contracts import BackendReport, FleetDevice, Strict
from kafila.runtime.llama.backends import backend_report
from kafila.runtime.llama.cpu_safety import RepackChoice, reported_features
from kafila.runtime.llama.errors import last_error
from kafila.runtime.llama.loading import LlamaUnavailable, llama, model_params, repack_choice, system_info
from kafila.runtime.llama.threads import serving_threads
from kafila.runtime.machine.memory import MemorySource, MemoryUnknown, available_memory

GB = 1e9
GIB = 2**30

ProgressFn = Callable[[str, float], None]
"""Told what the probe is doing and how far along it is, as a fraction from 0 to 1."""


class ProbeError(RuntimeError):
    """The probe could not measure this device; the message says why, in one line."""


class LlamaCppMissing(ProbeError):
    """llama.cpp's Python binding is absent or its shared library does not load."""


# ---------------------------------------------------------------------------------------------
# The probe's design, fixed so that every device is measured the same way.
# ---------------------------------------------------------------------------------------------


class BlockShape(Strict):
    """One llama block's widths. Attention is full multi-head so every projection is square."""

    n_embd: Annotated[int, Field(gt=0, multiple_of=32)] = 2048
    n_ff: Annotated[int, Field(gt=0, multiple_of=32)] = 5632
    n_head: Annotated[int, Field(gt=0)] = 16

    @property
    def matmul_elements(self) -> int:
        """Weight elements a token multiplies through: q, k, v, o and the three FFN matrices."""
        return 4 * self.n_embd * self.n_embd + 3 * self.n_embd * self.n_ff


Q8_0_BLOCK_ELEMENTS = 32
Q8_0_BLOCK_BYTES = 34  # one f16 scale + 32 int8 values
WEIGHT_TYPE = "Q8_0"  # streamed by the CPU backend at batch one (no repacking on x86), as real Q8_0 models are


def q8_0_bytes(elements: int) -> int:
    """Bytes of `elements` weights stored as Q8_0."""
    return elements // Q8_0_BLOCK_ELEMENTS * Q8_0_BLOCK_BYTES


class ProbeModel(Strict):
    """A block-only llama model: `n_blocks` blocks of one shape and a 4-token vocabulary."""

    shape: BlockShape
    n_blocks: Annotated[int, Field(gt=0)]

    @property
    def matmul_elements(self) -> int:
        return self.n_blocks * self.shape.matmul_elements

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: the Q8_0 matrices and two f32 norm vectors per block."""
        return self.n_blocks * (q8_0_bytes(self.shape.matmul_elements) + 2 * 4 * self.shape.n_embd)


NARROW = BlockShape(n_embd=512, n_ff=1408, n_head=4)
WIDE = BlockShape()
# 3.4, 55, 164 and 328 MB of weights. Every block runs the same kernels whatever its width, so
# the narrow one-block model is a stage with almost no bytes: it pins the intercept (overhead)
# that the wide ones alone would leave to a long extrapolation. The wide ones set the slope and
# show whether time is linear in bytes.
PROBE_MODELS = (
    ProbeModel(shape=NARROW, n_blocks=1),
    ProbeModel(shape=WIDE, n_blocks=1),
    ProbeModel(shape=WIDE, n_blocks=3),
    ProbeModel(shape=WIDE, n_blocks=6),
)
PREFILL_MODEL = 1  # the one-block wide model: big matrices, little time
CONTEXT = 512
PREFILL_TOKENS = 512  # llama.cpp's default micro-batch, the size real prompts are processed in
MAX_PREFILL_REPEATS = 5
PREFILL_BUDGET_S = 2.0
MIN_ROUNDS = 15
MAX_ROUNDS = 100  # about 2 s on a quiet 2-core machine; a busy one stops at the time budget instead
DECODE_BUDGET_S = 5.0  # stop here once MIN_ROUNDS are in
DECODE_DEADLINE_S = 7.0  # stop here regardless, once a few rounds are in: the probe must end
MIN_ROUNDS_AT_DEADLINE = 3
# A device not steady by then is timed on, its rounds pooled, until it is or this much has passed:
# the more rounds, the more of them the load leaves alone, and the low quantile finds them.
BUSY_DEADLINE_S = 15.0
# Interference from other processes only ever adds time, so the statistic is a low quantile:
# the device's own step time, without the one or two luckiest samples that a minimum would trust.
QUANTILE = 0.1
# A measurement is called steady when a straight line explains the step times and the typical
# step is close to the quantile; otherwise the device was busy and the figures are pessimistic.
STEADY_R_SQUARED = 0.99
STEADY_MEDIAN_RATIO = 1.5
N_VOCAB = 4


# ---------------------------------------------------------------------------------------------
# Pure core: the fit and the parsers.
# ---------------------------------------------------------------------------------------------


class LineFit(Strict):
    """Least-squares line y = slope * x + intercept, with how much of y's variance it explains."""

    slope: float
    intercept: float
    r_squared: float


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Ordinary least squares through (x, y): the slope and intercept are 1/b and o."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    dx = x - x.mean()
    dy = y - y.mean()
    slope = float(dx @ dy / (dx @ dx))
    intercept = float(y.mean() - slope * x.mean())
    return LineFit(slope=slope, intercept=intercept, r_squared=_r_squared(x, y, slope, intercept))


def _r_squared(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], slope: float, intercept: float) -> float:
    """How much of y's variance the line explains (1 where y does not vary)."""
    dy = y - y.mean()
    total = float(dy @ dy)
    residual = y - (slope * x + intercept)
    return 1.0 if total == 0.0 else 1.0 - float(residual @ residual) / total


def fit_through_origin(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Least squares through the origin: y in proportion to x, no intercept (the slope is 1/b, o is 0)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if not (x > 0).any():
        raise ValueError("a line through the origin needs an x above 0")
    slope = float(x @ y / (x @ x))
    return LineFit(slope=slope, intercept=0.0, r_squared=_r_squared(x, y, slope, 0.0))


def fit_below(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """The line y = slope * x + intercept that no point lies below, with intercept >= 0 and slope > 0,
    as close under the points as they allow (the least sum of the points' heights above it): a fit
    for costs that load only ever inflates.

    A busy machine inflates a long step far more than a short one (a step shorter than the
    scheduler's slice often runs through; a longer one is preempted, and a team of two threads
    then waits at every barrier for its second core), so least squares through such points reads
    the inflation as overhead, or as a line tilted past zero. Every point is an upper bound on the
    cost of its x; the line kept under them all leans on the points the load left alone, the
    large x most, where a stage's bytes lie. (Heights in proportion to each point let one inflated
    short step pin a high intercept and a flat slope: 85 GB/s and 1.2 ms at a load average of 14 to
    19.) On quiet points it is about the least-squares line. r_squared is that of the points about it, or 0
    where the line explains none of their variance (points high above it).
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    points = list(zip(xs, ys, strict=True))
    if min(xs) < 0 or min(ys) <= 0:
        raise ValueError("the points must have x >= 0 and y > 0")
    # The optimum is where two of the constraints meet: a line through two points, or through one
    # and the origin. The flattest line through the origin passes under every point, so one is kept.
    candidates = [(y / x, 0.0) for x, y in points if x > 0]
    for (x1, y1), (x2, y2) in itertools.combinations(points, 2):
        if x1 != x2:
            slope = (y2 - y1) / (x2 - x1)
            candidates.append((slope, y1 - slope * x1))
    tolerance = 1e-9 * max(ys)
    weight_of_intercept, weight_of_slope = len(points), sum(xs)
    under_every_point = [
        (slope, intercept)
        for slope, intercept in candidates
        if 0 < slope < math.inf
        and 0 <= intercept < math.inf
        and all(y >= slope * x + intercept - tolerance for x, y in points)
    ]
    if not under_every_point:  # only where y / x overflows: an x within a float's reach of 0
        raise ValueError("the x values are too close to 0 for a finite slope under the points")
    slope, intercept = max(
        under_every_point, key=lambda line: line[0] * weight_of_slope + line[1] * weight_of_intercept
    )
    r_squared = _r_squared(np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64), slope, intercept)
    return LineFit(slope=slope, intercept=intercept, r_squared=max(0.0, r_squared))


def low_quantile(samples: Sequence[float], fraction: float = QUANTILE) -> float:
    """The `fraction` quantile, interpolated: robust to the slow tail that a busy machine adds."""
    if not samples:
        raise ValueError("no samples")
    return float(np.quantile(np.asarray(samples, dtype=np.float64), fraction))


def significant(value: float, digits: int = 4) -> float:
    """Round to significant digits, so a small positive figure never rounds to zero."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


# ---------------------------------------------------------------------------------------------
# The result.
# ---------------------------------------------------------------------------------------------


class DecodeSample(Strict):
    """Single-token decode on one probe model: the point (weight_bytes, step_ms) of the fit."""

    n_embd: int
    n_blocks: int
    weight_bytes: int
    step_ms: float
    median_ms: float
    min_ms: float
    max_ms: float
    repetitions: int


class PrefillSample(Strict):
    """One prompt-processing batch on the smallest probe model."""

    tokens: int
    weight_elements: int
    batch_ms: float
    median_ms: float
    repetitions: int


class DeviceProbe(Strict):
    """What the probe measured, in the fleet file's units, with enough detail to judge the fit."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    bandwidth_gb_s: Annotated[float, Field(gt=0)]
    overhead_us: Annotated[float, Field(ge=0)]
    tflops: Annotated[float, Field(gt=0)]
    memory_gib: Annotated[float, Field(gt=0)]
    memory_source: MemorySource
    backend: Literal["cpu", "gpu"]
    devices: BackendReport | None = None  # llama.cpp's devices, and which served the probe
    weight_type: str
    statistic: str
    threads: int
    llama_cpp_version: str
    cpu_features: list[str]  # as llama.cpp reported them
    repack: RepackChoice  # whether weights were repacked into llama.cpp's extra buffers, and why
    fit: LineFit
    intercept_clamped: bool
    steady: bool
    decode: list[DecodeSample]
    prefill: PrefillSample
    elapsed_s: float

    def fleet_device(self) -> FleetDevice:
        """This device as a fleet-file member, validated by the same schema `kafila plan` reads."""
        return FleetDevice(
            name=self.name,
            bandwidth_gb_s=significant(self.bandwidth_gb_s),
            overhead_us=significant(self.overhead_us),
            tflops=significant(self.tflops),
            memory_gib=significant(self.memory_gib),
        )


def is_steady(fit: LineFit, decode: Sequence[DecodeSample]) -> bool:
    """Whether the device was quiet enough while measured for the figures to be trusted."""
    return fit.r_squared >= STEADY_R_SQUARED and all(d.median_ms <= STEADY_MEDIAN_RATIO * d.step_ms for d in decode)


def decode_samples(times: Sequence[Sequence[float]]) -> list[DecodeSample]:
    """Each probe model's decode steps (seconds, `PROBE_MODELS` order) as its point of the fit."""
    return [
        DecodeSample(
            n_embd=model.shape.n_embd,
            n_blocks=model.n_blocks,
            weight_bytes=model.weight_bytes,
            step_ms=low_quantile(samples) * 1e3,
            median_ms=statistics.median(samples) * 1e3,
            min_ms=min(samples) * 1e3,
            max_ms=max(samples) * 1e3,
            repetitions=len(samples),
        )
        for model, samples in zip(PROBE_MODELS, times, strict=True)
    ]


def device_fit(decode: Sequence[DecodeSample]) -> tuple[LineFit, bool]:
    """The line through the decode steps and whether the device was steady while they were timed
    (`is_steady`): least squares where it was; where not, the line under every step (`fit_below`),
    since a busy machine inflated the long steps more than the short ones, and least squares would
    read that as overhead."""
    xs, ys = [d.weight_bytes for d in decode], [d.step_ms / 1e3 for d in decode]
    fit = fit_line(xs, ys)
    if fit.slope > 0 and is_steady(fit, decode):
        return fit, True
    return fit_below(xs, ys), False


# ---------------------------------------------------------------------------------------------
# Probe models.
# ---------------------------------------------------------------------------------------------


def random_q8_0(n_bytes: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """Valid Q8_0 bytes: a small finite scale and random int8 values in every 34-byte block.

    Written directly rather than through gguf.quants.quantize, which would take seconds for the
    hundreds of MB needed; the content of weights does not change how fast they stream.
    """
    if n_bytes % Q8_0_BLOCK_BYTES:
        raise ValueError(f"{n_bytes} is not a whole number of Q8_0 blocks")
    rng = np.random.default_rng(seed)
    blocks = np.empty((n_bytes // Q8_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(1.0 / 512).tobytes(), dtype=np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, size=(blocks.shape[0], Q8_0_BLOCK_ELEMENTS), dtype=np.int8).view(np.uint8)
    return blocks.reshape(-1)


def write_probe_model(path: Path, model: ProbeModel, pool: npt.NDArray[np.uint8]) -> Path:
    """The probe model as a GGUF file, its weights cut from `pool`.

    With no `output.weight` llama.cpp ties the output to the 4-row embedding, so the head costs
    next to nothing and decode time is the blocks' time plus fixed overhead.
    """
    shape, n_blocks = model.shape, model.n_blocks
    e, ff = shape.n_embd, shape.n_ff

    def q8(rows: int, cols: int) -> npt.NDArray[np.uint8]:
        row_bytes = q8_0_bytes(cols)
        return pool[: rows * row_bytes].reshape(rows, row_bytes)

    writer = GGUFWriter(str(path), arch="llama")
    writer.add_name(f"kafila-probe-{e}x{n_blocks}")
    writer.add_block_count(n_blocks)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(e)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "x"])
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types([2, 3, 3, 1])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    rng = np.random.default_rng(1)
    writer.add_tensor("token_embd.weight", (rng.standard_normal((N_VOCAB, e)) * 0.05).astype(np.float32))
    ones = np.ones(e, dtype=np.float32)
    writer.add_tensor("output_norm.weight", ones)
    q8_0 = GGMLQuantizationType.Q8_0
    for i in range(n_blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", q8(e, e), raw_dtype=q8_0)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", q8(ff, e), raw_dtype=q8_0)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", q8(ff, e), raw_dtype=q8_0)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", q8(e, ff), raw_dtype=q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# This machine: memory and cores.
# ---------------------------------------------------------------------------------------------


def probe_threads() -> int:
    """One thread per physical math core this process may run on, as serving runs with."""
    return serving_threads()


def host_name() -> str:
    """The hostname, cut to the fleet schema's 64 characters."""
    return (socket.gethostname().strip() or "this-device")[:64]


# ---------------------------------------------------------------------------------------------
# llama.cpp.
# ---------------------------------------------------------------------------------------------


def load_llama_cpp() -> Any:
    """llama.cpp, initialised, or LlamaCppMissing with a one-line reason."""
    try:
        return llama()
    except LlamaUnavailable as error:
        raise LlamaCppMissing(str(error)) from None


class LlamaStage:
    """One probe model loaded in llama.cpp with a context, timed one decode call at a time."""

    def __init__(self, llama_cpp: Any, path: Path, threads: int, gpu: bool) -> None:
        self._ll = llama_cpp
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params(999 if gpu else 0))
        if not self._model:
            raise ProbeError(f"llama.cpp could not load a probe model: {last_error()}")
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = CONTEXT
        context_params.n_batch = CONTEXT
        context_params.n_ubatch = CONTEXT
        context_params.n_seq_max = 1
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ProbeError(f"llama.cpp could not create a context: {last_error()}")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._one = (llama_cpp.llama_token * 1)(3)
        self._prompt = (llama_cpp.llama_token * PREFILL_TOKENS)(*([3] * PREFILL_TOKENS))

    def _timed(self, tokens: Any, n_tokens: int) -> float:
        """Seconds for one decode call from an empty cache; the cache reset is not timed."""
        ll = self._ll
        ll.llama_memory_clear(self._memory, False)
        batch = ll.llama_batch_get_one(tokens, n_tokens)
        started = time.perf_counter()
        status = ll.llama_decode(self._ctx, batch)
        ll.llama_synchronize(self._ctx)
        elapsed = time.perf_counter() - started
        if status != 0:
            raise ProbeError(f"llama_decode failed with status {status}: {last_error()}")
        return elapsed

    def decode_step(self) -> float:
        """Seconds for one token through every block: the batch-one step that streams all weights."""
        return self._timed(self._one, 1)

    def prefill(self) -> float:
        """Seconds for a PREFILL_TOKENS prompt batch: matrix-matrix work, bound by arithmetic."""
        return self._timed(self._prompt, PREFILL_TOKENS)

    def close(self) -> None:
        if self._ctx:
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None


def _quiet(_stage: str, _fraction: float) -> None:
    return None


@contextlib.contextmanager
def _loaded(llama_cpp: Any, paths: Sequence[Path], threads: int, gpu: bool) -> Iterator[list[LlamaStage]]:
    stages: list[LlamaStage] = []
    try:
        for path in paths:
            stages.append(LlamaStage(llama_cpp, path, threads, gpu))
        yield stages
    finally:
        for stage in stages:
            stage.close()


def _time_decode(stages: Sequence[LlamaStage], progress: ProgressFn) -> list[list[float]]:
    """Rounds of one step on every model, always in the same cyclic order; where the steps are not
    steady by the usual deadline (a busy device), more rounds until they are, or BUSY_DEADLINE_S.

    Interleaving spreads a neighbour's burst of load over all sizes instead of bending the line,
    and the fixed order means no model is ever timed right after itself: between two steps on one
    model at least 219 MB of other weights stream through, so no last-level cache keeps it hot and
    even the 3 MB model is read from memory.
    """
    started = time.perf_counter()
    for stage in stages:  # warm-up: fault the mapped weights in, start the thread pool
        stage.decode_step()
    times: list[list[float]] = [[] for _ in stages]
    rounds = 0
    while rounds < MAX_ROUNDS:
        for stage, samples in zip(stages, times, strict=True):
            samples.append(stage.decode_step())
        rounds += 1
        spent = time.perf_counter() - started
        progress(f"timing decode steps ({rounds} rounds)", min(1.0, max(rounds / MAX_ROUNDS, spent / DECODE_BUDGET_S)))
        if (rounds >= MIN_ROUNDS and spent >= DECODE_BUDGET_S) or (
            rounds >= MIN_ROUNDS_AT_DEADLINE and spent >= DECODE_DEADLINE_S
        ):
            break
    while time.perf_counter() - started < BUSY_DEADLINE_S and not device_fit(decode_samples(times))[1]:
        for stage, samples in zip(stages, times, strict=True):
            samples.append(stage.decode_step())
        rounds += 1
        progress(f"timing decode steps ({rounds} rounds; the device is busy)", 1.0)
    return times


def _time_prefill(stage: LlamaStage, progress: ProgressFn) -> list[float]:
    """Prompt batches on one model, at least two, more while they fit in the time budget."""
    progress("", 0.0)
    started = time.perf_counter()
    stage.prefill()  # warm-up: first use of the batch-sized compute buffers
    times: list[float] = []
    while len(times) < MAX_PREFILL_REPEATS:
        times.append(stage.prefill())
        progress("", len(times) / MAX_PREFILL_REPEATS)
        if len(times) >= 2 and time.perf_counter() - started >= PREFILL_BUDGET_S:
            break
    return times


def run_probe(progress: ProgressFn = _quiet) -> DeviceProbe:
    """Measure this device: bandwidth and overhead from decode, throughput from prefill, memory."""
    started = time.perf_counter()
    progress("loading llama.cpp", 0.0)
    llama_cpp = load_llama_cpp()
    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    try:
        devices: BackendReport | None = backend_report()
    except LlamaUnavailable:  # ggml's libraries are not where they should be: measured all the same
        devices = None
    try:
        memory_bytes, memory_source = available_memory(gpu)
    except MemoryUnknown as error:
        raise ProbeError(str(error)) from None
    threads = probe_threads()
    weights_needed = sum(model.weight_bytes for model in PROBE_MODELS)
    if not gpu and memory_bytes < 2 * weights_needed:
        raise ProbeError(
            f"only {memory_bytes / GIB:.2f} GiB of memory is available; "
            f"the probe needs about {2 * weights_needed / GIB:.2f} GiB"
        )

    def step(phase: str, start: float, width: float) -> ProgressFn:
        return lambda text, fraction: progress(text or phase, start + width * fraction)

    with tempfile.TemporaryDirectory(prefix="kafila-probe-") as folder:
        pool = random_q8_0(max(q8_0_bytes(m.shape.n_ff * m.shape.n_embd) for m in PROBE_MODELS))
        paths = []
        for i, model in enumerate(PROBE_MODELS):
            progress(f"writing probe model {i + 1}/{len(PROBE_MODELS)}", 0.02 + 0.13 * i / len(PROBE_MODELS))
            path = Path(folder) / f"probe-{model.shape.n_embd}x{model.n_blocks}.gguf"
            try:
                paths.append(write_probe_model(path, model, pool))
            except OSError as error:
                raise ProbeError(f"cannot write probe models to {folder}: {error.strerror or error}") from None
        del pool
        progress("loading probe models", 0.15)
        with _loaded(llama_cpp, paths, threads, gpu) as stages:
            decode_times = _time_decode(stages, step("timing decode steps", 0.2, 0.65))
            prefill_times = _time_prefill(stages[PREFILL_MODEL], step("timing prompt processing", 0.85, 0.15))

    decode = decode_samples(decode_times)
    fit, steady = device_fit(decode)
    prefill_s = low_quantile(prefill_times)
    prefill_elements = PROBE_MODELS[PREFILL_MODEL].matmul_elements
    try:
        result = DeviceProbe(
            name=host_name(),
            bandwidth_gb_s=1.0 / fit.slope / GB,
            overhead_us=max(0.0, fit.intercept) * 1e6,
            tflops=2.0 * prefill_elements * PREFILL_TOKENS / prefill_s / 1e12,
            memory_gib=memory_bytes / GIB,
            memory_source=memory_source,
            backend="gpu" if gpu else "cpu",
            devices=devices,
            weight_type=WEIGHT_TYPE,
            statistic=f"{round(QUANTILE * 100)}th percentile of each size's steps"
            + ("" if steady else "; busy: the line under them"),
            threads=threads,
            llama_cpp_version=str(getattr(llama_cpp, "__version__", "unknown")),
            cpu_features=reported_features(system_info()),
            repack=repack_choice(),
            fit=fit,
            intercept_clamped=fit.intercept < 0,
            steady=steady,
            decode=decode,
            prefill=PrefillSample(
                tokens=PREFILL_TOKENS,
                weight_elements=prefill_elements,
                batch_ms=prefill_s * 1e3,
                median_ms=statistics.median(prefill_times) * 1e3,
                repetitions=len(prefill_times),
            ),
            elapsed_s=time.perf_counter() - started,
        )
        result.fleet_device()
    except ValidationError as error:  # a figure outside what a fleet file accepts: say which
        raise ProbeError(f"the measurement is out of range: {error.errors()[0]['msg']}") from None
    return result
