"""Open, resume, takeover and slow-client handling are decisions of the session core."""

from __future__ import annotations

import pytest

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import (
    Action,
    Call,
    CloseSession,
    CloseSocket,
    DropOutput,
    Release,
    Replay,
    Send,
    SendStamped,
    Takeover,
)
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.machine import SessionMachine
from duplex_server.protocol.resume import new_resume_token
from duplex_server.protocol.session_config import EffectiveSession

SID = "sess_0123456789abcdef0123456789abcdef"


def _caps() -> ev.Capabilities:
    return ev.Capabilities(True, True, ["pcm16"], ["pcm16"], ["server_vad"], "energy", 1, 1, 1.0)


def opened() -> tuple[SessionMachine, str]:
    core = SessionMachine(SID, EffectiveSession())
    token, digest = new_resume_token()
    core.opened(token, _caps(), token_hash=digest)
    return core, token


def fatal_code(core: SessionMachine, token: str) -> str:
    with pytest.raises(SessionFatal) as info:
        core.admit_resume(token)
    return info.value.code


def test_resume_refusals() -> None:
    core, token = opened()
    assert fatal_code(core, "not-the-token") == "invalid_resume_token"
    core.admit_resume(token)
    assert fatal_code(core, token) == "stale_lease"  # a second resume while one is waiting
    core.resumption.resume_failed()
    core.admit_resume(token)  # allowed again once the first failed
    core.resumption.resume_failed()
    core.close("client")
    assert fatal_code(core, token) == "session_not_found"


def test_resume_takes_over_an_attached_transport_then_replays() -> None:
    core, token = opened()
    core.admit_resume(token)
    new_token, digest = new_resume_token()
    actions = core.resumed(2, new_token, digest, after_seq=5, attached=True)
    assert actions == [Takeover(), Replay(5)]
    assert core.lease_generation == 2 and not core.resumption.resuming
    assert fatal_code(core, token) == "invalid_resume_token"  # tokens are one-time
    core.admit_resume(new_token)
    core.resumption.resume_failed()
    assert core.resumed(3, new_token, digest, after_seq=0, attached=False) == [Replay(0)]


def test_replay_results() -> None:
    core, token = opened()
    core.admit_resume(token)
    core.resumed(2, "tok2", b"", after_seq=1, attached=False)
    out = core.replayed([b"a", b"b"], first_available=2, last_seq=3)
    assert out[0] == SendStamped((b"a", b"b"))
    resumed = out[1]
    assert isinstance(resumed, Send) and isinstance(resumed.event, ev.SessionResumed)
    assert resumed.event.replayed == 2 and resumed.event.resume_token == "tok2"
    assert resumed.event.lease_generation == 2
    lost = core.replayed(None, first_available=7, last_seq=9)
    assert isinstance(lost[0], Send) and isinstance(lost[0].event, ev.ResyncRequired)
    assert (lost[0].event.first_available_seq, lost[0].event.last_seq) == (7, 9)
    assert isinstance(lost[1], Send) and isinstance(lost[1].event, ev.SessionResumed)
    assert lost[1].event.replayed == 0


def test_a_slow_client_ends_the_session_once() -> None:
    core, _ = opened()
    out: list[Action] = core.too_slow()
    assert out[0] == DropOutput() and out[-1] == Release()
    events = [a.event for a in out if isinstance(a, Send)]
    assert isinstance(events[0], ev.Error) and events[0].error.code == "client_too_slow"
    assert isinstance(events[1], ev.SessionClosed)
    closes = [a for a in out if isinstance(a, CloseSocket)]
    assert closes[0] == CloseSocket(1008, "client_too_slow")  # the first close wins
    assert Call(CloseSession("client_too_slow")) in out
    assert core.closed and core.too_slow() == []


def test_input_refusals() -> None:
    core, _ = opened()
    refused = core.input_refused()
    assert isinstance(refused[0], Send) and isinstance(refused[0].event, ev.Error)
    assert refused[0].event.error.code == "input_backpressure" and len(refused) == 1
    failed = core.input_failed()
    assert isinstance(failed[0], Send) and isinstance(failed[0].event, ev.Error)
    assert failed[0].event.error.code == "server_error"
    assert failed[1] == CloseSocket(1011, "server_error")


def test_session_created_says_where_to_resume() -> None:
    plain = SessionMachine(SID, EffectiveSession()).opened("t", _caps())
    routed = SessionMachine("sess_w2_" + "0" * 32, EffectiveSession()).opened("t", _caps())
    created = [a.event for a in (plain[0], routed[0])]  # type: ignore[attr-defined]
    assert created[0].resume_query == "intent=resume"
    assert created[1].resume_query == "intent=resume&route=w2"
