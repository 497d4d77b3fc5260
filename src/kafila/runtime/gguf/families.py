"""What Kafila must know about each model family to cut it into stages and embed tokens.

llama.cpp does the maths. The slicer carries every per-layer metadata array over to a slice by
itself (`slicer._Slice`); this table holds only what cannot be read from the file: the transform
llama.cpp applies to token embeddings (and where it applies it to embeddings given as input too,
the graph node where a stage undoes that), its default layout of sliding-window blocks where the
file lists none, the settings its code derives from the block count or a block's absolute index,
which a slice changes (`SliceRules`) or refuses where nothing in a slice can restore them, and
where a setting keyed on the index cannot be carried by a slice, the blocks a stage may start at
(`CutPoints`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGUFValueType


@dataclass(frozen=True)
class SliceView:
    """What a family's rules see of the stage being cut: its place in the source, and the
    source's metadata (`value(key)`: a scalar, a string, a numeric list, or None if absent)."""

    arch: str
    n_blocks: int  # the source's
    first: int
    end: int
    is_head: bool
    value: Callable[[str], Any]

    @property
    def count(self) -> int:
        return self.end - self.first


@dataclass(frozen=True)
class SliceRules:
    """What a slice must carry beyond the source's metadata with per-layer arrays sliced:
    `values`, keys written as given (type and value), over the source's; `tensor_scales`, factors
    applied to the slice's float32 block tensors named by what follows `blk.N.`; `refusal`, why
    this slice cannot be cut at all (the slicer refuses the division with it, naming the family);
    `identity_blocks`, blocks the slice runs before its own where llama.cpp would take its count
    for another kind of model (deepseek2's Lite counts): copies of source block 0's tensors and
    per-layer settings, all zero. A zero norm weight zeroes the attention's and the FFN's input,
    so each adds exactly 0 to the residual: the block passes its input on bit for bit."""

    values: Mapping[str, tuple[GGUFValueType, Any]] = field(default_factory=dict)
    tensor_scales: Mapping[str, float] = field(default_factory=dict)
    refusal: str | None = None
    identity_blocks: int = 0  # blocks run before the slice's own, which pass their input on unchanged


def _no_rules(_view: SliceView) -> SliceRules:
    return SliceRules()


@dataclass(frozen=True)
class CutPoints:
    """Where a model may be cut: the blocks a stage other than the first may start at (None: any;
    empty: none, the model runs whole), and why llama.cpp needs that, for the refusal."""

    starts: tuple[int, ...] | None = None
    reason: str = ""


def _anywhere(_n_blocks: int, _value: Callable[[str], Any]) -> CutPoints:
    return CutPoints()


# llama.cpp's graph size for most families: at least 1024 nodes, 8 a tensor, none a batch row
DEFAULT_GRAPH_NODES = (1024, 8, 0)


@dataclass(frozen=True)
class Family:
    name: str
    scales_token_embeddings: bool = False  # gemma multiplies token embeddings by sqrt(n_embd)
    sliding_window_period: int | None = None  # llama.cpp's default pattern, unless the file lists the blocks
    unsplittable_block_counts: frozenset[int] = frozenset()  # where no rule can restore what the count keys
    output_required: bool = False  # llama.cpp loads no stage without output.weight (gpt-oss): it gets a stand-in
    unsplittable_reason: str = ""  # what llama.cpp keys on those counts, for the refusal
    rules: Callable[[SliceView], SliceRules] = _no_rules
    # gemma2, gpt-oss: llama.cpp windows every model of the family, so a slice of global blocks
    # only cannot drop its window (the slicer gives it one no position reaches)
    always_windowed: bool = False
    default_sliding_window: int | None = None  # gemma2's window where the file names none
    # gemma2: the graph node where llama.cpp transforms embeddings given as input as it does token
    # embeddings (both scaled by sqrt(n_embd)); a stage puts the rows it is fed back over its result
    input_restored_at: str | None = None
    # (the source's block count, its metadata) -> where it may be cut
    cut_points: Callable[[int, Callable[[str], Any]], CutPoints] = _anywhere
    # llama.cpp's graph size for the family (llama_context::graph_max_nodes): its scheduler keeps
    # about 24 KiB of metadata per node, so a delta-net family's 40 nodes a batch row weigh
    graph_nodes: tuple[int, int, int] = DEFAULT_GRAPH_NODES
    # Whether llama.cpp windows (or chunks) some of the family's attention layers beside full ones
    # (a batch then builds two masks, and a cache may be cut only near its end): True whatever the
    # file says, False whatever it says (phi3: llama.cpp ignores its window), None as the file says.
    windowed: bool | None = None
    # A hybrid whose linear-attention blocks (`recurrent_blocks`) keep a recurrent state per
    # sequence and no KV cache (qwen3next's gated delta nets)
    recurrent_state: bool = False
    # Why drafts must not be checked on this family (speculative decoding), where they must not:
    # its rejected rows are cut mid-generation, and that cut has to leave other sequences alone.
    speculation_refused: str = ""

    def token_input_scale(self, n_embd: int) -> np.float32 | None:
        """The factor llama.cpp applies to token embeddings only, as the float32 sqrtf it computes."""
        if not self.scales_token_embeddings:
            return None
        return np.sqrt(np.float32(n_embd))

    def sliding_blocks(self, first: int, count: int, period: int) -> list[bool]:
        """Which blocks of a slice use sliding-window attention, by their original index."""
        if period == 0:
            return [True] * count
        return [(first + i) % period < period - 1 for i in range(count)]


def _first(value: Any) -> int:
    """A setting stored as a scalar, or as a per-layer array of which llama.cpp reads entry 0."""
    return int(value[0]) if isinstance(value, list) else int(value)


def gemma_attention_scale(view: SliceView, n_blocks: int, wide_count: int) -> float:
    """The query scale llama.cpp gives a gemma2 or gemma3 model of `n_blocks` blocks: its 27B
    (`wide_count` blocks) scales by 1/sqrt(n_embd / n_head), every other size by 1/sqrt(head_dim)."""
    arch = view.arch
    n_embd, n_head = int(view.value(f"{arch}.embedding_length")), _first(view.value(f"{arch}.attention.head_count"))
    key_length = view.value(f"{arch}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else n_embd // n_head
    return 1.0 / math.sqrt(n_embd // n_head if n_blocks == wide_count else head_dim)


def _gemma2_rules(view: SliceView) -> SliceRules:
    """gemma2 scales its queries by a factor keyed on the block count (the 27B's 46) and, unlike
    gemma3, has no query norm whose weights could absorb a change: the product is rounded before
    anything else of the slice's touches it. A slice whose count changes the factor is refused."""
    whole = gemma_attention_scale(view, view.n_blocks, 46)
    sliced = gemma_attention_scale(view, view.count, 46)
    if whole != sliced:
        return SliceRules(
            refusal=f"gemma2 blocks {view.first}-{view.end - 1} of {view.n_blocks} cannot be a stage: llama.cpp "
            "scales queries by 1/sqrt(n_embd / n_head) in a model of 46 blocks and by 1/sqrt(head_dim) otherwise, "
            "and gemma2 has no float32 tensor on that path to restore the difference"
        )
    return SliceRules()


def _gemma3_rules(view: SliceView) -> SliceRules:
    """gemma3 scales its queries after their RMS norm by a factor keyed on the block count (the
    27B's 62); the slice's own count gives another, so its query norm weights absorb the ratio."""
    whole = gemma_attention_scale(view, view.n_blocks, 62)
    sliced = gemma_attention_scale(view, view.count, 62)
    if whole == sliced:
        return SliceRules()
    return SliceRules(tensor_scales={"attn_q_norm.weight": whole / sliced})


def recurrent_blocks(arch: str, n_blocks: int, value: Callable[[str], Any]) -> list[bool]:
    """Which of the blocks a hybrid's graph runs are recurrent (linear attention), as its loader
    reads it: the `attention.recurrent_layers` array if the file has one, else every block but each
    `full_attention_interval`-th (default 4), counting from 1 (llama.cpp's
    src/models/qwen3next.cpp, load_arch_hparams)."""
    listed = value(f"{arch}.attention.recurrent_layers")
    if isinstance(listed, list):
        return [bool(v) for v in listed[:n_blocks]]
    interval = int(value(f"{arch}.full_attention_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(n_blocks)]


def _hybrid_cut_points(n_blocks: int, value: Callable[[str], Any]) -> CutPoints:
    """Stages of a hybrid start right after a full-attention block, and the last keeps one: each
    then holds blocks of both kinds, without which llama.cpp aborts (`_hybrid_rules`)."""
    full = [i for i, recurrent in enumerate(recurrent_blocks("qwen3next", n_blocks, value)) if not recurrent]
    starts = tuple(i + 1 for i in full if full and i + 1 <= full[-1])
    return CutPoints(
        starts,
        "llama.cpp aborts on a stage whose blocks are all gated delta nets or all full attention, so a "
        "stage starts right after a full-attention block",
    )


def _hybrid_rules(view: SliceView) -> SliceRules:
    """A hybrid of gated delta-net and full attention blocks (qwen3next) keys each block's kind on
    its absolute index, so the slice lists its blocks' kinds. llama.cpp aborts the process on a
    model whose blocks are all of one kind (the graph then leaves the other memory's inputs
    unallocated): such a slice, which `_hybrid_cut_points` keeps the planner from, is refused."""
    kinds = recurrent_blocks(view.arch, view.n_blocks, view.value)[view.first : view.end]
    if all(kinds) or not any(kinds):
        kind = "gated delta-net (linear attention)" if all(kinds) else "full attention"
        return SliceRules(
            refusal=f"{view.arch}: a stage holding blocks {view.first}-{view.end - 1} would have only "
            f"{kind} blocks, and llama.cpp aborts on such a model: every stage needs blocks of both kinds"
        )
    key = f"{view.arch}.attention.recurrent_layers"
    return SliceRules(values={key: (GGUFValueType.ARRAY, kinds)})


def _leading_dense_blocks(view: SliceView) -> dict[str, tuple[GGUFValueType, Any]]:
    """llama.cpp gives blocks before `leading_dense_block_count` a dense FFN and the rest experts,
    by their index in the file: a slice counts the dense blocks among its own."""
    key = f"{view.arch}.leading_dense_block_count"
    lead = view.value(key)
    if lead is None:
        return {}
    return {key: (GGUFValueType.UINT32, min(max(int(lead) - view.first, 0), view.count))}


GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama_expert_gating_func_type


def deepseek2_vocab_size(view: SliceView) -> int:
    """The vocabulary size deepseek2's loader sees: the converter's vocab_size, else the token list's."""
    stored = view.value(f"{view.arch}.vocab_size")
    return int(stored) if stored is not None else len(view.value("tokenizer.ggml.tokens") or ())


def deepseek2_is_lite(n_blocks: int, n_vocab: int) -> bool:
    """What llama.cpp takes for a Lite model (DeepSeek-V2-Lite, GigaChat3, Kanana-2), whose queries
    are one attn_q, and whose q_lora_rank it does not read: decided by the block count alone."""
    return n_blocks in (26, 27) or (n_blocks == 48 and n_vocab == 128256)


def _deepseek2_rules(view: SliceView) -> SliceRules:
    """deepseek2 keys three settings on the block count (and the vocabulary size), and each slice
    has its own count and a stand-in vocabulary. The vocabulary size is written as the source's;
    the dense lead as the slice's own; a Lite model's query rank as 0 (no low-rank queries, as it
    has none), which llama.cpp reads whenever the count does not make the slice Lite; and the
    expert gating as the source's, with llama.cpp's default for the source where it has none.
    A slice of a model with low-rank queries whose count llama.cpp takes for a Lite model's (26,
    27) runs identity blocks first (`SliceRules.identity_blocks`), enough to leave those counts."""
    arch = view.arch
    n_vocab = deepseek2_vocab_size(view)
    values = _leading_dense_blocks(view)
    values[f"{arch}.vocab_size"] = (GGUFValueType.UINT32, n_vocab)
    identity_blocks = 0
    if deepseek2_is_lite(view.n_blocks, n_vocab):
        values[f"{arch}.attention.q_lora_rank"] = (GGUFValueType.UINT32, 0)
    elif int(view.value(f"{arch}.attention.q_lora_rank") or 0) > 0:
        while deepseek2_is_lite(view.count + identity_blocks, n_vocab):
            identity_blocks += 1  # llama.cpp would skip the query rank and look for attn_q
        lead_key = f"{arch}.leading_dense_block_count"
        if identity_blocks and int(view.value(lead_key) or 0) > 0:  # copies of block 0, a dense one
            values[lead_key] = (GGUFValueType.UINT32, values[lead_key][1] + identity_blocks)
    gating = int(view.value(f"{arch}.expert_gating_func") or 0)
    if gating == 0:  # none given: llama.cpp's default for the source (GLM-4.7-Flash's count and vocabulary)
        gating = GATING_SIGMOID if view.n_blocks in (47, 48) and n_vocab == 154880 else GATING_SOFTMAX
    values[f"{arch}.expert_gating_func"] = (GGUFValueType.UINT32, gating)
    return SliceRules(values=values, identity_blocks=identity_blocks)


# Any two sections make llama.cpp rotate by sections; with the same position in all four (a text
# token's), every rotary pair turns by the same angle as in a plain NEOX rotation, bit for bit.
TEXT_ROPE_SECTIONS = [1, 1, 0, 0]


def _glm4moe_rules(view: SliceView) -> SliceRules:
    """glm4moe: the slice's own dense lead; and rope sections, since llama.cpp aborts a glm4moe
    graph fed embeddings (as every stage is) unless it rotates by sections (glm4-moe.cpp)."""
    values = _leading_dense_blocks(view)
    sections = view.value(f"{view.arch}.rope.dimension_sections")
    if not (isinstance(sections, list) and len(sections) > 1 and sections[0] > 0 and sections[1] > 0):
        values[f"{view.arch}.rope.dimension_sections"] = (GGUFValueType.ARRAY, TEXT_ROPE_SECTIONS)
    return SliceRules(values=values)


LLAMA4_NO_ROPE_STEP = 4  # llama.cpp's default n_no_rope_layer_step, which no llama4 file can set
LLAMA4_CHUNKED_PERIOD = 4  # load_swa_pattern(ml, 4): three chunked blocks, then one of full attention


def _llama4_cut_points(n_blocks: int, value: Callable[[str], Any]) -> CutPoints:
    """llama.cpp decides by a block's index in the file whether it skips RoPE (every 4th) and
    whether its FFN is experts (every interleave_moe_layer_step-th), and no key can list either
    per block: a slice renumbers its blocks from 0, so it must start where both patterns restart.
    A file whose blocks are all chunked makes llama.cpp abort, so the last stage keeps a block of
    full attention. With attention.sliding_window = 0, llama.cpp skips RoPE in the last block of
    the file (n_no_rope_layer_step = n_layer): every slice would skip it in its own last block."""
    if value("llama4.attention.sliding_window") == 0:
        return CutPoints((), "with attention.sliding_window = 0 llama.cpp skips RoPE in the last block of each file")
    moe_step = int(value("llama4.interleave_moe_layer_step") or 0)
    step = math.lcm(LLAMA4_NO_ROPE_STEP, LLAMA4_CHUNKED_PERIOD, max(1, moe_step))
    starts = tuple(range(step, n_blocks - LLAMA4_CHUNKED_PERIOD + 1, step))
    experts = f", and its experts where (i + 1) % {moe_step} == 0" if moe_step > 1 else ""
    reason = (
        f"llama.cpp skips RoPE in block i where (i + 1) % {LLAMA4_NO_ROPE_STEP} == 0{experts}, i counted in the "
        f"file, so stages start at multiples of {step}; and the last stage needs a block of full attention, "
        f"which only every {LLAMA4_CHUNKED_PERIOD}th block is"
    )
    return CutPoints(starts, reason)


FAMILIES = {
    family.name: family
    for family in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),
        Family("qwen3moe"),  # its experts are tensors of their block: a slice carries them whole
        Family("gemma3", scales_token_embeddings=True, sliding_window_period=6, rules=_gemma3_rules, windowed=True),
        # gpt-oss: llama.cpp requires its window and windows its even blocks, whatever the file lists
        Family(
            "gpt-oss",
            sliding_window_period=2,
            output_required=True,
            always_windowed=True,
            windowed=True,
            speculation_refused=(
                "on llama.cpp 0.3.36 a cut of one sequence's cache changes the logits of another that is "
                "prefilling beside it and goes on after the cut (seen on the tiny gpt-oss; cause not found)"
            ),
        ),
        Family(
            "qwen3next",
            rules=_hybrid_rules,
            cut_points=_hybrid_cut_points,
            graph_nodes=(0, 32, 40),
            recurrent_state=True,
        ),
        Family(
            "gemma2",
            scales_token_embeddings=True,
            sliding_window_period=2,
            unsplittable_block_counts=frozenset({46}),
            unsplittable_reason=(
                "llama.cpp scales the queries of a 46-block gemma2 (Gemma 2 27B) by 1/sqrt(n_embd / n_head) "
                "and of any other by 1/sqrt(head_dim); a slice has fewer blocks, and gemma2, unlike gemma3, has "
                "no query norm whose weights could carry the difference"
            ),
            rules=_gemma2_rules,
            always_windowed=True,
            windowed=True,
            default_sliding_window=4096,
            input_restored_at="inp_scaled",
        ),
        # Phi-3 and Phi-4: its rope factor tensors are global, in every stage; llama.cpp disables its window
        Family("phi3", windowed=False),
        Family("mistral3"),  # its attention temperature is keyed on positions, which stages keep
        Family("deepseek2", rules=_deepseek2_rules),
        Family("glm4moe", rules=_glm4moe_rules),
        Family("llama4", cut_points=_llama4_cut_points, windowed=True),  # chunked attention in 3 of 4 blocks
    )
}


def attention_windowed(arch: str, file_window: Any) -> bool:
    """Whether llama.cpp runs windowed (or chunked) attention layers for a model of `arch` whose
    file names `file_window` (`attention.sliding_window`, None where absent)."""
    family = FAMILIES.get(arch)
    if family is not None and family.windowed is not None:
        return family.windowed
    return isinstance(file_window, int) and not isinstance(file_window, bool) and file_window > 0


class UnsupportedFamily(ValueError):
    def __init__(self, architecture: str) -> None:
        super().__init__(
            f"model family '{architecture}' is not supported for splitting; supported: {', '.join(sorted(FAMILIES))}"
        )


def family_of(architecture: str) -> Family:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise UnsupportedFamily(architecture) from None
