"""ASR with pocketsphinx 5 (the en-us model ships in the wheel): fast, streaming, inaccurate.

Two ways to use it:

* :class:`PocketsphinxAsr`, the pipeline stage: decodes a whole utterance per request;
* :class:`PocketsphinxStream`, a synchronous streaming decoder for live partial transcripts
  (``feed`` 20-100 ms pieces while the user speaks, ``finish`` at the endpoint). It is
  CPU-bound (2-4 ms per 20 ms of audio): run it in a worker thread, never on an event loop.

Accuracy is good on short, clean commands and poor on long or conversational speech; prefer
Whisper where the transcript matters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec

from audio_kit.pcm import resample_pcm16
from duplex_contract.batch import TranscriptOut
from duplex_contract.errors import StageError
from engine.messages import AsrRequest, StageDone, StageOutput, StageRequest
from engine.stages.edges import Edge
from engine.stages.stage_front import StageFront
from engine.stages.threaded import ThreadedRuntime

log = logging.getLogger(__name__)

ASR_RATE = 16000


class PocketsphinxOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # None: the en-us acoustic model, language model and dictionary shipped in the wheel.
    hmm: str | None = None
    lm: str | None = None
    dictionary: str | None = None
    loglevel: str = "FATAL"


def _decoder(options: PocketsphinxOptions, first_pass_only: bool = False) -> Any:
    """A decoder; ``first_pass_only``: without the flat-lexicon and best-path passes that
    ``end_utt`` runs over the whole utterance (partials come from the first pass anyway)."""
    from pocketsphinx import Decoder

    kwargs: dict[str, Any] = {"samprate": ASR_RATE, "loglevel": options.loglevel}
    if first_pass_only:
        kwargs.update(fwdflat=False, bestpath=False)
    if options.hmm is not None:
        kwargs["hmm"] = options.hmm
    if options.lm is not None:
        kwargs["lm"] = options.lm
    if options.dictionary is not None:
        kwargs["dict"] = options.dictionary
    return Decoder(**kwargs)


def _hyp_text(decoder: Any) -> str:
    hyp = decoder.hyp()
    return "" if hyp is None else str(hyp.hypstr).strip()


class PocketsphinxStream:
    """Incremental decoding of one audio stream (PCM16 mono 16 kHz).

    ``feed`` returns the partial transcript when it changed, else ``None``; ``finish`` ends
    the utterance and returns the final transcript; the stream is then ready for the next
    utterance (``reset`` discards the current one instead). Not thread-safe.

    First pass only: the partials come from pocketsphinx's first (tree) pass, and the passes
    ``end_utt`` would run after it (flat lexicon, best path) took ~270 ms over an 8 s turn,
    at the commit, on the cores the turn's answer needs then; without them ~6 ms. The final
    transcript is Whisper's; ``finish`` returns the first pass's words.
    """

    def __init__(self, options: PocketsphinxOptions | None = None) -> None:
        self._decoder = _decoder(options or PocketsphinxOptions(), first_pass_only=True)
        self._active = False
        self._partial = ""
        self._carry = b""

    @property
    def partial(self) -> str:
        return self._partial

    def feed(self, pcm: bytes) -> str | None:
        data = self._carry + pcm
        cut = len(data) - len(data) % 2
        self._carry = data[cut:]
        if cut == 0:
            return None
        if not self._active:
            self._decoder.start_utt()
            self._active = True
        self._decoder.process_raw(data[:cut], False, False)
        text = _hyp_text(self._decoder)
        if text == self._partial:
            return None
        self._partial = text
        return text

    def finish(self) -> str:
        self._carry = b""
        if not self._active:
            return ""
        self._decoder.end_utt()
        self._active = False
        text = _hyp_text(self._decoder)
        self._partial = ""
        return text

    def reset(self) -> None:
        self._carry = b""
        self._partial = ""
        if self._active:
            self._decoder.end_utt()
            self._active = False


class PocketsphinxAsr(StageFront):
    """Whole-utterance pocketsphinx decoding: one TranscriptOut(final=True), then StageDone.

    The stage interface is its :class:`ThreadedRuntime`'s (one utterance at a time); this
    class is the model (``load``, ``run``, ``unload``: engine/stages/threaded.py)."""

    Options: ClassVar[type[msgspec.Struct]] = PocketsphinxOptions
    consumes: Edge = Edge.AUDIO
    emits: Edge = Edge.TEXT
    device_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    keeps_auto: ClassVar[bool] = False

    def __init__(
        self,
        options: PocketsphinxOptions,
        name: str,
        *,
        device: str = "cpu",
        stage: str | None = None,
    ) -> None:
        self.opts = options
        self.name = name
        self.device = device
        self._decoder: Any = None
        self.runtime = ThreadedRuntime(name, self)

    def serving(self) -> ThreadedRuntime:
        return self.runtime

    @classmethod
    def cuda_device_count(cls) -> int:
        return 0

    # -- the stage interface: its runtime's --------------------------------------------

    # -- the model (worker thread) -----------------------------------------------------
    def load(self) -> None:
        self._decoder = _decoder(self.opts)
        log.info("pocketsphinx loaded")

    def unload(self) -> None:
        self._decoder = None

    def transcribe(self, pcm16: bytes) -> str:
        """Decode a whole PCM16 16 kHz utterance (worker thread)."""
        if self._decoder is None:
            raise StageError(f"{self.name}: model not loaded")
        self._decoder.start_utt()
        self._decoder.process_raw(pcm16, False, True)
        self._decoder.end_utt()
        return _hyp_text(self._decoder)

    def run(self, request: StageRequest, cancelled: threading.Event) -> Iterator[StageOutput]:
        if not isinstance(request, AsrRequest):
            raise StageError(f"{self.name}: expected an AsrRequest, got {type(request).__name__}")
        if request.language.split("-")[0].lower() != "en":
            log.warning("pocketsphinx only has an English model; got %r", request.language)
        pcm = resample_pcm16(request.audio, request.sample_rate, ASR_RATE)
        text = self.transcribe(pcm[: len(pcm) - len(pcm) % 2])
        if cancelled.is_set():
            return
        yield TranscriptOut(request_id=request.request_id, text=text, final=True)
        yield StageDone(request_id=request.request_id)
