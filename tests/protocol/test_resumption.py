"""A session's resumption alone (protocol/resumption.py): the token check, the resume
handshake and what a new transport is told."""

from __future__ import annotations

import pytest

from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import ConfigureInput, Replay, Send, SendStamped, Takeover
from duplex_server.protocol.errors import SessionFatal
from duplex_server.protocol.resume import new_resume_token
from duplex_server.protocol.resumption import Resumption
from duplex_server.protocol.session_config import EffectiveSession

SID = "sess_0123456789abcdef0123456789abcdef"
CAPS = ev.Capabilities(True, True, ["pcm16"], ["pcm16"], ["server_vad"], "energy", 1, 1, 1.0)


def _refusal(r: Resumption, token: str, *, closed: bool = False) -> str:
    with pytest.raises(SessionFatal) as info:
        r.admit(token, closed=closed)
    return info.value.code


def test_open_keeps_only_the_digest_and_configures_the_input() -> None:
    r = Resumption(SID)
    token, digest = new_resume_token()
    out = r.opened(EffectiveSession(), token, CAPS, digest)
    assert r.token_hash == digest and token.encode() not in r.token_hash
    created, configure = out
    assert isinstance(created, Send) and isinstance(created.event, ev.SessionCreated)
    assert created.event.resume_token == token and created.event.session.id == SID
    assert isinstance(configure, ConfigureInput)


def test_admission_refuses_a_wrong_token_a_closed_session_and_a_second_resume() -> None:
    r = Resumption(SID)
    token, digest = new_resume_token()
    r.opened(EffectiveSession(), token, CAPS, digest)
    assert _refusal(r, "nope") == "invalid_resume_token"
    assert _refusal(r, token, closed=True) == "session_not_found"
    r.admit(token, closed=False)
    assert r.resuming and _refusal(r, token) == "stale_lease"
    r.resume_failed()
    r.admit(token, closed=False)


def test_a_resume_replays_then_hands_out_the_new_token() -> None:
    r = Resumption(SID)
    token, digest = new_resume_token()
    r.opened(EffectiveSession(), token, CAPS, digest)
    r.admit(token, closed=False)
    assert r.resumed("tok2", b"d2", after_seq=4, attached=True) == [Takeover(), Replay(4)]
    assert not r.resuming and r.token_hash == b"d2"
    out = r.replayed([b"x"], 4, 5, lease_generation=3, last_input_seq=9)
    assert out[0] == SendStamped((b"x",))
    resumed = out[1]
    assert isinstance(resumed, Send) and isinstance(resumed.event, ev.SessionResumed)
    assert (resumed.event.resume_token, resumed.event.lease_generation) == ("tok2", 3)
    assert resumed.event.last_input_seq == 9 and resumed.event.replayed == 1


def test_a_takeover_says_what_may_be_lost() -> None:
    r = Resumption(SID)
    out = r.taken_over(
        EffectiveSession(), "tok", last_seq=7, lost=True, lease_generation=2, last_input_seq=1
    )
    events = [a.event for a in out if isinstance(a, Send)]
    assert isinstance(out[0], ConfigureInput)
    assert isinstance(events[0], ev.ResyncRequired) and events[0].first_available_seq == 8
    assert isinstance(events[1], ev.SessionResumed) and events[1].lease_generation == 2
