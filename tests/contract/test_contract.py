"""The contract module: settings and their patch, audio durations, errors in transit,
msgspec errors read once, and the engine's side of it (rate check, settings replace)."""

from __future__ import annotations

import threading

import msgspec
import pytest

from duplex_contract.audio import INPUT_RATE, duration_ms, input_bytes, input_ms
from duplex_contract.control import AppendCall, OpenCall, SignalCall
from duplex_contract.errors import ControlError, EngineDeadError, StageError
from duplex_contract.session_events import ErrorInfo
from duplex_contract.settings import PATCH_FIELDS, SessionSettings, SessionUpdate
from duplex_contract.validation import explain
from engine.config import DuplexRuntimeConfig
from engine.duplex.control_plane import DuplexControl


def test_input_format_durations() -> None:
    assert INPUT_RATE == 16000
    assert input_ms(32) == 1.0 and input_ms(640) == 20.0
    assert duration_ms(4800, 24000) == 100.0
    assert input_bytes(20.0) == 640 and input_bytes(0.03) == 0  # whole samples only


def test_patch_fields_are_the_settings_fields() -> None:
    patch = set(SessionUpdate.__struct_fields__) - {"settings"}
    assert (
        patch
        == set(PATCH_FIELDS)
        == set(SessionSettings.__struct_fields__) - {"output_sample_rate"}
    )


def test_patch_changes_only_given_fields_and_replace_lifts_a_limit() -> None:
    base = SessionSettings(instructions="a", max_output_tokens=10, output_sample_rate=16000)
    patched = SessionUpdate(instructions="b").apply(base)
    assert patched == SessionSettings(
        instructions="b", max_output_tokens=10, output_sample_rate=16000
    )
    # a patch cannot say "no limit" (None means untouched); a replace can
    assert SessionUpdate(max_output_tokens=None).apply(base).max_output_tokens == 10
    lifted = SessionUpdate.replace_with(SessionSettings(instructions="b")).apply(base)
    assert lifted.max_output_tokens is None


def test_errors_round_trip_through_error_info() -> None:
    for exc in (ControlError("x", code="stale_fence"), StageError("y"), EngineDeadError("z")):
        info = msgspec.msgpack.decode(
            msgspec.msgpack.encode(ErrorInfo.from_exc(exc)), type=ErrorInfo
        )
        back = info.to_exc()
        assert type(back) is type(exc) and back.code == exc.code and back.message == exc.message
    assert ErrorInfo.from_exc(EngineDeadError("z")).fatal


class _Obj(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class _Outer(msgspec.Struct):
    items: list[_Obj]


@pytest.mark.parametrize(
    ("data", "kind", "at", "path"),
    [
        ({"items": [{"name": 1}]}, "invalid", "items.0.name", "items.0.name"),
        ({"items": [{"name": "a", "x": 1}]}, "unknown", "items.0", "items.0.x"),
        ({"items": [{}]}, "missing", "items.0", "items.0.name"),
    ],
)
def test_validation_errors_are_read_once(data: object, kind: str, at: str, path: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(data, _Outer)
    problem = explain(info.value)
    assert (problem.kind, problem.at, problem.path) == (kind, at, path)
    assert " - at " not in problem.message


def _open(control: DuplexControl) -> AppendCall:
    res, _ = control.handle(OpenCall(), 1, 0.0)
    assert res.ok and res.accepted_fence is not None
    return AppendCall(fence=res.accepted_fence, lease_generation=1, audio=b"\0\0" * 16)


def test_the_engine_refuses_input_audio_at_another_rate() -> None:
    control = DuplexControl(DuplexRuntimeConfig())
    call = _open(control)
    assert control.handle(call, 2, 0.0)[0].ok
    res, _ = control.handle(msgspec.structs.replace(call, sample_rate=24000), 3, 0.0)
    assert not res.ok and res.error is not None and res.error.code == "invalid_argument"


def test_the_engine_applies_a_settings_replace() -> None:
    control = DuplexControl(DuplexRuntimeConfig())
    call = _open(control)
    sid = call.fence.session_id
    control.handle(
        SignalCall(
            fence=call.fence,
            lease_generation=1,
            event="session.update",
            update=SessionUpdate(max_output_tokens=5, instructions="x"),
        ),
        2,
        0.0,
    )
    assert control.sessions[sid].config.max_output_tokens == 5
    new = SessionSettings(instructions="y", output_modalities=("text",))
    control.handle(
        SignalCall(
            fence=call.fence,
            lease_generation=1,
            event="session.update",
            update=SessionUpdate.replace_with(new),
        ),
        3,
        0.0,
    )
    assert control.sessions[sid].config == new


def test_counts_is_safe_while_sessions_open_and_close() -> None:
    control = DuplexControl(DuplexRuntimeConfig(max_sessions=10_000))
    stop = threading.Event()
    failures: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                control.counts()
            except BaseException as exc:  # a dict resized during iteration
                failures.append(exc)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            res, _ = control.handle(OpenCall(), i, 0.0)
            assert res.session_id is not None
            if i % 2:
                control.finish_close(res.session_id)
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert sum(control.counts().values()) == 1500
