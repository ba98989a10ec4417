"""A responses-mode delegation's backend run (sans-I/O): the second model call the server
makes for a delegated task, and the Responses streaming events it becomes.

The backend is a chat job on the engine (:class:`~duplex_contract.batch.ChatJob`: the
route ``server.live.backend_route``, by default the session's own ``text`` route, or one
with an LLM stage of its own) with the delegation's backend instructions and function
tools. Each model call is one Responses response; :class:`BackendRun` turns its stream into
the events OpenAI's Responses API streams, each wrapped by the adapter in a
``response.event{delegation_id, event}``:

* ``response.created`` (``status: in_progress``);
* a text answer: ``response.output_item.added`` (a ``message``),
  ``response.content_part.added``, ``response.output_text.delta`` per piece,
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``;
* a function call: ``response.output_item.added`` (a ``function_call``),
  ``response.function_call_arguments.delta`` and ``.done``, ``response.output_item.done``;
* ``response.completed`` with ``usage`` (the backend's tokens), or ``response.failed``.

Lifecycle snapshots (``response.created`` / ``.completed`` / ``.failed``) carry no
``output``, ``instructions``, ``tools`` or ``input`` (as OpenAI's Live service strips them):
read items from ``response.output_item.done``. A function call is the application's: the
run waits until every call of the response has a ``function_call_output``
(``response.item.create``) and the client sends ``response.create``; the next model call
sees each call and its result (a system note, as the engine's history shows results).
A text answer ends the run: it is the delegation's result.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplex_contract.batch import BatchDone, BatchItem, CallOut, ChatJob, ChatMessage, TextOut
from duplex_contract.tools import ToolCallError, check_call, tool_result_note, tools_prompt
from duplex_server.protocol.errors import ProtocolError
from duplex_server.protocol.live_config import Backend

#: what the backend is told when no ``delegation.responses.instructions`` are given
DEFAULT_BACKEND_INSTRUCTIONS = (
    "You are the helper of a voice assistant. Do the task you are given and answer with the "
    "result in one or two short sentences the assistant can say aloud."
)
#: after a function's result, the last words of the backend's prompt
RESULT_HINT = "Answer the task with this result in one or two sentences."


@dataclass(frozen=True, slots=True)
class Finished:
    """The model call ended: ``text`` (the result, the run is over) or ``calls`` (the run
    waits for their outputs)."""

    text: str | None
    calls: tuple[tuple[str, str, str], ...] = ()  # (call_id, name, arguments)


@dataclass(slots=True)
class _Response:
    id: str
    seq_start: int
    text: list[str] = field(default_factory=list)
    call: list[str] = field(default_factory=list)
    msg_id: str | None = None


class BackendRun:
    """One delegation's backend conversation and the response in progress."""

    def __init__(
        self,
        task: str,
        backend: Backend,
        *,
        route: str,
        new_id: Callable[[str], str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.route = route
        self._new_id = new_id
        self._clock = clock
        system = backend.instructions.strip() or DEFAULT_BACKEND_INSTRUCTIONS
        tools = backend.tools if backend.tool_choice != "none" else ()
        if backend.tool_choice == "function":
            tools = tuple(t for t in tools if t.name == backend.tool_name)
        self.tools = tools
        if tools:
            system = f"{system}\n\n{tools_prompt(tools, self.required)}"
        self.messages: list[ChatMessage] = [
            ChatMessage(role="system", content=system),
            ChatMessage(role="user", content=task),
        ]
        self.seq = 0
        self.current: _Response | None = None
        #: calls of the last response: call_id -> (name, arguments, output or None)
        self.pending: dict[str, tuple[str, str, str | None]] = {}
        self.rounds = 0  # model calls made

    @property
    def required(self) -> bool:
        return self.backend.tool_choice in ("required", "function")

    @property
    def waiting(self) -> bool:
        """The run waits for the application's function outputs (and ``response.create``)."""
        return self.current is None and bool(self.pending)

    def ready(self) -> bool:
        """Every pending call has its output: ``response.create`` goes on."""
        return bool(self.pending) and all(out is not None for _, _, out in self.pending.values())

    # ------------------------------------------------------------------ one model call
    def start(self) -> tuple[ChatJob, list[dict[str, Any]]]:
        """The next model call (the results of the last one's calls added) and its
        ``response.created``."""
        notes = [
            tool_result_note(name, args, out or "") for name, args, out in self.pending.values()
        ]
        if notes:
            self.messages.append(
                ChatMessage(role="system", content="\n".join([*notes, RESULT_HINT]))
            )
        self.pending = {}
        self.rounds += 1
        resp = _Response(self._new_id("resp"), self.seq)
        self.current = resp
        job = ChatJob(
            messages=tuple(self.messages),
            max_tokens=self.backend.max_output_tokens,
            tools=self.tools,
            tool_required=self.required and self.rounds == 1,
            route=self.route,
        )
        return job, [self._event("response.created", response=self._snapshot(resp, "in_progress"))]

    def item(self, item: BatchItem) -> tuple[list[dict[str, Any]], Finished | None]:
        """One item of the model call's stream: the events it makes, and how the call
        ended once it has (``BatchDone``)."""
        resp = self.current
        if resp is None:
            return [], None
        if isinstance(item, TextOut):
            return self._text(resp, item.text), None
        if isinstance(item, CallOut):
            resp.call.append(item.text)
            return [], None
        if isinstance(item, BatchDone):
            return self._done(resp, item)
        return [], None

    def failed(self, code: str, message: str) -> list[dict[str, Any]]:
        """The model call failed: ``response.failed``; the run is over."""
        resp = self.current
        self.current = None
        self.pending = {}
        if resp is None:
            return []
        snap = self._snapshot(resp, "failed")
        snap["error"] = {"code": code, "message": message}
        return [self._event("response.failed", response=snap)]

    def output(self, call_id: str, output: str) -> None:
        """The application's ``function_call_output`` for ``call_id``."""
        call = self.pending.get(call_id)
        if call is None:
            raise ProtocolError(
                "invalid_value", f"no function call {call_id} is waiting", param="item.call_id"
            )
        self.pending[call_id] = (call[0], call[1], output)

    # ------------------------------------------------------------------ internals
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _snapshot(self, resp: _Response, status: str) -> dict[str, Any]:
        return {
            "id": resp.id,
            "object": "response",
            "created_at": int(self._clock()),
            "status": status,
            "model": self.backend.model,
            "output": [],
        }

    def _text(self, resp: _Response, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if resp.msg_id is None:
            resp.msg_id = self._new_id("msg")
            item = {
                "id": resp.msg_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self._event("response.output_item.added", output_index=0, item=item))
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=resp.msg_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                )
            )
        resp.text.append(text)
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=resp.msg_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _done(
        self, resp: _Response, done: BatchDone
    ) -> tuple[list[dict[str, Any]], Finished | None]:
        self.current = None
        out: list[dict[str, Any]] = []
        finished: Finished
        if resp.call:
            try:
                call = check_call("".join(resp.call), self.tools)
            except ToolCallError as exc:
                return self.failed_after(resp, "invalid_tool_call", str(exc)), Finished(None)
            call_id = self._new_id("call")
            out += self._call_events(call_id, call.name, call.arguments)
            self.pending = {call_id: (call.name, call.arguments, None)}
            finished = Finished(None, ((call_id, call.name, call.arguments),))
        else:
            text = "".join(resp.text)
            if resp.msg_id is not None:
                out += self._text_done(resp.msg_id, text)
            finished = Finished(text)
        snap = self._snapshot(resp, "completed")
        total = done.prompt_tokens + done.completion_tokens
        snap["usage"] = {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total,
        }
        out.append(self._event("response.completed", response=snap))
        return out, finished

    def failed_after(self, resp: _Response, code: str, message: str) -> list[dict[str, Any]]:
        self.current = resp
        return self.failed(code, message)

    def _text_done(self, msg_id: str, text: str) -> list[dict[str, Any]]:
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _call_events(self, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        fc_id = self._new_id("fc")
        item: dict[str, Any] = {
            "id": fc_id,
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        where = {"item_id": fc_id, "output_index": 0}
        return [
            self._event("response.output_item.added", output_index=0, item=dict(item)),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
            self._event(
                "response.function_call_arguments.done", **where, name=name, arguments=arguments
            ),
            self._event(
                "response.output_item.done",
                output_index=0,
                item={**item, "arguments": arguments, "status": "completed"},
            ),
        ]


def function_output(item: dict[str, Any]) -> tuple[str, str]:
    """``(call_id, output)`` of a ``response.item.create`` item; only
    ``function_call_output`` items are taken (output text, or JSON of structured output)."""
    if item.get("type") != "function_call_output":
        raise ProtocolError(
            "unsupported",
            "only function_call_output items can be added to a delegation's backend",
            param="item.type",
        )
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ProtocolError(
            "missing_required_parameter", "call_id is required", param="item.call_id"
        )
    output = item.get("output")
    if output is None:
        raise ProtocolError("missing_required_parameter", "output is required", param="item.output")
    return call_id, output if isinstance(output, str) else json.dumps(output)
