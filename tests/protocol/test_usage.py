"""Usage accounting in the session core (pure): the audio a response answers, the tokens it
used, a cancelled response's usage and the session's sum (docs/protocol.md §5.11)."""

from __future__ import annotations

from duplex_contract.fence import Fence
from duplex_contract.session_events import AudioChunk, ResponseDone, ResponseStarted
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Commit
from duplex_server.protocol.usage import audio_tokens, response_usage
from duplex_server.protocol.vad_events import VadStart, VadStop
from tests.protocol.test_session import CHUNK, SID, _speak, calls, core, sent


def test_audio_tokens_round_up_per_response() -> None:
    assert audio_tokens(0, 10) == 0
    assert audio_tokens(100, 10) == 1 and audio_tokens(100.0000001, 10) == 1
    assert audio_tokens(101, 10) == 2 and audio_tokens(1234, 20) == 25
    u = response_usage(input_text=30, output_text=7, input_audio_ms=1500, output_audio_ms=2000)
    assert u.input_token_details == ev.InputTokenDetails(text_tokens=30, audio_tokens=15)
    assert u.output_token_details == ev.OutputTokenDetails(text_tokens=7, audio_tokens=40)
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (45, 47, 92)
    assert (u.input_audio_seconds, u.output_audio_seconds) == (1.5, 2.0)


def _chunk(fence: Fence, start: float) -> AudioChunk:
    return AudioChunk(
        fence=fence, pcm=b"\0" * 4800, sample_rate=24000, audio_start_ms=start, duration_ms=100.0
    )


def test_a_vad_turn_bills_the_audio_it_committed_and_the_engine_tokens() -> None:
    c = core()
    c.on_input_audio(CHUNK * 10, [], 0)  # 200 ms idle: prefix padding kept in the ring
    c.on_input_audio(CHUNK, [VadStart(onset_ms=180.0, audio_start_ms=0.0)], 10)
    out = c.on_input_audio(CHUNK, [VadStop(audio_end_ms=220.0)], 20)
    commit = calls(out)[-1]
    assert isinstance(commit, Commit)
    fence = Fence(SID, 0, 1, 1)
    c.on_result(commit, fence)
    c.on_engine_event(ResponseStarted(fence=fence), 30)
    c.on_engine_event(_chunk(fence, 0.0), 40)
    c.on_engine_event(_chunk(fence, 100.0), 50)
    done_in = ResponseDone(fence=fence, status="completed", output_tokens=9, input_tokens=41)
    (done,) = [e for e in sent(c.on_engine_event(done_in, 60)) if isinstance(e, ev.ResponseDone)]
    usage = done.response.usage
    assert usage is not None
    # 12 chunks of 20 ms went to the engine: the ring (200 ms) and the two with VAD events
    assert usage.input_audio_seconds == 0.24 and usage.input_token_details.audio_tokens == 3
    assert usage.input_token_details.text_tokens == 41
    assert usage.output_token_details == ev.OutputTokenDetails(text_tokens=9, audio_tokens=4)
    assert usage.output_audio_seconds == 0.2 == done.response.audio_ms / 1000


def test_a_cancelled_response_bills_its_audio_and_the_session_sums_it_all() -> None:
    c = core()
    c.audio_received(48000)  # 1 s at 24 kHz PCM16 (the session's input format)
    fence = Fence(SID, 0, 1, 1)
    c.on_result(Commit(0, respond=True), fence)
    c.on_engine_event(ResponseStarted(fence=fence), 0)
    c.on_engine_event(_chunk(fence, 0.0), 1)
    out = _speak(c, 200, now=500)  # a barge-in: the server cancels, the engine counts nothing
    (done,) = [e for e in sent(out) if isinstance(e, ev.ResponseDone)]
    assert done.response.status == "cancelled" and done.response.usage is not None
    assert done.response.usage.output_token_details == ev.OutputTokenDetails(0, 2)
    assert done.response.usage.output_audio_seconds == 0.1
    (closed,) = [e for e in sent(c.close("client")) if isinstance(e, ev.SessionClosed)]
    total = closed.usage
    assert total is not None and total.responses == 1
    assert total.input_audio_seconds == 1.0  # received, answered or not
    assert total.output_token_details == ev.OutputTokenDetails(0, 2)
    assert total.total_tokens == total.input_tokens + total.output_tokens == 2
