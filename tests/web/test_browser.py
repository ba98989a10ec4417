"""The browser client in headless Chromium (Debian ``chromium`` + ``chromium-driver``, driven
by Selenium) against the real server: a fake microphone plays a WAV; the page completes a
spoken turn, shows both transcripts and its TTFA, and a second utterance during playback
interrupts the reply (the local player is flushed). Screenshot: artifacts/web-client.png.
In WebRTC mode (the page's toggle) the same fake microphone does one turn over
POST /v1/realtime/calls: Opus both ways, events on the ``oai-events`` data channel.
"""

from __future__ import annotations

import os
import shutil
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server.harness import REALTIME_TTS, UNIT, running_server, write_config

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
        reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install -y chromium "
        "chromium-driver; `make test` installs them); set CHROMIUM/CHROMEDRIVER to override",
    ),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")


def _speech(ms: int, rate: int) -> np.ndarray:
    """A voiced, syllable-like signal (harmonics, 4 Hz amplitude modulation)."""
    t = np.arange(int(rate * ms / 1000)) / rate
    voice = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((180, 360, 540, 900), 1))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    return np.asarray(voice * envelope * 0.25)


def _mic_wav(path: Path, rate: int = 16000) -> None:
    def gap(ms: int) -> np.ndarray:
        return np.zeros(int(rate * ms / 1000))

    # turn 1; a second utterance while the 3.5 s reply plays (barge-in); then quiet so the
    # answer to the second one completes before the file loops
    signal = np.concatenate(
        [gap(500), _speech(800, rate), gap(3000), _speech(800, rate), gap(7000)]
    )
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((signal * 32767).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_config(tmp_path_factory.mktemp("web"), engine=REALTIME_TTS)
    with running_server(Path(path)) as addr:
        yield addr


def _talkover_wav(path: Path, rate: int = 16000) -> None:
    """A question, then continuous speech from 0.7 s after it, all over the answer."""
    gap = [np.zeros(int(rate * ms / 1000)) for ms in (500, 700, 8000)]
    signal = np.concatenate([gap[0], _speech(800, rate), gap[1], _speech(5000, rate), gap[2]])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((signal * 32767).astype("<i2").tobytes())


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    wav = tmp_path / "mic.wav"
    _mic_wav(wav)
    yield from _chromium(wav)


@pytest.fixture
def browser_talkover(tmp_path: Path) -> Iterator[Any]:
    wav = tmp_path / "talkover.wav"
    _talkover_wav(wav)
    yield from _chromium(wav)


def _chromium(wav: Path) -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        "--window-size=1000,800",
        # WebRTC on loopback: loopback candidates, real addresses instead of mDNS names
        # (no multicast look-ups); the server offers 127.0.0.1 only (configs/test.yaml)
        "--allow-loopback-in-peer-connection",
        "--disable-features=WebRtcHideLocalIpsWithMdns",
    ):
        opts.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must never download
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _state(driver: Any) -> dict[str, Any]:
    result: dict[str, Any] = driver.execute_script("return window.duplexState")
    return result


def _open(browser: Any, url: str) -> None:
    """Load the page; a cold headless Chromium can return before the document is in (seen
    once in a loaded CI run: an empty title), so wait for it, and reload once if needed."""
    for _ in range(2):
        browser.get(url)
        deadline = time.monotonic() + 10 * UNIT
        while time.monotonic() < deadline:
            if browser.title == "duplex-server":
                return
            time.sleep(0.1)
    raise AssertionError(
        f"page did not load: title={browser.title!r} {browser.page_source[:300]!r}"
    )


def test_spoken_turn_transcripts_and_barge_in(server: str, browser: Any) -> None:
    _open(browser, f"http://{server}/")
    browser.find_element("id", "connect").click()
    deadline = time.monotonic() + 40 * UNIT
    state = _state(browser)
    while time.monotonic() < deadline:
        state = _state(browser)
        done = state["responses"]
        if "cancelled" in done and "completed" in done[done.index("cancelled") :]:
            break
        time.sleep(0.2)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "web-client.png"))
    assert state["connected"] and state["sessionId"].startswith("sess_")
    assert state["framesSent"] > 100  # 20 ms binary frames from the AudioWorklet
    assert "cancelled" in state["responses"], state  # the second utterance interrupted
    assert "completed" in state["responses"], state  # ... and its own answer completed
    assert state["flushes"] >= 1  # the local player was flushed on barge-in
    assert state["userTranscripts"][:2] == ["what is the weather like today"] * 2
    assert any(t.startswith("Hello there.") for t in state["assistantTranscripts"])
    # the completed turn's timeline (response.done timing) is drawn as a stacked bar
    assert state["timings"] and all(v >= 0 for v in state["timings"][-1].values()), state
    assert "asr" in state["timings"][-1] and "llm" in state["timings"][-1]
    bars = browser.find_elements("css selector", "#timing .seg")
    assert bars and any(b.get_attribute("title").startswith("asr ") for b in bars)
    assert state["ttfaMs"] and 0 < state["ttfaMs"][0] < 5000
    page = browser.find_element("id", "log").text
    assert "what is the weather like today" in page and "Hello there." in page
    assert browser.find_element("id", "ttfa").text.endswith(" ms")


def test_webrtc_mode_one_turn(server: str, browser: Any) -> None:
    _open(browser, f"http://{server}/")
    browser.find_element("id", "webrtc").click()
    browser.find_element("id", "connect").click()
    deadline = time.monotonic() + 30 * UNIT
    state = _state(browser)
    while time.monotonic() < deadline:
        state = _state(browser)
        if "completed" in state["responses"] and state["rtcPacketsReceived"] > 100:
            break
        time.sleep(0.2)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "web-client-webrtc.png"))
    assert state["transport"] == "webrtc"
    assert state["connected"] and state["sessionId"].startswith("sess_"), state
    assert state["framesSent"] > 50, state  # Opus packets from the fake microphone
    assert state["userTranscripts"][:1] == ["what is the weather like today"], state
    assert "completed" in state["responses"], state
    assert state["audioStarted"] >= 1  # output_audio_buffer.started on the data channel
    assert state["rtcPacketsReceived"] > 100 and state["rtcAudioEnergy"] > 0, state
    # what Chromium's jitter buffer holds (bench/browser_jitter.py reads the same figures)
    assert 0 < state["rtcJitterBufferMs"] < 1000 and state["rtcJitterTargetMs"] > 0, state
    assert any(t.startswith("Hello there.") for t in state["assistantTranscripts"])
    assert state["ttfaMs"] and 0 < state["ttfaMs"][0] < 5000


@pytest.fixture(scope="module")
def fast_tts_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A TTS faster than real time, like the CPU default: the answer is complete on the
    server while it still plays at the client."""
    tts = {"stages": {"tts": {"backend": "test", "options": {"ms_per_word": 300.0}}}}
    path = write_config(tmp_path_factory.mktemp("web-fast"), engine=tts)
    with running_server(Path(path)) as addr:
        yield addr


@pytest.mark.parametrize("mode", ["websocket", "webrtc"])
def test_talking_over_the_answer_shows_an_interrupted_bubble(
    fast_tts_server: str, browser_talkover: Any, mode: str
) -> None:
    """Continuous speech over an answer that is complete on the server but still playing:
    its playback is cut (WebSocket: the page flushes its player; WebRTC: the server clears
    the track) and its bubble is marked interrupted, in both modes."""
    browser = browser_talkover
    _open(browser, f"http://{fast_tts_server}/")
    if mode == "webrtc":
        browser.find_element("id", "webrtc").click()
    browser.find_element("id", "connect").click()
    deadline = time.monotonic() + 30 * UNIT
    state = _state(browser)
    while time.monotonic() < deadline:
        state = _state(browser)
        if state["interrupted"]:
            break
        time.sleep(0.2)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"web-client-talkover-{mode}.png"))
    assert state["transport"] == mode and state["interrupted"] >= 1, state
    bubbles = browser.find_elements("css selector", "#log li.assistant.cancelled")
    assert bubbles, browser.find_element("id", "log").get_attribute("innerHTML")
    assert all(b.is_displayed() and b.text.startswith("Hello there.") for b in bubbles)
    assert browser.find_element("id", "interrupts").text == str(state["interrupted"])


@pytest.fixture(scope="module")
def backchannel_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every speech is heard as "mm-hm" (a backchannel), and answers play in real time."""
    stages = {
        "asr": {"backend": "test", "options": {"transcript": "mm-hm"}},
        "tts": {"backend": "test", "options": {"realtime": True}},
    }
    path = write_config(tmp_path_factory.mktemp("web-mmhm"), engine={"stages": stages})
    with running_server(Path(path)) as addr:
        yield addr


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_config(
        tmp_path_factory.mktemp("web-keyed"), engine=REALTIME_TTS, server={"api_keys": ["sk-app"]}
    )
    with running_server(Path(path)) as addr:
        yield addr


def _backchannel_wav(path: Path, rate: int = 16000) -> None:
    """A question, then a short "mm-hm" (0.35 s) 1.2 s into the answer, then quiet."""
    gap = [np.zeros(int(rate * ms / 1000)) for ms in (500, 1200, 9000)]
    signal = np.concatenate([gap[0], _speech(800, rate), gap[1], _speech(350, rate), gap[2]])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((signal * 32767).astype("<i2").tobytes())


@pytest.fixture
def browser_backchannel(tmp_path: Path) -> Iterator[Any]:
    wav = tmp_path / "mmhm.wav"
    _backchannel_wav(wav)
    yield from _chromium(wav)


@pytest.mark.parametrize("mode", ["websocket", "webrtc"])
def test_a_backchannel_over_the_answer_shows_a_cut_taken_back(
    backchannel_server: str, browser_backchannel: Any, mode: str
) -> None:
    """interrupt_mode confirm ("Confirm cuts" ticked on the WebSocket; WebRTC's default): an
    "mm-hm" over the answer pauses it (output_audio_buffer.paused: the page pauses its
    player) and the cut is taken back (.resumed: it plays on); the answer completes, marked
    "(cut taken back)", not interrupted, and the "mm-hm" is no turn of its own."""
    browser = browser_backchannel
    _open(browser, f"http://{backchannel_server}/")
    if mode == "webrtc":
        browser.find_element("id", "webrtc").click()
    else:
        browser.find_element("id", "confirm").click()
    browser.find_element("id", "connect").click()
    deadline = time.monotonic() + 40 * UNIT
    state = _state(browser)
    while time.monotonic() < deadline:  # (the microphone may start mid-file: it loops)
        state = _state(browser)
        answered = len(state["responses"]) == len(state["userTranscripts"])
        if state["takenBack"] and answered:
            break
        time.sleep(0.2)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"web-client-taken-back-{mode}.png"))
    assert state["transport"] == mode, state
    assert state["paused"] >= 1 and state["takenBack"] >= 1, state
    assert state["interrupted"] == 0 and state["audioCleared"] == 0, state
    # every turn is a question, answered in full; no "mm-hm" became a turn
    assert state["responses"] and set(state["responses"]) == {"completed"}, state
    assert len(state["responses"]) == len(state["userTranscripts"]), state
    bubble = browser.find_element("css selector", "#log li.assistant.taken-back")
    assert bubble.is_displayed() and bubble.text.startswith("Hello there."), bubble.text
    assert browser.find_element("id", "takenback").text == str(state["takenBack"])


@pytest.mark.parametrize("mode", ["websocket", "webrtc"])
def test_the_page_opens_a_session_with_a_client_secret(
    keyed_server: str, browser: Any, mode: str
) -> None:
    """The app's server mints a secret with its key; the page (which never sees the key)
    opens its session with the secret in the key field: one turn answered, on both wires."""
    import httpx

    minted = httpx.post(
        f"http://{keyed_server}/v1/realtime/client_secrets",
        json={"session": {"instructions": "Be brief."}},
        headers={"Authorization": "Bearer sk-app"},
    )
    assert minted.status_code == 200, minted.text
    secret = minted.json()["value"]
    _open(browser, f"http://{keyed_server}/")
    browser.find_element("id", "key").send_keys(secret)
    if mode == "webrtc":
        browser.find_element("id", "webrtc").click()
    browser.find_element("id", "connect").click()
    deadline = time.monotonic() + 30 * UNIT
    state = _state(browser)
    while time.monotonic() < deadline and "completed" not in state["responses"]:
        time.sleep(0.2)
        state = _state(browser)
    assert state["connected"] and state["sessionId"].startswith("sess_"), state
    assert "completed" in state["responses"], state
