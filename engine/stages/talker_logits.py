"""A vLLM (v1) logits processor that keeps a talker on well-formed codec frames.

Loaded by vLLM's engine (``logits_processors=["engine.stages.talker_logits:CodecFrameLogits"]``),
so it imports torch and vLLM and is only imported where vLLM runs. A request opts in with
``SamplingParams.extra_args["codec_frames"] = [audio_base, codebook_size, frame_size,
[end ids]]``: at every step the request's logits keep only the token ids of the codebook its
next frame position needs (``audio_base + position * codebook_size + code``), plus the end
ids when the next token starts a frame. Whatever the weights, the talker then samples whole,
in-range frames and stops only between frames (engine/codec_layout.py).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

KEY = "codec_frames"


def frame_spec(params: SamplingParams) -> tuple[int, int, int, tuple[int, ...]] | None:
    extra = params.extra_args or {}
    spec = extra.get(KEY)
    if spec is None:
        return None
    base, size, frame, ends = spec
    return int(base), int(size), int(frame), tuple(int(e) for e in ends)


class CodecFrameLogits(LogitsProcessor):  # type: ignore[misc]
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            spec = frame_spec(sampling_params)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"extra_args[{KEY!r}]: expected [base, size, frame, [ends]]: {exc}"
            ) from None
        if spec is not None and (spec[1] < 1 or spec[2] < 1):
            raise ValueError(f"extra_args[{KEY!r}]: codebook size and frame size must be >= 1")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (spec, the request's live list of output token ids)
        self.rows: dict[int, tuple[tuple[int, int, int, tuple[int, ...]], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            spec = frame_spec(params)
            if spec is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (spec, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        for index, ((base, size, frame, ends), output_ids) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            position = len(output_ids) % frame
            lo = base + position * size
            row = logits[index]
            keep = row[lo : lo + size].clone()
            end = row[list(ends)].clone() if position == 0 and ends else None
            row.fill_(float("-inf"))
            row[lo : lo + size] = keep
            if end is not None:
                row[list(ends)] = end
        return logits
