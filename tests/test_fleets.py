"""The benchmark's models (tests/helpers/fleets.py) against their publishers' figures, and its fleets.

The planner benchmark is only as honest as these sizes: each model is sized tensor by tensor
from its config, so its parameter counts must land on the published ones, and where a
published GGUF header is known, on its tensor types and size.
"""

from __future__ import annotations

from collections import Counter

import pytest
from fleets import DEEPSEEK_V3, DEVICES, FLEETS, GPT_OSS_120B, MODELS, model_entry, model_tensors, parameters

from kafila.planner.fleet import FleetModel
from kafila.runtime.gguf.manifest import _EXPERT_TENSOR

# name: (total, active, whether the publisher counts the token embedding as active), from the
# model cards: Qwen3's "30.5B in total and 3.3B activated"; gpt-oss-120b's 116.83B and 5.13B;
# DeepSeek-V3's main model, 671B and 36.6B "including 0.9B for the output head" (README_WEIGHTS).
PUBLISHED = {
    "Qwen3-8B-Q4_K_M": (8.2e9, None, True),
    "Qwen3-14B-Q4_K_M": (14.8e9, None, True),
    "Qwen3-32B-Q4_K_M": (32.8e9, None, True),
    "Qwen3-30B-A3B-Q4_K_M": (30.5e9, 3.3e9, True),
    GPT_OSS_120B: (116.83e9, 5.13e9, False),
    DEEPSEEK_V3: (671e9, 36.6e9, False),
}


def test_every_model_has_its_published_figures() -> None:
    assert set(PUBLISHED) == set(MODELS)


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_the_published_ones(name: str) -> None:
    total, active = parameters(name)
    published_total, published_active, counts_token_embedding = PUBLISHED[name]
    assert total == pytest.approx(published_total, rel=0.01)
    if published_active is not None:
        embedding = next(t.elements for t in model_tensors(name).head if t.name == "token_embd")
        assert active + (embedding if counts_token_embedding else 0) == pytest.approx(published_active, rel=0.02)


def test_gpt_oss_matches_the_published_gguf_header() -> None:
    """ggml-org/gpt-oss-120b-GGUF's loader log (llama.cpp issue #15253): 433 f32, 146 q8_0 and
    108 mxfp4 tensors, 59.02 GiB."""
    model = model_tensors(GPT_OSS_120B)
    tensors = [t for block in model.blocks for t in block] + model.head
    assert Counter(t.qtype.name for t in tensors) == {"F32": 433, "Q8_0": 146, "MXFP4": 108}
    entry = model_entry(GPT_OSS_120B)
    assert (sum(entry["block_bytes"]) + entry["head_bytes"]) / 2**30 == pytest.approx(59.02, abs=0.005)


def test_deepseek_v3_dense_lead_blocks_and_mla_cache() -> None:
    entry = model_entry(DEEPSEEK_V3)
    assert entry["n_blocks"] == 61  # the multi-token-prediction block is dropped by the converter
    assert entry["expert_bytes"][:3] == [0, 0, 0] and all(entry["expert_bytes"][3:])
    assert entry["kv_bytes_per_token_per_block"] == 2 * (512 + 64)  # f16 latent + rotary key; no V cache


@pytest.mark.parametrize("name", PUBLISHED)
def test_routed_tensors_are_those_the_manifest_counts_as_experts(name: str) -> None:
    """fleets.py's expert bytes must mean what a GGUF's manifest means by them."""
    for block in model_tensors(name).blocks:
        for tensor in block:
            gguf_name = f"blk.0.{tensor.name}" + ("" if "." in tensor.name else ".weight")
            assert bool(_EXPERT_TENSOR.match(gguf_name)) == tensor.routed, gguf_name
    FleetModel.model_validate(model_entry(name)).manifest()


LARGE_MODEL_FLEETS = [
    *((fleet_name, GPT_OSS_120B) for fleet_name in ("lan", "one-region", "intercontinental")),
    ("big-memory", DEEPSEEK_V3),
]


@pytest.mark.parametrize(("fleet_name", "model"), LARGE_MODEL_FLEETS)
def test_large_models_fit_the_fleet_but_no_member(fleet_name: str, model: str) -> None:
    entry = model_entry(model)
    weights_gib = (sum(entry["block_bytes"]) + entry["head_bytes"]) / 2**30
    memories = [DEVICES[device][1] for device in FLEETS[fleet_name]["members"]]
    assert max(memories) < weights_gib < sum(memories)
    assert model in FLEETS[fleet_name]["benchmark"]
