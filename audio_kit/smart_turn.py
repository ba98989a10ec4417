"""Semantic end of turn: Smart Turn v3.2 (BSD-2, pipecat-ai) on onnxruntime.

Does the user's speech so far sound finished ("What is the capital of France?") or not
("It was the best of times, ...")? The model hears the last 8 s of the turn (16 kHz, left
padded with zeros), as Whisper log-mel features (80 x 800), and returns the probability that
the turn is complete. The server asks it when a pause begins (``semantic_vad``): a complete
turn ends after a short silence, an unfinished one waits up to the eagerness's longest wait.

The ONNX file ships inside the ``pipecat-ai`` wheel (installed with ``--no-deps``, see the
Makefile); it is located with ``importlib.util.find_spec`` without importing pipecat. The
features are faster-whisper's ``FeatureExtractor`` (the same log-mel as transformers'
``WhisperFeatureExtractor``, which Smart Turn was trained on) after the waveform is scaled to
zero mean and unit variance, as upstream does.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

RATE = 16000
WINDOW_S = 8
WINDOW = RATE * WINDOW_S
FRAMES = WINDOW // 160
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
#: where the file lies inside the pipecat package
MODEL_PARTS = ("audio", "turn", "smart_turn", "data", MODEL_FILE)
_NORM_EPS = 1e-7


class SmartTurnUnavailable(RuntimeError):
    """The pipecat-ai wheel (which carries the model file) is not installed."""


def model_path() -> Path:
    """The Smart Turn v3.2 ONNX file inside the installed pipecat-ai wheel (not imported)."""
    spec = importlib.util.find_spec("pipecat")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = Path(root).joinpath(*MODEL_PARTS)
            if path.is_file():
                return path
    raise SmartTurnUnavailable(
        f"{MODEL_FILE} not found: install the pipecat-ai wheel with --no-deps (make install)"
    )


def features(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Smart Turn's input (1, 80, 800) for 16 kHz float audio: the last 8 s, left padded."""
    from faster_whisper.feature_extractor import FeatureExtractor

    x = np.asarray(audio, dtype=np.float32)[-WINDOW:]
    x = np.pad(x, (WINDOW - x.size, 0))
    x = (x - x.mean()) / np.sqrt(x.var() + _NORM_EPS)
    mel = _extractor(FeatureExtractor)(x.astype(np.float32), padding=0)
    out: npt.NDArray[np.float32] = mel[None, :, :FRAMES].astype(np.float32)
    return out


_FE: Any = None


def _extractor(cls: Any) -> Any:
    global _FE
    if _FE is None:
        _FE = cls(feature_size=80, sampling_rate=RATE, hop_length=160, n_fft=400)
    return _FE


class SmartTurn:
    """One ONNX session (1 intra-op thread), shared by all sessions; calls are serialized."""

    _shared: SmartTurn | None = None
    _shared_lock = threading.Lock()

    def __init__(self, path: Path | None = None, threads: int = 1) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(
            str(path or model_path()), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self._lock = threading.Lock()

    @classmethod
    def shared(cls) -> SmartTurn:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def probability(self, audio: npt.NDArray[np.float32]) -> float:
        """P(the turn is complete) for the turn's 16 kHz float audio so far."""
        feats = features(audio)
        with self._lock:
            out = self._session.run(None, {"input_features": feats})
        return float(np.ravel(out[0])[0])
