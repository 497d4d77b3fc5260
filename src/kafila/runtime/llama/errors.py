"""What llama.cpp says when it fails: its log, quiet unless KAFILA_LLAMA_LOG is set, with its
last errors kept to explain a failed load, and whether a failure was for lack of memory."""

from __future__ import annotations

import os
import sys
from typing import Any

GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4  # ggml_log_level


_ERRORS: list[str] = []


_WARNINGS: list[str] = []


def log_line(level: int, text: bytes | None, _user: Any) -> None:
    """llama.cpp's log: silent unless KAFILA_LLAMA_LOG is set; errors are kept to explain failures."""
    message = text.decode("utf-8", errors="replace") if text else ""
    if os.environ.get("KAFILA_LLAMA_LOG"):
        print(message, end="", file=sys.stderr, flush=True)
    if level in (GGML_LOG_WARN, GGML_LOG_ERROR) and message.strip():
        kept = _ERRORS if level == GGML_LOG_ERROR else _WARNINGS
        kept.append(message.strip())
        del kept[:-5]


def last_error(default: str = "no reason given") -> str:
    """Why llama.cpp failed since `forget_errors`: its errors, the cause first and its summary
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


def forget_errors() -> None:
    """Before a load: what an earlier one logged explains nothing about this one."""
    _ERRORS.clear()
    _WARNINGS.clear()
