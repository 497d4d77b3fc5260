"""Head placement with its margin, and admission, against brute force over every rotation."""

from __future__ import annotations

import itertools
import math

import pytest
from brute import any_division_fits, chain_for_head, compositions, context_bytes, head_by_rule, need_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import devices, manifests, sessions

from kafila.planner import PlanRefused, plan_serving_host, plan_session
from kafila.planner.fleet import device_of
from kafila.planner.types import Device, ModelManifest, ServingSpec


def min_max_fill(manifest: ModelManifest, session: ServingSpec, ring: list[Device]) -> float:
    best = math.inf
    for r in range(len(ring)):
        chain = chain_for_head(ring, r)
        for counts in compositions(manifest.n_blocks, len(chain), manifest.stage_starts):
            start, worst = 0, 0.0
            for i, (device, count) in enumerate(zip(chain, counts, strict=True)):
                need = need_bytes(manifest, session, start, start + count, i == len(chain) - 1)
                worst = max(worst, need / device.memory_bytes)
                start += count
            best = min(best, worst)
    return best


@settings(max_examples=250, deadline=None)
@given(data=st.data(), manifest=manifests(max_blocks=7), session=sessions)
def test_head_placement_and_admission_equal_brute_force(
    data: st.DataObject, manifest: ModelManifest, session: ServingSpec
) -> None:
    m = data.draw(st.integers(1, min(4, manifest.max_stages)))
    ring = data.draw(devices(m))  # no NAT or RTT data: the ring keeps the listed order
    check_against_brute_force(manifest, session, ring)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), manifest=manifests(max_blocks=6, with_context=True), session=sessions)
def test_with_each_stages_llama_context_placement_and_admission_equal_brute_force(
    data: st.DataObject, manifest: ModelManifest, session: ServingSpec
) -> None:
    """Each stage's llama.cpp context counted too, by brute force's own count: the devices' memory
    lies in the band where which stages fit turns on their graph nodes, masks and vocabulary."""
    m = data.draw(st.integers(1, min(4, manifest.max_stages)))
    floor = context_bytes(manifest, session, 0, 0, is_head=False)  # the least any stage's context needs
    drawn = data.draw(devices(m))
    ring = [d.model_copy(update={"memory_bytes": floor + d.memory_bytes * 200}) for d in drawn]
    check_against_brute_force(manifest, session, ring)


def check_against_brute_force(manifest: ModelManifest, session: ServingSpec, ring: list[Device]) -> None:
    expected = head_by_rule(manifest, session, ring)
    assert (expected is not None) == any_division_fits(manifest, session, ring)
    if expected is None:
        with pytest.raises(PlanRefused) as refused:
            plan_session(manifest, ring, session)
        named = next(d for d in ring if d.name == refused.value.device)
        shortfall = refused.value.shortfall_bytes
        assert shortfall is not None and shortfall > 0
        fill = min_max_fill(manifest, session, ring)
        assert fill > 1
        assert math.isclose((named.memory_bytes + shortfall) / named.memory_bytes, fill, rel_tol=1e-12)
        assert named.name in str(refused.value) and str(shortfall) in str(refused.value)
        return
    plan = plan_session(manifest, ring, session)
    position, bottleneck = expected
    assert plan.bottleneck_s == bottleneck
    assert plan.head == ring[position].name
    assert plan.ring[0] == plan.head
    assert [s.device for s in plan.stages][-1] == plan.head
    assert plan.stages[0].start == 0 and plan.stages[-1].end == manifest.n_blocks
    for stage, following in itertools.pairwise(plan.stages):
        assert stage.end == following.start and stage.end > stage.start
    for stage in plan.stages:
        assert stage.resident_bytes <= stage.memory_bytes
        assert stage.resident_bytes == need_bytes(manifest, session, stage.start, stage.end, stage.is_head)


def _device(name: str, bandwidth: float, overhead: float, memory: int = 10**12) -> Device:
    return Device(name=name, memory_bytes=memory, bandwidth_bytes_per_s=bandwidth, overhead_s=overhead)


def test_anchor_keeps_the_head_within_the_margin() -> None:
    """A head elsewhere that is better by less than 5% does not move it off the anchor."""
    manifest = ModelManifest(name="m", block_bytes=(100,) * 4, head_bytes=400, kv_bytes_per_token=(0,) * 4)
    # The anchor pays 3% more overhead than its twin; moving the head would gain under 5%.
    ring = [_device("anchor", 100.0, 0.103), _device("twin", 100.0, 0.100)]
    plan = plan_session(manifest, ring, ServingSpec(context=1))
    assert plan.head == "anchor"


def test_head_moves_when_another_is_clearly_better() -> None:
    manifest = ModelManifest(name="m", block_bytes=(100,) * 4, head_bytes=400, kv_bytes_per_token=(0,) * 4)
    ring = [_device("slow-anchor", 100.0, 0.0), _device("fast", 1000.0, 0.0)]
    plan = plan_session(manifest, ring, ServingSpec(context=1))
    assert plan.head == "fast"
    assert any("moved" in note for note in plan.notes)


def test_head_moves_when_the_anchor_cannot_hold_it() -> None:
    manifest = ModelManifest(name="m", block_bytes=(100,) * 4, head_bytes=1000, kv_bytes_per_token=(0,) * 4)
    ring = [_device("small-anchor", 1000.0, 0.0, memory=500), _device("big", 100.0, 0.0, memory=5000)]
    plan = plan_session(manifest, ring, ServingSpec(context=1))
    assert plan.head == "big"
    assert plan.stages[0].device == "small-anchor" and plan.stages[0].resident_bytes <= 500


def test_refusal_names_the_member_and_the_bytes() -> None:
    manifest = ModelManifest(name="m", block_bytes=(1000,) * 4, head_bytes=0, kv_bytes_per_token=(0,) * 4)
    ring = [_device("roomy", 1.0, 0.0, memory=3000), _device("tiny", 1.0, 0.0, memory=500)]
    with pytest.raises(PlanRefused) as refused:
        plan_session(manifest, ring, ServingSpec(context=1))
    assert refused.value.device == "tiny"
    assert refused.value.shortfall_bytes == 500
    assert "tiny" in str(refused.value) and "500 bytes" in str(refused.value)


def test_kv_cache_counts_against_memory() -> None:
    """The same fleet fits at a short context and is refused at a long one."""
    manifest = ModelManifest(name="m", block_bytes=(1000,) * 2, head_bytes=0, kv_bytes_per_token=(1,) * 2)
    ring = [_device("a", 1.0, 0.0, memory=1100), _device("b", 1.0, 0.0, memory=1100)]
    plan_session(manifest, ring, ServingSpec(context=100, concurrency=1))
    with pytest.raises(PlanRefused) as refused:
        plan_session(manifest, ring, ServingSpec(context=100, concurrency=2))
    assert refused.value.shortfall_bytes == 100


def test_too_many_members_for_the_blocks_is_refused_clearly() -> None:
    manifest = ModelManifest(name="m", block_bytes=(10,) * 2, head_bytes=0, kv_bytes_per_token=(0,) * 2)
    ring = [_device(f"d{i}", 1.0, 0.0) for i in range(3)]
    with pytest.raises(PlanRefused, match="2 blocks but the fleet has 3 members"):
        plan_session(manifest, ring, ServingSpec())


def test_a_model_cut_only_at_some_blocks_is_planned_there() -> None:
    """llama4's rule: stages start at blocks 4 and 8 of 12 only. The division, the baselines and the
    member limit all keep to them, even where an even cut elsewhere would be faster."""
    manifest = ModelManifest(
        name="m", block_bytes=(100,) * 12, head_bytes=0, kv_bytes_per_token=(0,) * 12, stage_starts=(4, 8)
    )
    ring = [_device("a", 100.0, 0.0), _device("b", 100.0, 0.0)]
    plan = plan_session(manifest, ring, ServingSpec(context=1))
    assert [(s.start, s.end) for s in plan.stages] in ([(0, 4), (4, 12)], [(0, 8), (8, 12)])
    assert plan.bottleneck_s == pytest.approx(8.0)  # 6 + 6 is not allowed
    assert {b.counts for b in plan.baselines.values()} <= {(4, 8), (8, 4)}
    refusal = r"at most 3 stages \(its family's start at blocks 4, 8\), but the fleet has 4 members"
    with pytest.raises(PlanRefused, match=refusal):
        plan_session(manifest, [*ring, _device("c", 1.0, 0.0), _device("d", 1.0, 0.0)], ServingSpec())


def test_a_serving_host_that_holds_no_whole_stage_takes_none() -> None:
    """A host that can hold a block but not the smallest stage allowed (4 blocks) serves only."""
    manifest = ModelManifest(
        name="m", block_bytes=(100,) * 8, head_bytes=0, kv_bytes_per_token=(0,) * 8, stage_starts=(4,)
    )
    host = _device("host", 100.0, 0.0, memory=300)
    plan = plan_serving_host(manifest, [host, _device("a", 100.0, 0.0), _device("b", 100.0, 0.0)], ServingSpec())
    assert "host" not in [s.device for s in plan.stages] and [(s.start, s.end) for s in plan.stages] == [(0, 4), (4, 8)]


def test_a_measured_head_bandwidth_prices_the_heads_read_and_only_that() -> None:
    """b_head replaces b for the head's projection; the blocks stay priced at b."""
    from kafila.planner.cost import ChainPrefix, cost_model_matrix

    manifest = ModelManifest(name="m", block_bytes=(100, 200, 300), head_bytes=1000, kv_bytes_per_token=(0, 0, 0))
    prefix = ChainPrefix.of(manifest, ServingSpec())
    plain = Device(name="a", memory_bytes=10**6, bandwidth_bytes_per_s=100.0, overhead_s=1.0)
    fast_head = plain.model_copy(update={"head_bandwidth_bytes_per_s": 500.0})
    assert cost_model_matrix(plain, prefix, True)[1, 3] == pytest.approx(1 + 500 / 100 + 1000 / 100)
    assert cost_model_matrix(fast_head, prefix, True)[1, 3] == pytest.approx(1 + 500 / 100 + 1000 / 500)
    assert cost_model_matrix(fast_head, prefix, False)[1, 3] == cost_model_matrix(plain, prefix, False)[1, 3]


@given(
    scale=st.floats(min_value=0.06, max_value=19.0),
    start=st.integers(0, 2),
    length=st.integers(1, 3),
    head=st.booleans(),
    fast_head=st.booleans(),
)
def test_a_price_from_serving_scales_every_stage_by_what_one_stage_measured(
    scale: float, start: int, length: int, head: bool, fast_head: bool
) -> None:
    """The whole cost function o + bytes/b (+ head/b_head) is scaled, so every range, the head's
    too, costs `scale` times what it did: the measured stage is met exactly, the rest keep their
    shape."""
    from kafila.contracts import FleetDevice
    from kafila.planner.cost import ChainPrefix, cost_model_matrix
    from kafila.planner.fleet import pricing_from_serving

    manifest = ModelManifest(
        name="m", block_bytes=(3 * 10**8, 2 * 10**8, 10**8, 4 * 10**8), head_bytes=10**9, kv_bytes_per_token=(0,) * 4
    )
    prefix = ChainPrefix.of(manifest, ServingSpec())
    device = FleetDevice(
        name="a", memory_gib=64, bandwidth_gb_s=20.0, overhead_us=300.0, head_bandwidth_gb_s=45.0 if fast_head else None
    )
    before = cost_model_matrix(device_of(device), prefix, True)
    predicted = float(before[1, 3])
    pricing = pricing_from_serving(device, "ab" * 32, predicted, predicted * scale)
    assert pricing is not None
    after = cost_model_matrix(device_of(device.priced(pricing)), prefix, head)
    original = cost_model_matrix(device_of(device), prefix, head)
    end = min(4, start + length)
    assert after[start, end] == pytest.approx(scale * original[start, end], rel=1e-9)


def test_a_price_from_serving_is_refused_without_numbers_to_scale_or_past_its_limits() -> None:
    from kafila.contracts import FleetDevice
    from kafila.planner.fleet import pricing_from_serving

    probed = FleetDevice(name="a", memory_gib=8, bandwidth_gb_s=10.0, overhead_us=100.0)
    assert pricing_from_serving(FleetDevice(name="b", memory_gib=8), "ab" * 32, 0.01, 0.02) is None  # nothing measured
    assert pricing_from_serving(probed, "ab" * 32, 0.0, 0.02) is None
    assert pricing_from_serving(probed, "ab" * 32, 0.01, 0.0) is None
    assert pricing_from_serving(probed, "ab" * 32, 0.01, 0.01 * 25) is None  # a stall, not a price
    assert pricing_from_serving(probed, "ab" * 32, 0.01, 0.01 / 25) is None
    doubled = pricing_from_serving(probed, "ab" * 32, 0.01, 0.02)
    assert doubled is not None
    numbers = (doubled.bandwidth_gb_s, doubled.head_bandwidth_gb_s, doubled.overhead_us)
    assert numbers == pytest.approx((5.0, 5.0, 200.0))


def test_a_pinned_head_stays_on_the_anchor_even_when_another_member_is_faster() -> None:
    manifest = ModelManifest(name="m", block_bytes=(100,) * 8, head_bytes=400, kv_bytes_per_token=(0,) * 8)
    slow = Device(name="host", memory_bytes=10**6, bandwidth_bytes_per_s=100.0, overhead_s=0.0)
    fast = Device(name="gpu", memory_bytes=10**6, bandwidth_bytes_per_s=10_000.0, overhead_s=0.0)
    free = plan_session(manifest, [slow, fast], ServingSpec(), anchor="host")
    assert free.head == "gpu"
    pinned = plan_session(manifest, [slow, fast], ServingSpec(), anchor="host", pin_head=True)
    assert pinned.head == "host" and pinned.stages[-1].device == "host" and pinned.stages[-1].is_head
    tiny = slow.model_copy(update={"memory_bytes": 300})
    with pytest.raises(PlanRefused) as refused:
        plan_session(manifest, [tiny, fast], ServingSpec(), anchor="host", pin_head=True)
    assert refused.value.device == "host"
    with pytest.raises(ValueError, match="anchor"):
        plan_session(manifest, [slow, fast], ServingSpec(), pin_head=True)


def test_the_head_leaves_the_serving_host_only_when_the_host_cannot_hold_it() -> None:
    manifest = ModelManifest(name="m", block_bytes=(100,) * 4, head_bytes=1000, kv_bytes_per_token=(0,) * 4)
    small = _device("laptop", 1000.0, 0.0, memory=500)
    big = _device("workstation", 100.0, 0.0, memory=5000)
    moved = plan_serving_host(manifest, [small, big], ServingSpec(context=1))
    assert moved.head == "workstation" and moved.stages[-1].device == "workstation"
    assert [s.device for s in moved.stages if not s.is_head] == ["laptop"]  # the host keeps blocks of its own
    assert any("cannot hold the head" in note for note in moved.notes)
    nowhere = big.model_copy(update={"memory_bytes": 1000})
    with pytest.raises(PlanRefused) as refused:
        plan_serving_host(manifest, [small, nowhere], ServingSpec(context=1))
    assert refused.value.device in ("laptop", "workstation") and "cannot hold" in str(refused.value)
    # A host that cannot hold even one block with its cache holds no stage: the members hold it all.
    bare = _device("laptop", 1000.0, 0.0, memory=99)
    desktop = big.model_copy(update={"name": "desktop"})
    without = plan_serving_host(manifest, [bare, big, desktop], ServingSpec(context=1))
    assert "laptop" not in [s.device for s in without.stages] and sum(s.end - s.start for s in without.stages) == 4
    assert any("holds no stage" in note for note in without.notes)
    with pytest.raises(PlanRefused) as refused:  # and when the members cannot, one of them is named
        plan_serving_host(manifest, [bare, nowhere], ServingSpec(context=1))
    assert refused.value.device == "workstation"
    # A faster member does not take the head from a host that can hold it (see plan_serving_host).
    fast = _device("gpu", 100_000.0, 0.0, memory=5000)
    assert plan_serving_host(manifest, [big, fast], ServingSpec(context=1)).head == "workstation"
    assert plan_session(manifest, [big, fast], ServingSpec(context=1), anchor="workstation").head == "gpu"
