"""Loading llama.cpp: the OpenMP settings for a machine whose cores stages share, the library
and its ggml next to it, the GPU it may use, the repack choice, model parameters, and a quiet
threadpool. Everything else that touches ctypes is in `model`."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kafila.runtime.llama.cpu_safety import REPACK_SETTING, RepackChoice, choose_repack, repack_mode
from kafila.runtime.llama.errors import log_line

T = TypeVar("T")


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
#   generate`, whose stages run on their processes' main threads, were a little slower bound (2
#   and 3 stages: 5-20%), so they are left free. The host's measure of its model before the first
#   plan times its rings as the demo will serve: bound, each stage on a thread of its own
#   (`model_probe.probe_child_env`), since bound and free teams answer a busy machine unalike.
# A process alone on its machine keeps libgomp's defaults: its threads spin through the barriers
# and are not pulled together, and a dedicated member has no one to yield its cores to. libgomp
# reads these when it loads, so they are set before llama_cpp is first imported, and a value the
# user set is kept.
SHARED_MACHINE_OPENMP = {"GOMP_SPINCOUNT": "1000"}


BOUND_TEAMS_OPENMP = {"OMP_PROC_BIND": "true"}


def teams_bound(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether libgomp, loaded with `environ`, binds each computing team's threads to their own
    cores: OMP_PROC_BIND set to anything but false (true, close, spread, primary)."""
    return environ.get("OMP_PROC_BIND", "").strip().lower() not in ("", "false")


def computed_as_served(work: Callable[[], T]) -> T:
    """`work`'s result, computed as a session computes its stage: where teams are bound, on a
    thread started for it (the host's engine loop, a member's executor), since libgomp binds the
    team of a thread other than the one that loaded it, the thread itself included, each to its
    own core; where they are free, here."""
    if not teams_bound():
        return work()
    with ThreadPoolExecutor(1, thread_name_prefix="kafila-team") as pool:
        return pool.submit(work).result()


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


KEPT_CALLBACKS: list[Any] = []  # ctypes callbacks must outlive every call that may use them


@functools.cache
def llama() -> Any:
    """llama_cpp, initialised once, with its log routed through `log_line`."""
    llama_cpp = load_llama()
    callback = llama_cpp.llama_log_callback(log_line)
    KEPT_CALLBACKS.append(callback)
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
        # The name is read for every node of every graph a callback sees (a block stage's ~685 a
        # decode), from inside the callback, which holds the GIL: a plain CDLL call would let it
        # go and take it back around a read of a struct field. PyDLL keeps it.
        held = ctypes.PyDLL(str(ggml_library_path("ggml-base")))
        held.ggml_get_name.argtypes, held.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_set.restype = None
        return cls(held.ggml_get_name, lib.ggml_nbytes, lib.ggml_backend_tensor_get, lib.ggml_backend_tensor_set)


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
