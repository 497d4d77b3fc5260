"""Text deltas with stop strings: what is sent is always a prefix of the text, and never a stop."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kafila.serving.text import StopAwareText

pieces = st.lists(st.binary(min_size=0, max_size=4), max_size=30)
stops = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), max_size=4)
texts = st.lists(st.text(alphabet="abc\né", min_size=0, max_size=3), max_size=30)


def run(parts: list[bytes], stop: list[str]) -> tuple[str, bool]:
    text = StopAwareText(stop)
    sent = ""
    for part in parts:
        update = text.feed(part)
        sent += update.delta
        if update.stopped:
            return sent, True
    return sent + text.flush(), False


@given(texts, stops)
def test_the_sent_text_ends_before_the_first_stop_the_tokens_complete(parts: list[str], stop: list[str]) -> None:
    """Generation halts at the first token that completes a stop string; the text is cut at the
    earliest stop found in everything up to that token, and nothing after it is sent."""
    sent, stopped = run([p.encode() for p in parts], stop)
    for k in range(len(parts)):
        upto = "".join(parts[: k + 1])
        cuts = [i for i in (upto.find(s) for s in stop) if i >= 0]
        if cuts:
            assert stopped and sent == upto[: min(cuts)]
            return
    assert not stopped and sent == "".join(parts)


@given(pieces)
def test_bytes_split_inside_characters_come_out_whole(raw: list[bytes]) -> None:
    sent, stopped = run(raw, [])
    assert not stopped
    assert sent == b"".join(raw).decode("utf-8", errors="replace")


def test_a_stop_string_across_tokens_is_held_then_dropped() -> None:
    text = StopAwareText(["</s>"])
    assert text.feed(b"Hello <").delta == "Hello "
    assert text.feed(b"/").delta == ""
    update = text.feed(b"s> more")
    assert update.stopped and update.delta == ""
    assert text.text == "Hello "


def test_a_stop_completed_first_wins_over_a_longer_one_still_open() -> None:
    text = StopAwareText(["b", "abc"])
    assert text.feed(b"a").delta == ""  # could be the start of "abc"
    update = text.feed(b"b")
    assert update.stopped and text.text == "a"


def test_held_text_that_never_becomes_a_stop_is_released() -> None:
    text = StopAwareText(["STOP"])
    assert text.feed(b"ST").delta == ""
    assert text.feed(b"AY").delta == "STAY"
    assert text.feed(b"S").delta == ""
    assert text.flush() == "S"


@given(texts, stops)
def test_the_stop_that_ended_the_text_is_told(parts: list[str], stop: list[str]) -> None:
    """`matched` is a stop string found where the text was cut (Anthropic's `stop_sequence`), and
    None while none has."""
    text = StopAwareText(stop)
    seen = ""
    for part in parts:
        seen += part
        if text.feed(part.encode()).stopped:
            assert text.matched in stop and seen.startswith(text.matched, len(text.text))
            return
    assert text.matched is None
