"""The control calls a front end makes on the engine's sessions, and their one result.

A front end opens a session (:class:`OpenCall`), feeds it (:class:`AppendCall`), ends a
turn (:class:`CommitCall`), signals it (:class:`SignalCall`: barge-in, cancel, a pause,
a settings update), reports what it played (:class:`TouchCall` with a
:class:`PlaybackMark`), resumes it after a reconnect (:class:`ResumeCall`), keeps its state
and its conversation items there (:class:`ReplicaCall`, :class:`ItemsCall`) and closes it
(:class:`CloseCall`). Every call but open and resume names the session's
:class:`~duplex_contract.fence.Fence` and lease generation; each gets one
:class:`ControlResult`. The engine's queue envelopes that carry them stay in the engine
(``engine/messages.py``).

Retries: every call may carry an ``operation_id`` (the front end sends one on each call,
unique within its session). A call repeated with the same id (its answer was lost: a
deadline, an engine restart) is answered with the first answer (``deduplicated``) and
changes nothing; the same id on a different call is refused (``invalid_argument``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from duplex_contract.audio import INPUT_RATE
from duplex_contract.fence import Fence
from duplex_contract.session_events import ErrorInfo, Msg
from duplex_contract.settings import SessionSettings, SessionUpdate
from duplex_contract.tools import ItemRef, ResponseOptions, ToolOutput


class OpenCall(Msg, frozen=True, tag="open"):
    config: SessionSettings = SessionSettings()
    route_key: str | None = None  # the opening front end's; carried in the session id
    traceparent: str | None = None  # W3C trace context of the session's span (engine/spans.py)
    operation_id: str | None = None  # a retried open opens one session


class AppendCall(Msg, frozen=True, tag="append"):
    fence: Fence
    lease_generation: int
    audio: bytes = b""  # PCM16 mono at ``sample_rate``
    text: str | None = None
    sample_rate: int = INPUT_RATE  # the engine refuses any other rate
    seq: int | None = None  # client append sequence: a resend after reconnect never duplicates
    operation_id: str | None = None
    expected_epoch: int | None = None
    item_id: str | None = None  # the client's item this text belongs to
    tool_output: ToolOutput | None = None  # a function_call_output item
    #: where ``audio`` starts on the session's input clock (ms of input the front end has
    #: processed, silence included): the engine times the pause between two turns in audio,
    #: not wall-clock, time (engine/orchestration/speculation.py). None: not known (wall clock
    #: instead).
    stream_ms: float | None = None


class CommitCall(Msg, frozen=True, tag="commit"):
    fence: Fence
    lease_generation: int
    respond: bool = True
    operation_id: str | None = None
    expected_epoch: int | None = None  # refused (stale_fence) if the session is at another
    item_id: str | None = None  # the user audio item this commit closes
    response: ResponseOptions | None = None  # overrides of the response (if respond)
    traceparent: str | None = None  # W3C trace context of the turn's span (engine/spans.py)


SignalEvent = Literal[
    "barge_in",
    "response.cancel",
    "input.cancel",
    "session.update",
    # The VAD saw a pause begin: transcribe the input so far speculatively; a commit that
    # follows (with only silence appended since) uses that transcript.
    "input.pause",
    # The user resumed speaking: drop the speculation.
    "input.resume",
    # conversation.item.delete: drop ``item`` from the history
    "item.delete",
    # A backchannel taken back (the front end's interruption decision): drop the input
    # audio not yet committed, with no new epoch; its speech never becomes a turn.
    "input.discard",
]


class SignalCall(Msg, frozen=True, tag="signal"):
    fence: Fence
    lease_generation: int
    event: SignalEvent
    next_fence: Fence | None = None
    update: SessionUpdate | None = None
    operation_id: str | None = None
    item: ItemRef | None = None  # item.delete
    # input.pause: the commit that may follow will ask for a response (so the engine may
    # answer the pause ahead of it: engine/orchestration/drafts.py)
    respond: bool = True
    # input.pause: W3C trace context of the turn's span (engine/spans.py)
    traceparent: str | None = None
    # input.pause: send the guess's transcript back, tagged with this number (a non-final
    # UserTranscript with ``guess``): the front end's end-of-turn judge reads it
    # (semantic_vad with ``end_of_turn: words``, duplex_server/session/turn_words.py)
    words: int | None = None


class PlaybackMark(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the client actually played of one response (truncates its assistant turn)."""

    turn_id: int
    response_seq: int
    played_ms: float
    # False: progress report (kept; applied if the response is cancelled or already done).
    # True: cut the assistant turn now (``conversation.item.truncate``).
    truncate: bool = False


Activity = Literal["heartbeat", "detach", "attach", "playback_ack"]


class TouchCall(Msg, frozen=True, tag="touch"):
    fence: Fence
    lease_generation: int
    activity: Activity
    playback: PlaybackMark | None = None
    operation_id: str | None = None


class ResumeCall(Msg, frozen=True, tag="resume"):
    session_id: str
    expected_lease_generation: int
    #: look only: the current lease generation, the front end's replica and items and the
    #: engine's input seq, nothing changed (a front end that does not know the session asks
    #: first)
    peek: bool = False
    #: the owner attaches again after an engine restart (docs/scale.md): the lease
    #: generation must be ``expected_lease_generation`` and stays; this front end gets the
    #: session's events from now on
    reattach: bool = False
    operation_id: str | None = None


class ReplicaCall(Msg, frozen=True, tag="replica"):
    """The owning front end's state of a session (an opaque blob it can rebuild the session
    from on any front end: engine/duplex/replica.py); the engine keeps the latest one."""

    fence: Fence
    lease_generation: int
    state: bytes
    operation_id: str | None = None


class ItemRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One conversation item as the owning front end keeps it (``record``: opaque to the
    engine, duplex_server/session/snapshot.py), by its id."""

    item_id: str
    record: bytes


class ItemsCall(Msg, frozen=True, tag="items"):
    """The owner's conversation items changed: ``upserts`` replace (or add, as the newest)
    the records of their ids, ``deletes`` drop theirs, and a non-empty ``state`` replaces the
    front end's conversation state (the next item number, the last item, the usage counters;
    opaque to the engine). The engine keeps them beside the conversation (bounded: the
    oldest records go first) and hands them to whichever front end takes the session over."""

    fence: Fence
    lease_generation: int
    upserts: tuple[ItemRecord, ...] = ()
    deletes: tuple[str, ...] = ()
    state: bytes = b""
    operation_id: str | None = None


class CloseCall(Msg, frozen=True, tag="close"):
    fence: Fence
    lease_generation: int
    reason: str = "client"
    operation_id: str | None = None


ControlCall = (
    OpenCall
    | AppendCall
    | CommitCall
    | SignalCall
    | TouchCall
    | ResumeCall
    | CloseCall
    | ReplicaCall
    | ItemsCall
)


class ControlResult(Msg, frozen=True, tag="result"):
    """``ok=False`` is authoritative: the call changed nothing."""

    control_id: int
    ok: bool
    session_id: str | None = None
    accepted_fence: Fence | None = None
    lease_generation: int = 0
    error: ErrorInfo | None = None
    clamped_ms: float | None = None  # playback_ack: the played duration actually applied
    deduplicated: bool = False
    replica: bytes | None = None  # resume: the front end's replica of the session
    input_seq: int | None = None  # resume: the newest client input seq the engine has
    #: resume (peek): the session's conversation items and the front end's state of them
    items: tuple[ItemRecord, ...] | None = None
    items_state: bytes | None = None
    #: the engine's session store holds the session as this call left it (an engine that
    #: restarts has it); False: not stored (an append: the front end keeps it until a later
    #: call's answer says ``saved``), or the engine keeps no store
    saved: bool = False
