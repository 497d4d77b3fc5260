"""The seam between the API and whoever runs the model: the routes read a `Served`, the session
changes it (`session.availability.Availability`), and neither package imports the other."""

from __future__ import annotations

from typing import Protocol

from kafila.contracts import SessionStatus
from kafila.event_feed import EventFeed
from kafila.serving.handle import ServedState, ServingHandle


class Served(Protocol):
    """What the routes read of whoever runs the model: the ring serving now (requests are
    submitted to it and cancelled on it), the state to tell callers, the session's status and
    its events. The API only reads it; the session changes it."""

    @property
    def ring(self) -> ServingHandle | None:
        """The ring serving now, or broken and not yet replaced; None while nothing serves."""

    @property
    def events(self) -> EventFeed: ...
    def state(self) -> ServedState: ...
    def session_status(self) -> SessionStatus: ...
    async def until_resumed(self) -> None:
        """Wait while a planned replan runs (up to a bound); the caller then looks again."""

    def client_gone(self, request_id: str) -> None:
        """A request's client left after its ring broke: the next ring is not to take it on."""
