"""The SNAC 24 kHz decoder as a torch module: build it and decode batches of code rows.

Kept apart from the stage (engine/stages/codec_snac.py) so that ``bench/talker.py
--codec-only`` runs where only torch, numpy, snac and einops are installed (a lent GPU
machine without the project's other requirements): this module and engine/codec_layout.py
import nothing else.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duplex_contract.errors import ConfigError

log = logging.getLogger(__name__)

# hubertsiuzdak/snac_24khz config.json (public): 24 kHz, hop 512, codebooks at 12/23/47 Hz.
SNAC_24KHZ: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
# Frames either side of a frame that its samples depend on (2.31 measured, rounded up).
EXACT_MARGIN_FRAMES = 3


def build_snac(
    device: str,
    *,
    model: str | None = None,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    dtype: str = "float32",
    noise: bool = False,
    threads: int | None = None,
    where: str = "snac",
) -> tuple[Any, Any]:
    """The SNAC decoder on ``device`` (weights from the directory ``model``, else random
    with ``seed``; ``config`` overrides the random model's config) and the torch module."""
    try:
        import torch
        from snac import SNAC
        from snac.layers import DecoderBlock, NoiseBlock
    except ImportError as exc:
        raise ConfigError(
            f"{where}: the snac codec needs torch and snac ({exc}); use the vLLM venv "
            "(`make install-vllm`) or a GPU install"
        ) from None
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    overrides = dict(config or {})
    if model is not None:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file() or not (path / "pytorch_model.bin").is_file():
            raise ConfigError(
                f"{where}.model: {model} is not a SNAC directory (config.json + pytorch_model.bin)"
            )
        published = json.loads((path / "config.json").read_text())
        if published.get("sampling_rate") != 24000 or published.get("vq_strides") != [4, 2, 1]:
            raise ConfigError(f"{where}.model: {model} is not a 24 kHz SNAC model")
        net = SNAC(**published)
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    else:
        unknown = set(overrides) - set(SNAC_24KHZ)
        if unknown:
            raise ConfigError(f"{where}.config: unknown SNAC config keys {sorted(unknown)}")
        for key in ("sampling_rate", "decoder_rates", "vq_strides", "codebook_size"):
            if key in overrides and overrides[key] != SNAC_24KHZ[key]:
                raise ConfigError(f"{where}.config.{key}: fixed by the 24 kHz layout")
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            net = SNAC(**{**SNAC_24KHZ, **overrides})
        finally:
            torch.random.set_rng_state(rng_state)
        log.warning("codec: SNAC 24 kHz with random weights (seed %d): noise", seed)
    if not noise:  # noise blocks add fresh random noise per call: no two decodes would agree
        for block in net.decoder.modules():
            if isinstance(block, DecoderBlock):
                block.block = torch.nn.Sequential(
                    *[m for m in block.block if not isinstance(m, NoiseBlock)]
                )
    net = net.eval().to(device=device, dtype=getattr(torch, dtype))
    net.encoder = None  # a codec stage only decodes
    return net, torch


def decode_rows(net: Any, torch: Any, rows: Sequence[Sequence[Any]], device: str) -> Any:
    """One decoder call on equal-length rows (each: one int64 array per codebook) ->
    float32 numpy audio [B, T]."""
    n_books = len(rows[0])
    codes = [torch.from_numpy(np.stack([r[cb] for r in rows])).to(device) for cb in range(n_books)]
    with torch.inference_mode():
        return net.decode(codes)[:, 0, :].float().cpu().numpy()


__all__ = ["EXACT_MARGIN_FRAMES", "SNAC_24KHZ", "build_snac", "decode_rows"]
