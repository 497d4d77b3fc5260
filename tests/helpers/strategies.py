"""Hypothesis strategies for small, awkward planning instances."""

from __future__ import annotations

from hypothesis import strategies as st

from kafila.planner.types import ContextNeeds, Device, ModelManifest, ServingSpec


@st.composite
def context_needs(draw: st.DrawFn, n_blocks: int) -> ContextNeeds:
    """A stage's llama.cpp context figures, small enough that stages differ by a few graph nodes,
    rows, masks and vocabulary entries above the 16 MiB every stage needs."""
    small = st.integers(0, 3)
    return ContextNeeds(
        block_tensors=tuple(draw(st.lists(small, min_size=n_blocks, max_size=n_blocks))),
        other_tensors=draw(small),
        min_graph_nodes=draw(st.integers(0, 8)),
        graph_nodes_per_tensor=draw(small),
        graph_nodes_per_row=draw(st.integers(0, 1)),
        activation_bytes_per_row=draw(st.integers(0, 64)),
        attention_masks=draw(st.integers(0, 2)),
        n_vocab=draw(st.integers(0, 2000)),
    )


@st.composite
def manifests(draw: st.DrawFn, max_blocks: int = 8, with_context: bool = False) -> ModelManifest:
    """Dense models, and mixtures of experts whose blocks hold experts of any share of their bytes;
    some may be cut only before some of their blocks (llama4's rule), or not at all. `with_context`:
    each stage also needs its llama.cpp context (`ContextNeeds`)."""
    n_blocks = draw(st.integers(1, max_blocks))
    block_bytes = tuple(draw(st.lists(st.integers(1, 1000), min_size=n_blocks, max_size=n_blocks)))
    moe: dict[str, object] = {}
    if draw(st.booleans()):
        experts = draw(st.integers(1, 64))
        moe = {
            "expert_bytes": tuple(draw(st.integers(0, size)) for size in block_bytes),
            "experts": experts,
            "experts_used": draw(st.integers(1, experts)),
        }
    starts = draw(st.none() | st.sets(st.integers(1, n_blocks - 1)).map(sorted).map(tuple)) if n_blocks > 1 else None
    return ModelManifest(
        name="random",
        stage_starts=starts,
        block_bytes=block_bytes,
        head_bytes=draw(st.integers(0, 3000)),
        kv_bytes_per_token=tuple(draw(st.lists(st.integers(0, 40), min_size=n_blocks, max_size=n_blocks))),
        context=draw(context_needs(n_blocks)) if with_context else None,
        **moe,  # type: ignore[arg-type]
    )


sessions = st.builds(ServingSpec, context=st.integers(1, 4), concurrency=st.integers(1, 3))


@st.composite
def devices(draw: st.DrawFn, count: int, measured: bool = True) -> list[Device]:
    return [
        Device(
            name=f"d{i}",
            memory_bytes=draw(st.integers(1, 12000)),
            bandwidth_bytes_per_s=draw(st.integers(1, 64)) * 0.5 if measured else None,
            overhead_s=draw(st.integers(0, 40)) * 0.25 if measured else None,
        )
        for i in range(count)
    ]
