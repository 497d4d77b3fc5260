"""The types that cross package boundaries: a stage's report as the ring carries it, the host's status."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError
from rich.console import Console

from kafila.cli.status_command import render_status, speculation_line
from kafila.contracts import (
    EdgeStatus,
    HostStatus,
    Incident,
    MemberStatus,
    PlanStatus,
    SessionStatus,
    SpeculationStatus,
    StageReport,
    StagesCover,
)
from kafila.runtime.engine.ring import StageFailed, ring_stats
from kafila.wire.frames import Frame, Kind


def test_a_stage_report_goes_to_json_and_back_unchanged() -> None:
    report = StageReport(
        range=(2, 6), ms_per_token=1.5, ms_per_token_alone=1.25, steps_alone=40, prefill_ms_per_token=0.5, seconds=3.0,
        rows=90, decode_ms_by_rows=[(1, 1.25), (4, 2.5)],
    )  # fmt: skip
    wire = report.wire()
    assert wire == {
        "range": [2, 6], "ms_per_token": 1.5, "ms_per_token_alone": 1.25, "steps_alone": 40, "seconds": 3.0, "rows": 90,
        "prefill_ms_per_token": 0.5, "decode_ms_by_rows": [[1, 1.25], [4, 2.5]],
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
        {"range": [0, 2], "decode_ms_by_rows": [[0, 1.0]]},  # a decode of no rows
        {"range": [0, 2], "decode_ms_by_rows": [[2, -1.0]]},
        {"range": [0, 2], "decode_ms_by_rows": [[2, 1.0, 3]]},
        {"range": [0, 2], "decode_ms_by_rows": [[n, 1.0] for n in range(1, 40)]},  # beyond the bound
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


def a_ring_status() -> HostStatus:
    session = SessionStatus(
        code="7-crimson-harbor-lemon-tiger-orbit-cactus",
        epoch=2,
        members=[
            MemberStatus(
                id="h", name="host-pc", host=True, blocks=(4, 6), predicted_ms_per_token=2.0, priced_on="the model"
            ),
            MemberStatus(
                id="m", name="laptop", path="relayed", link="up", rtt_ms=31.5, blocks=(0, 4),
                predicted_ms_per_token=3.5, priced_on="the generic probe",
            ),
            MemberStatus(id="x", name="gone", path="direct", link="down", left=True),
        ],
        edges=[EdgeStatus.model_validate({"from": "host-pc", "to": "laptop", "path": "relayed", "rtt_ms": 31.5})],
        plan=PlanStatus(tier="cost-model", ring=["host-pc", "laptop"], head="host-pc", division=[4, 2]),
    )  # fmt: skip
    return HostStatus(
        model="tiny", ready=True, context_per_sequence=256, tokens_per_s=12.5,
        requests_by_dialect={"openai chat": 3, "anthropic messages": 1},
        stages=[StageReport(range=(0, 4), ms_per_token=3.0, ms_per_token_alone=3.25, steps_alone=20)],
        stages_cover=StagesCover(requests=4, generated_tokens=96),
        incidents=[Incident(what="the ring broke", detail="the link to gone is down", at=1.0)],
        speculation=SpeculationStatus(
            mode="ngram", drafted_tokens=40, accepted_tokens=30, trips=10, accepted_per_trip=3.0, mean_window=4.0,
            waves_behind=6, waves_stale=2, trip_ms=62.5, row_ms=8.25, fixed_ms=21.5,
        ),
        **{name: getattr(session, name) for name in session.model_fields_set},
    )  # fmt: skip


def test_a_hosts_status_reads_back_as_it_was_sent() -> None:
    status = a_ring_status()
    wire = json.loads(json.dumps(status.wire()))
    assert wire["edges"] == [{"from": "host-pc", "to": "laptop", "path": "relayed", "rtt_ms": 31.5}]
    assert wire["members"][2] == {"id": "x", "name": "gone", "path": "direct", "link": "down", "left": True}
    assert "rebalance" not in wire and "division" not in wire  # not set: not shown
    assert HostStatus.model_validate(wire) == status


def test_kafila_status_shows_every_part_of_a_typed_status() -> None:
    console = Console(record=True, width=200)
    render_status(a_ring_status(), console)
    shown = console.export_text()
    assert "tiny: ready" in shown and "tokens/s 12.5" in shown
    assert "requests by dialect: anthropic messages 1, openai chat 3" in shown
    assert "laptop" in shown and "relayed, up, 31.50 ms" in shown and "3.50 *" in shown  # a generic price, starred
    assert "3.25" in shown and "0–3" in shown  # measured alone, beside the member holding those blocks
    assert "gone" in shown and "left" in shown
    assert "ring host-pc → laptop" in shown and "division [4, 2]" in shown
    assert "last incident" in shown and "the ring broke: the link to gone is down" in shown
    assert "drafts: ngram, 40 drafted, 30 kept, 3.00 kept a trip, window 4.0" in shown
    # What the cost rule weighs: the trip, what carrying drafts adds to a wave, then each drafted row.
    assert "window 4.0; a trip 62.5 ms, a wave with drafts 21.5 ms more, a drafted row 8.2 ms more" in shown


def test_kafila_status_shows_what_a_draft_model_s_decode_costs() -> None:
    speculation = SpeculationStatus(
        mode="draft", drafted_tokens=12, accepted_tokens=6, trips=4, accepted_per_trip=1.5, mean_window=3.0,
        trip_ms=40.0, row_ms=5.0, draft_ms=12.3,
    )  # fmt: skip
    assert speculation_line(speculation).endswith("a drafted row 5.0 ms more; the draft 12.3 ms a token")
    assert "the draft" not in speculation_line(speculation.model_copy(update={"draft_ms": None}))


def test_a_speculation_status_without_the_fixed_cost_still_reads_and_a_negative_one_is_refused() -> None:
    """A host from before the cost rule's fixed part sends no `fixed_ms`: its status reads back,
    and `kafila status` leaves that part out; a negative one is no measurement."""
    wire = json.loads(json.dumps(a_ring_status().wire()))
    assert wire["speculation"]["fixed_ms"] == 21.5
    del wire["speculation"]["fixed_ms"]
    older = HostStatus.model_validate(wire).speculation
    assert older is not None and older.fixed_ms is None
    assert speculation_line(older).endswith("; a trip 62.5 ms, a drafted row 8.2 ms more")
    with pytest.raises(ValidationError, match="fixed_ms"):
        SpeculationStatus.model_validate(wire["speculation"] | {"fixed_ms": -1.0})
