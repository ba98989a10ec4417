"""Front-end state kept in the engine (engine/duplex/replica.py): the owner's replica, a
peek that changes nothing, and what a taking-over front end gets back from resume."""

from __future__ import annotations

from duplex_contract.control import AppendCall, ReplicaCall, ResumeCall, TouchCall
from engine.duplex.replica import MAX_REPLICA_BYTES
from tests.engine.test_control import Harness


def test_the_owner_keeps_a_replica_and_a_peek_hands_it_out_unchanged() -> None:
    h = Harness()
    sid, f = h.open()
    peek = h.ok(ResumeCall(session_id=sid, expected_lease_generation=0, peek=True))
    assert peek.replica == b"" and peek.input_seq is None  # nothing kept yet
    h.ok(ReplicaCall(fence=f, lease_generation=1, state=b"state-1"))
    h.ok(AppendCall(fence=f, lease_generation=1, text="hi", seq=7))
    h.ok(ReplicaCall(fence=f, lease_generation=1, state=b"state-2"))  # the latest wins
    h.ok(TouchCall(fence=f, lease_generation=1, activity="detach"))
    peek = h.ok(ResumeCall(session_id=sid, expected_lease_generation=0, peek=True))
    assert (peek.replica, peek.input_seq, peek.lease_generation) == (b"state-2", 7, 1)
    session = h.control.sessions[sid]
    assert session.lease.generation == 1 and session.lease.detached_at is not None  # unchanged
    res = h.ok(ResumeCall(session_id=sid, expected_lease_generation=peek.lease_generation))
    assert res.lease_generation == 2 and res.input_seq == 7 and res.replica is None
    # of two front ends racing with the same peek, the second loses
    h.fails(ResumeCall(session_id=sid, expected_lease_generation=1), "stale_lease")


def test_a_replaced_owner_cannot_overwrite_the_replica() -> None:
    h = Harness()
    sid, f = h.open()
    h.ok(ReplicaCall(fence=f, lease_generation=1, state=b"old owner"))
    h.ok(ResumeCall(session_id=sid, expected_lease_generation=1))
    h.fails(ReplicaCall(fence=f, lease_generation=1, state=b"stale"), "stale_fence")
    h.ok(ReplicaCall(fence=f, lease_generation=2, state=b"new owner"))
    assert h.control.sessions[sid].replica == b"new owner"


def test_an_oversized_replica_or_unknown_session_is_refused() -> None:
    h = Harness()
    sid, f = h.open()
    big = b"x" * (MAX_REPLICA_BYTES + 1)
    h.fails(ReplicaCall(fence=f, lease_generation=1, state=big), "invalid_argument")
    assert h.control.sessions[sid].replica == b""  # a refused call changed nothing
    h.fails(ResumeCall(session_id="sess_nope", expected_lease_generation=0, peek=True), "not_found")
