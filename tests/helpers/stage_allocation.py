"""What building a llama.cpp stage allocates, counted by glibc (`mallinfo2`): for the stage-memory
test and benchmark (tests/test_stage_memory.py, scripts/bench_stage_memory.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

from kafila.planner.types import ServingSpec
from kafila.runtime.engine.stage import BlockStage, HeadStage, WholeModel
from kafila.runtime.llama.model import ContextSettings


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_counter() -> ctypes.CDLL | None:
    """glibc, whose `mallinfo2` counts this process's heap; None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError, TypeError):
        return None
    return libc


LIBC = heap_counter()


def allocated() -> int:
    """Bytes of this process's heap in use, mapped chunks included (glibc)."""
    assert LIBC is not None, "needs glibc's mallinfo2"
    info = LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def settings_of(session: ServingSpec) -> ContextSettings:
    """A stage's context as a session's runner makes it."""
    n = session.concurrency
    return ContextSettings(n_ctx=session.context * n, n_batch=512, n_seq_max=n, n_threads=2)


def stage_allocation(path: Path, is_head: bool, whole: bool, session: ServingSpec) -> int:
    """What building the stage allocated, plus the weights it maps from its file."""
    before = allocated()
    kind = WholeModel if whole else HeadStage if is_head else BlockStage
    stage = kind(path, settings_of(session))
    try:
        grown = allocated() - before
        weights = int(stage.model._llama.llama_model_size(stage.model.model))
    finally:
        stage.close()
    return grown + weights
