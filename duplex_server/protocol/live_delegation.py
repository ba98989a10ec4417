"""A Live session's delegations and the lines waiting for the floor (sans-I/O).

The thinker hands a task off by calling the built-in ``delegate`` function
(:data:`~duplex_server.protocol.live_config.DELEGATE_TOOL`); its call, once the response
that made it is done, becomes a :class:`Delegation` (``session.delegation.created``). The
call stays open in the conversation ("You called delegate with {task}."): whatever comes
back for the delegation (commentary, thinking, a responses-mode backend's answer) is added
as that call's output, which the engine's history shows as the call's result.

What the model is to say (a short acknowledgement after ``acknowledgement_delay_ms``, a
commentary, a backend's answer) waits in :class:`Floor` until the floor is free: no
response in progress, the user not speaking, the last answer's audio all sent, a client
attached. Any commentary or thinking cancels every pending acknowledgement (OpenAI's rule).
Nothing here is cancelled by a barge-in: a delegation outlives the answer it interrupted.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

from duplex_contract.batch import BatchItem, ChatJob
from duplex_server.protocol import events as ev
from duplex_server.protocol.commands import Action, Send
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.live_backend import BackendRun, function_output
from duplex_server.protocol.live_config import LiveOptions, LiveStart
from duplex_server.protocol.live_events import (
    LiveDelegation,
    LiveDelegationCreated,
    LiveResponseCreate,
    LiveResponseEvent,
    LiveResponseItemCreate,
)
from duplex_server.protocol.machine import SessionMachine

#: delegations remembered per session (the oldest are forgotten)
MAX_DELEGATIONS = 64
#: what the thinker is told when it should acknowledge a delegation
ACK_NOTE = (
    "You just handed the user's request to a helper, who is working on it. In a few words, "
    "tell the user you are on it. Do not answer the request yourself."
)
#: what the thinker is told with a commentary that belongs to no delegation
SAY_NOTE = "Tell the user this now, briefly and in your own words: "


@dataclass(frozen=True, slots=True)
class RunBackend:
    """Run the next model call of a responses-mode delegation's backend (a chat job)."""

    delegation_id: str
    job: ChatJob


@dataclass(frozen=True, slots=True)
class StopBackends:
    """The session ended: stop every backend run."""


#: what the session runtime does beside the core's actions
LiveAction = RunBackend | StopBackends
Step = Action | LiveAction


@dataclass(slots=True)
class Delegation:
    id: str
    call_id: str  # the thinker's delegate call: what comes back is its output
    task: str
    target: Literal["client", "responses"]
    offset_ms: int
    backend: BackendRun | None = None  # responses mode
    done: bool = False


@dataclass(slots=True)
class Line:
    """Something the model is to say once the floor is free (and ``due_ms`` has come):
    ``events`` are core client events (a ``response.create`` among them)."""

    due_ms: float
    events: tuple[ev.AnyClientEvent, ...]
    ack: bool = False
    delegation_id: str | None = None


@dataclass(slots=True)
class Floor:
    """Lines waiting to be said, in order."""

    lines: deque[Line] = field(default_factory=deque)

    def add(self, line: Line) -> None:
        self.lines.append(line)

    def cancel_acks(self) -> None:
        self.lines = deque(x for x in self.lines if not x.ack)

    def clear(self) -> None:
        self.lines.clear()

    def next(self, now_ms: float) -> Line | None:
        """The first line that is due (taken off), or None."""
        for i, line in enumerate(self.lines):
            if line.due_ms <= now_ms:
                del self.lines[i]
                return line
        return None


class Delegations:
    """The session's delegations by id, the lines waiting for the floor, and the
    responses-mode backend runs: what delegation does on the shared core."""

    def __init__(self, core: SessionMachine, start: LiveStart, options: LiveOptions) -> None:
        self.core = core
        self.target = start.target
        self.options = options
        self.by_id: OrderedDict[str, Delegation] = OrderedDict()
        self.floor = Floor()
        self.ack_delay_ms = start.ack_delay_ms
        self.backend = start.backend

    def get(self, delegation_id: str) -> Delegation | None:
        return self.by_id.get(delegation_id)

    def for_append(self, delegation_id: str | None) -> Delegation | None:
        """The delegation an append names (None: none); refuses an unknown id, and any id
        in responses mode (whose results come from the backend)."""
        if delegation_id is None:
            return None
        if self.target == "responses":
            raise ProtocolError(
                "invalid_value",
                "delegation ids are not accepted with responses delegation",
                param="delegation_id",
            )
        d = self.by_id.get(delegation_id)
        if d is None:
            raise ProtocolError(
                "invalid_value", f"no delegation {delegation_id}", param="delegation_id"
            )
        return d

    # ------------------------------------------------------------------ a delegation begins
    def created(
        self, call: ev.FunctionCallItem, offset_ms: int, now_ms: float
    ) -> tuple[list[Action], list[LiveAction]]:
        """The thinker's ``delegate`` call ended its response: the delegation begins
        (its backend's first model call in responses mode) and an acknowledgement waits."""
        target = self.target
        assert target is not None
        try:
            task = str(json.loads(call.arguments).get("task") or call.arguments)
        except (json.JSONDecodeError, AttributeError):
            task = call.arguments
        d = Delegation(self.core.items.new_id("deleg"), call.call_id, task, target, offset_ms)
        self.by_id[d.id] = d
        while len(self.by_id) > MAX_DELEGATIONS:
            self.by_id.popitem(last=False)
        out: list[Action] = []
        live: list[LiveAction] = []
        response_id = None
        events: list[dict[str, Any]] = []
        if target == "responses" and self.backend is not None:
            d.backend = BackendRun(
                task, self.backend, route=self.options.backend_route, new_id=self.core.items.new_id
            )
            job, events = d.backend.start()
            assert d.backend.current is not None
            response_id = d.backend.current.id
            live.append(RunBackend(d.id, job))
        created = LiveDelegationCreated(
            delegation=LiveDelegation(
                id=d.id, target=target, type="delegation", response_id=response_id
            ),
            offset_ms=offset_ms,
        )
        out.append(Send(created))
        out += [Send(LiveResponseEvent(event=e, delegation_id=d.id)) for e in events]
        ack = respond(f"{self.core.config.instructions}\n\n{ACK_NOTE}")
        self.floor.add(Line(now_ms + self.ack_delay_ms, (ack,), ack=True, delegation_id=d.id))
        return out, live

    def result_item(self, d: Delegation, content: str, now_ms: float) -> list[Step]:
        """``content`` as the output of ``d``'s delegate call (the thinker's context)."""
        item = ev.ItemParam(type="function_call_output", call_id=d.call_id, output=content)
        return list(self.core.on_client_event(ev.ConversationItemCreate(item=item), now_ms))

    # ------------------------------------------------------------------ responses mode
    def backend_event(self, e: LiveResponseItemCreate | LiveResponseCreate) -> list[Step]:
        """``response.item.create`` (a function's output) or ``response.create`` (go on)."""
        if self.target != "responses":
            raise ProtocolError(
                "invalid_state",
                f"{type(e).__struct_config__.tag} requires responses delegation",
                param="type",
            )
        runs = [d for d in self.by_id.values() if d.backend is not None]
        if isinstance(e, LiveResponseItemCreate):
            call_id, output = function_output(e.item)
            d = next((d for d in runs if d.backend and call_id in d.backend.pending), None)
            if d is None or d.backend is None:
                raise ProtocolError(
                    "invalid_value", f"no function call {call_id} is waiting", param="item.call_id"
                )
            d.backend.output(call_id, output)
            return []
        ready = [d for d in runs if d.backend is not None and d.backend.ready()]
        if not ready:
            if any(d.backend is not None and d.backend.waiting for d in runs):
                raise ProtocolError(
                    "function_call_outputs_required",
                    "send a function_call_output (response.item.create) for every call first",
                )
            raise ProtocolError("invalid_state", "no delegation waits for response.create")
        out: list[Step] = []
        for d in ready:
            assert d.backend is not None
            job, events = d.backend.start()
            out += [Send(LiveResponseEvent(event=x, delegation_id=d.id)) for x in events]
            out.append(RunBackend(d.id, job))
        return out

    def on_backend(self, delegation_id: str, item: BatchItem, now_ms: float) -> list[Step]:
        """One item of a backend model call's stream."""
        d = self.by_id.get(delegation_id)
        if d is None or d.backend is None or d.done:
            return []
        events, finished = d.backend.item(item)
        out: list[Step] = [Send(LiveResponseEvent(event=x, delegation_id=d.id)) for x in events]
        if finished is not None and finished.text is not None:
            out += self.finished(d, finished.text, now_ms)
        elif finished is not None and not finished.calls:  # an invalid call: it failed
            out += self.finished(d, "The helper could not finish the task.", now_ms)
        return out

    def backend_failed(
        self, delegation_id: str, code: str, message: str, now_ms: float
    ) -> list[Step]:
        """A backend model call failed (the engine refused it, or it broke off)."""
        d = self.by_id.get(delegation_id)
        if d is None or d.backend is None or d.done:
            return []
        events = d.backend.failed(code, message)
        out: list[Step] = [Send(LiveResponseEvent(event=x, delegation_id=d.id)) for x in events]
        note = f"The helper could not finish the task: {message}"
        return [*out, *self.finished(d, note, now_ms)]

    def finished(self, d: Delegation, text: str, now_ms: float) -> list[Step]:
        """The backend's answer is the delegation's result: the thinker's context, then
        said when the floor is free."""
        d.done = True
        self.floor.cancel_acks()
        out = self.result_item(d, text, now_ms)
        self.floor.add(Line(now_ms, (ev.ResponseCreate(),), delegation_id=d.id))
        return out


def respond(instructions: str) -> ev.ResponseCreate:
    """A ``response.create`` with these instructions and no function call."""
    return ev.ResponseCreate(
        response=ev.ResponseParam(instructions=instructions, tool_choice="none")
    )
