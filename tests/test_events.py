"""The host's event feed and its `/events` stream, and the web page's files, on the real API app:
bounded (events kept, clients at once, a slow client's backlog), resumable with Last-Event-ID,
heartbeats while nothing happens, a client that goes away forgotten, and the page beside the API
without changing what unknown routes answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from http.client import HTTPResponse
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
from serving_checks import serving_in_thread
from waiting import until

from kafila.api.server import ApiConfig
from kafila.event_feed import EventFeed
from kafila.session.availability import Availability

HEARTBEAT_S = 0.2


def test_the_feed_keeps_the_latest_events_and_counts_on() -> None:
    feed = EventFeed(keep=3)
    for n in range(5):
        feed.publish("note", f"event {n}")
    assert [e.id for e in feed.recent()] == [3, 4, 5]
    assert [e.text for e in feed.recent(after=4)] == ["event 4"]
    assert feed.publish("left", "x" * 10_000, "y" * 10_000).id == 6
    assert len(feed.recent()[-1].text) == len(feed.recent()[-1].detail) == 2000


async def _turns_until(condition: Callable[[], bool]) -> None:
    """Give the loop turns until `condition` holds (the caller bounds the wait)."""
    while not condition():
        await asyncio.sleep(0)


def test_clients_are_capped_and_one_that_falls_behind_is_dropped() -> None:
    async def check() -> None:
        feed = EventFeed(max_clients=2, client_backlog=3)
        feed.publish("joined", "before")
        first, second = feed.subscribe(), feed.subscribe(after=1)
        assert first is not None and second is not None and feed.subscribe() is None
        assert [e.text for e in first.backlog] == ["before"] and second.backlog == []
        for n in range(4):  # nobody reads `first`: its backlog of 3 overflows
            feed.publish("note", str(n))
        await asyncio.wait_for(_turns_until(lambda: first.dropped), 5)  # the offers run on this loop
        assert first.dropped and first.queue.qsize() == 3
        feed.unsubscribe(first)
        assert feed.clients == 1 and feed.subscribe() is not None

    asyncio.run(check())


@pytest.fixture
def served() -> Iterator[tuple[str, Availability]]:
    serving = Availability(events=EventFeed(max_clients=2))
    config = ApiConfig(model_id="tiny", context_per_sequence=256, event_heartbeat_s=HEARTBEAT_S)
    with serving_in_thread(serving, 256, config) as base_url:
        yield base_url, serving


def open_events(base_url: str, last_id: int | None = None, key: str | None = None) -> HTTPResponse:
    headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    response: HTTPResponse = urlopen(Request(f"{base_url}/events", headers=headers), timeout=10)
    return response


def next_event(stream: HTTPResponse) -> dict[str, Any]:
    """The next event's data, past the retry line, heartbeats and blank lines."""
    event_id = None
    while line := stream.readline().decode():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data: dict[str, Any] = json.loads(line[6:])
            assert data["id"] == event_id
            return data
    raise AssertionError("the stream ended")


def test_events_stream_what_was_kept_then_what_happens_and_resume_after_the_last_seen(
    served: tuple[str, Availability],
) -> None:
    base_url, serving = served
    serving.events.publish("joined", "laptop joined")
    serving.record_incident("the ring broke", "lost laptop")  # an incident is an event too
    with open_events(base_url) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        assert next_event(stream) == {**serving.events.recent()[0].wire(), "kind": "joined"}
        assert next_event(stream)["kind"] == "incident"
        serving.events.publish("replanned", "replanned with 2 members")  # from this thread: any thread may
        assert next_event(stream)["text"] == "replanned with 2 members"
        lines = [stream.readline() for _ in range(3)]  # the end of that event, then nothing happens:
        assert lines == [b"\n", b": heartbeat\n", b"\n"]  # a heartbeat, and the stream stays
    with open_events(base_url, last_id=2) as stream:
        assert next_event(stream)["id"] == 3


def test_event_clients_are_bounded_and_one_that_goes_away_is_forgotten(served: tuple[str, Availability]) -> None:
    base_url, serving = served
    with open_events(base_url), open_events(base_url):
        until(lambda: serving.events.clients == 2, "two clients follow", timeout=10)
        with pytest.raises(HTTPError) as refused:
            open_events(base_url)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        assert json.loads(refused.value.read())["error"]["code"] == "too_many_clients"
    # by the next heartbeat
    until(lambda: serving.events.clients == 0, "the clients that hung up are forgotten", timeout=10)
    with open_events(base_url):
        pass


def test_a_feed_closed_ends_its_streams_and_takes_no_more(served: tuple[str, Availability]) -> None:
    """As `kafila host` does on Ctrl-C: an open page must not hold the server's shutdown up."""
    base_url, serving = served
    serving.events.publish("joined", "laptop joined")
    with open_events(base_url) as stream:
        assert next_event(stream)["text"] == "laptop joined"
        serving.events.close()
        assert stream.read() in (
            b"\n: caught up\n\n",
            b"\n: caught up\n\n: heartbeat\n\n",
        )  # the end, before any timeout
    with pytest.raises(HTTPError) as refused:
        open_events(base_url)
    assert refused.value.code == 503 and json.loads(refused.value.read())["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("last_id", ["abc", "-1", "9" * 40])
def test_a_last_event_id_that_is_no_id_is_a_400(served: tuple[str, Availability], last_id: str) -> None:
    with pytest.raises(HTTPError) as refused:
        urlopen(Request(f"{served[0]}/events", headers={"Last-Event-ID": last_id}), timeout=10)
    assert refused.value.code == 400


def test_the_page_is_served_beside_the_api_and_unknown_routes_answer_as_before(
    served: tuple[str, Availability],
) -> None:
    base_url, _ = served
    with urlopen(f"{base_url}/", timeout=10) as page:
        html = page.read().decode()
        assert page.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    assert '<script src="/ui/app.js">' in html and "/ui/app.css" in html and "http" not in html  # nothing external
    for path, kind in (("/ui/app.js", "text/javascript"), ("/ui/app.css", "text/css")):
        with urlopen(f"{base_url}{path}", timeout=10) as response:
            assert response.headers["Content-Type"].startswith(kind) and response.read()
    for method, path, status, code in (("GET", "/nope", 404, "unknown_url"), ("POST", "/", 405, "method_not_allowed")):
        with pytest.raises(HTTPError) as unknown:
            urlopen(Request(f"{base_url}{path}", method=method, data=b"{}" if method == "POST" else None), timeout=10)
        assert unknown.value.code == status
        error = json.loads(unknown.value.read())["error"]
        assert error["code"] == code and "/events" in error["message"]


def test_with_an_api_key_the_page_loads_but_its_events_need_the_key() -> None:
    serving = Availability()
    config = ApiConfig(model_id="tiny", context_per_sequence=256, api_key="secret", event_heartbeat_s=HEARTBEAT_S)
    serving.events.publish("joined", "laptop joined")
    with serving_in_thread(serving, 256, config) as base_url:
        with urlopen(f"{base_url}/", timeout=10) as page:
            assert page.status == 200
        with pytest.raises(HTTPError) as refused:
            open_events(base_url)
        assert refused.value.code == 401
        with open_events(base_url, key="secret") as stream:
            assert next_event(stream)["text"] == "laptop joined"
