"""Types that cross package boundaries, defined once.

The planner, the network, the runtime, the session and the API each keep their own types inside;
what one hands another is one of these frozen models, serialised only at the HTTP and wire edges.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Frozen, no unknown fields, no NaN or infinity: what every boundary type is built on."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# NATs: what the network measures and the planner predicts edges from.
# ---------------------------------------------------------------------------------------------


class Mapping(StrEnum):
    """RFC 4787 mapping behaviour: how a NAT reuses its external port across destinations."""

    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


Filtering = Mapping  # RFC 4787 uses the same three words for filtering.


class NatClass(StrEnum):
    """The coarse classes of the paper, for members that measured no more than that."""

    PERMISSIVE = "permissive"
    ORDINARY = "ordinary"
    RESTRICTIVE = "restrictive"


class NatBehaviour(Strict):
    mapping: Mapping
    filtering: Filtering

    @property
    def maps_endpoint_dependently(self) -> bool:
        return self.mapping is not Mapping.ENDPOINT_INDEPENDENT

    @property
    def filters_by_address_and_port(self) -> bool:
        return self.filtering is Mapping.ADDRESS_AND_PORT_DEPENDENT

    @classmethod
    def from_class(cls, nat_class: NatClass) -> NatBehaviour:
        """Read a class as the behaviour it implies, assuming the worst where the class is silent.

        `ordinary` says nothing about filtering, so it is taken as address-and-port-dependent;
        `restrictive` means endpoint-dependent mapping, whose filtering no longer matters.
        """
        if nat_class is NatClass.PERMISSIVE:
            return cls(mapping=Mapping.ENDPOINT_INDEPENDENT, filtering=Mapping.ENDPOINT_INDEPENDENT)
        if nat_class is NatClass.ORDINARY:
            return cls(mapping=Mapping.ENDPOINT_INDEPENDENT, filtering=Mapping.ADDRESS_AND_PORT_DEPENDENT)
        return cls(mapping=Mapping.ADDRESS_AND_PORT_DEPENDENT, filtering=Mapping.ADDRESS_AND_PORT_DEPENDENT)


# ---------------------------------------------------------------------------------------------
# Stage statistics: what each stage measures serving, reported round the ring.
# ---------------------------------------------------------------------------------------------

MAX_REPORTED_BLOCK = 1 << 16
Milliseconds = Annotated[float, Field(ge=0)]


class StageReport(Strict):
    """One stage's measured decode times. Block stages report theirs round the ring (a PING
    frame, as JSON), the head its own; the host prices replans and rebalances with them, and
    `/status` and `/metrics` show them."""

    range: tuple[  # the stage's blocks, [first, end)
        Annotated[int, Field(ge=0, le=MAX_REPORTED_BLOCK)], Annotated[int, Field(ge=1, le=MAX_REPORTED_BLOCK)]
    ]
    ms_per_token: Milliseconds | None = None  # every decode row, batched ones included
    ms_per_token_alone: Milliseconds | None = None  # recent decodes of one row: what the planner prices
    steps_alone: Annotated[int, Field(ge=0)] = 0  # decodes of one row so far: a new one means fresh figures
    seconds: Annotated[float, Field(ge=0)] | None = None  # all the time it spent decoding, prompts included
    rows: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _blocks_in_order(self) -> StageReport:
        first, end = self.range
        if first >= end:
            raise ValueError(f"a stage's blocks run from first to end, not {first} to {end}")
        return self

    def wire(self) -> dict[str, object]:
        """As JSON, for the ring and `/status`."""
        return self.model_dump(mode="json")
