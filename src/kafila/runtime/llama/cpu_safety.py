"""What llama.cpp says of this CPU, how weights are laid out for it, and what a native crash means.

Pure: the text of `llama_print_system_info()`, the environment's setting and a child's exit
status go in; a choice or a message comes out. `llama.loading` applies the choice to every
model it loads.

Why it exists: on Intel Xeons with AMX (Sapphire Rapids and later), llama.cpp repacks weights
into its AMX buffer type, and on some machines its first prompt-sized matrix multiply there
crashes the process (ggml-org/llama.cpp issue 20824, ollama issues 17249 and 17006). Loading
without extra buffer types avoids it. Elsewhere the CPU repack speeds up some quant types, so
llama.cpp's default is kept.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from enum import StrEnum

from kafila.contracts import Strict

REPACK_SETTING = "KAFILA_LLAMA_REPACK"
AMX_FEATURE = "AMX_INT8"
AMX_NOTE = "AMX found: weights are not repacked for AMX (llama.cpp crashes there)"
UPSTREAM_AMX_ISSUE = "ggml-org/llama.cpp issue 20824"


class RepackMode(StrEnum):
    """What the user asked for: llama.cpp's extra (repacked) weight buffers or not."""

    AUTO = "auto"  # off where llama.cpp reports AMX, llama.cpp's default elsewhere
    ON = "on"
    OFF = "off"


class RepackChoice(Strict):
    """Whether models load with llama.cpp's extra buffer types (`use_extra_bufts`), and why."""

    mode: RepackMode
    repack: bool
    amx: bool  # llama.cpp reported AMX on this CPU
    reason: str

    @property
    def note(self) -> str | None:
        """The line to say once in the log where the default was changed for safety."""
        return AMX_NOTE if self.amx and not self.repack and self.mode is RepackMode.AUTO else None


def repack_mode(environ: Mapping[str, str]) -> RepackMode:
    """The user's setting; ValueError naming the variable and its values when it is not one of them."""
    raw = environ.get(REPACK_SETTING, "").strip().lower()
    if not raw:
        return RepackMode.AUTO
    try:
        return RepackMode(raw)
    except ValueError:
        values = "|".join(mode.value for mode in RepackMode)
        raise ValueError(f"{REPACK_SETTING}={environ[REPACK_SETTING]!r} is not one of {values}") from None


def reported_features(system_info: str, backend: str = "CPU") -> list[str]:
    """The features of one backend that llama.cpp reports as present, in its order.

    The text runs `CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | CUDA : ARCHS = 900 | ...`: each
    backend's name, then its `NAME = value` parts. A feature at 0 or with a value that is not a
    number is not present; a text that names no backend is read as one.
    """
    features: list[str] = []
    current: str | None = None
    for part in system_info.replace("\n", "|").split("|"):
        prefix, colon, rest = part.partition(":")
        if colon:
            current = prefix.strip()
        name, equals, value = (rest if colon else part).partition("=")
        name, value = name.strip(), value.strip()
        if current not in (None, backend) or not equals or not name or not value.isdigit() or int(value) == 0:
            continue
        if name not in features:
            features.append(name)
    return features


def choose_repack(system_info: str, mode: RepackMode) -> RepackChoice:
    """Load with extra buffer types unless told not to, or unless llama.cpp runs AMX here (auto)."""
    amx = AMX_FEATURE in reported_features(system_info)
    if mode is RepackMode.ON:
        return RepackChoice(mode=mode, repack=True, amx=amx, reason=f"{REPACK_SETTING}=on")
    if mode is RepackMode.OFF:
        return RepackChoice(mode=mode, repack=False, amx=amx, reason=f"{REPACK_SETTING}=off")
    if amx:
        return RepackChoice(mode=mode, repack=False, amx=True, reason="auto: llama.cpp runs AMX kernels here")
    return RepackChoice(mode=mode, repack=True, amx=False, reason="auto: llama.cpp's default, no AMX on this CPU")


# ---------------------------------------------------------------------------------------------
# A process that died by a signal.
# ---------------------------------------------------------------------------------------------

# The signals native code dies by; any other was sent from outside (a person, the OOM killer).
NATIVE_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"})


def signal_of(returncode: int | None) -> int | None:
    """The signal a child died by (Popen's negative return code), or None if it exited or runs."""
    return -returncode if returncode is not None and returncode < 0 else None


def _short_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return ""


def signal_name(signum: int) -> str:
    """`SIGSEGV (Segmentation fault)`; a number the platform does not know is named as one."""
    name = _short_name(signum)
    if not name:
        return f"signal {signum}"
    described = signal.strsignal(signum)
    return f"{name} ({described})" if described and described != name else name


def likely_cause(signum: int, features: Sequence[str], choice: RepackChoice) -> str:
    """The most likely reason a process running llama.cpp died by this signal here, and what avoids it."""
    name = _short_name(signum)
    if name not in NATIVE_SIGNALS:
        return "it was ended from outside: by the system's out-of-memory killer, or by a person"
    if name == "SIGILL":
        return (
            "llama.cpp was compiled for instructions this CPU lacks (a build copied from another machine); "
            "reinstall it on this machine: python3 -m pip install --force-reinstall --no-cache-dir llama-cpp-python"
        )
    if AMX_FEATURE in features and choice.repack:
        return (
            f"llama.cpp's AMX kernels, which crash on some machines ({UPSTREAM_AMX_ISSUE}); "
            f"{REPACK_SETTING}=off (or auto, the default) loads weights without repacking them for AMX"
        )
    if choice.repack:
        return (
            "a fault in llama.cpp's CPU kernels for these features; "
            f"{REPACK_SETTING}=off loads weights without repacking them, the commonest way round it"
        )
    return "a fault in llama.cpp's kernels for these features, with weights not repacked; report it with this log"


def died_by_signal(
    what: str, returncode: int, system_info: str, choice: RepackChoice, log_tail: Sequence[str] = ()
) -> str:
    """One paragraph for a process that died by a signal: which signal and, for a native crash, the CPU
    features llama.cpp reported, the likely cause and the setting that avoids it; then its last lines."""
    signum = signal_of(returncode)
    if signum is None:
        raise ValueError(f"exit status {returncode} is not a death by a signal")
    features = reported_features(system_info)
    cause = likely_cause(signum, features, choice)
    if _short_name(signum) in NATIVE_SIGNALS:
        shown = ", ".join(features) if features else "none reported"
        repacked = "repacked" if choice.repack else "not repacked"
        message = (
            f"{what} died with {signal_name(signum)}. llama.cpp reported these CPU features: {shown}; "
            f"weights were {repacked} ({choice.reason}). Likely cause: {cause}"
        )
    else:
        message = f"{what} died with {signal_name(signum)}: {cause}"
    lines = [line for line in log_tail if line.strip()]
    if lines:
        message += ". Its last lines:\n  " + "\n  ".join(lines)
    return message
