"""TTS stage: eSpeak NG 1.52 from ``espeakng-loader`` through ctypes (tiny, robotic, ~600x RT).

libespeak-ng runs in synchronous mode: ``espeak_Synth`` blocks while it calls our synth
callback with ~50 ms buffers of 22.05 kHz int16. The text is split into sentences; each
sentence's audio is resampled by soxr and sent as ~100 ms chunks as soon as that sentence
is done. The callback returns 1 (abort) once ``cancelled`` is set.

libespeak-ng keeps global state (voice, callback, rate), so every call into it holds one
process-wide lock: several replicas in one process take turns. ``espeak_SetVoiceByName``
must run before any synthesis call, or the library segfaults; ``_Espeak`` does it at init.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Annotated, ClassVar

import msgspec

from audio_kit.pcm import PcmChunker, StreamResampler
from duplex_contract.batch import AudioOut
from duplex_contract.errors import StageError
from engine.messages import StageDone, StageOutput, StageRequest, TtsRequest
from engine.models import espeak_ng_data, espeak_ng_library
from engine.stages.edges import Edge
from engine.stages.stage_front import StageFront
from engine.stages.threaded import ThreadedRuntime

log = logging.getLogger(__name__)

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_ESPEAK_RATE = 1
_DEFAULT_WPM = 175
_SENTENCE = re.compile(r"(?<=[.!?;:])\s+")

_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)

_LIB_LOCK = threading.Lock()


class _Espeak:
    """The process-wide libespeak-ng handle (initialized once)."""

    _instance: ClassVar[_Espeak | None] = None

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(espeak_ng_library()))
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 50, str(espeak_ng_data()).encode(), 0
        )
        if rate <= 0:
            raise StageError(f"espeak_Initialize failed ({rate})")
        self.lib = lib
        self.sample_rate = int(rate)
        self.voice: bytes | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self._callback = _SynthCallback(self._on_audio)  # kept alive for the library
        lib.espeak_SetSynthCallback(self._callback)
        self.set_voice("en-us")

    @classmethod
    def get(cls) -> _Espeak:
        with _LIB_LOCK:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _on_audio(self, wav: ctypes._Pointer[ctypes.c_short] | None, n: int, _events: int) -> int:
        if not wav or n <= 0 or self._sink is None:
            return 0
        data = ctypes.string_at(wav, n * 2)
        return 0 if self._sink(data) else 1  # 1 = abort synthesis

    def set_voice(self, name: str) -> None:
        encoded = name.encode()
        if encoded == self.voice:
            return
        err = self.lib.espeak_SetVoiceByName(encoded)
        if err != 0:
            raise StageError(f"espeak: unknown voice {name!r} (error {err})")
        self.voice = encoded

    def synth(self, text: str, *, voice: str, wpm: int, sink: Callable[[bytes], bool]) -> None:
        """Synthesize ``text``; ``sink`` gets PCM16 pieces and returns False to abort."""
        data = text.encode("utf-8") + b"\0"
        with _LIB_LOCK:
            self.set_voice(voice)
            self.lib.espeak_SetParameter(_ESPEAK_RATE, wpm, 0)
            self._sink = sink
            try:
                err = self.lib.espeak_Synth(
                    data, len(data), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None
                )
            finally:
                self._sink = None
        if err not in (0, 2):  # EE_OK, EE_BUFFER_FULL never happens synchronously
            raise StageError(f"espeak_Synth failed ({err})")


class EspeakOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    voice: str = "en-us"  # an espeak-ng voice name (request voices are OpenAI names: ignored)
    words_per_minute: Annotated[int, msgspec.Meta(ge=80, le=450)] = _DEFAULT_WPM
    chunk_ms: Annotated[float, msgspec.Meta(ge=10, le=1000)] = 100.0


class EspeakTts(StageFront):
    """Text -> AudioOut chunks (PCM16 mono at request.sample_rate), then StageDone.

    The stage interface is its :class:`ThreadedRuntime`'s (one request at a time); this
    class is the model (``load``, ``run``, ``unload``: engine/stages/threaded.py)."""

    Options: ClassVar[type[msgspec.Struct]] = EspeakOptions
    consumes: Edge = Edge.TEXT
    emits: Edge = Edge.AUDIO
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self, options: EspeakOptions, name: str, *, device: str = "cpu", stage: str | None = None
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self._espeak: _Espeak | None = None
        self.runtime = ThreadedRuntime(name, self)

    def serving(self) -> ThreadedRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    def voices(self) -> tuple[str, ...]:
        """The configured espeak-ng voice, the one it speaks in (requests do not choose)."""
        return (self.opts.voice,)

    # -- the stage interface: its runtime's --------------------------------------------

    # -- the model (worker thread) -----------------------------------------------------
    @property
    def native_rate(self) -> int:
        return self._espeak.sample_rate if self._espeak is not None else 22050

    def load(self) -> None:
        self._espeak = _Espeak.get()
        self._espeak.set_voice(self.opts.voice)
        log.info("espeak-ng loaded (%d Hz, voice %s)", self._espeak.sample_rate, self.opts.voice)

    def unload(self) -> None:
        """The library stays loaded (process-wide, shared by every replica)."""

    def synthesize(self, text: str, *, speed: float, keep_going: Callable[[], bool]) -> bytes:
        """PCM16 at ``native_rate`` for one piece of text (worker thread)."""
        if self._espeak is None:
            raise StageError(f"{self.name}: not loaded")
        pieces: list[bytes] = []

        def sink(pcm: bytes) -> bool:
            pieces.append(pcm)
            return keep_going()

        wpm = max(80, min(450, round(self.opts.words_per_minute * speed)))
        self._espeak.synth(text, voice=self.opts.voice, wpm=wpm, sink=sink)
        return b"".join(pieces)

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        if not isinstance(request, TtsRequest):
            raise StageError(f"{self.name}: expected a TtsRequest, got {type(request).__name__}")
        rid, rate = request.request_id, request.sample_rate
        resampler = StreamResampler(self.native_rate, rate)
        chunker = PcmChunker(rate, self.opts.chunk_ms)
        for sentence in (s for s in _SENTENCE.split(request.text.strip()) if s):
            pcm = self.synthesize(
                sentence, speed=request.speed, keep_going=lambda: not cancelled.is_set()
            )
            pieces = chunker.push(resampler.process(pcm) + resampler.flush())
            rest = chunker.flush()
            for chunk in [*pieces, rest] if rest else pieces:
                if cancelled.is_set():
                    return
                yield AudioOut(
                    request_id=rid, pcm=chunk, sample_rate=rate, t_ns=time.monotonic_ns()
                )
        if not cancelled.is_set():
            yield StageDone(request_id=rid)
