"""``duplex-client talk``: stream a WAV as a microphone and report what happened, turn by turn.

A recording usually holds several utterances, and server VAD ends a turn at each pause long
enough, so one WAV makes as many turns as the server detects. By default the microphone
then waits, as a polite person would: once a turn has ended it sends silence until the answer
has played (its audio's length from its first delta), then goes on with the recording.
``talk_over`` (``--talk-over``) streams the recording straight through instead: a reply still
playing when the recording speaks again is interrupted (barge-in). The report says what
happened: per turn its transcript, its answer (completed or interrupted) and the answer's
TTFA, then a summary (turns detected, transcripts, answers by status, TTFA).

TTFA is timed here, at the client, as bench/live_latency.py times it: from the *last voiced
frame sent* to the first ``response.output_audio.delta`` of the answer (first byte), and to
its first *audible* sample (``audible``: a 5 ms window at -40 dBFS as a player that starts on
the first byte reaches it, :class:`duplex_contract.audible.AudibleStart`; a voice that opens
with silence is heard that much later). The end of speech is
the server's own: ``speech_stopped.audio_end_ms`` (the VAD's end of speech, in ms of the
session's input audio) is mapped back to the moment the client sent that audio. (An earlier
version called a frame voiced above 5% of the recording's loudest frame, so a breath in a
pause counted as speech and TTFA came out tens of ms.) That is the user's wait;
``speech_stopped`` itself arrives a silence window (500 ms by default) later.

With ``interrupt_mode: confirm`` (``--interrupt-mode confirm``; docs/protocol.md §6.1) the
server pauses an answer for speech over it (``output_audio_buffer.paused``) and either stops
it (interrupted, as above) or takes the cut back (``output_audio_buffer.resumed``: a
listener's "mm-hm", a cough): the report says so on the answer and in the summary.

:class:`TalkReport` is the pure part (events and times in, lines out); :func:`talk` runs it
against a server.
"""

from __future__ import annotations

import asyncio
import base64
import statistics
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duplex_client import events as ev
from duplex_client.audio_input import read_wav, to_pcm16
from duplex_client.client import DuplexClient
from duplex_client.errors import SessionEnded
from duplex_contract.audible import AudibleStart

RATE = 16000  # the session's input rate: frames are sent as they are, never resampled
FRAME_MS = 20
VOICED_REL = 0.05
OUT_RATE = 24000
TRAILING_SILENCE_S = 1.0  # after the WAV, so the VAD hears the last turn end
IDLE_S = 30.0  # after the WAV: stop when no event came for this long
QUIET_S = 3.0  # ... or this long, with no speech and no answer in progress
ANSWER_WAIT_S = 10.0  # waiting for an answer: the longest wait for it to begin
AFTER_ANSWER_S = 0.5  # ... and the pause after it has played before speaking on


def frames_of(pcm: bytes, rate: int = RATE, frame_ms: int = FRAME_MS) -> list[bytes]:
    step = int(rate * frame_ms / 1000) * 2
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


def voiced_flags(frames: list[bytes]) -> list[bool]:
    """Which frames are voiced: RMS over ``VOICED_REL`` of the loudest frame's."""
    rms = [
        float(np.sqrt(np.mean(np.frombuffer(f, dtype="<i2").astype(np.float64) ** 2)))
        if len(f) >= 2
        else 0.0
        for f in frames
    ]
    top = max(rms, default=0.0)
    return [top > 0 and r > VOICED_REL * top for r in rms]


@dataclass
class Turn:
    number: int
    item_id: str
    voiced_end: float | None  # when the last voiced frame before the turn's end was sent
    transcript: str | None = None
    ended_at: float | None = None  # when speech_stopped arrived


@dataclass
class Answer:
    response_id: str
    turn: Turn | None
    status: str = "in_progress"
    text: str = ""
    audio: list[bytes] = field(default_factory=list)
    pauses: int = 0  # output_audio_buffer.paused: speech over it was judged
    taken_back: int = 0  # output_audio_buffer.resumed: ... and was not an interruption
    #: when its first audio arrived (``first_byte_at``) and was first audible (``at``)
    heard: AudibleStart = field(default_factory=AudibleStart)

    @property
    def first_audio(self) -> float | None:
        return self.heard.first_byte_at

    @property
    def ttfa_ms(self) -> float | None:
        return self._since_voice(self.first_audio)

    @property
    def audible_ms(self) -> float | None:
        """The last voiced frame sent -> the answer's first audible sample."""
        return self._since_voice(self.heard.at)

    def _since_voice(self, at: float | None) -> float | None:
        if self.turn is None or self.turn.voiced_end is None or at is None:
            return None
        return (at - self.turn.voiced_end) * 1000

    @property
    def audio_s(self) -> float:
        return sum(map(len, self.audio)) / (2 * OUT_RATE)


class TalkReport:
    """What happened in a talk session; :meth:`on_event` returns the lines to print."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.answers: list[Answer] = []
        self.errors: list[str] = []
        self.last_voiced: float | None = None
        self.sent_at: list[float] = []  # when each 20 ms frame of session input was sent
        self.speaking = False
        self._by_item: dict[str, Turn] = {}
        self._by_response: dict[str, Answer] = {}
        self._speech_item: str | None = None  # of the speech in progress
        #: speech items a taken-back cut came from, and when their last voiced frame was
        #: sent: a turn only if committed after all (its words came late)
        self._held: dict[str, float | None] = {}

    def sent_frame(self, voiced: bool, now: float) -> None:
        self.sent_at.append(now)
        if voiced:
            self.last_voiced = now

    def sent_time(self, audio_ms: float) -> float | None:
        """When the frame holding ``audio_ms`` of session input was sent (None: not sent)."""
        index = int(audio_ms // FRAME_MS)
        return self.sent_at[index] if 0 <= index < len(self.sent_at) else None

    def holding(self, now: float) -> bool:
        """Should the microphone wait (send silence) for an answer? A turn has ended and its
        answer has not begun (at most ``ANSWER_WAIT_S``), runs, or is still playing."""
        if self.speaking or not self.turns:
            return False
        last = self.turns[-1]
        answer = self.answers[-1] if self.answers and self.answers[-1].turn is last else None
        if answer is None:
            return last.ended_at is not None and now - last.ended_at < ANSWER_WAIT_S
        if answer.status == "in_progress":
            return True
        if answer.first_audio is None:
            return False
        return now < answer.first_audio + answer.audio_s + AFTER_ANSWER_S

    @property
    def idle(self) -> bool:
        """No speech in progress and no answer still open."""
        return not self.speaking and not any(a.status == "in_progress" for a in self.answers)

    @property
    def settled(self) -> bool:
        """Idle, and the last turn has its answer (an earlier turn may have none)."""
        last = self.turns[-1] if self.turns else None
        answered = bool(self.answers) and self.answers[-1].turn is last
        return self.idle and last is not None and answered

    def on_event(self, event: ev.AnyServerEvent, now: float) -> list[str]:
        if isinstance(event, ev.SpeechStarted):
            self.speaking = True
            self._speech_item = event.item_id
        elif isinstance(event, ev.SpeechStopped):
            self.speaking = False
            sent = self.sent_time(event.audio_end_ms)  # the server's end of speech
            voiced_end = sent if sent is not None else self.last_voiced
            if event.item_id in self._held:
                self._held[event.item_id] = voiced_end
            else:
                turn = self._turn(event.item_id)
                turn.voiced_end = voiced_end
                turn.ended_at = now
        elif isinstance(event, ev.InputCommitted):
            held = event.item_id in self._held
            voiced_end = self._held.pop(event.item_id, None)
            turn = self._turn(event.item_id)
            if held:
                turn.voiced_end = voiced_end
                turn.ended_at = now
        elif isinstance(event, ev.InputTranscriptCompleted):
            turn = self._turn(event.item_id)
            turn.transcript = event.transcript
            return [f"turn {turn.number}  you:       {event.transcript or '(no words heard)'}"]
        elif isinstance(event, ev.ResponseCreated):
            created = Answer(event.response.id, self.turns[-1] if self.turns else None)
            self.answers.append(created)
            self._by_response[created.response_id] = created
        elif isinstance(event, ev.AudioDelta):
            answer = self._by_response.get(event.response_id)
            if answer is not None:
                pcm = base64.b64decode(event.delta)
                answer.audio.append(pcm)
                answer.heard.feed(now, pcm, OUT_RATE)
        elif isinstance(event, ev.TranscriptDelta | ev.TextDelta):
            answer = self._by_response.get(event.response_id)
            if answer is not None:
                answer.text += event.delta
        elif isinstance(event, ev.OutputAudioPaused | ev.OutputAudioResumed):
            return self._paused(event)
        elif isinstance(event, ev.ResponseDone):
            answer = self._by_response.get(event.response.id)
            if answer is not None:
                answer.status = event.response.status
                return [self._answer_line(answer)]
        elif isinstance(event, ev.Error):
            line = f"error: {event.error.code}: {event.error.message}"
            self.errors.append(line)
            return [line]
        return []

    def _paused(self, event: ev.OutputAudioPaused | ev.OutputAudioResumed) -> list[str]:
        answer = self._by_response.get(event.response_id)
        if answer is None:
            return []
        where = f"turn {answer.turn.number}" if answer.turn is not None else "turn -"
        if isinstance(event, ev.OutputAudioPaused):
            answer.pauses += 1
            return []
        answer.taken_back += 1
        if self._speech_item is not None and self._speech_item not in self._by_item:
            self._held.setdefault(self._speech_item, None)  # not a turn unless committed
        return [f"{where}  assistant: paused for speech over it, resumed (cut taken back)"]

    def _turn(self, item_id: str) -> Turn:
        turn = self._by_item.get(item_id)
        if turn is None:
            turn = Turn(len(self.turns) + 1, item_id, self.last_voiced)
            self.turns.append(turn)
            self._by_item[item_id] = turn
        return turn

    @staticmethod
    def _answer_line(answer: Answer) -> str:
        where = f"turn {answer.turn.number}" if answer.turn is not None else "turn -"
        text = answer.text.strip() or "(nothing said)"
        if answer.status == "cancelled":
            how = "interrupted"
            how += (
                f" after {answer.audio_s:.1f} s of audio" if answer.audio else " before any audio"
            )
        else:
            how = answer.status
        if answer.taken_back:
            how += f", {_n(answer.taken_back, 'cut')} taken back"
        ttfa = answer.ttfa_ms
        if ttfa is not None:
            how += f", TTFA {ttfa:.0f} ms"
            audible = answer.audible_ms
            how += f" (audible {audible:.0f} ms)" if audible is not None else " (never audible)"
        return f"{where}  assistant: {text}  [{how}]"

    def summary(self, fast: bool = False) -> list[str]:
        by_status: dict[str, int] = {}
        for a in self.answers:
            label = "interrupted" if a.status == "cancelled" else a.status
            by_status[label] = by_status.get(label, 0) + 1
        counts = ", ".join(f"{n} {label}" for label, n in by_status.items())
        heard = sum(1 for t in self.turns if t.transcript is not None)
        lines = [
            f"{_n(len(self.turns), 'turn')} detected by server VAD, "
            f"{_n(heard, 'transcript')}, {_n(len(self.answers), 'answer')}"
            + (f" ({counts})" if counts else "")
        ]
        taken_back = sum(a.taken_back for a in self.answers)
        if taken_back:
            lines.append(f"{_n(taken_back, 'cut')} taken back (speech over an answer, not a turn)")
        answered = {id(a.turn) for a in self.answers}
        unanswered = [str(t.number) for t in self.turns if id(t) not in answered]
        if unanswered:
            which = ", ".join(unanswered)
            lines.append(f"{_n(len(unanswered), 'turn')} got no answer (turn {which})")
        ttfas = [t for a in self.answers if (t := a.ttfa_ms) is not None]
        if ttfas:
            each = ", ".join(f"{t:.0f}" for t in ttfas)
            lines.append(
                f"TTFA, last voiced frame sent -> first answer audio: median "
                f"{statistics.median(ttfas):.0f} ms over {_n(len(ttfas), 'answer')} ({each} ms)"
                + (" (--fast: sent faster than real time, not a live figure)" if fast else "")
            )
            audible = [t for a in self.answers if (t := a.audible_ms) is not None]
            if audible:
                lines.append(
                    f"     ... -> first audible sample (-40 dBFS): median "
                    f"{statistics.median(audible):.0f} ms over {_n(len(audible), 'answer')}"
                )
        else:
            lines.append("TTFA: no answer audio received")
        return lines

    def reply_pcm(self) -> bytes:
        """The answers' audio in order (interrupted ones as far as they came)."""
        return b"".join(b"".join(a.audio) for a in self.answers)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def write_wav(path: Path, pcm: bytes, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


async def talk(
    url: str,
    api_key: str | None,
    wav: Path,
    out: Path | None,
    fast: bool,
    idle_s: float = IDLE_S,
    talk_over: bool = False,
    interrupt_mode: str | None = None,
) -> int:
    """Stream ``wav`` as a microphone (server VAD ends the turns); print the report.
    ``talk_over``: never wait for an answer (the recording interrupts them);
    ``interrupt_mode``: the session's, ``immediate`` or ``confirm`` (None: the server's)."""
    detection: dict[str, str] = {"type": "server_vad"}
    if interrupt_mode is not None:
        detection["interrupt_mode"] = interrupt_mode
    pcm, rate = read_wav(wav)
    frames = frames_of(to_pcm16(pcm, rate, RATE))
    voiced = voiced_flags(frames)
    silence = frames_of(b"\0\0" * int(RATE * TRAILING_SILENCE_S))
    report = TalkReport()
    async with await DuplexClient.connect(url, api_key=api_key) as client:
        await client.update_session(
            {
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": RATE},
                        "turn_detection": detection,
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": OUT_RATE}},
                },
            }
        )
        while not isinstance(await client.next_event(10.0), ev.SessionUpdated):
            pass

        async def send() -> None:  # events are read meanwhile: TTFA is timed as they arrive
            start = time.monotonic()
            mic = frames + silence
            flags = voiced + [False] * len(silence)
            quiet = silence[0]
            i = sent = 0
            while i < len(mic):
                if not talk_over and report.holding(time.monotonic()):
                    frame, is_voiced = quiet, False  # waiting for the answer
                else:
                    frame, is_voiced = mic[i], flags[i]
                    i += 1
                await client.send_audio(frame, RATE)
                report.sent_frame(is_voiced, time.monotonic())
                sent += 1
                if not fast:
                    due = start + sent * FRAME_MS / 1000
                    await asyncio.sleep(max(0.0, due - time.monotonic()))

        sender = asyncio.create_task(send(), name="microphone")
        last_event = time.monotonic()
        try:
            while not (sender.done() and report.settled):
                try:
                    event = await client.next_event(0.5)
                except TimeoutError:
                    quiet = time.monotonic() - last_event
                    if not sender.done():
                        continue
                    if report.idle and quiet > QUIET_S:
                        break  # the last turn got no answer
                    if quiet > idle_s:
                        print(f"(no event for {idle_s:.0f} s: stopping)", file=sys.stderr)
                        break
                    continue
                except SessionEnded:
                    break
                if isinstance(event, ev.HeartbeatAck):
                    continue  # keeps the session alive, says nothing about the turns
                last_event = time.monotonic()
                for line in report.on_event(event, last_event):
                    print(line, flush=True)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    for line in report.summary(fast):
        print(line)
    if out is not None:
        reply = report.reply_pcm()
        write_wav(out, reply, OUT_RATE)
        print(f"wrote {out} ({len(reply) / (2 * OUT_RATE):.2f} s: the answers' audio in order)")
    return 1 if report.errors else 0
