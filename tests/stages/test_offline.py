"""Every embedded model loads and runs with the network cut off (nothing fetched at run time).

A subprocess blocks every outbound connection and name lookup (any attempt raises), points
the Hugging Face cache at an empty directory with HF_HUB_OFFLINE=1, then loads all stage
backends and the VAD and runs one request through each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.models

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import socket, threading

    def _blocked(*args, **kwargs):
        raise OSError("network access attempted: %r" % (args[1:] or args,))

    socket.socket.connect = _blocked
    socket.socket.connect_ex = _blocked
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked

    import urllib.request
    try:
        urllib.request.urlopen("http://127.0.0.1:9/", timeout=1)
        raise SystemExit("the socket guard did not block a connection")
    except OSError as exc:
        assert "network access attempted" in str(exc), exc

    import numpy as np
    from engine.messages import AsrRequest, ChatMessage, LlmRequest, TtsRequest, AudioOut
    from engine.stages.asr_pocketsphinx import PocketsphinxAsr, PocketsphinxOptions
    from engine.stages.asr_whisper import WhisperAsr, WhisperOptions
    from engine.stages.llm_llamacpp import LlamaCppLlm, LlamaCppOptions
    from engine.stages.tts_espeak import EspeakOptions, EspeakTts
    from engine.stages.tts_piper import PiperOptions, PiperTts
    from audio_kit.vad import SileroVad

    go = threading.Event()
    SileroVad().probability(np.zeros(512, np.float32))
    # no random noise in the voice: the same audio every run (with it, Whisper once heard
    # "Allowed there." for "Hello there.")
    tts = PiperTts(PiperOptions(noise_scale=0.0, noise_w_scale=0.0), "tts")
    tts.load()
    pcm = b"".join(o.pcm for o in tts.run(TtsRequest(request_id="t", text="Hello there.",
                                                   sample_rate=16000), go)
                   if isinstance(o, AudioOut))
    esp = EspeakTts(EspeakOptions(), "esp")
    esp.load()
    assert list(esp.run(TtsRequest(request_id="e", text="Hi."), go))
    whisper = WhisperAsr(WhisperOptions(), "asr")
    whisper.load()
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    print("WhisperAsr", whisper.transcribe(audio, "en"))
    ps = PocketsphinxAsr(PocketsphinxOptions(), "ps")
    ps.load()
    print("PocketsphinxAsr", list(ps.run(AsrRequest(request_id="a", audio=pcm), go))[0].text)
    llm = LlamaCppLlm(LlamaCppOptions(), "llm")
    llm.load()
    msgs = (ChatMessage(role="user", content="Hi"),)
    print("llm", list(llm.run(LlmRequest(request_id="l", messages=msgs, max_tokens=4), go))[-1])
    print("OFFLINE-OK")
    """
)


def test_models_load_and_run_without_network(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OFFLINE-OK" in proc.stdout
    assert "WhisperAsr Hello there" in proc.stdout, proc.stdout
