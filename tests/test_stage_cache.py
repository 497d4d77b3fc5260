"""The stage-file cache stays bounded: least recently used files go first, never one in use or
used within the hour (another kafila process on this machine may be using it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disks import small_disk
from tiny_models import write_tiny_model

from kafila.runtime.gguf.slicer import SliceError, block_range_file, cached_slices
from kafila.runtime.gguf.stage_cache import (
    PARTIAL_KEPT_S,
    RECENT_S,
    STAGE_CACHE_ENV,
    CachedFile,
    choose_evictions,
    choose_stale_partials,
    make_room,
    stage_cache_budget,
    trim_stage_cache,
)

NOW = 1_000_000.0
OLD = NOW - 2 * RECENT_S


def named(i: int) -> str:
    return f"{i:064x}.gguf"


def test_the_least_recently_used_go_first_until_the_rest_fit() -> None:
    files = [CachedFile(named(i), 100, OLD + i) for i in range(5)]  # named(0) is the oldest
    assert choose_evictions(files, [], 500, NOW) == []
    assert choose_evictions(files, [], 300, NOW) == [named(0), named(1)]
    assert choose_evictions(files, [named(0)], 300, NOW) == [named(1), named(2)]  # in use: kept
    assert choose_evictions(files, [named(4)], 0, NOW) == [named(i) for i in range(4)]


def test_a_partial_fetch_left_a_day_is_given_up_unless_it_is_the_one_resumed() -> None:
    touched = [("old", NOW - PARTIAL_KEPT_S - 1), ("fresh", NOW - 60), ("resumed", NOW - 10 * PARTIAL_KEPT_S)]
    assert choose_stale_partials(touched, keep="resumed", now=NOW) == ["old"]
    assert choose_stale_partials([], keep="x", now=NOW) == []


def test_files_used_within_the_hour_stay_even_over_budget() -> None:
    files = [CachedFile(named(0), 100, NOW - 60), CachedFile(named(1), 100, OLD), CachedFile(named(2), 100, NOW)]
    assert choose_evictions(files, [], 0, NOW) == [named(1)]


@pytest.mark.parametrize(("setting", "budget"), [(None, 2000), ("", 2000), ("5", 5_000_000_000), ("0.5", 500_000_000)])
def test_the_budget_is_twice_what_is_in_use_unless_set(setting: str | None, budget: int) -> None:
    assert stage_cache_budget(1000, setting) == budget


@pytest.mark.parametrize("setting", ["lots", "-1", "nan", "inf", "1e400"])
def test_a_budget_that_is_no_size_is_refused(setting: str) -> None:
    with pytest.raises(ValueError, match=STAGE_CACHE_ENV):
        stage_cache_budget(1000, setting)


def test_trimming_a_folder_leaves_partial_transfers_and_other_files(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / named(i)).write_bytes(b"x" * 100)
        os.utime(tmp_path / named(i), (time.time() - 2 * RECENT_S + i,) * 2)
    (tmp_path / f"{0:064x}.partial").write_bytes(b"x" * 1000)  # a transfer that may resume
    (tmp_path / "index.json").write_text("{}")
    removed = trim_stage_cache(tmp_path, [tmp_path / named(3)])  # budget: twice the 100 bytes in use
    assert sorted(p.name for p in removed) == [named(0), named(1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([named(2), named(3), f"{0:064x}.partial", "index.json"])
    assert trim_stage_cache(tmp_path / "absent", []) == []


def test_cuts_of_new_divisions_push_out_the_oldest_and_a_pushed_out_cut_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that replans cuts the model again for each division; the cache keeps this cut and
    about one earlier one's worth, and forgets the index entries of what it dropped."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    cache = tmp_path / "cache"
    divisions = ([2, 2], [1, 3], [3, 1])
    largest = max(sum(s.n_bytes for s in cached_slices(model, d, tmp_path / "scratch")) for d in divisions)
    monkeypatch.setenv(STAGE_CACHE_ENV, str(2 * largest / 1e9))  # two cuts' worth, as by default

    def age(stages: list) -> None:  # as if cut two hours ago
        for stage in stages:
            os.utime(stage.path, (time.time() - 2 * RECENT_S,) * 2)

    first = cached_slices(model, [2, 2], cache)
    age(first)
    second = cached_slices(model, [1, 3], cache)
    age(second)
    assert all(s.path.is_file() for s in first + second)  # two cuts: within twice one cut
    third = cached_slices(model, [3, 1], cache)
    assert all(s.path.is_file() for s in third)
    assert not any(s.path.is_file() for s in first)  # the oldest went
    assert any(s.path.is_file() for s in second)
    index = json.loads((cache / "index.json").read_text())
    assert not any("[2, 2]" in key for key in index)  # no entry names a file that is gone
    again = cached_slices(model, [2, 2], cache)  # cut anew, the same bytes
    assert [(s.sha256, s.n_bytes) for s in again] == [(s.sha256, s.n_bytes) for s in first]
    assert all(s.path.is_file() for s in again + third)


def test_a_cache_hit_counts_as_a_use(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    first = cached_slices(model, [2, 2], tmp_path / "cache")
    for stage in first:
        os.utime(stage.path, (time.time() - 2 * RECENT_S,) * 2)
    cached_slices(model, [2, 2], tmp_path / "cache")
    assert all(time.time() - s.path.stat().st_mtime < 60 for s in first)


COMMANDS = [["join", "7-crimson-harbor-lemon-tiger-orbit-cactus"], ["host"], ["generate", "--prompt", "hi"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_commands_refuse_a_cache_budget_that_is_no_size(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, STAGE_CACHE_ENV: "plenty"},
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{STAGE_CACHE_ENV} must be a number of gigabytes" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_room_is_made_before_new_files_arrive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Old cuts may fill the disk: before a cut or a transfer, the cache trims to leave the new
    files their budget (twice their size by default)."""
    monkeypatch.delenv(STAGE_CACHE_ENV, raising=False)
    for i in range(4):
        (tmp_path / named(i)).write_bytes(b"x" * 100)
        os.utime(tmp_path / named(i), (time.time() - 2 * RECENT_S + i,) * 2)
    assert sorted(p.name for p in make_room(tmp_path, 150)) == [named(0), named(1), named(2)]
    assert [p.name for p in tmp_path.iterdir()] == [named(3)]  # 100 bytes: with 150 more, within 300


def test_a_disk_too_small_for_the_cut_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    with small_disk(tmp_path / "disk", "64k") as disk:
        for cut in (lambda: cached_slices(model, [2, 2], disk / "stages"), lambda: block_range_file(model, 0, 2, disk)):
            with pytest.raises(SliceError, match=r"needs [0-9.]+KB in .*, which has [0-9.]+KB free: free some space"):
                cut()
        assert not any(p.suffix in (".gguf", ".partial") for p in disk.rglob("*"))


def test_a_disk_that_fills_up_during_the_cut_says_so_and_keeps_nothing(tmp_path: Path) -> None:
    # Room for the stage's tensor data (what is checked before writing) but not its header too:
    # the write runs out of space part way, and the cut says which disk filled and what to do.
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=4)
    with small_disk(tmp_path / "disk", "104k") as disk:  # 106,496 bytes: the stage's data exactly
        with pytest.raises(SliceError, match=r"the disk holding .* filled up while a stage file was written: free"):
            block_range_file(model, 0, 2, disk)
        assert not any(p.suffix in (".gguf", ".partial") for p in disk.rglob("*"))
