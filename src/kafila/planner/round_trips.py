"""The measured round trip of every edge between members: what the ring pays to cross it.

A member's round trip to the rendezvous only bounds an edge (`reachability.edge_cost_s`); the
session measures each edge itself, and where those measurements exist the planner reads them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from kafila.contracts import Strict

Seconds = Annotated[float, Field(ge=0, le=60)]


class RoundTrips(Strict):
    """Round trips in seconds, a symmetric matrix over `members` (a trip there and back is the same
    trip whichever end starts it), zero on the diagonal."""

    members: tuple[str, ...] = Field(min_length=1)
    seconds: tuple[tuple[Seconds, ...], ...]

    @model_validator(mode="after")
    def _square_symmetric_named(self) -> RoundTrips:
        m = len(self.members)
        if len(set(self.members)) != m:
            raise ValueError("round trips name a member twice")
        if len(self.seconds) != m or any(len(row) != m for row in self.seconds):
            raise ValueError(f"round trips over {m} members need a {m}×{m} matrix")
        for i in range(m):
            if self.seconds[i][i] != 0:
                raise ValueError(f"'{self.members[i]}' has a round trip to itself")
            for j in range(i):
                if self.seconds[i][j] != self.seconds[j][i]:
                    pair = f"'{self.members[i]}' and '{self.members[j]}'"
                    raise ValueError(f"the round trip between {pair} differs by direction")
        return self

    def between(self, a: str, b: str) -> float:
        return self.seconds[self.members.index(a)][self.members.index(b)]

    def missing(self, names: list[str]) -> list[str]:
        """The names it has no round trips for."""
        return [name for name in names if name not in self.members]
