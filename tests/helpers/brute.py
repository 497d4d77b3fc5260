"""Brute-force references, written from the specification and sharing no code with the planner."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from kafila.planner.types import Device, ModelManifest, ServingSpec


def compositions(n_blocks: int, n_parts: int, starts: Sequence[int] | None = None) -> Iterator[tuple[int, ...]]:
    """Every way to give n_parts devices at least one of n_blocks contiguous blocks, each stage
    after the first starting at one of `starts` (None: at any block)."""
    for cuts in itertools.combinations(range(1, n_blocks) if starts is None else starts, n_parts - 1):
        bounds = (0, *cuts, n_blocks)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def context_bytes(manifest: ModelManifest, session: ServingSpec, start: int, end: int, is_head: bool) -> int:
    """A stage's llama.cpp context beyond weights and KV, by the table in docs/runtime.md ("A
    stage's memory"), counted here in plain integers: 24 KiB a graph node, nodes the most of the
    floor, the per-row count at 512 rows and the per-tensor count; 512 rows of activations; 4 bytes
    a KV cell and row for each attention mask; 16 MiB of slack; at the head, each vocabulary entry's
    8 bytes a sequence and 256 of tokenizer."""
    needs = manifest.context
    if needs is None:
        return 0
    rows = 512
    tensors = sum(needs.block_tensors[start:end]) + needs.other_tensors
    nodes = max(needs.min_graph_nodes, needs.graph_nodes_per_row * rows, needs.graph_nodes_per_tensor * tensors)
    cells = session.context * session.concurrency
    total = nodes * 24 * 1024 + rows * needs.activation_bytes_per_row + needs.attention_masks * cells * rows * 4
    total += 16 * 1024 * 1024
    if is_head:
        total += needs.n_vocab * (8 * (session.concurrency + 8) + 256)
    return total


def need_bytes(manifest: ModelManifest, session: ServingSpec, start: int, end: int, is_head: bool) -> int:
    blocks = sum(manifest.block_bytes[start:end])
    kv = sum(manifest.kv_bytes_per_token[start:end]) * session.context * session.concurrency
    return blocks + kv + context_bytes(manifest, session, start, end, is_head) + (manifest.head_bytes if is_head else 0)


def decode_read_bytes(manifest: ModelManifest, block: int) -> int:
    """What decoding one token reads of a block: all of a dense one; of a mixture of experts, its
    dense part and k of its n experts (rounded up to a whole byte)."""
    size = manifest.block_bytes[block]
    if manifest.expert_bytes is None:
        return size
    experts = manifest.expert_bytes[block]
    return size - experts + math.ceil(experts * manifest.experts_used / manifest.experts)


def stage_cost(device: Device, manifest: ModelManifest, start: int, end: int, is_head: bool) -> float:
    assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
    fixed = device.overhead_s + (manifest.head_bytes / device.bandwidth_bytes_per_s if is_head else 0.0)
    return fixed + sum(decode_read_bytes(manifest, b) for b in range(start, end)) / device.bandwidth_bytes_per_s


def best_division(
    manifest: ModelManifest, session: ServingSpec, chain: Sequence[Device]
) -> tuple[float, tuple[int, ...]] | None:
    """Minimum bottleneck over every division that fits, with the head last in the chain."""
    best: tuple[float, tuple[int, ...]] | None = None
    for counts in compositions(manifest.n_blocks, len(chain), manifest.stage_starts):
        start, worst, fits = 0, 0.0, True
        for i, (device, count) in enumerate(zip(chain, counts, strict=True)):
            is_head = i == len(chain) - 1
            if need_bytes(manifest, session, start, start + count, is_head) > device.memory_bytes:
                fits = False
                break
            worst = max(worst, stage_cost(device, manifest, start, start + count, is_head))
            start += count
        if fits and (best is None or worst < best[0]):
            best = (worst, counts)
    return best


def chain_for_head(ring: Sequence[Device], head: int) -> list[Device]:
    from_head = list(ring[head:]) + list(ring[:head])
    return from_head[1:] + from_head[:1]


def head_by_rule(
    manifest: ModelManifest, session: ServingSpec, ring: Sequence[Device], margin: float = 0.05
) -> tuple[int, float] | None:
    """Ring position of the head the rule picks, and its bottleneck; the anchor is position 0."""
    solved = [best_division(manifest, session, chain_for_head(ring, r)) for r in range(len(ring))]
    anchor = solved[0]
    threshold = anchor[0] * (1 - margin) if anchor is not None else math.inf
    better = [(s[0], r) for r, s in enumerate(solved) if r > 0 and s is not None and s[0] < threshold]
    if better:
        value, position = min(better)
        return position, value
    return (0, anchor[0]) if anchor is not None else None


def any_division_fits(manifest: ModelManifest, session: ServingSpec, ring: Sequence[Device]) -> bool:
    for r in range(len(ring)):
        chain = chain_for_head(ring, r)
        for counts in compositions(manifest.n_blocks, len(chain), manifest.stage_starts):
            start, fits = 0, True
            for i, (device, count) in enumerate(zip(chain, counts, strict=True)):
                if need_bytes(manifest, session, start, start + count, i == len(chain) - 1) > device.memory_bytes:
                    fits = False
                    break
                start += count
            if fits:
                return True
    return False


def best_ring_key(weights: Sequence[Sequence[int]], anchor: int) -> int:
    others = [i for i in range(len(weights)) if i != anchor]
    best = None
    for order in itertools.permutations(others):
        ring = (anchor, *order)
        key = sum(weights[ring[i]][ring[(i + 1) % len(ring)]] for i in range(len(ring)))
        best = key if best is None else min(best, key)
    return best if best is not None else 0
