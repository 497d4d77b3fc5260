"""A session's first plan is priced on the model itself: the host measures its model's stages on
its own machine before it plans (a quick local ring, kept by the model's hash), prices every
member without its own pricing by the ratio of their generic probes, and keeps what its stage
then measured serving for its next start. Real processes over QUIC, a real llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from host_process import (
    one_user,
    planned_and_measured,
    running_host,
    said,
    seeded_cache,
    start_member,
    status_of,
    stop,
    until_status,
    wait_ready,
)
from tiny_models import write_wide_model
from waiting import until

from kafila.contracts import FleetDevice, ModelPricing
from kafila.planner.fleet import device_of, pricing_by_ratio
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import file_sha256
from kafila.runtime.machine.model_probe import MEASURED_BEFORE_THE_FIRST_PLAN

COMMON = ("--context", "256", "--concurrency", "1", "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")
SERVED_ALONE = 40  # decodes of one row each stage times: past MIN_STEPS_TO_REBALANCE, which the host keeps by
SANE = 10.0  # a prediction this far from its measurement would be a unit wrong, not a machine busy


def kept_record(cache: Path, digest: str) -> dict[str, Any] | None:
    path = cache / "model-pricing" / f"{digest}.json"
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record


def stage_ms(pricing: ModelPricing, generic: FleetDevice, blocks: list[int], read: tuple[int, ...], head: int) -> float:
    """The cost model's c = o + bytes / b (+ head bytes / b_head) in ms, at `pricing`'s numbers."""
    device = device_of(generic.priced(pricing))
    assert device.bandwidth_bytes_per_s is not None and device.overhead_s is not None
    seconds = device.overhead_s + sum(read[blocks[0] : blocks[1]]) / device.bandwidth_bytes_per_s
    return 1e3 * (seconds + head / (device.head_bandwidth_bytes_per_s or device.bandwidth_bytes_per_s))


@pytest.mark.timeout(300)
def test_the_first_plan_prices_every_stage_on_what_the_host_measured_of_the_model(tmp_path: Path) -> None:
    model = write_wide_model(tmp_path / "wide.gguf", n_blocks=4)
    digest, manifest = file_sha256(model), read_manifest(model)
    host_cache = seeded_cache(tmp_path / "host-cache")
    generic = FleetDevice.model_validate(json.loads((host_cache / "probe.json").read_text())["device"])
    env = {"KAFILA_CACHE": str(host_cache), "KAFILA_PRICE_MODEL": "on", "KAFILA_REBALANCE_COOLDOWN_S": "600"}
    args = ("--model", model, "--members", "3", "--name", "the-host", *COMMON)
    members = []
    with running_host(*args, ready=False, env=env) as host:
        try:
            code, rendezvous = host.join_line(timeout=120)  # said once the model is priced
            # Measured before the code was said, in one local ring, and kept by the model's hash.
            assert "pricing wide's stages on this machine: timing [1, 2, 1] as a local ring" in host.output()
            record = kept_record(host_cache, digest)
            assert record is not None and record["source"] == MEASURED_BEFORE_THE_FIRST_PLAN, record
            measured = ModelPricing.model_validate(record["pricing"])
            members = [
                start_member(code, rendezvous, f"member-{i}", tmp_path / f"cache-{i}", "--threads", "1")
                for i in range(2)
            ]
            wait_ready(host)
            # Every stage predicted from that measure: the host's own, the members' scaled by
            # their generic probe against the host's (one machine, one probe: the same numbers).
            first = planned_and_measured(status_of(host))
            assert {s["name"]: s["priced_on"] for s in first} == {
                "the-host": "the model", "member-0": "the host's, scaled", "member-1": "the host's, scaled"
            }  # fmt: skip
            assert pricing_by_ratio(manifest, generic, measured, generic) == measured
            read = manifest.read_bytes()
            for stage in first:
                head = manifest.head_bytes if stage["head"] else 0
                expected = stage_ms(measured, generic, list(stage["blocks"]), read, head)
                assert stage["predicted"] == pytest.approx(expected, abs=2e-3), first
            assert said(host, "stage times: priced on this model's own stages for the-host; from this model's stages")

            # Serving: each stage's measurement sits beside its prediction, within reason; and once
            # the host's stage has timed enough tokens alone, the cache keeps what it measured.
            one_user(host, "wide", "The history of the printing press begins", 2, SERVED_ALONE // 2 + 4)
            served = until_status(
                host,
                lambda status: all((s.get("steps_alone") or 0) >= SERVED_ALONE for s in status["stages"]),
                "every stage timing its decodes alone",
            )
            for stage in planned_and_measured(served):
                assert stage["measured"] is not None, served
                assert 1 / SANE < stage["measured"] / stage["predicted"] < SANE, stage
            until(
                lambda: (kept_record(host_cache, digest) or {}).get("source") == "measured serving it",
                timeout=60,
                what="the host keeping what its stage measured serving the model",
            )
            kept = ModelPricing.model_validate((kept_record(host_cache, digest) or {})["pricing"])
            assert kept.model_sha256 == digest and kept != measured
        finally:
            for member in members:
                stop(member)
