"""VAD decisions as the protocol core receives them (made off the loop by
duplex_server.session.input_lane).

Times are milliseconds of session input audio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VadStart:
    """Speech onset at ``onset_ms`` of session audio; ``audio_start_ms`` includes padding."""

    onset_ms: float
    audio_start_ms: float


@dataclass(frozen=True, slots=True)
class VadStop:
    """Speech ended at ``audio_end_ms`` (where the silence began); the VAD decided it at
    ``at_ms`` (the silence window later; None: not known)."""

    audio_end_ms: float
    at_ms: float | None = None


@dataclass(frozen=True, slots=True)
class VadPause:
    """A pause inside speech, not yet long enough to end the turn."""

    at_ms: float


@dataclass(frozen=True, slots=True)
class VadResume:
    """Speech came back before the pause ended the turn."""

    at_ms: float


@dataclass(frozen=True, slots=True)
class VadOnset:
    """A speech onset heard (one VAD chunk over the threshold) that is not yet speech: a
    ``VadStart`` follows once it lasts the segmenter's ``min_speech_ms``, a
    ``VadOnsetLost`` if silence comes first. ``at_ms``: where the VAD heard it."""

    at_ms: float


@dataclass(frozen=True, slots=True)
class VadOnsetLost:
    """The onset fell silent before it was speech."""

    at_ms: float


VadEvent = VadStart | VadStop | VadPause | VadResume | VadOnset | VadOnsetLost
