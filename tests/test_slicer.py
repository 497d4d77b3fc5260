"""The slicer: deterministic stage files, rewritten per-layer metadata, clear refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from test_split_correctness import SETTINGS, greedy_split, greedy_unsplit
from tiny_models import ModelShape, write_tiny_model

from kafila.runtime.families import UnsupportedFamily, family_of
from kafila.runtime.gguf_file import FastGGUFReader, RawCopyWriter, raw_value
from kafila.runtime.manifest import read_manifest
from kafila.runtime.slicer import SliceError, block_range_file, slice_model
from kafila.runtime.stage import WholeModel


def rewrite(source: Path, target: Path, overrides: dict[str, list[int]]) -> Path:
    """A copy of a model with some metadata replaced by per-layer arrays."""
    reader = FastGGUFReader(source)
    writer = RawCopyWriter(target, arch=str(reader.scalar("general.architecture")))
    for key in reader.fields:
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in overrides:
            writer.add_array(key, overrides[key])
        else:
            vtype, value = raw_value(reader, key)
            writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_same_model_and_division_give_the_same_bytes(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    first = slice_model(model, [1, 2, 1], tmp_path / "a")
    second = slice_model(model, [1, 2, 1], tmp_path / "b")
    assert [s.sha256 for s in first] == [s.sha256 for s in second]
    for a, b in zip(first, second, strict=True):
        assert a.path.read_bytes() == b.path.read_bytes()
        assert a.path.name == f"{a.sha256}.gguf"
    assert len({s.sha256 for s in first}) == 3


def test_stage_and_head_files_hold_what_they_should(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    source = FastGGUFReader(model)
    stage, head = slice_model(model, [3, 1], tmp_path / "out")

    reader = FastGGUFReader(stage.path)
    names = {t.name for t in reader.tensors}
    assert reader.scalar("llama.block_count") == 3
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1", "2"}
    assert "output.weight" not in names
    assert reader.strings("tokenizer.ggml.tokens") == ["<pad>", "<eos>", "<bos>", "<unk>"]
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embedding.data.shape[0] == 4
    assert reader.scalar("kafila.slice.first_block") == 0 and reader.scalar("kafila.slice.is_head") is False

    reader = FastGGUFReader(head.path)
    assert reader.scalar("llama.block_count") == 1
    assert reader.strings("tokenizer.ggml.tokens") == source.strings("tokenizer.ggml.tokens")
    assert {"output.weight", "output_norm.weight", "token_embd.weight", "blk.0.attn_q.weight"} <= {
        t.name for t in reader.tensors
    }
    original = next(t for t in source.tensors if t.name == "blk.3.ffn_down.weight")
    renamed = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert original.tensor_type == renamed.tensor_type and np.array_equal(original.data, renamed.data)


def test_per_layer_arrays_are_cut_to_the_slice(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    kv_heads = int(FastGGUFReader(model).scalar("llama.attention.head_count_kv"))
    ffn = int(FastGGUFReader(model).scalar("llama.feed_forward_length"))
    arrays = rewrite(
        model,
        tmp_path / "arrays.gguf",
        {"llama.attention.head_count_kv": [kv_heads] * 4, "llama.feed_forward_length": [ffn] * 4},
    )
    stage, head = slice_model(arrays, [1, 3], tmp_path / "out")
    assert FastGGUFReader(stage.path).scalar("llama.attention.head_count_kv") == [kv_heads]
    assert FastGGUFReader(head.path).scalar("llama.feed_forward_length") == [ffn] * 3
    whole = WholeModel(arrays, SETTINGS)
    prompt = whole.vocabulary.tokenize("hello world, the kafila model is in a block of the world")
    whole.close()
    assert greedy_split([stage.path, head.path], prompt, 16) == greedy_unsplit(arrays, prompt, 16)


def test_gemma_sliding_window_pattern_follows_the_original_indices(gemma_path: Path, tmp_path: Path) -> None:
    first, middle, last = slice_model(gemma_path, [5, 12, 1], tmp_path)
    assert FastGGUFReader(first.path).scalar("gemma3.attention.sliding_window_pattern") == [True] * 5
    expected = [(5 + i) % 6 < 5 for i in range(12)]
    assert FastGGUFReader(middle.path).scalar("gemma3.attention.sliding_window_pattern") == expected
    # Block 17 is global: a slice of only global blocks carries no window at all.
    only_global = FastGGUFReader(last.path)
    assert "gemma3.attention.sliding_window" not in only_global.fields
    assert "gemma3.attention.sliding_window_pattern" not in only_global.fields


def test_slicing_gemma_is_fast_and_keeps_the_vocabulary(gemma_path: Path, tmp_path: Path) -> None:
    started = time.perf_counter()
    stages = slice_model(gemma_path, [6, 6, 6], tmp_path)
    elapsed = time.perf_counter() - started
    head = FastGGUFReader(stages[-1].path)
    assert len(head.strings("tokenizer.ggml.tokens")) == 262_144
    assert elapsed < 60  # a guard against a hang, not a speed claim: see docs/benchmarks.md


def test_one_stage_is_the_original_file(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "qwen2.gguf", "qwen2", n_blocks=4)
    (only,) = slice_model(model, [4], tmp_path / "out")
    assert only.path == model and only.is_head and (only.first_block, only.end_block) == (0, 4)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("counts", "message"),
    [([2, 1], "covers 3 blocks but the model has 4"), ([4, 0], "at least one block"), ([], "at least one block")],
)
def test_bad_divisions(tmp_path: Path, counts: list[int], message: str) -> None:
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    with pytest.raises(SliceError, match=message):
        slice_model(model, counts, tmp_path / "out")


def _bare_model(path: Path, arch: str, n_blocks: int) -> Path:
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_key_value(f"{arch}.block_count", n_blocks, GGUFValueType.UINT32)
    for i in range(n_blocks):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_family_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    model = _bare_model(tmp_path / "mamba.gguf", "mamba", 2)
    with pytest.raises(UnsupportedFamily, match=r"'mamba'.*supported: gemma3, llama, llama4, qwen2, qwen3"):
        slice_model(model, [1, 1], tmp_path / "out")
    assert slice_model(model, [2], tmp_path / "out")[0].path == model  # unsplit needs no support


def test_cached_slices_reuse_an_earlier_cut(tmp_path: Path) -> None:
    from kafila.runtime.slicer import cached_slices

    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4)
    first = cached_slices(model, [2, 2], tmp_path / "cache")
    inodes = [stage.path.stat().st_ino for stage in first]  # a file cut again is a new file
    again = cached_slices(model, [2, 2], tmp_path / "cache")
    assert again == first and [s.path.stat().st_ino for s in again] == inodes
    first[0].path.unlink()  # a missing file means the cut is made again
    remade = cached_slices(model, [2, 2], tmp_path / "cache")
    assert [s.sha256 for s in remade] == [s.sha256 for s in first] and remade[0].path.is_file()
    other = cached_slices(model, [1, 3], tmp_path / "cache")
    assert other[0].sha256 != first[0].sha256


def _recorder() -> tuple[list[tuple[int, int, str]], Callable[[int, int], None]]:
    calls: list[tuple[int, int, str]] = []
    return calls, lambda done, total: calls.append((done, total, threading.current_thread().name))


def test_cutting_reports_its_progress_from_writing_through_hashing_and_cuts_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kafila.runtime.slicer as slicer
    from kafila.runtime.slicer import block_range_file

    monkeypatch.setattr(slicer, "SIZE_POLL_S", 0.001)  # the test model is written in milliseconds
    shape = dataclasses.replace(ModelShape(64, 4, 2, 16, 128, tied_output=False), n_embd=512, n_ff=2048)
    model = write_tiny_model(tmp_path / "llama.gguf", "llama", n_blocks=4, shape=shape)  # about 20 MB
    quiet = slice_model(model, [1, 3], tmp_path / "quiet")
    calls, progress = _recorder()
    told = slice_model(model, [1, 3], tmp_path / "told", progress)
    assert [s.sha256 for s in told] == [s.sha256 for s in quiet]

    total = calls[-1][1]
    assert {t for _, t, _ in calls} == {total}  # one whole, said the same each time
    assert total <= sum(s.n_bytes for s in told) < total * 1.01  # the tensors: nearly all of the files
    assert [d for d, _, _ in calls] == sorted(d for d, _, _ in calls) and calls[-1][0] == total
    assert any(name == "kafila-slice-progress" for _, _, name in calls)  # heard while the file was written
    assert any(0 < d < total for d, _, _ in calls)

    calls, progress = _recorder()
    head = block_range_file(model, 1, 4, tmp_path / "one", is_head=True, progress=progress)
    assert head.sha256 == quiet[1].sha256 and calls[-1][0] == calls[-1][1] > 0


def test_hashing_a_model_reports_its_bytes_and_stops_when_its_caller_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from kafila.runtime.local_plan import hash_model

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    small = tmp_path / "small.gguf"
    small.write_bytes(b"x" * (9 << 20))
    calls, progress = _recorder()
    digest = asyncio.run(hash_model(small, progress))
    assert digest == hashlib.sha256(small.read_bytes()).hexdigest()
    assert calls[-1][:2] == (9 << 20, 9 << 20) and len(calls) == 3  # 4 MiB at a time
    calls.clear()
    assert asyncio.run(hash_model(small, progress)) == digest and calls == []  # remembered: not read again

    large = tmp_path / "large.gguf"
    with large.open("wb") as sparse:
        sparse.truncate(64 << 30)  # minutes to hash; nothing on disk

    async def cancel_after_the_first_piece() -> None:
        task = asyncio.create_task(hash_model(large, progress))
        while not calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(cancel_after_the_first_piece())  # asyncio.run waits for the hashing thread to end
    assert time.monotonic() - started < 20
    assert calls[-1][0] < (64 << 30) // 4
    assert str(large.resolve()) not in (tmp_path / "cache" / "model-hashes.json").read_text()


def with_uint32(source: Path, target: Path, key: str, value: int) -> Path:
    """A copy of a model with one more (or another) unsigned metadata value."""
    reader = FastGGUFReader(source)
    writer = RawCopyWriter(target, arch=str(reader.scalar("general.architecture")))
    for name in reader.fields:
        if not name.startswith("GGUF.") and name not in ("general.architecture", key):
            vtype, raw = raw_value(reader, name)
            writer.add_key_value(name, raw, vtype)
    writer.add_uint32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.parametrize(
    ("n_blocks", "metadata", "starts"),
    [
        (48, {"llama4.interleave_moe_layer_step": 1}, tuple(range(4, 45, 4))),  # Scout
        (48, {"llama4.interleave_moe_layer_step": 2}, tuple(range(4, 45, 4))),  # Maverick
        (48, {"llama4.interleave_moe_layer_step": 3}, (12, 24, 36)),
        (50, {"llama4.interleave_moe_layer_step": 2}, tuple(range(4, 47, 4))),  # the last stage keeps block 47
        (7, {"llama4.interleave_moe_layer_step": 1}, ()),  # 4-6 would have no block of full attention
        (48, {"llama4.interleave_moe_layer_step": 1, "llama4.attention.sliding_window": 0}, ()),
    ],
)
def test_llama4_stages_start_where_its_block_patterns_restart(
    n_blocks: int, metadata: dict[str, int], starts: tuple[int, ...]
) -> None:
    assert family_of("llama4").cut_points(n_blocks, metadata.get).starts == starts


def test_llama4_cut_off_its_patterns_is_refused_for_a_stage_file_too(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "llama4.gguf", "llama4", n_blocks=12)
    for first, end, wrong in ((2, 12, 2), (4, 10, 10), (0, 6, 6)):
        with pytest.raises(SliceError, match=f"cannot be cut at block {wrong}: .*RoPE.* can be cut at blocks 4, 8$"):
            block_range_file(model, first, end, tmp_path / "out", is_head=end == 12)
    stage = block_range_file(model, 4, 8, tmp_path / "out")
    assert FastGGUFReader(stage.path).scalar("llama4.block_count") == 4


def test_llama4_without_chunked_attention_is_not_split(tmp_path: Path) -> None:
    """With attention.sliding_window = 0, llama.cpp skips RoPE in the last block of a file, which
    a slice would move to its own last block: the model runs whole, and is planned so."""
    source = write_tiny_model(tmp_path / "llama4.gguf", "llama4", n_blocks=8)
    model = with_uint32(source, tmp_path / "full.gguf", "llama4.attention.sliding_window", 0)
    with pytest.raises(SliceError, match=r"this llama4 model cannot be split: .*sliding_window = 0"):
        slice_model(model, [4, 4], tmp_path / "out")
    manifest = read_manifest(model)
    assert manifest.stage_starts == () and manifest.max_stages == 1
    assert read_manifest(source).stage_starts == (4,)
