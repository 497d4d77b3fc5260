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
from gguf import GGUFValueType
from test_split_correctness import SETTINGS, greedy_split, greedy_unsplit
from tiny_gguf import rewrite, write_other_family
from tiny_models import TINY_SHAPES, ModelShape, write_tiny_model

from kafila.runtime.engine.stage import BlockStage, HeadStage, StepInput, WholeModel
from kafila.runtime.gguf.families import FAMILIES, UnsupportedFamily, family_of
from kafila.runtime.gguf.gguf_file import FastGGUFReader
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import UNREACHED_WINDOW, SliceError, block_range_file, check_family, slice_model


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
        {
            "llama.attention.head_count_kv": (GGUFValueType.ARRAY, [kv_heads] * 4),
            "llama.feed_forward_length": (GGUFValueType.ARRAY, [ffn] * 4),
        },
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


def test_gpt_oss_slices_alternate_from_their_first_block_and_a_lone_full_block_gets_a_window(tmp_path: Path) -> None:
    """llama.cpp windows gpt-oss's even blocks and asserts that a gpt-oss has a windowed block: a
    slice of one odd block alone is one windowed block whose window no sequence spans."""
    model = write_tiny_model(tmp_path / "gpt-oss.gguf", "gpt-oss", n_blocks=5)
    stages = [FastGGUFReader(stage.path) for stage in slice_model(model, [1, 1, 3], tmp_path / "out")]
    patterns = [reader.scalar("gpt-oss.attention.sliding_window_pattern") for reader in stages]
    assert patterns == [[True], [True], [True, False, True]]  # block 1 alone is the one marked anew
    windows = [reader.scalar("gpt-oss.attention.sliding_window") for reader in stages]
    assert windows == [8, UNREACHED_WINDOW, 8]
    # no windowed block of the source has a rope base of its own: llama.cpp gives them the global one
    assert all("gpt-oss.rope.freq_base_swa" not in reader.fields for reader in stages)
    for reader in stages[:2]:  # llama.cpp requires gpt-oss's output projection: a 4-row stand-in
        output = next(t for t in reader.tensors if t.name == "output.weight")
        assert output.data.shape[0] == 4 and not output.data.any()


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


def test_unsupported_family_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    model = write_other_family(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(UnsupportedFamily, match=r"'mamba' is not supported for splitting; supported: ") as refused:
        slice_model(model, [1, 1], tmp_path / "out")
    assert all(name in str(refused.value) for name in FAMILIES)
    assert slice_model(model, [2], tmp_path / "out")[0].path == model  # unsplit needs no support


def test_cached_slices_reuse_an_earlier_cut(tmp_path: Path) -> None:
    from kafila.runtime.gguf.slicer import cached_slices

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
    import kafila.runtime.gguf.slicer as slicer
    from kafila.runtime.gguf.slicer import block_range_file

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

    from kafila.runtime.machine.this_machine import hash_model

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


def test_qwen3next_slices_list_which_of_their_blocks_are_delta_nets(tmp_path: Path) -> None:
    """llama.cpp counts qwen3next's full-attention blocks (every 4th) from a block's index in the
    file: a slice lists its blocks' kinds, and a listing in the source is cut like any per-layer
    array; either way the split decodes what the whole model does."""
    expected_kinds = [(i + 1) % 4 != 0 for i in range(12)]
    for listed in (False, True):
        shape = dataclasses.replace(TINY_SHAPES["qwen3next"], list_recurrent_layers=listed)
        model = write_tiny_model(tmp_path / f"listed-{listed}.gguf", "qwen3next", n_blocks=12, shape=shape)
        stages = slice_model(model, [4, 4, 4], tmp_path / f"out-{listed}")
        for stage in stages:
            kinds = FastGGUFReader(stage.path).scalar("qwen3next.attention.recurrent_layers")
            assert kinds == expected_kinds[stage.first_block : stage.end_block]
        whole = WholeModel(model, SETTINGS)
        prompt = whole.vocabulary.tokenize("hello world, the kafila model is in a block of the world")
        whole.close()
        assert greedy_split([s.path for s in stages], prompt, 12) == greedy_unsplit(model, prompt, 12)


@pytest.mark.parametrize(
    ("counts", "kinds", "message"),
    [
        ([3, 5], None, r"qwen3next models cannot be cut at block 3: .* can be cut at blocks 4$"),
        ([4, 3, 1], None, r"qwen3next models cannot be cut at block 7: .* can be cut at blocks 4$"),
        # full attention at 2 and 3: both cuts are after one, yet block 3 alone is of one kind
        ([3, 1, 4], [True, True, False, False, True, True, True, False], r"blocks 3-3 would have only full attention"),
    ],
)
def test_qwen3next_cuts_llama_cpp_cannot_run_are_refused_before_writing(
    tmp_path: Path, counts: list[int], kinds: list[bool] | None, message: str
) -> None:
    listed = {} if kinds is None else {"qwen3next.attention.recurrent_layers": kinds}
    model = write_other_family(tmp_path / "qwen3next.gguf", "qwen3next", 8, listed)
    with pytest.raises(SliceError, match=message):
        slice_model(model, counts, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_qwen3next_prediction_blocks_go_to_no_slice_and_the_kinds_count_without_them(tmp_path: Path) -> None:
    """A qwen3next converted with its multi-token-prediction block (9 stored, 8 run): the slices
    hold the 8 and list their kinds by the blocks llama.cpp runs."""
    model = write_other_family(tmp_path / "qwen3next.gguf", "qwen3next", 9, {"qwen3next.nextn_predict_layers": 1})
    for stage in slice_model(model, [4, 4], tmp_path / "out"):
        reader = FastGGUFReader(stage.path)
        assert reader.scalar("qwen3next.attention.recurrent_layers") == [True, True, True, False]
        assert reader.scalar("qwen3next.block_count") == 4
        assert {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")} == {"0", "1", "2", "3"}


def test_a_46_block_gemma2_is_refused_and_says_why(tmp_path: Path) -> None:
    """Gemma 2 27B has 46 blocks, and llama.cpp scales a 46-block gemma2's queries by
    1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim). Unlike gemma3, gemma2 has no query norm:
    the scaled queries are rounded before any float32 tensor of a slice touches them, so no slice
    can restore the factor, and the model is refused before anything is written."""
    shape = TINY_SHAPES["gemma2"]
    assert shape.n_embd // shape.n_head != shape.head_dim
    model = write_tiny_model(tmp_path / "gemma2-27b.gguf", "gemma2", n_blocks=46, shape=shape)
    reason = r"gemma2 models with 46 blocks cannot be split: .*1/sqrt\(n_embd / n_head\).*no query norm"
    with pytest.raises(SliceError, match=reason):
        check_family("gemma2", 46)
    with pytest.raises(SliceError, match=reason):
        slice_model(model, [23, 23], tmp_path / "out")
    with pytest.raises(SliceError, match=reason):
        block_range_file(model, 0, 23, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_gemma2_stage_of_46_blocks_is_refused(tmp_path: Path) -> None:
    """A stage of 46 blocks of a larger gemma2 would take the 27B's query scale: refused too, while
    other cuts of the same model are made."""
    model = write_tiny_model(tmp_path / "gemma2.gguf", "gemma2", n_blocks=47, shape=TINY_SHAPES["gemma2"])
    with pytest.raises(SliceError, match=r"gemma2 blocks 1-46 of 47 cannot be a stage: .*1/sqrt\(head_dim\)"):
        slice_model(model, [1, 46], tmp_path / "out")
    assert len(slice_model(model, [20, 27], tmp_path / "out")) == 2


def test_a_gemma2_stage_of_global_blocks_only_keeps_a_window_no_position_reaches(tmp_path: Path) -> None:
    """llama.cpp windows every gemma2 (4096 positions where the file names no window) and aborts on
    a window no block uses: a stage of one global block is written as a windowed block whose
    window is wider than any context, with the global blocks' rope base."""
    tiny = write_tiny_model(tmp_path / "tiny.gguf", "gemma2", n_blocks=5)
    model = rewrite(tiny, tmp_path / "gemma2.gguf", {"gemma2.rope.freq_base_swa": (GGUFValueType.FLOAT32, 1000.0)})
    files = [stage.path for stage in slice_model(model, [1, 1, 3], tmp_path / "out")]
    reader = FastGGUFReader(files[1])
    assert reader.scalar("gemma2.attention.sliding_window") == UNREACHED_WINDOW
    assert reader.scalar("gemma2.attention.sliding_window_pattern") == [True]
    assert reader.scalar("gemma2.rope.freq_base_swa") == reader.scalar("gemma2.rope.freq_base") == 10000.0

    # Past 4096 positions, where llama.cpp's default window would hide the first ones from that block.
    long_context = dataclasses.replace(SETTINGS, n_ctx=4608, n_batch=512, n_seq_max=1)
    whole = WholeModel(model, long_context)
    prompt = whole.vocabulary.tokenize("the kafila model is in a block of the world " * 400)[:4300]
    expected = whole.forward_tokens(0, 0, prompt)
    whole.close()
    blocks = [BlockStage(path, long_context) for path in files[:2]]
    head = HeadStage(files[2], long_context)
    try:
        states = head.embed(prompt)
        for stage in blocks:
            states = stage.forward([StepInput(0, 0, states)])[0]
        assert np.array_equal(head.forward([StepInput(0, 0, states)])[0], expected)
    finally:
        for stage in blocks:
            stage.close()
        head.close()


def test_prediction_blocks_go_to_no_slice(tmp_path: Path) -> None:
    """glm4moe's multi-token prediction block (after the 4 it runs) is in no stage file, whose
    block count, prediction count and per-layer arrays cover its own blocks alone."""
    path = write_tiny_model(tmp_path / "glm.gguf", "glm4moe", n_blocks=4)
    with pytest.raises(SliceError, match="covers 5 blocks but the model has 4"):
        slice_model(path, [2, 3], tmp_path / "wrong")
    for stage in slice_model(path, [1, 3], tmp_path / "out"):
        reader = FastGGUFReader(stage.path)
        count = stage.end_block - stage.first_block
        assert reader.scalar("glm4moe.block_count") == count
        assert reader.scalar("glm4moe.nextn_predict_layers") is None
        blocks = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")}
        assert blocks == set(range(count))
        assert not any(".nextn." in t.name for t in reader.tensors)
        assert reader.scalar("glm4moe.leading_dense_block_count") == (1 if stage.first_block == 0 else 0)


def test_identity_blocks_are_zeros_of_block_0(tmp_path: Path) -> None:
    """A 27-block slice of a deepseek2 with low-rank queries (a count llama.cpp takes for a Lite
    model) runs one block of zeros first, shaped and typed as block 0 (dense), and says so."""
    path = write_tiny_model(tmp_path / "ds.gguf", "deepseek2", n_blocks=29, shape=TINY_SHAPES["deepseek2"])
    source = FastGGUFReader(path)
    first, second = slice_model(path, [2, 27], tmp_path / "out")
    assert FastGGUFReader(first.path).scalar("kafila.slice.identity_blocks") is None
    reader = FastGGUFReader(second.path)
    assert reader.scalar("deepseek2.block_count") == 28 and reader.scalar("kafila.slice.identity_blocks") == 1
    assert reader.scalar("deepseek2.leading_dense_block_count") == 1  # the identity block alone
    zero = {t.name: t for t in reader.tensors if t.name.startswith("blk.0.")}
    template = {t.name: t for t in source.tensors if t.name.startswith("blk.0.")}
    assert zero.keys() == template.keys()
    for name, tensor in zero.items():
        assert tensor.tensor_type == template[name].tensor_type and not np.asarray(tensor.data).any(), name
    moved = {t.name: t for t in reader.tensors}["blk.1.attn_q_a.weight"]
    original = {t.name: t for t in source.tensors}["blk.2.attn_q_a.weight"]
    assert bytes(moved.data) == bytes(original.data)


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
    model = rewrite(source, tmp_path / "full.gguf", {"llama4.attention.sliding_window": (GGUFValueType.UINT32, 0)})
    with pytest.raises(SliceError, match=r"this llama4 model cannot be split: .*sliding_window = 0"):
        slice_model(model, [4, 4], tmp_path / "out")
    manifest = read_manifest(model)
    assert manifest.stage_starts == () and manifest.max_stages == 1
    assert read_manifest(source).stage_starts == (4,)
