"""Partition is the exact minimum bottleneck over contiguous, memory-respecting divisions."""

from __future__ import annotations

import math

import numpy as np
from brute import best_division, compositions, need_bytes, stage_cost
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import devices, manifests, sessions

from kafila.planner.partition import division_from_counts, partition
from kafila.planner.types import Device, ModelManifest, ServingSpec


def matrices_for(chain: list[Device], manifest: ModelManifest, session: ServingSpec) -> list[np.ndarray]:
    """Cost matrices written from the formula, with ranges that do not fit, or that begin or end
    where the model may not be cut, priced at infinity."""
    k = manifest.n_blocks
    starts = manifest.stage_starts
    cuts = set(range(k + 1)) if starts is None else {0, *starts, k}
    result = []
    for i, device in enumerate(chain):
        is_head = i == len(chain) - 1
        matrix = np.full((k + 1, k + 1), np.inf)
        for a in range(k):
            for b in range(a + 1, k + 1):
                if a in cuts and b in cuts and need_bytes(manifest, session, a, b, is_head) <= device.memory_bytes:
                    matrix[a, b] = stage_cost(device, manifest, a, b, is_head)
        result.append(matrix)
    return result


@settings(max_examples=300, deadline=None)
@given(data=st.data(), manifest=manifests(), session=sessions)
def test_partition_equals_brute_force(data: st.DataObject, manifest: ModelManifest, session: ServingSpec) -> None:
    m = data.draw(st.integers(1, min(4, manifest.max_stages)))
    chain = data.draw(devices(m))
    matrices = matrices_for(chain, manifest, session)
    found = partition(matrices)
    expected = best_division(manifest, session, chain)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert found.bottleneck == expected[0]

    # Of the divisions that tie at that bottleneck, the one with the most even stages.
    def stage_costs(counts: tuple[int, ...]) -> list[float]:
        bounds = division_from_counts(counts)
        return [float(matrix[a, b]) for matrix, a, b in zip(matrices, bounds, bounds[1:], strict=False)]

    every = compositions(manifest.n_blocks, m, manifest.stage_starts)
    tied = [c for c in map(stage_costs, every) if max(c) <= found.bottleneck]
    assert sum(c * c for c in stage_costs(found.counts)) <= min(sum(c * c for c in t) for t in tied) * (1 + 1e-12)
    assert sum(found.counts) == manifest.n_blocks and min(found.counts) >= 1
    start = 0
    for i, (device, count) in enumerate(zip(chain, found.counts, strict=True)):
        is_head = i == m - 1
        assert need_bytes(manifest, session, start, start + count, is_head) <= device.memory_bytes
        assert stage_cost(device, manifest, start, start + count, is_head) <= found.bottleneck
        start += count


def test_unequal_blocks_defeat_the_one_pass_greedy() -> None:
    """The paper's greedy fails here: the first device takes two blocks and strands the heavy one."""
    manifest = ModelManifest(name="m", block_bytes=(1, 1, 10, 1), head_bytes=0, kv_bytes_per_token=(0,) * 4)
    session = ServingSpec(context=1, concurrency=1)
    chain = [
        Device(name="a", memory_bytes=11, bandwidth_bytes_per_s=1.0, overhead_s=0.0),
        Device(name="b", memory_bytes=1, bandwidth_bytes_per_s=1.0, overhead_s=0.0),
        Device(name="c", memory_bytes=11, bandwidth_bytes_per_s=1.0, overhead_s=0.0),
    ]
    found = partition(matrices_for(chain, manifest, session))
    assert found is not None
    assert found.counts == (1, 1, 2)
    assert found.bottleneck == 11.0


def test_ties_at_the_bottleneck_go_to_the_most_even_division() -> None:
    """A heavy head sets the bottleneck with one block; the other 17 blocks could pile onto one
    device and leave its neighbour one (as good on paper), but they are split evenly."""
    manifest = ModelManifest(name="m", block_bytes=(1,) * 18, head_bytes=40, kv_bytes_per_token=(0,) * 18)
    chain = [Device(name=n, memory_bytes=100, bandwidth_bytes_per_s=1.0, overhead_s=1.0) for n in "abc"]
    found = partition(matrices_for(chain, manifest, ServingSpec(context=1, concurrency=1)))
    assert found is not None
    assert found.bottleneck == 42.0  # o + one block + the head
    assert found.counts[2] == 1 and sorted(found.counts[:2]) == [8, 9]


def test_costs_near_the_float_limit_still_divide() -> None:
    """The tie-break squares stage costs; a device priced absurdly slow must not overflow them."""
    manifest = ModelManifest(name="m", block_bytes=(10**9,) * 4, head_bytes=10**9, kv_bytes_per_token=(0,) * 4)
    chain = [Device(name=n, memory_bytes=10**12, bandwidth_bytes_per_s=1e-290, overhead_s=0.0) for n in "ab"]
    found = partition(matrices_for(chain, manifest, ServingSpec(context=1, concurrency=1)))
    assert found is not None and found.counts == (2, 2) and math.isfinite(found.bottleneck)


def test_more_devices_than_blocks_has_no_division() -> None:
    manifest = ModelManifest(name="m", block_bytes=(5, 5), head_bytes=0, kv_bytes_per_token=(0, 0))
    chain = [Device(name=f"d{i}", memory_bytes=100, bandwidth_bytes_per_s=1.0, overhead_s=0.0) for i in range(3)]
    assert partition(matrices_for(chain, manifest, ServingSpec())) is None


def test_bound_below_returns_only_strict_improvements() -> None:
    manifest = ModelManifest(name="m", block_bytes=(4, 4, 4, 4), head_bytes=0, kv_bytes_per_token=(0,) * 4)
    chain = [Device(name=f"d{i}", memory_bytes=100, bandwidth_bytes_per_s=1.0, overhead_s=0.0) for i in range(2)]
    matrices = matrices_for(chain, manifest, ServingSpec())
    best = partition(matrices)
    assert best is not None and best.bottleneck == 8.0
    assert partition(matrices, below=8.0) is None
    improved = partition(matrices, below=math.nextafter(8.0, math.inf))
    assert improved is not None and improved.bottleneck == 8.0
