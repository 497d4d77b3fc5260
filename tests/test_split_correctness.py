"""The correctness gate: a split generates exactly what the unsplit model does.

Every supported family, at every 2-stage cut point and in one 3-stage split, on real llama.cpp
with tiny models the test writes itself; then four sequences interleaved in one stage. The
unsplit model these compare with is itself held to llama-cpp-python's own `Llama`, on the tiny
models and on the real gemma-3-270m.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from plain_llama import plain_llama
from tiny_models import SUPPORTED_TINY_ARCHS, TINY_SHAPES, write_tiny_model

from kafila.runtime.engine.stage import BlockStage, HeadStage, StepInput, WholeModel
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import SliceError, slice_model
from kafila.runtime.llama.model import ContextSettings, LlamaModel

SETTINGS = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=4, n_threads=2)
PROMPT = "hello world, the kafila model is in a block of the world and it is to the model of the world"
STEPS = 32
# gpt-oss windows its even blocks: with 5, slices start on both parities, and the 3-way cut's middle
# stage is block 1 alone, a full-attention block with no windowed one beside it.
# qwen3next: blocks 3, 7 and 11 are full attention, the rest gated delta nets; stages start after a
# full-attention block (4 and 8 of 12), so that each holds both kinds.
# gemma2 alternates windowed and global blocks: with 5, cuts start slices on either kind, its 3-way
# cut leaves a stage of one global block only, and its last 2-way cut a head of one windowed block.
# llama4 may be cut only at multiples of 4 blocks (its RoPE-less and expert blocks go by index):
# 12 blocks give two 2-stage cuts and one 3-stage one.
N_BLOCKS = {
    "llama": 4, "qwen2": 4, "qwen3": 5, "gemma3": 6, "qwen3moe": 4, "gpt-oss": 5, "qwen3next": 12,
    "gemma2": 5, "phi3": 4, "mistral3": 4, "deepseek2": 5, "glm4moe": 4, "llama4": 12,
}  # fmt: skip
GEMMA_TURN = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"


def greedy_unsplit(path: Path, prompt: list[int], steps: int = STEPS) -> list[int]:
    whole = WholeModel(path, SETTINGS)
    try:
        logits = whole.forward_tokens(0, 0, prompt)
        out: list[int] = []
        for _ in range(steps):
            out.append(int(np.argmax(logits)))
            logits = whole.forward_tokens(0, len(prompt) + len(out) - 1, out[-1:], decode=True)
        return out
    finally:
        whole.close()


def greedy_split(files: list[Path], prompt: list[int], steps: int = STEPS) -> list[int]:
    blocks = [BlockStage(f, SETTINGS) for f in files[:-1]]
    head = HeadStage(files[-1], SETTINGS)
    try:

        def ring(tokens: list[int], position: int) -> np.ndarray:
            states = head.embed(tokens)
            for stage in blocks:
                states = stage.forward([StepInput(0, position, states)])[0]
            return head.forward([StepInput(0, position, states)])[0]

        logits = ring(prompt, 0)
        out: list[int] = []
        for _ in range(steps):
            out.append(int(np.argmax(logits)))
            logits = ring(out[-1:], len(prompt) + len(out) - 1)
        return out
    finally:
        for stage in blocks:
            stage.close()
        head.close()


@pytest.fixture(scope="session", params=SUPPORTED_TINY_ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[int]]:
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, n_blocks=N_BLOCKS[arch])
    whole = WholeModel(path, SETTINGS)
    prompt = whole.vocabulary.tokenize(PROMPT)
    whole.close()
    assert len(prompt) > 16  # longer than gemma3's sliding window in the tiny model
    return arch, path, prompt


def divisions(n_blocks: int, starts: Sequence[int] | None) -> list[list[int]]:
    """Every 2-stage cut, and one 3-stage one, where the family lets stages start (`starts`; None: anywhere)."""
    if starts is None:
        third = n_blocks // 3
        return [*([cut, n_blocks - cut] for cut in range(1, n_blocks)), [third, third, n_blocks - 2 * third]]
    first, second = starts[len(starts) // 3], starts[2 * len(starts) // 3]
    return [*([cut, n_blocks - cut] for cut in starts), [first, second - first, n_blocks - second]]


def test_every_split_equals_the_unsplit_model(tiny: tuple[str, Path, list[int]], tmp_path: Path) -> None:
    arch, path, prompt = tiny
    expected = greedy_unsplit(path, prompt)
    assert len(set(expected)) > 3  # a model stuck on one token would prove nothing
    for counts in divisions(N_BLOCKS[arch], read_manifest(path).stage_starts):
        files = [stage.path for stage in slice_model(path, counts, tmp_path / "-".join(map(str, counts)))]
        assert greedy_split(files, prompt) == expected, f"{arch} split {counts} diverged"


def _splits_equal_the_whole(path: Path, divisions: list[list[int]], tmp_path: Path, steps: int = 16) -> None:
    whole = WholeModel(path, SETTINGS)
    prompt = whole.vocabulary.tokenize(PROMPT)
    whole.close()
    expected = greedy_unsplit(path, prompt, steps=steps)
    assert len(set(expected)) > 3
    for counts in divisions:
        files = [stage.path for stage in slice_model(path, counts, tmp_path / "-".join(map(str, counts)))]
        assert greedy_split(files, prompt, steps=steps) == expected, f"{path.stem} split {counts} diverged"


def test_gemma3_27b_shape_splits(tmp_path: Path) -> None:
    """Gemma 3 27B has 62 blocks, and llama.cpp scales a 62-block gemma3's queries by
    1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim). A tiny model of that count whose two
    differ (128 / 2 = 64 against 32) splits anywhere into the tokens the whole model decodes;
    the slices' query norms carry the difference."""
    shape = replace(TINY_SHAPES["gemma3"], n_head=2, n_head_kv=1)
    assert shape.n_embd // shape.n_head != shape.head_dim
    path = write_tiny_model(tmp_path / "gemma3-27b.gguf", "gemma3", n_blocks=62, shape=shape)
    _splits_equal_the_whole(path, [[1, 61], [31, 31], [55, 7], [61, 1], [20, 21, 21]], tmp_path)


def test_gpt_oss_splits_into_single_blocks(tmp_path: Path) -> None:
    """gpt-oss windows its even blocks, and llama.cpp loads no gpt-oss without a windowed block:
    a stage of one odd block, the head's included, holds it as windowed with a window wider than
    any context, and decodes what the whole model does."""
    path = write_tiny_model(tmp_path / "gpt-oss.gguf", "gpt-oss", n_blocks=4)
    _splits_equal_the_whole(path, [[1, 1, 1, 1]], tmp_path)


def test_llama4_maverick_shape_splits(tmp_path: Path) -> None:
    """llama.cpp types a llama4 of 128 experts as Maverick and then skips the L2 norm of queries and
    keys (use_kq_norm): a slice keeps the expert count, so it keeps that choice."""
    shape = replace(TINY_SHAPES["llama4"], n_expert=128, n_ff_expert=32)
    path = write_tiny_model(tmp_path / "maverick.gguf", "llama4", n_blocks=12, shape=shape)
    _splits_equal_the_whole(path, divisions(12, read_manifest(path).stage_starts), tmp_path)


def test_a_stage_whose_input_node_is_missing_fails_loudly(tmp_path: Path) -> None:
    """gemma2 stages put their input back at the graph node `inp_scaled`; were it renamed in a later
    llama.cpp, a decode says so instead of running blocks on input scaled twice."""
    path = write_tiny_model(tmp_path / "gemma2.gguf", "gemma2", n_blocks=2)
    first = slice_model(path, [1, 1], tmp_path / "stages")[0].path
    model = LlamaModel(first, SETTINGS, input_restored_at="no_such_node")
    try:
        with pytest.raises(RuntimeError, match="put back at graph node no_such_node 0 times"):
            model.decode([0], [0], [True], states=np.zeros((1, model.n_embd), dtype=np.float32))
    finally:
        model.close()


def test_deepseek2_slices_of_lite_counts_split(tmp_path: Path) -> None:
    """llama.cpp takes any deepseek2 of 26 or 27 blocks for a Lite model (one attn_q, no query rank).
    A 29-block model with low-rank queries splits into slices of those counts (identity blocks run
    first); a 27-block Lite model splits into slices of other counts (a query rank of 0 said)."""
    path = write_tiny_model(tmp_path / "full.gguf", "deepseek2", n_blocks=29, shape=TINY_SHAPES["deepseek2"])
    _splits_equal_the_whole(path, [[2, 27], [3, 26], [27, 2], [1, 27, 1]], tmp_path / "full")
    lite = replace(TINY_SHAPES["deepseek2"], q_lora_rank=0)
    path = write_tiny_model(tmp_path / "lite.gguf", "deepseek2", n_blocks=27, shape=lite)
    _splits_equal_the_whole(path, [[1, 26], [13, 14], [26, 1], [9, 9, 9]], tmp_path / "lite")


def test_deepseek2_default_gating_follows_the_whole_model(tmp_path: Path) -> None:
    """A deepseek2 without expert_gating_func gates its experts by sigmoid at 47 blocks and a
    154,880-token vocabulary (GLM-4.7-Flash), by softmax otherwise: every slice gates as the whole."""
    shape = replace(TINY_SHAPES["deepseek2"], expert_gating=0, stated_vocab_size=154880)
    path = write_tiny_model(tmp_path / "flash.gguf", "deepseek2", n_blocks=47, shape=shape)
    _splits_equal_the_whole(path, [[1, 46], [23, 24], [46, 1]], tmp_path)


def test_cuts_the_family_forbids_are_refused(tiny: tuple[str, Path, list[int]], tmp_path: Path) -> None:
    """Where llama.cpp keys a setting on a block's index in the file that no key can carry per block
    (llama4's RoPE-less blocks and experts), a stage starting elsewhere would compute something else
    or fail to load: the slicer refuses it, naming the blocks it may start at."""
    arch, path, _prompt = tiny
    n, starts = N_BLOCKS[arch], read_manifest(path).stage_starts
    if starts is None:
        return
    for cut in sorted(set(range(1, n)) - set(starts)):
        with pytest.raises(SliceError, match=f"{arch} models cannot be cut at block {cut}: .* can be cut at blocks"):
            slice_model(path, [cut, n - cut], tmp_path)
    assert not list(tmp_path.iterdir())  # refused before a file is written


def plain_llama_greedy(path: Path, prompt: list[int], steps: int = STEPS) -> list[int]:
    """What llama-cpp-python's high-level `Llama` decodes greedily, with the attention llama.cpp
    picks by default (flash attention on this CPU), as Kafila's stages take it. `Llama` itself
    turns flash attention off unless told, and on a real model that breaks near-ties the other
    way after a few tokens, so it is asked for here."""
    llm = plain_llama(
        str(path), n_ctx=SETTINGS.n_ctx, n_threads=2, flash_attn=True, n_gpu_layers=-1, verbose=False
    )  # on a GPU build, every layer there, as Kafila's stages put them
    try:
        out: list[int] = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == steps:
                return out
        return out
    finally:
        llm.close()


def test_the_unsplit_model_is_llama_cpp_itself(tiny: tuple[str, Path, list[int]]) -> None:
    arch, path, prompt = tiny
    assert greedy_unsplit(path, prompt) == plain_llama_greedy(path, prompt), arch


def test_a_split_of_the_real_model_decodes_what_llama_cpp_does(gemma_path: Path, tmp_path: Path) -> None:
    """gemma-3-270m cut in three: the same greedy tokens as `Llama` on the whole file."""
    whole = WholeModel(gemma_path, SETTINGS)
    prompt = whole.vocabulary.tokenize(GEMMA_TURN, parse_special=True)
    whole.close()
    expected = plain_llama_greedy(gemma_path, prompt)
    assert len(set(expected)) > 3
    files = [stage.path for stage in slice_model(gemma_path, [6, 6, 6], tmp_path)]
    assert greedy_split(files, prompt) == expected


def test_interleaved_sequences_equal_each_alone(tiny: tuple[str, Path, list[int]], tmp_path: Path) -> None:
    """Four sequences batched into the same decodes of one stage give what each gives alone."""
    arch, path, prompt = tiny
    n, starts = N_BLOCKS[arch], read_manifest(path).stage_starts
    half = n // 2 if starts is None else starts[len(starts) // 2]
    files = [s.path for s in slice_model(path, [half, n - half], tmp_path)]
    prompts = [prompt, prompt[:-3], prompt[2:], prompt[: len(prompt) // 2]]
    alone = [greedy_split(files, p, steps=12) for p in prompts]

    blocks, head = BlockStage(files[0], SETTINGS), HeadStage(files[1], SETTINGS)
    try:
        outs: list[list[int]] = [[] for _ in prompts]
        pending = [(seq, 0, p) for seq, p in enumerate(prompts)]
        for _ in range(13):
            steps = [StepInput(seq, position, head.embed(tokens)) for seq, position, tokens in pending]
            states = blocks.forward(steps)
            logits = head.forward([StepInput(s.sequence_id, s.position, x) for s, x in zip(steps, states, strict=True)])
            pending = []
            for step, row in zip(steps, logits, strict=True):
                seq, position = step.sequence_id, step.position
                token = int(np.argmax(row))
                outs[seq].append(token)
                consumed = len(prompts[seq]) if position == 0 else 1
                pending.append((seq, position + consumed, [token]))
        assert [o[:12] for o in outs] == alone
        blocks.forget(2)
        head.forget(2)  # a finished sequence leaves the others untouched
        steps = [StepInput(seq, position, head.embed(tokens)) for seq, position, tokens in pending if seq != 2]
        states = blocks.forward(steps)
        head.forward([StepInput(s.sequence_id, s.position, x) for s, x in zip(steps, states, strict=True)])
    finally:
        blocks.close()
        head.close()
