"""A vLLM (v1) logits processor that keeps a talker on well-formed codec frames.

Loaded by vLLM's engine (``logits_processors=["engine.stages.talker_logits:CodecFrameLogits"]``),
so it imports torch and vLLM and is only imported where vLLM runs. A request opts in with
``SamplingParams.extra_args["codec_frames"] = [audio_base, codebook_size, frame_size,
[end ids]]`` (or the flat ``[audio_base, codebook_size, frame_size, *end ids]``, the form
``vllm serve`` passes: its ``vllm_xargs`` takes lists of numbers, not nested lists): at every
step the request's logits keep only the token ids of the codebook its
next frame position needs (``audio_base + position * codebook_size + code``), plus the end
ids when the next token starts a frame. Whatever the weights, the talker then samples whole,
in-range frames and stops only between frames (engine/codec_layout.py).

The mask is engine/stages/talker_mask.py (torch only): one batched kernel sequence per step
whatever the batch size; this class only turns vLLM's batch updates into its row moves.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.stages.talker_mask import FrameMaskRows, Spec, check_spec

KEY = "codec_frames"


def frame_spec(params: SamplingParams) -> Spec | None:
    extra = params.extra_args or {}
    spec = extra.get(KEY)
    if spec is None:
        return None
    if len(spec) == 4 and isinstance(spec[3], list | tuple):
        base, size, frame, ends = spec  # in-process: [base, size, frame, [ends]]
    else:
        base, size, frame, *ends = spec  # from vllm_xargs: [base, size, frame, *ends]
    return int(base), int(size), int(frame), tuple(int(e) for e in ends)


class CodecFrameLogits(LogitsProcessor):  # type: ignore[misc, unused-ignore]  # (Any without vLLM)
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            spec = frame_spec(sampling_params)
            if spec is not None:
                check_spec(spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"extra_args[{KEY!r}]: expected [base, size, frame, [ends]]: {exc}"
            ) from None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.mask = FrameMaskRows()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # vLLM's order: removed, then added, then moved
        if not batch_update:
            return
        for index in batch_update.removed:
            self.mask.remove(index)
        for index, params, _, output_ids in batch_update.added:
            self.mask.add(index, frame_spec(params), output_ids)
        for a, b, direction in batch_update.moved:
            self.mask.move(a, b, swap=direction == MoveDirectionality.SWAP)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.mask.apply(logits)

    def apply_per_row(self, logits: torch.Tensor) -> torch.Tensor:
        """The per-row loop this processor replaced: the reference for tests and the bench."""
        return self.mask.apply_per_row(logits)
