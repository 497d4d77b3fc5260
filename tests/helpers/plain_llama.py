"""llama-cpp-python's high-level `Llama`, loading weights as Kafila does on this machine.

Tests and benchmarks hold Kafila to `Llama` as the reference: llama.cpp alone. `Llama` has no
argument for llama.cpp's `use_extra_bufts`, so on a CPU where Kafila's AMX rule keeps weights
unrepacked (`kafila.runtime.llama.cpu_safety`) plain `Llama` would repack them, and there crash. While
one is built, the binding's default model parameters carry Kafila's choice; nothing else changes.
"""

from __future__ import annotations

import threading
from typing import Any

import llama_cpp
import llama_cpp.llama as high_level

from kafila.runtime.llama.loading import repack_choice

_BUILDING = threading.Lock()  # the defaults are swapped for one construction at a time


def plain_llama(model_path: str, **kwargs: Any) -> llama_cpp.Llama:
    """`Llama(model_path, **kwargs)` with weights repacked or not as Kafila's stages load them."""
    defaults = high_level.llama_cpp.llama_model_default_params
    repack = repack_choice().repack

    def kafilas_defaults() -> Any:
        params = defaults()
        params.use_extra_bufts = repack
        return params

    with _BUILDING:
        high_level.llama_cpp.llama_model_default_params = kafilas_defaults
        try:
            return llama_cpp.Llama(model_path=model_path, **kwargs)
        finally:
            high_level.llama_cpp.llama_model_default_params = defaults
