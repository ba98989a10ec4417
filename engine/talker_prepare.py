"""Make the tiny Orpheus-layout talker for CI: a real Llama architecture, random weights.

The CI talker is made here, never downloaded: ``LlamaForCausalLM`` (the architecture class
of Orpheus 3B) with 2 small layers (hidden 128, 2 heads of 64, 1 KV head) and Orpheus's
vocabulary shape, 156,940 ids: a byte-level BPE tokenizer padded to Llama-3's 128,000
ordinary ids, Llama-3's 256 special ids from 128000 (``<|begin_of_text|>`` 128000,
``<|eot_id|>`` 128009), then ``<custom_token_N>`` at 128256 + N (Orpheus's control tokens
N < 10, audio codes from N = 10: engine/codec_layout.py). Weights are random (seeded), so
its speech is noise; what it proves is the plumbing: the real token layout, prompt format,
vocabulary size and model class on vLLM.

The directory lives in the project cache (``.cache/models/orpheus-tiny-v1``); making it
again is a no-op. Run ``python -m engine.talker_prepare`` in the vLLM venv (``make
install-vllm`` does); it needs torch, transformers and tokenizers.
"""

from __future__ import annotations

import importlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from duplex_contract.errors import ConfigError
from engine.codec_layout import ORPHEUS
from engine.models import cache_dir

log = logging.getLogger(__name__)

VERSION = "v1"
_DONE = ".complete"
BASE_VOCAB = 128000  # Llama-3's ordinary ids
SPECIALS = 256  # Llama-3's special ids (128000..128255)
VOCAB = 156940  # Orpheus 3B's vocab_size (config.json)
TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}


def tiny_talker_dir() -> Path:
    return cache_dir() / f"orpheus-tiny-{VERSION}"


def is_prepared(target: Path) -> bool:
    return (target / _DONE).is_file() and (target / "config.json").is_file()


def _special_names() -> list[str]:
    names = [f"<|reserved_special_token_{i}|>" for i in range(SPECIALS)]
    names[0], names[1], names[9] = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
    names[6], names[7] = "<|start_header_id|>", "<|end_header_id|>"
    return names


def build_tokenizer(target: Path) -> None:
    """A byte-level BPE tokenizer with Orpheus's id layout (tokenizer.json + config)."""
    tk = importlib.import_module("tokenizers")
    byte_level = importlib.import_module("tokenizers.pre_tokenizers").ByteLevel
    alphabet = byte_level.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), BASE_VOCAB):  # unreachable fillers: keep Llama-3's id layout
        vocab[f"<|filler_{i}|>"] = i
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = importlib.import_module("tokenizers.decoders").ByteLevel()
    specials = _special_names()
    customs = [f"<custom_token_{i}>" for i in range(VOCAB - BASE_VOCAB - SPECIALS)]
    tokenizer.add_special_tokens([tk.AddedToken(t, special=True) for t in specials + customs])
    tokenizer.post_processor = importlib.import_module("tokenizers.processors").TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BASE_VOCAB)]
    )
    assert tokenizer.token_to_id("<|eot_id|>") == 128009
    assert tokenizer.token_to_id("<custom_token_10>") == ORPHEUS.audio_base
    assert tokenizer.get_vocab_size() == VOCAB
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "pad_token": "<|end_of_text|>",
                "model_max_length": TINY["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )


def build_model(target: Path, seed: int = 1234) -> None:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        bos_token_id=BASE_VOCAB,
        eos_token_id=ORPHEUS.end_ids[0],
        pad_token_id=BASE_VOCAB + 1,
        torch_dtype="bfloat16",
        **TINY,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(target), safe_serialization=True)


def prepare() -> Path:
    """The tiny talker directory, made on first call."""
    target = tiny_talker_dir()
    if is_prepared(target):
        return target
    started = time.perf_counter()
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build_tokenizer(tmp)
        build_model(tmp)
    except ImportError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"making the tiny talker needs torch + transformers (the vLLM venv): {exc}"
        ) from None
    (tmp / _DONE).write_text(f"orpheus layout, random weights, {VERSION}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log.info("made the tiny talker %s in %.1f s", target, time.perf_counter() - started)
    return target


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python -m engine.talker_prepare", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"tiny talker (orpheus layout, for vllm): {prepare()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
