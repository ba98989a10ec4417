"""The layering rule: the protocol core and the SDK import no engine module, the audio kit
imports neither side, the server reaches the engine only through its public API, and the
stage backends import nothing of the control side nor of the orchestration; and the rooms'
rules: the session runtime, the batch routes and operations import no transport, the
orchestration no engine client, the route machinery nothing of the orchestration, the
control plane neither a client nor a stage, the engine no server module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

from duplex_contract.session_events import SessionEvent
from tools.import_boundary import (
    ENGINE_PUBLIC,
    SESSION_EVENTS,
    STAGE_PIPELINE,
    check,
    main,
)

ROOT = Path(__file__).resolve().parents[2]


def _copy_layers(tmp: Path) -> Path:
    for rel in (
        "duplex_contract",
        "duplex_server",
        "clients/duplex_client",
        "audio_kit",
        "engine",
    ):
        shutil.copytree(ROOT / rel, tmp / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


def _plant(root: Path, rel: str, code: str) -> None:
    """Append ``code`` to a file inside a function, where a module-level scan would miss it."""
    target = root / rel
    body = "".join(f"    {line}\n" for line in code.splitlines())
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n{body}")


def _reported(errors: str, rel: str, text: str) -> bool:
    """Whether one line of ``errors`` is about ``rel`` and ends with ``text`` exactly."""
    return any(rel in line.split(":")[0] and line.endswith(text) for line in errors.splitlines())


def test_the_repository_keeps_the_rule() -> None:
    assert check(ROOT) == []
    assert main(["import_boundary", str(ROOT)]) == 0


def test_a_planted_engine_import_in_the_core_fails(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    assert check(root) == []
    target = root / "duplex_server/protocol/machine.py"
    # hidden inside a function, where a module-level scan would miss it
    target.write_text(
        target.read_text() + "\n\ndef _sneaky() -> None:\n    from engine.errors import X\n"
    )
    errors = check(root)
    assert len(errors) == 1 and "protocol/machine.py" in errors[0]
    assert "the protocol core imports engine.errors" in errors[0]
    assert main(["import_boundary", str(root)]) == 1


def test_planted_violations_in_the_sdk_and_the_contract_fail(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    sdk = root / "clients/duplex_client/client.py"
    sdk.write_text(sdk.read_text() + "\nimport engine.messages\n")
    contract = root / "duplex_contract/fence.py"
    contract.write_text(contract.read_text() + "\nfrom duplex_server.protocol import events\n")
    core = root / "duplex_server/protocol/codec.py"  # the core may not reach the adapters
    core.write_text(core.read_text() + "\nfrom ..session import input_lane\n")
    errors = "\n".join(check(root))
    assert "client SDK imports engine.messages" in errors
    assert "contract imports duplex_server.protocol" in errors
    assert "protocol core imports duplex_server.session" in errors


def test_importing_the_sdk_and_the_core_loads_no_engine_module() -> None:
    code = (
        "import sys, duplex_client, duplex_client.cli, duplex_server.protocol.machine;"
        "bad = sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_planted_import_of_either_side_in_the_audio_kit_fails(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "audio_kit/pcm.py", "import engine.messages")
    _plant(root, "audio_kit/vad.py", "from duplex_server import turns")
    _plant(root, "audio_kit/echo.py", "from duplex_contract.audio import INPUT_RATE")  # allowed
    errors = check(root)
    assert len(errors) == 2, errors
    assert errors[0].startswith("audio_kit/pcm.py:")
    assert errors[0].endswith("the audio kit imports engine.messages")
    assert errors[1].startswith("audio_kit/vad.py:")
    assert errors[1].endswith("the audio kit imports duplex_server")


def test_the_server_reaches_the_engine_only_through_its_public_api(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    assert check(root) == []
    _plant(root, "duplex_server/session/input_lane.py", "from engine.messages import AsrRequest")
    _plant(
        root, "duplex_server/transports/media.py", "from engine.orchestration import orchestrator"
    )
    _plant(root, "duplex_server/http/routes.py", "import engine.stages.sim")
    _plant(root, "duplex_server/app.py", "from engine.pipeline.pipeline import Pipeline")
    _plant(root, "duplex_server/auth.py", "from engine.pipeline.chunkers import Chunk")
    # the public API is fine
    _plant(
        root, "duplex_server/session/output_audio.py", "from engine.api.client import AsyncEngine"
    )
    _plant(root, "duplex_server/session/hub.py", "from engine import voices")
    _plant(root, "duplex_server/config.py", "from engine.pipeline.graph import build_graph")
    errors = "\n".join(check(root))
    assert (
        "duplex_server/session/input_lane.py" in errors
        and "server imports engine.messages" in errors
    )
    # (no module of the orchestration is public now: its package is the first name refused)
    assert _reported(errors, "transports/media.py", "server imports engine.orchestration")
    assert "server imports engine.stages.sim" in errors
    assert "server imports engine.pipeline.pipeline" in errors
    assert "auth.py" in errors and "server imports engine.pipeline.chunkers" in errors
    for fine in ("output_audio.py", "hub.py", "config.py"):
        assert fine not in errors
    assert len(errors.splitlines()) == 5


def test_the_core_keeps_its_stricter_rule_inside_the_server(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "duplex_server/protocol/input.py", "from engine.api.client import AsyncEngine")
    errors = check(root)
    # reported once, by the core's rule (the server's rule leaves the core to it)
    assert errors == [errors[0]] and "the protocol core imports engine.api.client" in errors[0]


def test_stage_backends_import_no_control_messages(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "engine/stages/sim.py", "from duplex_contract.control import OpenCall")
    _plant(
        root, "engine/stages/tts_piper.py", "from duplex_contract.session_events import AudioChunk"
    )
    _plant(root, "engine/stages/asr_whisper.py", "from engine.messages import ControlRequest")
    _plant(root, "engine/stages/base.py", "from engine.duplex import control_plane")
    # stage messages, errors in transit and batch items are fine
    _plant(root, "engine/stages/testing.py", "from duplex_contract.session_events import ErrorInfo")
    _plant(root, "engine/stages/tts_espeak.py", "from engine.messages import StageDone")
    _plant(root, "engine/stages/codec_snac.py", "from duplex_contract.batch import AudioOut")
    errors = "\n".join(check(root))
    assert "stage backends imports duplex_contract.control" in errors
    assert "stage backends imports duplex_contract.session_events.AudioChunk" in errors
    assert "stage backends imports engine.messages.ControlRequest" in errors
    assert "stage backends imports engine.duplex" in errors
    for fine in ("testing.py", "tts_espeak.py", "codec_snac.py"):
        assert fine not in errors
    assert len(errors.splitlines()) == 4


def test_the_session_events_the_rule_names_are_the_contracts() -> None:
    members = {f"duplex_contract.session_events.{t.__name__}" for t in get_args(SessionEvent)}
    assert set(SESSION_EVENTS) == members | {"duplex_contract.session_events.SessionEvent"}


def test_the_public_engine_modules_exist_and_lint_runs_the_check() -> None:
    for name in ENGINE_PUBLIC:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.import_boundary" in lint
    assert "audio_kit" in lint  # ruff covers the kit
    typecheck = makefile.split("\ntypecheck:", 1)[1].split("\n\n", 1)[0]
    assert "mypy --strict audio_kit" in typecheck


def test_the_session_runtime_and_the_core_drive_no_transport(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "duplex_server/session/live.py", "from duplex_server.transports import media")
    _plant(root, "duplex_server/session/hub.py", "import duplex_server.transports.realtime")
    _plant(root, "duplex_server/protocol/items.py", "from ..transports.webrtc import X")
    _plant(root, "duplex_server/session/writer.py", "from duplex_server.ops import metrics")  # ok
    errors = check(root)
    assert len(errors) == 3, errors
    assert errors[0].startswith("duplex_server/protocol/items.py:")
    assert errors[0].endswith("the protocol core imports duplex_server.transports.webrtc")
    assert errors[1].startswith("duplex_server/session/hub.py:")
    assert errors[1].endswith("the session runtime imports duplex_server.transports.realtime")
    assert errors[2].startswith("duplex_server/session/live.py:")
    assert errors[2].endswith("the session runtime imports duplex_server.transports")


def test_the_batch_routes_and_operations_import_no_transport(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "duplex_server/http/codecs.py", "from duplex_server.transports import twilio")
    _plant(root, "duplex_server/http/batch_api.py", "from duplex_server.session import hub")
    _plant(root, "duplex_server/ops/drain.py", "from duplex_server.transports.media import M")
    _plant(root, "duplex_server/ops/metrics.py", "from duplex_server.session import hub")  # ok
    errors = "\n".join(check(root))
    assert (
        "http/codecs.py" in errors and "the batch routes imports duplex_server.transports" in errors
    )
    assert "http/batch_api.py" in errors and "batch routes imports duplex_server.session" in errors
    assert "ops/drain.py" in errors and "the operations imports duplex_server.transports" in errors
    assert "metrics.py" not in errors and len(errors.splitlines()) == 3


def test_the_orchestration_and_the_control_plane_call_no_engine_client(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "engine/orchestration/responder.py", "from engine.api.client import AsyncEngine")
    _plant(root, "engine/duplex/control_plane.py", "from engine.api import remote")
    _plant(root, "engine/duplex/lease.py", "from engine.stages.backends import BACKENDS")
    _plant(root, "engine/startup.py", "from duplex_server import app")
    _plant(root, "engine/pipeline/graph.py", "from engine.stages import backends")  # ok
    errors = "\n".join(check(root))
    assert "responder.py" in errors and "the orchestration imports engine.api.client" in errors
    assert "duplex/control_plane.py" in errors and "the control plane imports engine.api" in errors
    assert "duplex/lease.py" in errors and "the control plane imports engine.stages" in errors
    assert "engine/startup.py" in errors and "the engine imports duplex_server" in errors
    assert "graph.py" not in errors and len(errors.splitlines()) == 4


def test_the_route_machinery_imports_nothing_of_the_orchestration(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "engine/pipeline/pipeline.py", "from engine.orchestration import scheduling")
    _plant(root, "engine/pipeline/graph.py", "from engine.api.client import AsyncEngine")
    _plant(root, "engine/pipeline/chunkers.py", "from engine.duplex import lease")
    _plant(
        root, "engine/pipeline/segmenter.py", "from duplex_contract.session_events import TextDelta"
    )
    # the stages, stage messages and batch items are fine
    _plant(root, "engine/pipeline/__init__.py", "from engine.stages import backends")
    _plant(root, "engine/pipeline/pipeline.py", "from duplex_contract.batch import TextOut")
    errors = check(root)
    assert [e.split(":")[0] for e in errors] == [
        "engine/pipeline/chunkers.py",
        "engine/pipeline/graph.py",
        "engine/pipeline/pipeline.py",
        "engine/pipeline/segmenter.py",
    ], errors
    assert errors[0].endswith("the route machinery imports engine.duplex")
    assert errors[1].endswith("the route machinery imports engine.api.client")
    assert errors[2].endswith("the route machinery imports engine.orchestration")
    assert errors[3].endswith(
        "the route machinery imports duplex_contract.session_events.TextDelta"
    )


def test_stage_backends_import_no_orchestration_and_of_the_pipeline_only_chunkers(
    tmp_path: Path,
) -> None:
    root = _copy_layers(tmp_path)
    _plant(root, "engine/stages/sim.py", "from engine.orchestration import orchestrator")
    _plant(root, "engine/stages/tts_espeak.py", "import engine.orchestration.scheduling")
    _plant(root, "engine/stages/pool.py", "from engine.pipeline.pipeline import Pipeline")
    _plant(root, "engine/stages/codec_snac.py", "from engine.pipeline import graph")
    # the chunkers and the stages' own modules are fine
    _plant(root, "engine/stages/tts_piper.py", "from engine.stages import compute, edges")
    _plant(root, "engine/stages/base.py", "from engine.pipeline.chunkers import Chunk")
    errors = "\n".join(check(root))
    assert _reported(errors, "stages/sim.py", "stage backends imports engine.orchestration")
    assert (
        "tts_espeak.py" in errors
        and "stage backends imports engine.orchestration.scheduling" in errors
    )
    assert "pool.py" in errors and "stage backends imports engine.pipeline.pipeline" in errors
    assert "codec_snac.py" in errors and "stage backends imports engine.pipeline.graph" in errors
    assert "tts_piper.py" not in errors and "base.py" not in errors
    assert len(errors.splitlines()) == 4
    for name in STAGE_PIPELINE:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name
