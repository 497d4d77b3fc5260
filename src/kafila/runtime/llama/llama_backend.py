"""The thin layer over llama-cpp-python's low-level API that every stage shares.

Everything that touches ctypes lives here: loading a model, a context with an optional graph
callback, filling a batch from token ids or from hidden states, and reading a tensor out of the
running graph. Stage logic above it sees numpy arrays only.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kafila.runtime.llama.cpu_safety import REPACK_SETTING, RepackChoice, choose_repack, repack_mode
from kafila.runtime.llama.threads import serving_threads


class LlamaUnavailable(RuntimeError):
    """llama-cpp-python is missing or broken: say so plainly instead of a traceback."""


# How llama.cpp's OpenMP threads should behave in a process whose machine is shared with other
# stages of the same ring, which take turns on its cores.
# - GOMP_SPINCOUNT: the threads spin at every barrier waiting for more work. A waiting stage's
#   spinning threads would take the cores from the one computing: there a short spin, then sleep,
#   is far better (a 3-stage split on 2 cores went from 40% to 80% of unsplit).
# - OMP_PROC_BIND, for session processes (the demo's host and members): with the short spin a
#   thread often sleeps at a barrier. A session's stage runs on an executor thread that the event
#   loop wakes, and there a scheduler trace of the demo showed the two threads of a team taking
#   turns on one core while the other idled, each decode taking twice as long. Bound, each thread
#   of a team keeps its own core: the demo's block stages went from about 5 to about 3 ms per
#   token, 1 user from 40 to 47 tokens/s and 4 users from 76 to 93. The local rings of `kafila
#   generate` and of the model-stage probe, whose stages run on their processes' main threads,
#   were a little slower bound (2 and 3 stages: 5-20%), so they are left free.
# A process alone on its machine keeps libgomp's defaults: its threads spin through the barriers
# and are not pulled together, and a dedicated member has no one to yield its cores to. libgomp
# reads these when it loads, so they are set before llama_cpp is first imported, and a value the
# user set is kept.
SHARED_MACHINE_OPENMP = {"GOMP_SPINCOUNT": "1000"}
BOUND_TEAMS_OPENMP = {"OMP_PROC_BIND": "true"}


def shares_cores_env(bind_teams: bool = False) -> dict[str, str]:
    """The environment for a process that will share this machine's cores with other stages;
    `bind_teams` for session processes, whose teams of threads should each keep their own cores."""
    wanted = {**SHARED_MACHINE_OPENMP, **(BOUND_TEAMS_OPENMP if bind_teams else {})}
    return {name: os.environ.get(name, default) for name, default in wanted.items()}


def set_up_to_share_cores() -> bool:
    """Whether this process's OpenMP threads were set up, when llama.cpp loaded, to take turns on
    cores with other stages: by the demo, or by a user who set the variables themselves."""
    return all(os.environ.get(name) for name in (*SHARED_MACHINE_OPENMP, *BOUND_TEAMS_OPENMP))


def sharing_cores_hint() -> str:
    """How to start, by hand, stages that will share one machine's cores."""
    settings = " ".join(f"{name}={value}" for name, value in {**SHARED_MACHINE_OPENMP, **BOUND_TEAMS_OPENMP}.items())
    return (
        "`kafila host --demo --members N --model PATH` starts the members on this machine itself and sets "
        f"them up for it; by hand, set {settings} for the host and for every `kafila join` on this machine"
    )


def load_llama(shared_machine: bool = False, bind_teams: bool = False) -> Any:
    """Import llama.cpp's binding, or say in one line what is wrong and how to fix it.

    `shared_machine`: other stages will compute on this machine's cores in turn with this
    process, so its threads should sleep soon rather than spin; `bind_teams`, in a session's
    process, each on its own core. Only effective before the first import, and never overriding
    what the user set.
    """
    first_import = "llama_cpp" not in sys.modules
    if first_import and shared_machine:
        for name, value in shares_cores_env(bind_teams).items():
            os.environ.setdefault(name, value)
    cores = _thread_cores() if first_import else None
    try:
        return _import_llama()
    finally:
        # libgomp, told to bind, binds the thread that loads it to the first core; every thread
        # Python starts later (the event loop's helpers, a stage's executor) would inherit that one
        # core. Only a computing team's threads should be bound, and libgomp binds them itself.
        if cores is not None:
            _set_thread_cores(cores)


def _thread_cores() -> set[int] | None:
    getter = getattr(os, "sched_getaffinity", None)  # Linux only; elsewhere there is nothing to undo
    return set(getter(0)) if getter else None


def _set_thread_cores(cores: set[int]) -> None:
    setter = getattr(os, "sched_setaffinity", None)
    if setter and _thread_cores() != cores:
        setter(0, cores)


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise LlamaUnavailable(
            "llama.cpp is not installed: Kafila needs the llama_cpp module (python3 -m pip install llama-cpp-python)"
        ) from None
    except (OSError, RuntimeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LlamaUnavailable(f"llama.cpp's library does not load: {first_line}") from None
    return llama_cpp


_CALLBACKS: list[Any] = []  # ctypes callbacks must outlive every call that may use them
GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4  # ggml_log_level
_ERRORS: list[str] = []
_WARNINGS: list[str] = []


def _log(level: int, text: bytes | None, _user: Any) -> None:
    """llama.cpp's log: silent unless KAFILA_LLAMA_LOG is set; errors are kept to explain failures."""
    message = text.decode("utf-8", errors="replace") if text else ""
    if os.environ.get("KAFILA_LLAMA_LOG"):
        print(message, end="", file=sys.stderr, flush=True)
    if level in (GGML_LOG_WARN, GGML_LOG_ERROR) and message.strip():
        kept = _ERRORS if level == GGML_LOG_ERROR else _WARNINGS
        kept.append(message.strip())
        del kept[:-5]


def last_error(default: str = "no reason given") -> str:
    """Why llama.cpp failed since `_forget_errors`: its errors, the cause first and its summary
    after ("… tensor 'blk.1.attn_q.weight' not found; … failed to load model"), else its last warning."""
    return "; ".join(_ERRORS[-3:]) if _ERRORS else _WARNINGS[-1] if _WARNINGS else default


# What llama.cpp and ggml log when a buffer cannot be had (ggml's CPU, CUDA and Metal backends,
# llama's KV cache and compute buffers), lower-cased.
ALLOCATION_FAILURES = (
    "failed to allocate",
    "unable to allocate",
    "out of memory",
    "insufficient memory",
    "cudamalloc failed",
)


def out_of_memory(error: BaseException) -> bool:
    """Whether a failed load or context creation failed for lack of memory (its message carries
    llama.cpp's errors, `last_error`), rather than for a bad file or a bug."""
    if isinstance(error, MemoryError):
        return True
    message = str(error).lower()
    return any(failure in message for failure in ALLOCATION_FAILURES)


def _forget_errors() -> None:
    """Before a load: what an earlier one logged explains nothing about this one."""
    _ERRORS.clear()
    _WARNINGS.clear()


@functools.cache
def llama() -> Any:
    """llama_cpp, initialised once, with its log routed through `_log`."""
    llama_cpp = load_llama()
    callback = llama_cpp.llama_log_callback(_log)
    _CALLBACKS.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    return llama_cpp


def gpu_present() -> str | None:
    """A GPU this machine has, by its vendor's own tool or platform: "NVIDIA" where nvidia-smi
    runs, "Apple" on Apple silicon; None otherwise (or where there is no telling)."""
    if shutil.which("nvidia-smi") is not None:
        return "NVIDIA"
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "Apple"
    return None


GPU_BUILDS = {"NVIDIA": "CUDA", "Apple": "METAL"}  # a GPU's vendor: its ggml build option (others: Vulkan)


def rebuild_for_gpu(vendor: str, llama_version: str, system: str | None = None) -> str:
    """The command that rebuilds llama-cpp-python for this machine's GPU, as llama-cpp-python
    documents it: CMAKE_ARGS with the ggml backend switched on, in the shell of `system`
    (PowerShell on Windows). Pure."""
    option = f"-DGGML_{GPU_BUILDS.get(vendor, 'VULKAN')}=on"
    install = f"-m pip install --force-reinstall --no-cache-dir llama-cpp-python=={llama_version}"
    if (system or platform.system()) == "Windows":
        return f'$env:CMAKE_ARGS="{option}"; python {install}'
    return f'CMAKE_ARGS="{option}" python3 {install}'


@dataclass(frozen=True)
class IdleGpu:
    """A GPU this machine has that llama.cpp was built without, and the command that fixes it."""

    vendor: str
    command: str

    @property
    def message(self) -> str:
        return f"this machine's {self.vendor} GPU sits idle: llama.cpp was built for the CPU only. Rebuild it with"


def idle_gpu() -> IdleGpu | None:
    """Where this machine has a GPU that llama.cpp was not built to use, what to do about it."""
    vendor = gpu_present()
    llama_cpp = llama()
    if vendor is None or llama_cpp.llama_supports_gpu_offload():
        return None
    return IdleGpu(vendor, rebuild_for_gpu(vendor, str(getattr(llama_cpp, "__version__", "0.3.36"))))


@functools.cache
def system_info() -> str:
    """llama.cpp's own account of this machine: each backend's features (`CPU : AVX2 = 1 | ...`)."""
    raw = llama().llama_print_system_info()
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)


@functools.cache
def repack_choice() -> RepackChoice:
    """Whether this process loads models with llama.cpp's repacked weight buffers (`cpu_safety`);
    where that differs from llama.cpp's default for safety, said once on stderr."""
    choice = choose_repack(system_info(), repack_mode(os.environ))
    if choice.note:
        print(f"kafila: {choice.note} ({REPACK_SETTING}=on repacks them anyway)", file=sys.stderr, flush=True)
    return choice


def model_params(gpu_layers: int = 0, vocab_only: bool = False, repack: bool | None = None) -> Any:
    """llama.cpp's model parameters as every Kafila load takes them: layers on the GPU where there is
    one, and weights repacked or not as `repack_choice` decided for this machine (`repack` says
    otherwise: benchmarks compare both)."""
    ll = llama()
    params = ll.llama_model_default_params()
    params.n_gpu_layers = gpu_layers if ll.llama_supports_gpu_offload() else 0
    params.vocab_only = vocab_only
    params.use_extra_bufts = repack_choice().repack if repack is None else repack
    return params


def loaded_llama_path() -> Path | None:
    """The libllama this process loaded: llama_cpp takes it from LLAMA_CPP_LIB_PATH where that is
    set, else from its own lib folder (the CDLL it holds is named by the path it was opened with)."""
    handle = getattr(getattr(load_llama(), "llama_cpp", None), "_lib", None)
    name = getattr(handle, "_name", None)
    return Path(os.path.abspath(name)) if isinstance(name, str) and name else None


def ggml_library_dirs() -> list[Path]:
    """Where the ggml libraries that match the loaded libllama are, most likely first: its own
    folder (and, if it was reached through a link, the folder the link points into), then the
    lib folder of the llama_cpp package."""
    folders: list[Path] = []
    loaded = loaded_llama_path()
    if loaded is not None:
        folders += [loaded.parent, loaded.resolve().parent]
    folders.append(Path(load_llama().__file__).parent / "lib")
    return list(dict.fromkeys(folders))


def _library_names(stem: str, folder: Path) -> list[Path]:
    """The files in `folder` that may be the `stem` library, the plain name first."""
    plain = [folder / f"lib{stem}.so", folder / f"lib{stem}.dylib", folder / f"{stem}.dll", folder / f"lib{stem}.dll"]
    versioned = sorted([*folder.glob(f"lib{stem}.so.*"), *folder.glob(f"lib{stem}.*.dylib")])
    return [path for path in (*plain, *versioned) if path.is_file()]


def _already_loaded(path: Path) -> bool:
    """Whether this very file is mapped in the process already (where the platform can say)."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return False
    try:
        ctypes.CDLL(str(path), mode=no_load | getattr(os, "RTLD_LAZY", 1))
    except OSError:
        return False
    return True


@functools.cache
def ggml_library_path(stem: str) -> Path:
    """The `stem` ggml library (ggml, ggml-base, ggml-cpu) that belongs with the loaded libllama.

    The file libllama itself linked to, where it is already in the process: a wheel ships
    `libggml-base.so` and `libggml-base.so.0` as two copies, and opening the other would put a
    second ggml in the process. Else the first found, in `ggml_library_dirs` order."""
    folders = ggml_library_dirs()
    candidates = [path for folder in folders for path in _library_names(stem, folder)]
    for path in candidates:
        if _already_loaded(path):
            return path
    if candidates:
        return candidates[0]
    raise LlamaUnavailable(f"no {stem} library next to libllama in {', '.join(str(f) for f in folders)}")


@functools.cache
def ggml_library(stem: str) -> ctypes.CDLL:
    """One of the ggml libraries next to the loaded libllama (`ggml_library_path`)."""
    path = ggml_library_path(stem)
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise LlamaUnavailable(f"the {stem} library at {path} does not load: {error}") from None


@dataclass(frozen=True)
class GGMLBase:
    """The ggml calls the graph callback needs."""

    get_name: Callable[[int], bytes]
    nbytes: Callable[[int], int]
    tensor_get: Callable[[int, int, int, int], None]
    tensor_set: Callable[[int, int, int, int], None]

    @classmethod
    def load(cls) -> GGMLBase:
        lib = ggml_library("ggml-base")
        lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_set.restype = None
        return cls(lib.ggml_get_name, lib.ggml_nbytes, lib.ggml_backend_tensor_get, lib.ggml_backend_tensor_set)


GGML_MAX_N_THREADS = 512


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class QuietThreadpool:
    """A ggml CPU threadpool whose idle threads sleep instead of spinning.

    By default ggml's threads poll for new work after each graph. With several stages of one
    ring sharing a machine, the waiting stages' spinning threads take the cores from the one
    that is computing; with polling off they yield them.
    """

    def __init__(self, n_threads: int) -> None:
        base, cpu = ggml_library("ggml-base"), ggml_library("ggml-cpu")
        base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
        base.ggml_threadpool_params_default.restype = _ThreadpoolParams
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        params = base.ggml_threadpool_params_default(n_threads)
        params.poll = 0
        self._free = cpu.ggml_threadpool_free
        self.pointer = cpu.ggml_threadpool_new(ctypes.byref(params))
        if not self.pointer:
            raise RuntimeError("ggml could not create a threadpool")

    def attach(self, ctx: Any) -> None:
        attach = llama().llama_cpp._lib.llama_attach_threadpool
        attach.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        attach.restype = None
        attach(ctx, self.pointer, self.pointer)

    def close(self) -> None:
        if self.pointer:
            self._free(self.pointer)
            self.pointer = None


@dataclass(frozen=True)
class ContextSettings:
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 4
    n_threads: int = field(default_factory=serving_threads)  # as the probe measured with
    gpu_layers: int = 999  # everything, on a GPU build; ignored on CPU; 0: the CPU alone (see LlamaModel)
    quiet_threads: bool = True  # idle threads sleep: stages sharing a machine do not starve each other
    repack: bool | None = None  # llama.cpp's repacked weight buffers; None: as `repack_choice` decided here
    # Rows a decode may ask logits of; None: every row (llama.cpp's default, n_batch). llama.cpp
    # reserves its compute buffer for this many rows of logits, n_vocab floats each: 512 MiB for a
    # 262k vocabulary at n_batch 512, where a head that asks one row per sequence needs n_seq_max.
    max_outputs: int | None = None
    # Flash attention on or off; None leaves llama.cpp to choose (auto: on where the backend has it).
    # Stages of one ring may differ: the floats then differ slightly, which `agreement` measures.
    flash_attn: bool | None = None


class VocabularyOnly:
    """A model's tokenizer and chat template without its weights: a host whose head is on a member
    tokenizes, detokenizes and samples with this, and holds none of the output projection."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._llama = llama()
        _forget_errors()
        self.model = self._llama.llama_model_load_from_file(str(path).encode(), model_params(vocab_only=True))
        if not self.model:
            raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}: {last_error()}")
        self.vocab = self._llama.llama_model_get_vocab(self.model)
        self.n_vocab = int(self._llama.llama_vocab_n_tokens(self.vocab))

    def close(self) -> None:
        if getattr(self, "model", None):
            self._llama.llama_model_free(self.model)
            self.model = None


MROPE_TYPES = (8, 40)  # LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE: llama_hparams::n_pos_per_embd
MROPE_SECTIONS = 4
_DECODE_FAILURES = {-1: "invalid batch", 2: "aborted", -2: "out of memory", -3: "compute failed"}


class LlamaModel:
    """A loaded model and one context over it; frees both when closed.

    `input_restored_at`: a graph node where llama.cpp transforms embeddings given as input as it
    does token embeddings (gemma2's `inp_scaled`); each decode of hidden states writes its rows back
    over that node's result, since they are already past the transform.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: ContextSettings,
        eval_callback: Callable[[int, bool, Any], bool] | None = None,
        input_restored_at: str | None = None,
    ) -> None:
        self._llama = llama()
        self.settings = settings
        self._restored_at = input_restored_at.encode() if input_restored_at else None
        self._input_rows: npt.NDArray[np.float32] | None = None
        self._restores = 0
        self._user_callback = eval_callback
        if self._restored_at is not None:
            self._ggml = GGMLBase.load()
            eval_callback = self._restoring_input
        params = model_params(settings.gpu_layers, repack=settings.repack)
        _forget_errors()
        self.model = self._llama.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}: {last_error()}")
        params = self._llama.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch  # one graph per decode, so a callback sees every row at once
        params.n_seq_max = settings.n_seq_max
        params.n_outputs_max = settings.max_outputs or 0
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.kv_unified = True  # keeps a batch's tokens in order across sequences
        params.no_perf = True
        if settings.gpu_layers == 0 and self._llama.llama_supports_gpu_offload():
            # No layer on a GPU means no work there either: llama.cpp would otherwise run a large
            # batch's products on a GPU it finds (a CPU stage of a mixed ring). The KV cache stays
            # with its layers, on the CPU, as it is.
            params.op_offload = False
        if settings.flash_attn is not None:
            ll = self._llama
            params.flash_attn_type = (
                ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self._callback = None
        if eval_callback is not None:
            self._callback = self._llama.ggml_backend_sched_eval_callback(eval_callback)
            params.cb_eval = self._callback
            params.cb_eval_user_data = None
        self.ctx = self._llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            self._llama.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {path}: {last_error()}")
        self._threadpool = None
        if settings.quiet_threads:
            self._threadpool = QuietThreadpool(settings.n_threads)
            self._threadpool.attach(self.ctx)
        self.vocab = self._llama.llama_model_get_vocab(self.model)
        self.n_embd = int(self._llama.llama_model_n_embd(self.model))
        self.n_vocab = int(self._llama.llama_vocab_n_tokens(self.vocab))
        self._token_batch = self._llama.llama_batch_init(settings.n_batch, 0, 1)
        # A model that rotates by sections takes 4 positions a row of embeddings (all 4 a text
        # token's own), section by section; llama_batch_init sizes `pos` by its first argument.
        rope_type = int(self._llama.llama_model_rope_type(self.model))
        self._positions_per_row = MROPE_SECTIONS if rope_type in MROPE_TYPES else 1
        rows = settings.n_batch * self._positions_per_row
        self._embd_batch = self._llama.llama_batch_init(rows, self.n_embd, 1)

    def _restoring_input(self, tensor: int, ask: bool, user: object) -> bool:
        """The graph callback where input is restored: it writes the decode's rows over the node's
        result, then lets the stage's own callback, if any, see every other node."""
        if self._ggml.get_name(tensor) == self._restored_at:
            rows = self._input_rows
            if ask:
                return rows is not None  # token ids: llama.cpp's own transform is the one they need
            if rows is None or self._ggml.nbytes(tensor) != rows.nbytes:
                return False  # stop the graph: decode() finds the input not restored and says so
            self._ggml.tensor_set(tensor, rows.ctypes.data, 0, rows.nbytes)
            self._restores += 1
            return True
        if self._user_callback is not None:
            return self._user_callback(tensor, ask, user)
        return not ask

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._llama.llama_batch_free(self._token_batch)
            self._llama.llama_batch_free(self._embd_batch)
            self._llama.llama_free(self.ctx)
            self._llama.llama_model_free(self.model)
            if self._threadpool is not None:
                self._threadpool.close()
            self.ctx = None

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def decode(
        self,
        sequences: Sequence[int],
        positions: Sequence[int],
        outputs: Sequence[bool],
        tokens: Sequence[int] | None = None,
        states: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """One llama_decode over a batch given row by row, as token ids or as hidden states."""
        n = len(sequences)
        if n == 0 or n > self.settings.n_batch:
            raise ValueError(f"a decode takes 1 to {self.settings.n_batch} rows, not {n}")
        limit = self.settings.max_outputs
        if limit is not None and sum(map(bool, outputs)) > limit:  # llama.cpp would abort the process
            raise ValueError(f"a decode of this context returns at most {limit} rows of logits")
        if tokens is not None:
            batch = self._token_batch
            for i, token in enumerate(tokens):
                batch.token[i] = token
        else:
            assert states is not None
            batch = self._embd_batch
            rows = np.ascontiguousarray(states, dtype=np.float32)  # kept alive until the copy is done
            if rows.shape != (n, self.n_embd):
                raise ValueError(f"hidden states of shape {rows.shape}; expected ({n}, {self.n_embd})")
            ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
            self._input_rows, self._restores = rows, 0
        batch.n_tokens = n
        sections = 1 if tokens is not None else self._positions_per_row
        for i in range(n):
            for section in range(sections):
                batch.pos[section * n + i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequences[i]
            batch.logits[i] = outputs[i]
        try:
            status = self._llama.llama_decode(self.ctx, batch)
        finally:
            self._input_rows = None
        if status == 0 and states is not None and self._restored_at is not None and self._restores != 1:
            node = self._restored_at.decode()
            raise RuntimeError(f"the input rows were put back at graph node {node} {self._restores} times, not once")
        if status == 1:
            raise RuntimeError(f"the KV cache has no room for {n} more rows (llama_decode status 1)")
        if status != 0:
            why = _DECODE_FAILURES.get(status, "unknown failure")
            raise RuntimeError(f"llama_decode failed with status {status} ({why})")

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        pointer = self._llama.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def check_sequence(self, sequence: int) -> None:
        """Refuse a sequence id this context has no slot for: llama.cpp's cache calls abort the whole
        process on one out of their range (and -1, which a large id can wrap to, means every sequence)."""
        if not 0 <= sequence < self.settings.n_seq_max:
            raise ValueError(f"sequence {sequence} is outside this context's {self.settings.n_seq_max} slots")

    def next_position(self, sequence: int) -> int:
        """Where a sequence's next row goes: one past the last position its cache holds (0 when empty)."""
        self.check_sequence(sequence)
        return int(self._llama.llama_memory_seq_pos_max(self._llama.llama_get_memory(self.ctx), sequence)) + 1

    def truncate(self, sequence: int, position: int) -> bool:
        """Drop a sequence's rows from `position` on: what undoes a failed forward. False where the
        cache cannot: a recurrent state holds no earlier positions, so it can only be dropped whole."""
        self.check_sequence(sequence)
        return bool(self._llama.llama_memory_seq_rm(self._llama.llama_get_memory(self.ctx), sequence, position, -1))

    @property
    def keeps_recurrent_state(self) -> bool:
        """Whether some blocks keep a recurrent state per sequence (a hybrid such as qwen3next):
        llama.cpp then runs the rows of each sequence of a decode as a graph of their own."""
        return bool(self._llama.llama_model_is_recurrent(self.model) or self._llama.llama_model_is_hybrid(self.model))

    @property
    def sliding_window(self) -> int:
        """The model's attention window (0: none), whose cache reuses cells that fall out of it."""
        return int(self._llama.llama_model_n_swa(self.model))

    def forget(self, sequence: int, keep: int = 0) -> None:
        """Drop a sequence's cache from position `keep` on (all of it by default), for the next
        request in its slot (an id with no slot holds nothing)."""
        if 0 <= sequence < self.settings.n_seq_max:
            self._llama.llama_memory_seq_rm(self._llama.llama_get_memory(self.ctx), sequence, max(0, keep), -1)

    @property
    def holds_positions(self) -> bool:
        """Whether the cache is by position (KV), so a sequence can be cut after a prefix; a
        recurrent state (mamba, rwkv, the linear layers of a hybrid) holds only its latest."""
        model = self.model
        return not (self._llama.llama_model_is_recurrent(model) or self._llama.llama_model_is_hybrid(model))
