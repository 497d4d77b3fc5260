"""macOS's unified memory: what a stage may fill when the GPU and every other app share one RAM.

Metal's free-memory figure (what ggml reports for the GPU device) is its working-set budget
less what this process has allocated; it ignores what other apps hold in the same memory. On
Darwin a stage is therefore sized to the smaller of Metal's figure and what the system has
available, read from `vm_stat`: free, inactive, speculative and purgeable pages (memory the
system hands out without swapping). `vm_stat_available_bytes` and `pressure_warning` are pure;
`system_available_bytes` runs `vm_stat`.
"""

from __future__ import annotations

import re
import subprocess
import sys

from kafila.units import human_bytes

VM_STAT_TIMEOUT_S = 2.0
AVAILABLE_PAGES = ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable")
_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")


def vm_stat_available_bytes(text: str) -> int | None:
    """Free, inactive, speculative and purgeable pages times the page size, from `vm_stat`'s
    text; None where the text lacks the page size or any of those counts."""
    size = _PAGE_SIZE.search(text)
    if size is None:
        return None
    counts: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip().rstrip(".")
        if key.strip() in AVAILABLE_PAGES and value.isdigit():
            counts[key.strip()] = int(value)
    if len(counts) != len(AVAILABLE_PAGES):
        return None
    return sum(counts.values()) * int(size.group(1))


def stage_memory(gpu_free: int, system_available: int | None) -> int:
    """Bytes a stage may fill on unified memory: Metal's figure, cut to what the system has
    available where that is known and smaller."""
    return gpu_free if system_available is None else min(gpu_free, system_available)


def pressure_warning(system_available: int | None, gpu_free: int | None, lent: int | None) -> str | None:
    """A one-line warning where unified memory is under pressure: the system has less available
    than this member lends (`--memory`) or, lending everything, than Metal counts as free."""
    wanted = lent if lent is not None else gpu_free
    if system_available is None or wanted is None or system_available >= wanted:
        return None
    what = "this machine lends (--memory)" if lent is not None else "Metal counts as free for the GPU"
    return (
        f"unified memory is under pressure: the system has {human_bytes(system_available)} available, "
        f"less than the {human_bytes(wanted)} {what}; other apps hold the rest. Stages are sized to the "
        "smaller figure; quit some apps or lend less with --memory"
    )


def system_available_bytes(platform: str = sys.platform) -> int | None:
    """What macOS has available now, by `vm_stat`; None elsewhere or where it cannot be read."""
    if platform != "darwin":
        return None
    try:
        done = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=VM_STAT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return vm_stat_available_bytes(done.stdout) if done.returncode == 0 else None
