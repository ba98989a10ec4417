"""The session core's side of failover and drain, pure: a core rebuilt on another front end
continues at the engine's position and says what may be lost; a drain cancels an answer
still running instead of cutting it silently; the replica round-trips the configuration."""

from __future__ import annotations

from duplex_contract.fence import Fence
from duplex_contract.session_events import ResponseStarted
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Call, Cancel, ConfigureInput, Send
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.session_config import EffectiveSession
from duplex_server.session.snapshot import decode, encode

SID = "sess_w1_0123456789abcdef0123456789abcdef"


def _core(**kw: object) -> SessionMachine:
    return SessionMachine(SID, EffectiveSession(**kw))  # type: ignore[arg-type]


def test_a_core_taken_over_after_a_crash_continues_and_asks_for_a_resync() -> None:
    c = _core(instructions="be brief")
    c.adopted(Fence(SID, 3, 5, 5), 42, b"digest")
    assert c.position.fence == Fence(SID, 3, 5, 5)
    assert c.resumption.token_hash == b"digest"
    out = c.taken_over("tok2", last_seq=17, lost=True)
    assert isinstance(out[0], ConfigureInput)
    sent = [a.event for a in out if isinstance(a, Send)]
    assert isinstance(sent[0], ev.ResyncRequired)
    assert (sent[0].reason, sent[0].first_available_seq, sent[0].last_seq) == (
        "front_end_lost",
        18,
        17,
    )
    assert isinstance(sent[1], ev.SessionResumed)
    assert sent[1].resume_token == "tok2" and sent[1].last_input_seq == 42
    assert c.fence_for(c.epoch) == Fence(SID, 3, 5, 5)  # its calls carry the engine's position
    assert c.seqs.accept(42) is None  # input the engine has is not taken twice


def test_a_clean_handover_sends_no_resync() -> None:
    c = _core()
    c.adopted(Fence(SID, 0, 1, 1), 0, b"d")
    sent = [a.event for a in c.taken_over("t", last_seq=9, lost=False) if isinstance(a, Send)]
    assert [type(e) for e in sent] == [ev.SessionResumed]


def test_a_drain_cancels_an_answer_still_running() -> None:
    c = _core()
    assert c.cut_for_handover() == []  # nothing running: nothing to do
    c.responses.requested()
    c.on_engine_event(ResponseStarted(fence=Fence(SID, 0, 1, 1)), 0.0)
    out = c.cut_for_handover()
    done = [a.event for a in out if isinstance(a, Send) and isinstance(a.event, ev.ResponseDone)]
    assert done and done[0].response.status == "cancelled"
    assert done[0].response.status_details is not None
    assert done[0].response.status_details.reason == "server_draining"
    assert [a.command for a in out if isinstance(a, Call) and isinstance(a.command, Cancel)]
    assert c.epoch == 1 and not c.responses.active


def test_the_replica_round_trips_the_configuration() -> None:
    c = _core(instructions="be brief", voice="alba", output_modalities=("text",))
    c.resumption.token_hash = b"\x01" * 32
    template = EffectiveSession(output_rate=16000)
    rep = decode(encode(c, 12, handed_over=True), template)
    assert rep.token_hash == c.resumption.token_hash and rep.event_seq == 12 and rep.handed_over
    assert rep.config.instructions == "be brief" and rep.config.voice == "alba"
    assert rep.config.output_modalities == ("text",)
    assert rep.config.output_rate == 16000  # the taking-over front end's own
