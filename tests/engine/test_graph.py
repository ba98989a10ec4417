"""The stage graph from config: named stages, typed edges, routes, devices, and each refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from duplex_contract.control import AppendCall, CommitCall, OpenCall, SignalCall
from duplex_contract.errors import ConfigError, StageError
from engine.config import engine_config, load_engine_config
from engine.pipeline.graph import build_graph
from engine.stages.edges import Edge
from engine.stages.testing import TestStage

ROOT = Path(__file__).resolve().parents[2]
CASCADE = {
    "stages": {
        "asr": {"backend": "test"},
        "llm": {"backend": "test"},
        "tts": {"backend": "test"},
    },
    "routes": {
        "voice": ["asr", "llm", "tts"],
        "text": ["asr", "llm"],
        "speech": ["tts"],
        "transcribe": ["asr"],
    },
}


def cfg(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "stages": {k: dict(v) for k, v in CASCADE["stages"].items()},
        "routes": dict(CASCADE["routes"]),
    }
    for key, value in changes.items():
        if key in ("stages", "routes"):
            out[key].update(value)
        else:
            out[key] = value
    return out


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        build_graph(engine_config(data))
    return str(info.value)


def test_every_shipped_config_builds_its_graph_without_loading_models() -> None:
    for name in ("cpu.yaml", "test.yaml"):
        graph = build_graph(load_engine_config(ROOT / "configs" / name))
        assert set(graph.routes) == {"voice", "text", "speech", "transcribe"}
        voice = graph.routes["voice"]
        assert [s.name for s in voice.inputs] == ["asr"]
        assert voice.responder is not None and voice.responder.name == "llm"
        assert [s.name for s in voice.outputs] == ["tts"]
        assert voice.consumes is Edge.AUDIO and voice.emits is Edge.AUDIO
        assert graph.routes["text"].emits is Edge.TEXT and not graph.routes["text"].outputs
    # raw yaml of the vLLM configs has the same routes (their backends need the vLLM venv)
    for name in ("cpu-vllm.yaml", "gpu-vllm.yaml"):
        raw = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert engine_config(raw["engine"]).routes["voice"] == ("asr", "llm", "tts")


def test_a_stage_with_another_name_and_a_four_stage_route() -> None:
    data = cfg(
        stages={
            "thinker": {"backend": "test", "options": {"role": "llm"}},
            "talker": {"backend": "test"},
            "code2wav": {"backend": "test", "options": {"role": "codec"}},
        },
        routes={"voice": ["asr", "thinker", "talker", "code2wav"]},
    )
    graph = build_graph(engine_config(data))
    voice = graph.routes["voice"]
    assert voice.describe() == (
        "asr(audio -> text) -> thinker(text -> text) -> talker(text -> codec) -> "
        "code2wav(codec -> audio)"
    )
    assert [s.name for s in voice.outputs] == ["talker", "code2wav"]
    assert voice.accepts_text


def test_old_form_config_says_how_to_migrate() -> None:
    text = refused({"stages": CASCADE["stages"]})
    assert text.startswith("engine.routes: missing")
    assert "voice: [asr, llm, tts]" in text and "transcribe: [asr]" in text


def test_unknown_backend_is_refused_with_the_known_ones() -> None:
    text = refused(cfg(stages={"tts": {"backend": "nope"}}))
    assert text.startswith("engine.stages.tts.backend: unknown backend 'nope'")
    assert "whisper" in text and "piper" in text


def test_bad_edge_names_route_stage_and_field() -> None:
    text = refused(cfg(routes={"voice": ["asr", "tts", "llm"]}))
    assert text.startswith("engine.routes.voice: stage 'llm' (backend test) consumes text")
    assert "'tts' (backend test), emits audio" in text
    assert "engine.stages.llm.backend" in text


def test_route_naming_a_missing_stage() -> None:
    text = refused(cfg(routes={"voice": ["asr", "llm", "tts2"]}))
    assert text == (
        "engine.routes.voice: stage 'tts2' is not defined in engine.stages (defined: asr, llm, tts)"
    )


def test_devices_must_be_one_per_replica() -> None:
    text = refused(cfg(stages={"asr": {"backend": "test", "replicas": 2, "devices": ["cpu"]}}))
    assert text == (
        "engine.stages.asr.devices: 1 entries for 2 replicas; give one device per replica"
    )
    text = refused(cfg(stages={"asr": {"backend": "test", "devices": ["gpu"]}}))
    assert text.startswith("engine.stages.asr.devices[0]: 'gpu' is not a device")


def test_a_gpu_where_the_backend_cannot_use_one_or_none_exists() -> None:
    text = refused(cfg(stages={"tts": {"backend": "test", "devices": ["cuda:0"]}}))
    assert (
        text
        == "engine.stages.tts.devices[0]: backend 'test' cannot run on 'cuda:0' (it runs on: cpu)"
    )
    import ctranslate2

    if ctranslate2.get_cuda_device_count() > 0:
        pytest.skip("this machine has a GPU: the no-GPU refusal cannot be shown")
    text = refused(
        cfg(stages={"asr": {"backend": "whisper", "replicas": 2, "devices": ["cpu", "cuda:0"]}})
    )
    assert text == (
        "engine.stages.asr.devices[1]: 'cuda:0' requested, but backend 'whisper' sees "
        "0 CUDA device(s) on this machine"
    )


def test_auto_device_resolves_per_replica() -> None:
    data = cfg(stages={"asr": {"backend": "whisper", "replicas": 2}})
    graph = build_graph(engine_config(data))
    import ctranslate2

    want = "cuda:0" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    assert [getattr(r, "device", None) for r in graph.replicas["asr"]] == [want, want]
    assert [r.name for r in graph.replicas["asr"]] == ["asr0", "asr1"]


def test_unknown_backend_option_names_the_stage() -> None:
    text = refused(cfg(stages={"asr": {"backend": "whisper", "options": {"beam": 2}}}))
    assert text.startswith("engine.stages.asr.options.beam: Object contains unknown field")


@pytest.mark.parametrize(
    ("routes", "start"),
    [
        ({"voice": ["asr", "tts"]}, "engine.routes.voice: needs a responder"),
        ({"text": ["asr", "llm", "tts"]}, "engine.routes.text: must end in text"),
        ({"speech": ["asr", "llm", "tts"]}, "engine.routes.speech: must start with a stage"),
        ({"transcribe": ["asr", "llm"]}, "engine.routes.transcribe: must turn audio into text"),
        ({"voice": ["llm", "llm2", "tts"]}, "engine.routes.voice: stage 'llm2'"),
    ],
)
def test_route_duties_are_checked(routes: dict[str, list[str]], start: str) -> None:
    data = cfg(stages={"llm2": {"backend": "test", "options": {"role": "llm"}}}, routes=routes)
    assert refused(data).startswith(start)


def test_the_test_backend_needs_a_role_unless_named_after_one() -> None:
    text = refused(cfg(stages={"helper": {"backend": "test"}}))
    assert text.startswith("engine.stages.helper.options.role: the test backend needs a role")


def test_stage_names_and_empty_routes() -> None:
    assert refused(cfg(stages={"a/b": {"backend": "test"}})).startswith("engine.stages.a/b:")
    assert refused(cfg(routes={"voice": []})) == (
        "engine.routes.voice: a route names at least one stage"
    )
    assert refused(cfg(routes={"voice": ["asr", "asr"]})) == (
        "engine.routes.voice: a stage appears twice in one route"
    )
    assert refused(cfg(routes={"voice": 3})).startswith("engine.routes.voice: Expected `array`")


def test_missing_route_fails_the_work_that_needs_it_by_name() -> None:
    data = cfg()
    data["routes"] = {"voice": ["asr", "llm", "tts"]}
    graph = build_graph(engine_config(data))
    with pytest.raises(StageError) as info:
        graph.route("speech")
    assert info.value.code == "route_unavailable"
    assert "no 'speech' route, needed for /v1/audio/speech" in str(info.value)


def test_overrides_keep_their_declared_edges() -> None:
    from engine.stages.testing import TestStageOptions

    talker = TestStage(TestStageOptions(role="talker"), "tts")
    graph_cfg = engine_config(cfg())
    with pytest.raises(ConfigError, match=r"engine.routes.voice: must end in audio"):
        build_graph(graph_cfg, {"tts": [talker]})


@pytest.mark.usefixtures("transport")
def test_work_on_a_missing_route_fails_clearly_and_the_session_goes_on() -> None:
    import asyncio

    from duplex_contract.batch import SpeechJob
    from duplex_contract.session_events import ResponseDone
    from duplex_contract.settings import SessionSettings
    from tests.engine.conftest import collect, open_engine

    async def main() -> None:
        data = cfg()
        data["routes"] = {"voice": ["asr", "llm", "tts"]}  # no text, speech, transcribe
        engine = await open_engine(engine_config(data))
        try:
            res = await engine.call(OpenCall(config=SessionSettings(output_modalities=("text",))))
            assert res.session_id and res.accepted_fence
            await engine.call(AppendCall(fence=res.accepted_fence, lease_generation=1, text="hi"))
            await engine.call(CommitCall(fence=res.accepted_fence, lease_generation=1))
            events = await collect(engine, res.session_id, lambda e: isinstance(e, ResponseDone))
            done = events[-1]
            assert isinstance(done, ResponseDone) and done.status == "failed"
            assert done.reason == "route_unavailable" and done.error is not None
            assert "no 'text' route" in done.error.message
            with pytest.raises(StageError) as info:
                async for _ in engine.generate(SpeechJob(text="hello")):
                    pass
            assert info.value.code == "route_unavailable"
            # the same session, switched to audio output, is answered on the voice route
            from duplex_contract.settings import SessionUpdate

            fence = done.fence
            await engine.call(
                SignalCall(
                    fence=fence,
                    lease_generation=1,
                    event="session.update",
                    update=SessionUpdate(output_modalities=("audio",)),
                )
            )
            await engine.call(AppendCall(fence=fence, lease_generation=1, text="again"))
            await engine.call(CommitCall(fence=fence, lease_generation=1))
            events = await collect(engine, res.session_id, lambda e: isinstance(e, ResponseDone))
            assert isinstance(events[-1], ResponseDone) and events[-1].status == "completed"
        finally:
            await engine.shutdown()

    asyncio.run(main())
