"""Edge types: what a stage declares it consumes and emits, so the graph can fit stages into
routes (engine/pipeline/graph.py)."""

from __future__ import annotations

from enum import StrEnum


class Edge(StrEnum):
    """What a backend consumes and emits."""

    AUDIO = "audio"  # PCM16 mono chunks (AudioOut); into a stage: one utterance (AsrRequest)
    TEXT = "text"  # transcripts and LM deltas (TextOut); into a stage: one segment (TtsRequest)
    TOKENS = "tokens"  # LM token ids (TokensOut); into a stage: a window of ids (TokensRequest)
    CODEC = "codec"  # audio-codec frames as flat code ids (TokensOut / TokensRequest)


__all__ = ["Edge"]
