"""GPT-Live output (protocol/live_output.py): the pacer sends reply audio at real time with
at most the lead ahead, and drops what a barge-in cut; the output transcript leaves with
the audio, cut to whole words, placed on the session timeline."""

from __future__ import annotations

from duplex_server.protocol.live_output import OPEN_MS_PER_CHAR, OutputPacer, SpokenText

RATE = 24000


def _pcm(ms: float) -> bytes:
    return b"\x01\x00" * int(RATE * ms / 1000)


def _ms(nbytes: int) -> float:
    return nbytes / 2 * 1000 / RATE


def test_the_pacer_keeps_at_most_the_lead_ahead_of_real_time() -> None:
    p = OutputPacer(RATE, lead_ms=200, slice_ms=40)
    p.push(0, "resp_a", "item_a", 0.0, _pcm(1000))
    assert p.held_ms == 1000
    sent, now, worst = 0.0, 1000.0, 0.0
    first = p.take(now, session_ms=5000.0)
    assert sum(_ms(len(s.pcm)) for s in first) == 200  # the lead at once
    assert first[0].start_pos_ms == 5000.0 and first[0].item_end_ms == 40.0
    for s in first:
        sent += _ms(len(s.pcm))
    while p.busy:
        due = p.next_due(now)
        assert due is not None and due >= now
        now = due
        for s in p.take(now, session_ms=0.0):
            sent += _ms(len(s.pcm))
            worst = max(worst, sent - (now - 1000.0))
    assert sent == 1000 and worst <= 200 + 1e-6
    assert now - 1000.0 >= 800 - 1e-6  # a second of audio took 0.8 s to send: real time
    last = s
    assert last.item_end_ms == 1000.0 and last.end_pos_ms == 6000.0 and last.queued_ms == 0


def test_a_flush_or_a_new_epoch_drops_what_was_not_sent() -> None:
    p = OutputPacer(RATE, lead_ms=200)
    p.push(3, "resp_a", "item_a", 0.0, _pcm(500))
    p.take(0.0, 0.0)
    assert p.flush() and p.held_bytes == 0 and not p.take(1000.0, 0.0)
    p.push(3, "resp_b", "item_b", 0.0, _pcm(300))
    p.push(4, "resp_c", "item_c", 0.0, _pcm(300))
    assert p.purge(4) and p.held_ms == 300
    assert {s.item_id for s in p.take(5000.0, 0.0)} == {"item_c"}
    assert not p.purge(4)


def test_a_burst_after_silence_starts_at_the_session_clock() -> None:
    p = OutputPacer(RATE, lead_ms=200)
    p.push(0, "r", "i1", 0.0, _pcm(100))
    assert p.take(0.0, session_ms=1000.0)[-1].end_pos_ms == 1100.0
    p.push(0, "r", "i2", 0.0, _pcm(100))
    assert p.take(5000.0, session_ms=4000.0)[0].start_pos_ms == 4000.0
    p.push(0, "r", "i3", 0.0, _pcm(100))  # the clock is behind what was sent: it goes on
    assert p.take(9000.0, session_ms=10.0)[0].start_pos_ms == 4100.0


def test_words_leave_with_their_audio_cut_to_whole_words() -> None:
    t = SpokenText()
    text = "Hello there friend."  # 19 characters over 1900 ms: 100 ms each
    t.audio("item", 0.0, 1900.0)
    t.mark("item", 0.0, text)
    t.ended("item")
    assert t.through("item", 300.0, pos_ms=5300.0) == []  # "Hello" ends at 500 ms
    pieces = t.through("item", 1200.0, pos_ms=6200.0)
    assert [(p.text, p.start_ms, p.end_ms) for p in pieces] == [("Hello there", 5000, 6100)]
    pieces = t.through("item", 1900.0, pos_ms=6900.0)
    assert [(p.text, p.start_ms, p.end_ms) for p in pieces] == [(" friend.", 6100, 6900)]
    assert t.through("item", 1900.0, pos_ms=6900.0) == []


def test_a_barge_in_drops_the_words_not_yet_heard() -> None:
    t = SpokenText()
    t.mark("item", 0.0, "one two three four")
    t.audio("item", 0.0, 1800.0)
    t.ended("item")
    said = "".join(p.text for p in t.through("item", 900.0, 900.0))
    assert said == "one two"
    t.flush()
    assert t.through("item", 1800.0, 1800.0) == []


def test_marks_split_an_item_and_audio_may_come_before_its_mark() -> None:
    t = SpokenText()
    t.audio("item", 0.0, 400.0)  # the core sends a chunk, then its mark
    t.mark("item", 0.0, "Hi there. ")
    t.audio("item", 400.0, 600.0)
    t.audio("item", 1000.0, 200.0)
    t.mark("item", 1000.0, "Bye.")  # closes the first mark at 1000 ms
    t.ended("item")
    pieces = t.through("item", 1000.0, 1000.0)
    assert "".join(p.text for p in pieces) == "Hi there. "
    assert pieces[-1].end_ms == 1000
    assert [p.text for p in t.through("item", 1200.0, 1200.0)] == ["Bye."]


def test_an_open_mark_is_paced_so_words_never_lead_their_audio() -> None:
    t = SpokenText()
    text = "a b c d e f g h i j"  # 19 characters
    t.mark("item", 0.0, text)
    t.audio("item", 0.0, 100.0)  # only 100 ms known yet
    pieces = t.through("item", 100.0, 100.0)
    released = "".join(p.text for p in pieces)
    # at least OPEN_MS_PER_CHAR per character is assumed: 100 ms is about one character
    assert len(released) * OPEN_MS_PER_CHAR <= 100.0 + OPEN_MS_PER_CHAR
    t.audio("item", 100.0, 1800.0)
    t.ended("item")
    rest = "".join(p.text for p in t.through("item", 1900.0, 1900.0))
    assert released + rest == text
    # once a whole mark was spoken, its pace paces the next one
    assert t.pace() == OPEN_MS_PER_CHAR  # 19 characters: not enough to trust
    t.mark("item2", 0.0, "x" * 30)
    t.audio("item2", 0.0, 600.0)
    t.ended("item2")
    t.through("item2", 600.0, 600.0)
    assert 20.0 < t.pace() < OPEN_MS_PER_CHAR


def test_the_end_of_an_item_whose_audio_already_left_releases_its_last_words() -> None:
    # the pacer sent the whole (short) reply at once, before the core said it ended: no
    # slice is left to release the words that waited for the end, so the end does
    t = SpokenText()
    text = "tell me about the sea"
    t.audio("item", 0.0, 100.0)
    t.mark("item", 0.0, text)
    early = t.through("item", 100.0, pos_ms=5100.0)  # the mark is open: paced, not all
    assert "".join(p.text for p in early) != text
    rest = t.ended("item")
    assert "".join(p.text for p in early + rest) == text
    assert rest[-1].end_ms == 5100
    assert t.ended("item") == []  # nothing twice
    # an item ending before any of its audio left releases nothing yet: its slices will
    t.mark("item2", 0.0, "hello there")
    t.audio("item2", 0.0, 500.0)
    assert t.ended("item2") == []
    assert "".join(p.text for p in t.through("item2", 500.0, 5600.0)) == "hello there"
