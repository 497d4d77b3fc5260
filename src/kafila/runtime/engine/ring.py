"""The ring behind an engine: how the head reaches the other stages (`RingTransport`), what
fails a ring, and how many waves to keep in flight on it. Local processes (`local_ring`) and
QUIC links (`session.quic_ring`) are its two transports."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol

from pydantic import ValidationError

from kafila.contracts import StageReport
from kafila.validation import one_line
from kafila.wire.frames import Frame, Kind, is_control_sequence


class StageFailed(RuntimeError):
    """A stage process died, a link broke, or a stage gave up its stream: the ring cannot continue."""


def check_ring_error(frame: Frame, where: str = "") -> Frame:
    """The frame, unless it is an ERROR that names no request (a control-range sequence id): a stage
    that gave up its whole stream, which fails the ring. An ERROR on a request's sequence is
    returned like any frame: it fails only that sequence (`RingEngine.step_many`)."""
    if frame.kind is Kind.ERROR and is_control_sequence(frame.sequence_id):
        raise StageFailed(f"{where}{frame.text()}")
    return frame


def ring_stats(ring: RingTransport) -> list[StageReport]:
    """Every block stage's report: a PING goes round the ring, each stage appends its own."""
    ring.send([Frame(Kind.PING, 0, payload=json.dumps({"stages": []}).encode())])
    (report,) = ring.receive(1)
    if report.kind is not Kind.PING:
        raise StageFailed(f"the ring answered a stage report with {report.kind.name}: {report.text()}")
    try:
        stages = json.loads(report.payload)["stages"]
        return [StageReport.model_validate(stage) for stage in stages]
    except ValidationError as invalid:
        raise StageFailed(f"the ring's stage report is unreadable: {one_line(invalid)}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise StageFailed(f"the ring's stage report is unreadable: {error!r}") from None


class RingTransport(Protocol):
    """How the head reaches the other stages: local processes (`LocalRing`) or QUIC links."""

    def send(self, frames: Sequence[Frame]) -> None: ...
    def receive(self, count: int) -> list[Frame]: ...
    def stats(self) -> list[StageReport]: ...
    def close(self) -> None: ...


def waves_override() -> int | None:
    """KAFILA_PIPELINE_WAVES: a fixed count of waves in flight, for benchmarks and tests that
    compare counts; None where unset, and the engine loop chooses (planner/waves.py)."""
    override = os.environ.get("KAFILA_PIPELINE_WAVES", "").strip()
    return int(override) if override.isdigit() and int(override) >= 1 else None


def pipeline_depth(machines: int) -> int:
    """Waves to keep in flight on a ring over `machines` distinct machines until its stages have
    measured what waves cost (then the engine loop prices the count, planner/waves.py): one per
    machine keeps each busy, while stages that share a machine share its cores, where overlapping
    them only makes them contend (measured: docs/benchmarks.md). KAFILA_PIPELINE_WAVES overrides it."""
    override = waves_override()
    return override if override is not None else max(1, machines)
