"""macOS unified memory: stages sized to the smaller of Metal's free figure and what vm_stat says
is available, and a warning when the system has less than a member lends."""

from __future__ import annotations

from kafila.runtime.llama.unified_memory import (
    pressure_warning,
    stage_memory,
    system_available_bytes,
    vm_stat_available_bytes,
)
from kafila.runtime.machine.memory import memory_pressure

GIB = 2**30
# `vm_stat` on an Apple silicon Mac (16 KiB pages), as macOS 14 prints it.
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3493.
Pages active:                            249180.
Pages inactive:                          246028.
Pages speculative:                         1522.
Pages throttled:                              0.
Pages wired down:                        149396.
Pages purgeable:                           9218.
"Translation faults":                 912693740.
Pages copy-on-write:                   20386093.
Pages zero filled:                    435618357.
Pages reactivated:                      9373497.
Pages purged:                           2519393.
File-backed pages:                       152806.
Anonymous pages:                         343924.
Pages stored in compressor:              921519.
Pages occupied by compressor:            373018.
Decompressions:                        18637463.
Compressions:                          26393014.
Pageins:                               14372183.
Pageouts:                                128330.
Swapins:                                 587542.
Swapouts:                                910419.
"""
AVAILABLE = (3493 + 246028 + 1522 + 9218) * 16384  # free + inactive + speculative + purgeable


def test_vm_stat_available_is_free_inactive_speculative_and_purgeable_pages() -> None:
    assert vm_stat_available_bytes(VM_STAT) == AVAILABLE
    intel = VM_STAT.replace("page size of 16384 bytes", "page size of 4096 bytes")
    assert vm_stat_available_bytes(intel) == AVAILABLE // 4


def test_vm_stat_text_without_its_figures_is_unknown() -> None:
    assert vm_stat_available_bytes("") is None
    assert vm_stat_available_bytes(VM_STAT.replace("(page size of 16384 bytes)", "")) is None
    assert vm_stat_available_bytes(VM_STAT.replace("Pages speculative:", "Pages guessed:")) is None
    assert vm_stat_available_bytes(VM_STAT.replace("246028.", "lots.")) is None


def test_a_stage_fills_the_smaller_of_metal_and_the_system() -> None:
    assert stage_memory(12 * GIB, AVAILABLE) == AVAILABLE  # other apps hold most of the RAM
    assert stage_memory(2 * GIB, AVAILABLE) == 2 * GIB
    assert stage_memory(12 * GIB, None) == 12 * GIB  # not macOS, or vm_stat unreadable


def test_pressure_is_reported_against_what_is_lent_else_metals_figure() -> None:
    lent_too_much = pressure_warning(AVAILABLE, 12 * GIB, lent=8 * GIB)
    assert lent_too_much is not None and "--memory" in lent_too_much and "4.3GB available" in lent_too_much
    assert pressure_warning(AVAILABLE, 12 * GIB, lent=2 * GIB) is None  # lends less than is free
    everything = pressure_warning(AVAILABLE, 12 * GIB, lent=None)
    assert everything is not None and "Metal" in everything and "\n" not in everything
    assert pressure_warning(AVAILABLE, 2 * GIB, lent=None) is None
    assert pressure_warning(None, 12 * GIB, lent=8 * GIB) is None  # nothing to compare with
    assert pressure_warning(AVAILABLE, None, lent=None) is None


def test_only_macos_runs_vm_stat() -> None:
    assert system_available_bytes("linux") is None
    assert system_available_bytes("win32") is None
    assert system_available_bytes("darwin") is None  # asked here, where there is no vm_stat to run


def test_no_pressure_warning_off_macos() -> None:
    assert memory_pressure(lent=1) is None  # Linux: the warning never loads llama.cpp to ask Metal
