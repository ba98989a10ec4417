"""``duplex-client talk`` reports what happened: the turns server VAD detected, each turn's
transcript and answer (completed or interrupted), and each answer's TTFA from the last voiced
frame sent. Pure report tests, then the CLI against the real server (test stages, a
real-time TTS so that a second utterance interrupts the first answer)."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import wave
from pathlib import Path

from duplex_client import events as ev
from duplex_client.talk import TalkReport, frames_of, voiced_flags

from tests.server.harness import UNIT, silence, tone

ROOT = Path(__file__).resolve().parents[2]


def _response(rid: str, status: str) -> ev.ResponseObj:
    return ev.ResponseObj(id=rid, status=status, output=[], output_modalities=["audio"])  # type: ignore[arg-type]


def _audio(rid: str, ms: float = 100.0, pcm: bytes | None = None) -> ev.AudioDelta:
    """``ms`` of answer audio at 24 kHz: ``pcm``, else a level at -21 dBFS (audible)."""
    if pcm is None:
        pcm = (3000).to_bytes(2, "little") * int(24 * ms)
    else:
        ms = len(pcm) / 48
    return ev.AudioDelta(
        response_id=rid,
        item_id=f"item_{rid}",
        delta=base64.b64encode(pcm).decode(),
        epoch=0,
        audio_start_ms=0.0,
        duration_ms=ms,
    )


def test_voiced_flags_follow_the_loudest_frame() -> None:
    pcm = silence(100, 16000) + tone(60, 16000) + tone(40, 16000, amp=0.001) + silence(20, 16000)
    flags = voiced_flags(frames_of(pcm))
    assert flags == [False] * 5 + [True] * 3 + [False] * 3
    assert voiced_flags(frames_of(silence(100, 16000))) == [False] * 5


def test_report_two_turns_one_interrupted() -> None:
    """Two turns: the first answer is cut by the second utterance after 0.2 s of audio, the
    second completes; each TTFA runs from the last voiced frame sent before its turn ended."""
    r = TalkReport()
    lines: list[str] = []

    def feed(event: ev.AnyServerEvent, now: float) -> None:
        lines.extend(r.on_event(event, now))

    r.sent_frame(True, 0.98)
    r.sent_frame(True, 1.00)  # the last voiced frame of turn 1
    r.sent_frame(False, 1.02)
    feed(ev.SpeechStarted(audio_start_ms=0, item_id="u1"), 0.3)
    feed(ev.SpeechStopped(audio_end_ms=1000, item_id="u1"), 1.5)
    assert not r.settled  # the turn ended, its answer not created yet
    feed(ev.InputCommitted(item_id="u1"), 1.5)
    assert not r.settled  # committed, not answered yet
    feed(ev.ResponseCreated(response=_response("r1", "in_progress")), 1.6)
    feed(ev.InputTranscriptCompleted(item_id="u1", transcript="hello"), 1.7)
    feed(_audio("r1"), 1.75)  # TTFA 750 ms
    feed(ev.TranscriptDelta(response_id="r1", item_id="item_r1", delta="Hi there"), 1.76)
    feed(_audio("r1"), 1.8)
    r.sent_frame(True, 2.0)
    r.sent_frame(True, 2.5)  # the last voiced frame of turn 2
    feed(ev.SpeechStarted(audio_start_ms=1900, item_id="u2"), 2.0)
    assert not r.settled
    feed(ev.ResponseDone(response=_response("r1", "cancelled")), 2.05)
    feed(ev.SpeechStopped(audio_end_ms=2500, item_id="u2"), 3.0)
    feed(ev.InputCommitted(item_id="u2"), 3.0)
    feed(ev.ResponseCreated(response=_response("r2", "in_progress")), 3.0)
    feed(ev.InputTranscriptCompleted(item_id="u2", transcript=""), 3.1)
    feed(_audio("r2"), 3.1)  # TTFA 600 ms
    feed(ev.TranscriptDone(response_id="r2", item_id="item_r2", transcript="x"), 3.2)
    feed(ev.TranscriptDelta(response_id="r2", item_id="item_r2", delta="Fine."), 3.2)
    feed(ev.ResponseDone(response=_response("r2", "completed")), 3.3)
    assert r.settled
    assert lines == [
        "turn 1  you:       hello",
        "turn 1  assistant: Hi there  [interrupted after 0.2 s of audio, TTFA 750 ms "
        "(audible 750 ms)]",
        "turn 2  you:       (no words heard)",
        "turn 2  assistant: Fine.  [completed, TTFA 600 ms (audible 600 ms)]",
    ]
    assert r.summary() == [
        "2 turns detected by server VAD, 2 transcripts, 2 answers (1 interrupted, 1 completed)",
        "TTFA, last voiced frame sent -> first answer audio: median 675 ms over 2 answers "
        "(750, 600 ms)",
        "     ... -> first audible sample (-40 dBFS): median 675 ms over 2 answers",
    ]
    assert len(r.reply_pcm()) == 3 * 4800


def test_report_answer_cut_before_audio_and_no_audio_at_all() -> None:
    r = TalkReport()
    r.sent_frame(True, 0.5)
    for event in (
        ev.SpeechStopped(audio_end_ms=500, item_id="u1"),
        ev.InputCommitted(item_id="u1"),
        ev.ResponseCreated(response=_response("r1", "in_progress")),
    ):
        assert r.on_event(event, 1.0) == []
    done = ev.ResponseDone(response=_response("r1", "cancelled"))
    assert r.on_event(done, 1.1) == [
        "turn 1  assistant: (nothing said)  [interrupted before any audio]"
    ]
    assert r.settled
    r.on_event(ev.SpeechStarted(audio_start_ms=900, item_id="u2"), 1.2)
    r.on_event(ev.SpeechStopped(audio_end_ms=1200, item_id="u2"), 1.5)
    assert r.idle and not r.settled  # turn 2 has no answer (yet)
    r.on_event(ev.SpeechStarted(audio_start_ms=1400, item_id="u3"), 1.7)
    r.on_event(ev.SpeechStopped(audio_end_ms=1800, item_id="u3"), 2.1)
    r.on_event(ev.ResponseCreated(response=_response("r3", "in_progress")), 2.1)
    r.on_event(ev.ResponseDone(response=_response("r3", "completed")), 2.5)
    assert r.settled
    assert r.summary() == [
        "3 turns detected by server VAD, 0 transcripts, 2 answers (1 interrupted, 1 completed)",
        "1 turn got no answer (turn 2)",
        "TTFA: no answer audio received",
    ]


def test_report_a_cut_taken_back_is_not_a_turn() -> None:
    """interrupt_mode confirm: speech over the answer pauses it; a backchannel's pause is
    taken back (the answer goes on, the speech is no turn: never committed); a later speech
    whose words come after the resume is committed after all and is a turn."""
    r = TalkReport()
    lines: list[str] = []

    def feed(event: ev.AnyServerEvent, now: float) -> None:
        lines.extend(r.on_event(event, now))

    r.sent_frame(True, 1.0)
    feed(ev.SpeechStopped(audio_end_ms=1000, item_id="u1"), 1.5)
    feed(ev.InputCommitted(item_id="u1"), 1.5)
    feed(ev.ResponseCreated(response=_response("r1", "in_progress")), 1.6)
    feed(_audio("r1"), 1.8)
    feed(ev.TranscriptDelta(response_id="r1", item_id="item_r1", delta="Sure thing"), 1.8)
    r.sent_frame(True, 2.2)  # "mm-hm"
    feed(ev.SpeechStarted(audio_start_ms=2100, item_id="u2"), 2.2)
    feed(ev.OutputAudioPaused(response_id="r1", item_id="item_r1"), 2.2)
    feed(ev.OutputAudioResumed(response_id="r1", item_id="item_r1", audio_start_ms=400.0), 2.6)
    feed(ev.SpeechStopped(audio_end_ms=2400, item_id="u2"), 3.0)
    assert r.idle is False  # the answer goes on
    r.sent_frame(True, 3.5)  # "wait", its words late: taken back, then committed
    feed(ev.SpeechStarted(audio_start_ms=3300, item_id="u3"), 3.4)
    feed(ev.OutputAudioPaused(response_id="r1", item_id="item_r1"), 3.4)
    feed(ev.OutputAudioResumed(response_id="r1", item_id="item_r1", audio_start_ms=600.0), 3.7)
    feed(ev.SpeechStopped(audio_end_ms=3500, item_id="u3"), 4.0)
    feed(ev.ResponseDone(response=_response("r1", "cancelled")), 4.3)
    feed(ev.InputCommitted(item_id="u3"), 4.3)
    assert [t.item_id for t in r.turns] == ["u1", "u3"]
    assert r.turns[1].number == 2 and r.turns[1].voiced_end == 3.5
    assert r.answers[0].pauses == 2 and r.answers[0].taken_back == 2
    assert lines == [
        "turn 1  assistant: paused for speech over it, resumed (cut taken back)",
        "turn 1  assistant: paused for speech over it, resumed (cut taken back)",
        "turn 1  assistant: Sure thing  [interrupted after 0.1 s of audio, 2 cuts taken back, "
        "TTFA 800 ms (audible 800 ms)]",
    ]
    assert "2 cuts taken back (speech over an answer, not a turn)" in r.summary()


def test_report_times_the_first_audible_sample_of_a_voice_that_opens_with_silence() -> None:
    """A real voice with a known lead: beckett.wav's first word starts ~0.35 s into the file
    (tests/data/README.md). Sent as the answer in 100 ms pieces (at 24 kHz, as the server
    sends), arriving faster than they play: TTFA counts the first byte, the audible figure
    the moment a player started on that byte reaches the first word."""
    import soundfile as sf
    import soxr

    voice, rate = sf.read(ROOT / "tests" / "data" / "beckett.wav", dtype="float32")
    pcm = (soxr.resample(voice, rate, 24000)[:48000] * 32767).astype("<i2").tobytes()
    r = TalkReport()
    r.sent_frame(True, 1.0)
    r.on_event(ev.SpeechStopped(audio_end_ms=0, item_id="u1"), 1.5)
    r.on_event(ev.InputCommitted(item_id="u1"), 1.5)
    r.on_event(ev.ResponseCreated(response=_response("r1", "in_progress")), 1.5)
    for k, start in enumerate(range(0, len(pcm), 4800)):
        r.on_event(_audio("r1", pcm=pcm[start : start + 4800]), 1.6 + 0.01 * k)
    answer = r.answers[0]
    assert answer.ttfa_ms is not None and answer.audible_ms is not None
    assert round(answer.ttfa_ms) == 600
    lead = answer.audible_ms - answer.ttfa_ms
    assert 250 <= lead <= 450, lead  # the recording's leading silence, as a player hears it
    line = r.on_event(ev.ResponseDone(response=_response("r1", "completed")), 2.0)[0]
    assert f"TTFA 600 ms (audible {answer.audible_ms:.0f} ms)" in line


def test_report_an_answer_that_never_turns_audible_says_so() -> None:
    r = TalkReport()
    r.sent_frame(True, 1.0)
    r.on_event(ev.SpeechStopped(audio_end_ms=0, item_id="u1"), 1.5)
    r.on_event(ev.ResponseCreated(response=_response("r1", "in_progress")), 1.5)
    r.on_event(_audio("r1", pcm=b"\x01\x00" * 2400), 1.7)  # -90 dBFS
    line = r.on_event(ev.ResponseDone(response=_response("r1", "completed")), 2.0)[0]
    assert line.endswith("[completed, TTFA 700 ms (never audible)]")
    assert not any("audible sample" in x for x in r.summary())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "duplex_client.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60 * UNIT, cwd=ROOT)


def test_cli_talk_two_utterances_reports_two_turns(server: str, tmp_path: Path) -> None:
    """A WAV with two utterances 1.2 s apart, streamed in real time: two turns; the second
    utterance interrupts the first answer (the test TTS speaks in real time), the second
    answer completes. Its TTFA counts from the last voiced frame, so it includes the 500 ms
    silence window that ``speech_stopped`` would leave out."""
    src = tmp_path / "two.wav"
    with wave.open(str(src), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(
            silence(200, 16000) + tone(700, 16000) + silence(1200, 16000) + tone(700, 16000)
        )
    out = tmp_path / "reply.wav"
    url = f"ws://{server}/v1/realtime"
    talk = _cli("--url", url, "talk", "--wav", str(src), "--out", str(out), "--talk-over")
    assert talk.returncode == 0, talk.stderr
    text = talk.stdout
    assert (
        "2 turns detected by server VAD, 2 transcripts, 2 answers (1 interrupted, 1 completed)"
        in text
    ), text
    assert "turn 1  you:       what is the weather like today" in text
    assert "turn 2  you:       what is the weather like today" in text
    assert re.search(r"turn 1  assistant: .*\[interrupted ", text), text
    done = re.search(
        r"turn 2  assistant: Hello there\..*\[completed, TTFA (\d+) ms \(audible (\d+) ms\)\]",
        text,
    )
    assert done is not None, text
    assert 450 <= int(done.group(1)) < 5000 * UNIT, text  # includes the silence window
    assert int(done.group(2)) >= int(done.group(1)), text  # heard no sooner than it came
    assert "... -> first audible sample (-40 dBFS): median " in text
    assert "one spoken turn" not in text
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0


def test_ttfa_counts_from_the_server_s_end_of_speech_not_a_breath() -> None:
    """The end of speech is the server's (speech_stopped.audio_end_ms mapped to the moment
    that audio was sent): a breath-loud frame in the pause after it does not move the clock."""
    r = TalkReport()
    for i in range(100):  # 2 s of input, frame i sent at 10 + i * 0.02 s
        r.sent_frame(i < 40 or i == 70, 10 + i * 0.02)  # speech to 0.8 s, a breath at 1.4 s
    assert r.sent_time(790) == 10 + 39 * 0.02 and r.sent_time(5000) is None
    r.on_event(ev.SpeechStarted(audio_start_ms=0, item_id="u1"), 10.1)
    r.on_event(ev.SpeechStopped(audio_end_ms=800, item_id="u1"), 11.9)
    r.on_event(ev.ResponseCreated(response=_response("r1", "in_progress")), 11.95)
    r.on_event(_audio("r1"), 12.0)
    answer = r.answers[0]
    assert answer.ttfa_ms is not None and round(answer.ttfa_ms) == 1200  # from 10.8 s
    # the old rule (the last frame over 5% of the loudest) would have said 600 ms: the breath


def test_holding_waits_for_the_answer_to_play_out() -> None:
    r = TalkReport()
    assert not r.holding(0.0)  # nothing said yet
    r.on_event(ev.SpeechStarted(audio_start_ms=0, item_id="u1"), 1.0)
    assert not r.holding(1.1)  # the user speaks
    r.on_event(ev.SpeechStopped(audio_end_ms=900, item_id="u1"), 1.5)
    assert r.holding(1.6)  # the turn ended: wait for its answer ...
    assert not r.holding(1.5 + 10.5)  # ... but not for ever when none comes
    r.on_event(ev.ResponseCreated(response=_response("r1", "in_progress")), 2.0)
    r.on_event(_audio("r1", ms=1000), 2.5)  # 1 s of answer audio from 2.5 s
    r.on_event(ev.ResponseDone(response=_response("r1", "completed")), 2.6)
    assert r.holding(3.4)  # still playing
    assert r.holding(3.8)  # the pause after it
    assert not r.holding(4.1)  # played out: speak on


def test_cli_talk_waits_for_each_answer_and_times_from_the_end_of_speech(
    server: str, tmp_path: Path
) -> None:
    """Two utterances 1.2 s apart with a faint breath in the pause: by default the second
    waits until the first answer has played, so both answers complete; each TTFA runs from
    the server's end of speech (the breath does not count), so it holds the 500 ms silence
    window and no less."""
    src = tmp_path / "two.wav"
    with wave.open(str(src), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        pause = silence(500, 16000) + tone(60, 16000, amp=0.03) + silence(640, 16000)
        w.writeframes(silence(200, 16000) + tone(700, 16000) + pause + tone(700, 16000))
    url = f"ws://{server}/v1/realtime"
    talk = _cli("--url", url, "talk", "--wav", str(src))
    assert talk.returncode == 0, talk.stderr
    text = talk.stdout
    assert "2 turns detected by server VAD, 2 transcripts, 2 answers (2 completed)" in text, text
    ttfas = [int(t) for t in re.findall(r"\[completed, TTFA (\d+) ms \(audible \d+ ms\)\]", text)]
    assert len(ttfas) == 2, text
    assert all(450 <= t < 3000 * UNIT for t in ttfas), text
