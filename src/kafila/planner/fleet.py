"""The fleet file: what a person writes down about their machines, in the units they think in.

GB is 10^9 bytes (bandwidth), GiB is 2^30 bytes (memory). Conversion to the planner's bytes
and seconds happens here, once, at the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Annotated

from pydantic import Field, PositiveInt, model_validator

from kafila.contracts import MAX_MEMBERS, FleetDevice, ModelPricing, NatBehaviour, NatClass
from kafila.planner.round_trips import RoundTrips
from kafila.planner.types import MAX_BLOCKS, Device, ModelManifest, ServingSpec, Strict

NonNegativeInt = Annotated[int, Field(ge=0)]
RoundTripMs = Annotated[float, Field(ge=0, le=60_000, allow_inf_nan=False)]
# Two ends' measurements of one edge differ by noise; by more than this, one of them is a typo.
ROUND_TRIP_AGREEMENT = 1.25


class FleetModel(Strict):
    name: str = "model"
    architecture: str | None = None
    n_blocks: Annotated[int, Field(ge=1, le=MAX_BLOCKS)]
    block_bytes: PositiveInt | list[PositiveInt]
    head_bytes: NonNegativeInt
    kv_bytes_per_token_per_block: NonNegativeInt | list[NonNegativeInt]
    # a mixture of experts: of each block's bytes, its routed experts'; n experts, k a token
    expert_bytes: NonNegativeInt | list[NonNegativeInt] | None = None
    experts: Annotated[int, Field(ge=0, le=4096)] = 0
    experts_used: Annotated[int, Field(ge=0, le=4096)] = 0

    @model_validator(mode="after")
    def _lists_match_block_count(self) -> FleetModel:
        for field in ("block_bytes", "kv_bytes_per_token_per_block", "expert_bytes"):
            value = getattr(self, field)
            if isinstance(value, list) and len(value) != self.n_blocks:
                raise ValueError(f"{field} lists {len(value)} values but n_blocks is {self.n_blocks}")
        return self

    def manifest(self) -> ModelManifest:
        def per_block(value: int | list[int]) -> tuple[int, ...]:
            return tuple(value) if isinstance(value, list) else (value,) * self.n_blocks

        return ModelManifest(
            name=self.name,
            architecture=self.architecture,
            block_bytes=per_block(self.block_bytes),
            head_bytes=self.head_bytes,
            kv_bytes_per_token=per_block(self.kv_bytes_per_token_per_block),
            expert_bytes=None if self.expert_bytes is None else per_block(self.expert_bytes),
            experts=self.experts,
            experts_used=self.experts_used,
        )


# How far a stage's measured time may stray from its price before the measurement is taken for
# noise rather than a truer price (a stall, a swapped-out page, a clock jump).
SERVED_SCALE_LIMITS = (1 / 20, 20.0)


def pricing_for(model_sha256: str, pricings: Sequence[ModelPricing]) -> ModelPricing | None:
    """The pricing, among those a machine kept, of the model with this sha256."""
    return next((p for p in pricings if p.model_sha256 == model_sha256), None)


def pricing_from_serving(
    priced_as: FleetDevice, model_sha256: str, predicted_s: float, measured_s: float
) -> ModelPricing | None:
    """The device's numbers scaled so that its stage costs what it measured serving this model.

    A replan should use what a session has seen: a member priced by the generic probe may be
    far off on a narrow model. One stage time cannot separate o from b, so the whole cost
    function o + bytes/b (+ head/b_head) is scaled by measured/predicted, which keeps the
    device's shape and passes through the measurement. None where the device has no numbers to
    scale or the measurement is implausible.
    """
    if priced_as.bandwidth_gb_s is None or priced_as.overhead_us is None or predicted_s <= 0 or measured_s <= 0:
        return None
    scale = measured_s / predicted_s
    if not SERVED_SCALE_LIMITS[0] <= scale <= SERVED_SCALE_LIMITS[1]:
        return None
    head = priced_as.head_bandwidth_gb_s or priced_as.bandwidth_gb_s
    return ModelPricing(
        model_sha256=model_sha256,
        bandwidth_gb_s=min(1e6, priced_as.bandwidth_gb_s / scale),
        head_bandwidth_gb_s=min(1e6, head / scale),
        overhead_us=min(1e7, priced_as.overhead_us * scale),
    )


def generic_model_seconds(manifest: ModelManifest, device: FleetDevice) -> float | None:
    """The whole model's decode time per token on the device, all its blocks and the head, at its
    generic numbers (o + bytes / b + head bytes / b_head); None where it has none."""
    if device.bandwidth_gb_s is None or device.overhead_us is None:
        return None
    head = device.head_bandwidth_gb_s or device.bandwidth_gb_s
    blocks = sum(manifest.read_bytes()) / (device.bandwidth_gb_s * 1e9)
    return device.overhead_us * 1e-6 + blocks + manifest.head_bytes / (head * 1e9)


def pricing_by_ratio(
    manifest: ModelManifest, own: FleetDevice, own_pricing: ModelPricing, other: FleetDevice
) -> ModelPricing | None:
    """Another machine's pricing of the model, from this one's (`own_pricing`, measured on the
    model here) and the two machines' generic probes: this machine's model cost function scaled by
    r = (the whole model's time at the other's generic numbers) / (at this one's), so o by r and b
    and b_head by 1 / r. The generic probe misjudges a narrow model, but alike on machines alike,
    so its ratio carries where its absolute numbers do not. None where either has no generic numbers."""
    mine, theirs = generic_model_seconds(manifest, own), generic_model_seconds(manifest, other)
    if mine is None or theirs is None or mine <= 0 or theirs <= 0:
        return None
    ratio = theirs / mine
    return ModelPricing(
        model_sha256=own_pricing.model_sha256,
        bandwidth_gb_s=min(1e6, own_pricing.bandwidth_gb_s / ratio),
        head_bandwidth_gb_s=min(1e6, own_pricing.head_bandwidth_gb_s / ratio),
        overhead_us=min(1e7, own_pricing.overhead_us * ratio),
    )


def device_of(profile: FleetDevice) -> Device:
    """A machine's profile in the planner's units: bytes, bytes a second, seconds, FLOP/s."""
    nat = NatBehaviour.from_class(profile.nat) if isinstance(profile.nat, NatClass) else profile.nat
    head_bandwidth = profile.head_bandwidth_gb_s
    return Device(
        name=profile.name,
        memory_bytes=max(1, int(profile.memory_gib * 2**30)),
        bandwidth_bytes_per_s=profile.bandwidth_gb_s * 1e9 if profile.bandwidth_gb_s is not None else None,
        head_bandwidth_bytes_per_s=head_bandwidth * 1e9 if head_bandwidth is not None else None,
        overhead_s=profile.overhead_us * 1e-6 if profile.overhead_us is not None else None,
        flops=profile.tflops * 1e12 if profile.tflops is not None else None,
        nat=nat,
        rtt_s=profile.rtt_ms / 1e3 if profile.rtt_ms is not None else None,
        host_work_s=profile.host_work_us * 1e-6 if profile.host_work_us is not None else None,
        host_work_with_head_s=(
            profile.host_work_with_head_us * 1e-6 if profile.host_work_with_head_us is not None else None
        ),
    )


class Fleet(Strict):
    model: FleetModel | None = None
    session: ServingSpec = ServingSpec()
    anchor: str | None = None
    devices: list[FleetDevice] = Field(min_length=1, max_length=MAX_MEMBERS)
    # The measured round trip of every edge, in ms: {"a": {"b": 12.5}}, each pair one way or both.
    rtt_ms: dict[str, dict[str, RoundTripMs]] | None = None

    @model_validator(mode="after")
    def _names_unique_and_anchor_known(self) -> Fleet:
        names = [d.name for d in self.devices]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"device names must be unique; repeated: {', '.join(duplicates)}")
        if self.anchor is not None and self.anchor not in names:
            raise ValueError(f"anchor '{self.anchor}' is not one of the devices ({', '.join(names)})")
        if self.rtt_ms is not None:
            self._check_round_trips(names, self.rtt_ms)
        return self

    @staticmethod
    def _check_round_trips(names: list[str], rtt_ms: dict[str, dict[str, float]]) -> None:
        """Every pair of devices has a round trip, between devices the fleet has, agreeing both ways."""
        for a, row in rtt_ms.items():
            for b, value in row.items():
                unknown = [n for n in (a, b) if n not in names]
                if unknown:
                    raise ValueError(
                        f"rtt_ms names '{unknown[0]}', which is not one of the devices ({', '.join(names)})"
                    )
                if a == b and value != 0:
                    raise ValueError(f"rtt_ms gives '{a}' a round trip of {value} ms to itself")
        for a, b in combinations(names, 2):
            given = [v for v in (rtt_ms.get(a, {}).get(b), rtt_ms.get(b, {}).get(a)) if v is not None]
            if not given:
                raise ValueError(f"rtt_ms has no round trip between '{a}' and '{b}': every pair needs one")
            if len(given) == 2 and max(given) > ROUND_TRIP_AGREEMENT * min(given) + 1:
                raise ValueError(f"rtt_ms gives '{a}'–'{b}' {given[0]} ms one way and {given[1]} ms the other")

    def round_trips(self) -> RoundTrips | None:
        """The edges' round trips in seconds; a pair given both ways takes their mean."""
        if self.rtt_ms is None:
            return None
        names = [d.name for d in self.devices]
        rtt_ms = self.rtt_ms

        def between(a: str, b: str) -> float:
            given = [v for v in (rtt_ms.get(a, {}).get(b), rtt_ms.get(b, {}).get(a)) if v is not None]
            return sum(given) / len(given) / 1e3 if a != b else 0.0

        return RoundTrips(members=tuple(names), seconds=tuple(tuple(between(a, b) for b in names) for a in names))

    @property
    def anchor_name(self) -> str:
        return self.anchor if self.anchor is not None else self.devices[0].name
