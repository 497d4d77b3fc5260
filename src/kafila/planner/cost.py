"""The stage cost model and the memory rule, as matrices over contiguous block ranges.

Entry [a, b] of every matrix here describes one device holding blocks [a, b). Computing each
price once, in one place, means the partition search, the baselines and the reported stage
times all read the same float for the same range, so "equal bottleneck" is an exact test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kafila.planner.types import Device, ModelManifest, ServingSpec

FloatMatrix = npt.NDArray[np.float64]
IntMatrix = npt.NDArray[np.int64]
BoolMatrix = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class ChainPrefix:
    """Prefix sums over the block chain, so any range's bytes are one subtraction."""

    resident_bytes: npt.NDArray[np.int64]
    head_bytes: int
    context_bytes: tuple[IntMatrix, IntMatrix]  # [a, b]: a stage's llama.cpp context, as a block stage and as the head
    read_bytes: npt.NDArray[np.int64]  # read decoding a token: a dense block whole, a MoE block's routed experts
    cuts: BoolMatrix  # one per chain position: whether a stage may begin or end there (ModelManifest.stage_starts)

    @classmethod
    def of(cls, manifest: ModelManifest, session: ServingSpec) -> ChainPrefix:
        weights = np.asarray(manifest.block_bytes, dtype=np.int64)
        kv = np.asarray(manifest.cache_bytes(session.context, session.concurrency), dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        cuts = np.zeros(manifest.n_blocks + 1, dtype=bool)
        cuts[list(manifest.cut_positions())] = True
        return cls(
            resident_bytes=np.concatenate([zero, np.cumsum(weights + kv)]),
            head_bytes=manifest.head_bytes,
            context_bytes=(_context_matrix(manifest, session, False), _context_matrix(manifest, session, True)),
            read_bytes=np.concatenate([zero, np.cumsum(np.asarray(manifest.read_bytes(), dtype=np.int64))]),
            cuts=cuts,
        )

    @property
    def n_blocks(self) -> int:
        return len(self.read_bytes) - 1

    def range_read_matrix(self) -> IntMatrix:
        """Bytes a range's blocks read a decoded token (its weights, for dense blocks)."""
        return self.read_bytes[None, :] - self.read_bytes[:, None]

    def resident_matrix(self, is_head: bool) -> IntMatrix:
        """Bytes a device must hold for each range: blocks, their KV cache, the llama.cpp context
        that runs them, and the head if it is one."""
        need = self.resident_bytes[None, :] - self.resident_bytes[:, None] + self.context_bytes[is_head]
        return need + (self.head_bytes if is_head else 0)

    def stage_ranges(self) -> BoolMatrix:
        """The ranges a stage may hold: not empty, and beginning and ending where the model may be cut."""
        index = np.arange(self.n_blocks + 1)
        return (index[None, :] > index[:, None]) & self.cuts[:, None] & self.cuts[None, :]


def _context_matrix(manifest: ModelManifest, session: ServingSpec, is_head: bool) -> IntMatrix:
    """[a, b]: what the stage of blocks [a, b) needs for its llama.cpp context (`ContextNeeds`)."""
    n = manifest.n_blocks
    needs = manifest.context
    if needs is None:
        return np.zeros((n + 1, n + 1), dtype=np.int64)
    counts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(np.asarray(needs.block_tensors, dtype=np.int64))])
    tensors = counts[None, :] - counts[:, None] + needs.other_tensors
    return needs.stage_bytes(tensors, session.context * session.concurrency, session.concurrency, is_head)


def cost_model_matrix(device: Device, prefix: ChainPrefix, is_head: bool) -> FloatMatrix:
    """c = o + (bytes of its blocks) / b + [head] * head_bytes / b_head, with nothing fitted.

    b_head is the device's measured bandwidth on the output projection when it has one, else b.
    """
    assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
    bandwidth = device.bandwidth_bytes_per_s
    head_bandwidth = device.head_bandwidth_bytes_per_s or bandwidth
    fixed = device.overhead_s + (prefix.head_bytes / head_bandwidth if is_head else 0.0)
    costs = fixed + prefix.range_read_matrix() / bandwidth
    return np.where(prefix.stage_ranges(), costs, np.inf)


def throughput_matrix(device: Device, prefix: ChainPrefix) -> FloatMatrix:
    """Tier (b): block bytes over arithmetic throughput; it cannot price the head's extra read."""
    assert device.flops is not None
    costs = prefix.range_read_matrix() / device.flops
    return np.where(prefix.stage_ranges(), costs, np.inf)


def fill_matrix(device: Device, prefix: ChainPrefix, is_head: bool) -> FloatMatrix:
    """Fraction of the device's memory a range would occupy; tier (c) and refusals balance this."""
    fill = prefix.resident_matrix(is_head) / device.memory_bytes
    return np.where(prefix.stage_ranges(), fill, np.inf)


def fits_matrix(device: Device, prefix: ChainPrefix, is_head: bool) -> BoolMatrix:
    return prefix.resident_matrix(is_head) <= device.memory_bytes


def within_memory(costs: FloatMatrix, fits: BoolMatrix) -> FloatMatrix:
    """Price ranges that would exhaust the device at infinity, so no search can pick them."""
    return np.where(fits, costs, np.inf)
