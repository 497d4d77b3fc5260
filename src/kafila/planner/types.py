"""Strict types the planner consumes and produces, in bytes and seconds.

Every boundary of the planner is a frozen pydantic model, so a malformed fleet or manifest is
rejected with a readable message before any arithmetic runs on it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from kafila.contracts import NatBehaviour, Strict

MAX_BLOCKS = 512  # four times the deepest model in common use; planning time grows with its square


# What llama.cpp's context set-up allocates, by its own rules (llama-context.cpp, ggml-backend.cpp),
# measured against the allocations of every supported family in docs/runtime.md ("A stage's memory").
GRAPH_NODE_BYTES = 24 * 2**10  # per graph node: the scheduler's split inputs (60 tensors' metadata) and more
LOGITS_BYTES_PER_TOKEN = 2 * 4  # per vocabulary entry and sequence: the output buffer and the graph's logits row
# Rows of logits the head keeps beyond one per sequence, for the drafted tokens of one wave
# (speculative decoding: `runtime.engine.speculation`), which every sequence of the wave shares.
DRAFT_ROWS = 8
VOCABULARY_BYTES_PER_TOKEN = 256  # llama.cpp's tokenizer tables, per vocabulary entry (about 160 measured)
MASK_BYTES_PER_CELL = 4  # per KV cell and batch row, for each mask a batch builds (f16 with flash attention)
CONTEXT_SLACK_BYTES = 16 * 2**20  # batch inputs, ggml contexts, the thread pool: a stated margin
STAGE_BATCH_ROWS = 512  # the rows of a stage's prompt batches (n_batch = n_ubatch), which size its buffers


class ContextNeeds(Strict):
    """What a stage's llama.cpp context needs beyond its weights and KV cache, from the model's
    shape: the scheduler's graph metadata (per graph node), the activations of a full prompt batch,
    its attention masks, and at the head the logits rows and the tokenizer's tables."""

    block_tensors: tuple[Annotated[int, Field(ge=0, le=2**16)], ...] = Field(min_length=1, max_length=MAX_BLOCKS)
    other_tensors: Annotated[int, Field(ge=0, le=2**16)]  # embedding, norms, output: in every stage file
    min_graph_nodes: Annotated[int, Field(ge=0, le=2**24)] = 1024
    graph_nodes_per_tensor: Annotated[int, Field(ge=0, le=256)] = 8
    graph_nodes_per_row: Annotated[int, Field(ge=0, le=256)] = 0  # delta nets: the graph grows with the batch
    activation_bytes_per_row: Annotated[int, Field(ge=0, le=2**32)]
    attention_masks: Annotated[int, Field(ge=0, le=4)]  # one per attention kind in the model (full, windowed)
    n_vocab: Annotated[int, Field(ge=0, le=2**24)]

    def stage_bytes(
        self, tensors: npt.NDArray[np.int64], cells: int, sequences: int, is_head: bool, rows: int = STAGE_BATCH_ROWS
    ) -> npt.NDArray[np.int64]:
        """Bytes for stages of `tensors` tensors each (any shape of array) with `cells` KV cells in
        all and `sequences` at once."""
        floor = max(self.min_graph_nodes, self.graph_nodes_per_row * rows)
        nodes = np.maximum(self.graph_nodes_per_tensor * tensors, floor)
        need = (
            nodes * GRAPH_NODE_BYTES
            + rows * self.activation_bytes_per_row
            + self.attention_masks * cells * rows * MASK_BYTES_PER_CELL
            + CONTEXT_SLACK_BYTES
        )
        if is_head:
            need += self.n_vocab * ((sequences + DRAFT_ROWS) * LOGITS_BYTES_PER_TOKEN + VOCABULARY_BYTES_PER_TOKEN)
        return need


class ModelManifest(Strict):
    """What the planner needs to know of a model, read from its file without loading weights."""

    name: str
    architecture: str | None = None
    block_bytes: tuple[Annotated[int, Field(ge=1, le=2**40)], ...] = Field(min_length=1, max_length=MAX_BLOCKS)
    head_bytes: Annotated[int, Field(ge=0, le=2**44)]
    kv_bytes_per_token: tuple[Annotated[int, Field(ge=0, le=2**24)], ...] = Field(
        description="KV-cache bytes per token of context, one entry per block (f16 cache)."
    )
    state_bytes_per_sequence: tuple[Annotated[int, Field(ge=0, le=2**34)], ...] | None = Field(
        default=None,
        description="Recurrent state bytes per sequence, one entry per block (a hybrid's linear-attention "
        "blocks keep a fixed state instead of a KV cache); None: none.",
    )
    expert_bytes: tuple[Annotated[int, Field(ge=0, le=2**40)], ...] | None = Field(
        default=None,
        description="Of each block's bytes, those of its routed experts (a mixture of experts); None: dense.",
    )
    experts: Annotated[int, Field(ge=0, le=4096)] = 0  # experts per MoE block
    experts_used: Annotated[int, Field(ge=0, le=4096)] = 0  # routed to each token
    stage_starts: tuple[int, ...] | None = Field(
        default=None,
        description="The blocks a stage after the first may start at, ascending; None: any. Some families "
        "key settings on a block's index in the file, which a stage renumbers (llama4); empty: no split.",
    )
    context: ContextNeeds | None = Field(
        default=None, description="What each stage's llama.cpp context needs besides weights and KV; None: nothing."
    )

    @model_validator(mode="after")
    def _one_entry_per_block(self) -> ModelManifest:
        tensors = self.context.block_tensors if self.context is not None else None
        for name, values in (
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("state_bytes_per_sequence", self.state_bytes_per_sequence),
            ("expert_bytes", self.expert_bytes),
            ("context.block_tensors", tensors),
        ):
            if values is not None and len(values) != len(self.block_bytes):
                raise ValueError(f"{name} has {len(values)} entries but the model has {len(self.block_bytes)} blocks")
        if self.expert_bytes is not None:
            if any(e > b for e, b in zip(self.expert_bytes, self.block_bytes, strict=True)):
                raise ValueError("a block's expert bytes exceed its bytes")
            if not 0 < self.experts_used <= self.experts:
                raise ValueError(f"{self.experts_used} of {self.experts} experts per token is no mixture of experts")
        starts = self.stage_starts
        if starts is not None and (
            list(starts) != sorted(set(starts)) or not all(0 < s < self.n_blocks for s in starts)
        ):
            raise ValueError(f"stage_starts {list(starts)} are not ascending blocks between 1 and {self.n_blocks - 1}")
        return self

    def cache_bytes(self, context: int, sequences: int) -> tuple[int, ...]:
        """Each block's cache for `sequences` of `context` tokens: its KV cells, or its recurrent
        state (a fixed size a sequence)."""
        state = self.state_bytes_per_sequence or (0,) * self.n_blocks
        return tuple(
            kv * context * sequences + s * sequences for kv, s in zip(self.kv_bytes_per_token, state, strict=True)
        )

    def cut_positions(self) -> tuple[int, ...]:
        """Where a stage may begin or end, from 0 to n_blocks: every block boundary, or the first,
        the allowed starts and the last."""
        if self.stage_starts is None:
            return tuple(range(self.n_blocks + 1))
        return (0, *self.stage_starts, self.n_blocks)

    @property
    def max_stages(self) -> int:
        return len(self.cut_positions()) - 1

    def read_bytes(self, rows: int = 1) -> tuple[int, ...]:
        """Bytes each block reads to decode one step of `rows` sequences: its dense weights, and
        of its experts those the rows route to. With k of n experts a token, B rows reach
        n·(1 − (1 − k/n)^B) distinct experts on average (routes taken as independent); a dense
        block reads all its bytes. In whole bytes (exact integers: the planner's prefix sums
        stay exact)."""
        if self.expert_bytes is None:
            return self.block_bytes
        n, k, b = self.experts, self.experts_used, max(1, rows)
        return tuple(
            block - (experts * (n - k) ** b) // n**b
            for block, experts in zip(self.block_bytes, self.expert_bytes, strict=True)
        )

    @property
    def n_blocks(self) -> int:
        return len(self.block_bytes)

    def context_bytes(self, first: int, end: int, is_head: bool, session: ServingSpec) -> int:
        """What the stage of blocks [first, end) needs for its llama.cpp context (`ContextNeeds`)."""
        if self.context is None:
            return 0
        tensors = np.int64(sum(self.context.block_tensors[first:end]) + self.context.other_tensors)
        cells = session.context * session.concurrency
        return int(self.context.stage_bytes(np.asarray(tensors), cells, session.concurrency, is_head))

    @property
    def total_bytes(self) -> int:
        return sum(self.block_bytes) + self.head_bytes


class Device(Strict):
    """One member, as it measured itself. Missing measurements lower the planner's tier."""

    name: str = Field(min_length=1)
    memory_bytes: Annotated[int, Field(ge=1, le=2**50)]
    bandwidth_bytes_per_s: Annotated[float, Field(gt=0, le=1e15)] | None = None
    # The head's output projection is one wide matrix, which streams nearer peak bandwidth than
    # a narrow model's blocks of many small kernels; when measured, it prices the head's read.
    head_bandwidth_bytes_per_s: Annotated[float, Field(gt=0, le=1e15)] | None = None
    overhead_s: Annotated[float, Field(ge=0, le=10)] | None = None
    flops: Annotated[float, Field(gt=0, le=1e18)] | None = None
    nat: NatBehaviour | None = None
    rtt_s: Annotated[float, Field(ge=0, le=60)] | None = None
    # What this machine spends a token as the session's serving host, beyond its stage: the API's
    # streams, sampling, batching, detokenising, its links. It shares the host's cores with the
    # host's stage, so a plan for this machine as host adds it to that stage's price. Apart beside
    # a stage of blocks and beside the head (which also hands it each row of logits to sample);
    # one stands for the other where only one was measured; None for both: the head stays on the
    # host (its work then unpriced).
    host_work_s: Annotated[float, Field(ge=0, le=10)] | None = None
    host_work_with_head_s: Annotated[float, Field(ge=0, le=10)] | None = None

    def host_work(self) -> tuple[float, float] | None:
        """The host's own work a token beside a stage of blocks and beside the head; None where
        neither was measured."""
        plain, head = self.host_work_s, self.host_work_with_head_s
        if plain is None and head is None:
            return None
        return (plain if plain is not None else head or 0.0, head if head is not None else plain or 0.0)


class ServingSpec(Strict):
    """What a session serves at once: `concurrency` requests of up to `context` tokens each, which
    sizes every member's KV cache; `load`, the requests it is planned to serve at once, which who
    serves and the division are chosen for (a session serves fewer than it has room for as often as
    not: its host plans for the load it measures). None: `concurrency`."""

    context: Annotated[int, Field(ge=1, le=2**24)] = 4096
    concurrency: Annotated[int, Field(ge=1, le=4096)] = 1
    load: Annotated[int, Field(ge=1, le=4096)] | None = None

    @model_validator(mode="after")
    def _load_within_room(self) -> ServingSpec:
        if self.load is not None and self.load > self.concurrency:
            raise ValueError(
                f"a load of {self.load} is more than the {self.concurrency} requests the session has room for"
            )
        return self

    @property
    def users(self) -> int:
        """The requests at once a plan is chosen for."""
        return self.concurrency if self.load is None else self.load


class Tier(StrEnum):
    COST_MODEL = "cost-model"
    THROUGHPUT = "throughput"
    MEMORY = "memory"


class EdgePrediction(StrEnum):
    DIRECT = "direct"
    RELAYED = "relayed"


class RingSearch(StrEnum):
    EXACT = "exact"
    HEURISTIC = "heuristic"


class Stage(Strict):
    """One member's share: blocks [start, end) of the chain, and what they cost it."""

    device: str
    start: int
    end: int
    is_head: bool
    cost_s: float | None
    resident_bytes: int
    memory_bytes: int


class RingEdge(Strict):
    a: str
    b: str
    predicted: EdgePrediction
    cost_s: float | None


class DivisionSummary(Strict):
    """How a division performs on the chosen ring: used for Kafila's plan and for baselines."""

    counts: tuple[int, ...]
    bottleneck_s: float | None
    utilisation: float | None
    fits: bool


class Plan(Strict):
    tier: Tier
    ring: tuple[str, ...] = Field(description="Member names in ring order, head first.")
    head: str
    stages: tuple[Stage, ...] = Field(description="Stages in chain order: block 0 first, head last.")
    bottleneck_s: float | None
    utilisation: float | None
    edges: tuple[RingEdge, ...]
    ring_search: RingSearch
    baselines: dict[str, DivisionSummary]
    notes: tuple[str, ...] = ()


class PlanRefused(Exception):
    """No division fits: raised with the member that cannot hold its share and by how much."""

    def __init__(self, message: str, device: str | None, shortfall_bytes: int | None = None) -> None:
        super().__init__(message)
        self.device = device
        self.shortfall_bytes = shortfall_bytes
