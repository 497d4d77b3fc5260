"""The types that cross package boundaries: a stage's report as the ring carries it."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from kafila.contracts import StageReport
from kafila.network.frames import Frame, Kind
from kafila.runtime.pipeline import StageFailed, ring_stats


def test_a_stage_report_goes_to_json_and_back_unchanged() -> None:
    report = StageReport(range=(2, 6), ms_per_token=1.5, ms_per_token_alone=1.25, steps_alone=40, seconds=3.0, rows=90)
    wire = report.wire()
    assert wire == {
        "range": [2, 6], "ms_per_token": 1.5, "ms_per_token_alone": 1.25, "steps_alone": 40, "seconds": 3.0, "rows": 90,
    }  # fmt: skip
    assert StageReport.model_validate(json.loads(json.dumps(wire))) == report


@pytest.mark.parametrize(
    "hostile",
    [
        {"range": [4, 4]},  # no blocks
        {"range": [5, 2]},
        {"range": [0, 1 << 20]},
        {"range": [0]},
        {"range": [0, 2], "ms_per_token": -1.0},
        {"range": [0, 2], "ms_per_token": math.inf},
        {"range": [0, 2], "steps_alone": -3},
        {"range": [0, 2], "rows": "many"},
        {"range": [0, 2], "surprise": 1},
        {"ms_per_token": 1.0},
    ],
)
def test_a_hostile_stage_report_is_refused(hostile: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        StageReport.model_validate(hostile)


class OneReply:
    """A ring whose only answer is `reply`: what a broken or hostile stage could send back."""

    def __init__(self, reply: Frame) -> None:
        self.reply = reply

    def send(self, frames: object) -> None:
        return None

    def receive(self, count: int) -> list[Frame]:
        return [self.reply]

    def stats(self) -> list[StageReport]:
        return ring_stats(self)

    def close(self) -> None:
        return None


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"{not json", "unreadable"),
        (b'{"stages": [{"range": [3, 1]}]}', "from first to end"),
        (b'{"stages": 7}', "unreadable"),
        (b"{}", "unreadable"),
    ],
)
def test_a_ring_whose_report_is_unreadable_fails_saying_so(payload: bytes, why: str) -> None:
    with pytest.raises(StageFailed, match=why):
        ring_stats(OneReply(Frame(Kind.PING, 0, payload=payload)))
    good = {"stages": [StageReport(range=(0, 2)).wire()]}
    assert ring_stats(OneReply(Frame(Kind.PING, 0, payload=json.dumps(good).encode()))) == [StageReport(range=(0, 2))]
