"""Codec-LM token layouts: how a talker's sampled token ids map to audio-codec codes.

A talker (an autoregressive LM that speaks audio-codec tokens) and the codec decoder after
it agree on a *layout*: how many codes make one frame, which codebook each position of a
frame belongs to, where the audio tokens sit in the LM's vocabulary, which token ends the
speech, and how a prompt is written. Everything model-specific about a codec LM lives in
one :class:`CodecLayout`; another codec LM (a different codec, offsets, frame size) is a
new layout registered in :data:`LAYOUTS`, not a new stage.

On the ``codec`` edge a frame travels as ``frame_size`` flat codes in the layout's frame
order, each already de-offset (``0 <= code < codebook_size``). The talker converts token
ids with :meth:`CodecLayout.token_to_code` (refusing any token that is not an audio code of
the codebook its position needs); the decoder checks codes again with
:meth:`CodecLayout.split` before it decodes anything.

Orpheus (the first layout): a Llama-3 LM whose vocabulary is Llama-3's 128,256 tokens plus
``<custom_token_N>`` tokens at ``128256 + N``. Audio tokens start at custom token 10, so the
code ``c`` at frame position ``p`` (0..6) is token ``128266 + 4096 * p + c``. A frame is 7
SNAC 24 kHz codes over 3 codebooks (strides 4, 2, 1 = 12, 23.4, 46.9 Hz)::

    position   0      1      2      3      4      5      6
    codebook   0      1      2      2      1      2      2
    index      j      2j     4j     4j+1   2j+1   4j+2   4j+3      (frame j)

so one frame is 4 latent steps of the finest codebook = 2048 samples = 85.33 ms at 24 kHz.
The prompt is ``<start_of_human>`` + tokenize("{voice}: {text}") (with ``<|begin_of_text|>``)
+ ``<|eot_id|> <end_of_human> <start_of_ai> <start_of_speech>``; generation ends with
``<end_of_speech>`` (128258).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class FrameError(ValueError):
    """A token or code stream that is not well-formed frames of the layout."""


@dataclass(frozen=True)
class CodecLayout:
    """Token <-> code arithmetic of one codec LM (see the module docstring)."""

    name: str
    codec: str  # the decoder this layout feeds (``snac_24khz``)
    codebook_size: int
    # which codebook each position of a frame belongs to, and the index step inside it
    positions: tuple[int, ...]
    # per codebook: codes per frame (the codebook's time resolution)
    per_frame: tuple[int, ...]
    audio_base: int  # token id of code 0 at frame position 0
    end_ids: tuple[int, ...]  # tokens that end the speech (allowed only between frames)
    sample_rate: int  # the decoder's native rate
    samples_per_frame: int
    prompt_prefix: tuple[int, ...]
    prompt_suffix: tuple[int, ...]
    default_voice: str
    voices: tuple[str, ...]

    @property
    def frame_size(self) -> int:
        return len(self.positions)

    @property
    def n_codebooks(self) -> int:
        return len(self.per_frame)

    @property
    def audio_range(self) -> range:
        """Every audio token id (all positions)."""
        return range(self.audio_base, self.audio_base + self.frame_size * self.codebook_size)

    def position_range(self, position: int) -> range:
        """Token ids allowed at ``position`` (0..frame_size-1) of a frame."""
        lo = self.audio_base + position * self.codebook_size
        return range(lo, lo + self.codebook_size)

    @property
    def frame_ms(self) -> float:
        return self.samples_per_frame / self.sample_rate * 1000.0

    # ------------------------------------------------------------------ talker side
    def prompt_ids(
        self, encode: Callable[[str], list[int]], text: str, voice: str | None
    ) -> list[int]:
        """The talker prompt for ``text`` in ``voice`` (``encode`` adds the BOS token)."""
        who = voice or self.default_voice
        return [*self.prompt_prefix, *encode(f"{who}: {text}"), *self.prompt_suffix]

    def token_to_code(self, token: int, position: int) -> int:
        """The code of ``token`` sampled at ``position`` of a frame; refuses anything else."""
        allowed = self.position_range(position)
        if token not in allowed:
            other = (token - self.audio_base) // self.codebook_size
            where = (
                f"an audio token of another frame position ({other})"
                if token in self.audio_range
                else "not an audio token"
            )
            raise FrameError(
                f"{self.name}: token {token} at frame position {position} is {where}; "
                f"position {position} (codebook {self.positions[position]}) takes "
                f"{allowed.start}..{allowed.stop - 1}"
            )
        return token - allowed.start

    def tokens_to_codes(self, tokens: Sequence[int], start: int = 0) -> list[int]:
        """Codes of a token stream whose first token sits at frame position ``start``."""
        f = self.frame_size
        return [self.token_to_code(t, (start + i) % f) for i, t in enumerate(tokens)]

    # ------------------------------------------------------------------ decoder side
    def split(self, codes: Sequence[int]) -> list[IntArray]:
        """Whole frames of flat codes -> one int64 array per codebook (time order).

        Refuses a partial frame or a code out of its codebook's range (nothing is decoded).
        """
        f = self.frame_size
        if len(codes) % f:
            raise FrameError(
                f"{self.name}: {len(codes)} codes are not whole frames of {f} "
                f"({len(codes) % f} left over)"
            )
        arr = np.asarray(codes, dtype=np.int64).reshape(-1, f)
        bad = (arr < 0) | (arr >= self.codebook_size)
        if bad.any():
            frame, pos = (int(v) for v in np.argwhere(bad)[0])
            raise FrameError(
                f"{self.name}: code {int(arr[frame, pos])} at frame {frame} position {pos} "
                f"is out of range for codebook {self.positions[pos]} (0..{self.codebook_size - 1})"
            )
        n = arr.shape[0]
        out: list[IntArray] = []
        for cb, per in enumerate(self.per_frame):
            cols = [p for p, c in enumerate(self.positions) if c == cb]
            # positions of one codebook in time order: the layout lists them in order
            out.append(arr[:, cols].reshape(n * per))
        return out

    def join(self, codebooks: Sequence[IntArray]) -> list[int]:
        """Inverse of :meth:`split` (tests, tools)."""
        n = len(codebooks[0]) // self.per_frame[0]
        arr = np.zeros((n, self.frame_size), dtype=np.int64)
        for cb, per in enumerate(self.per_frame):
            cols = [p for p, c in enumerate(self.positions) if c == cb]
            arr[:, cols] = np.asarray(codebooks[cb]).reshape(n, per)
        return [int(v) for v in arr.reshape(-1)]


ORPHEUS = CodecLayout(
    name="orpheus",
    codec="snac_24khz",
    codebook_size=4096,
    # position -> codebook; split() reads each codebook's positions in list order, so the
    # order of positions of one codebook must be its time order: cb1 at 1, 4; cb2 at 2, 3, 5, 6
    positions=(0, 1, 2, 2, 1, 2, 2),
    per_frame=(1, 2, 4),
    audio_base=128266,  # <custom_token_10>
    end_ids=(128258,),  # <end_of_speech>
    sample_rate=24000,
    samples_per_frame=2048,  # 4 steps of the finest codebook at hop 512
    prompt_prefix=(128259,),  # <start_of_human>
    prompt_suffix=(128009, 128260, 128261, 128257),  # eot, end_of_human, start_of_ai, speech
    default_voice="tara",
    voices=("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"),
)

LAYOUTS: dict[str, CodecLayout] = {ORPHEUS.name: ORPHEUS}


def get_layout(name: str) -> CodecLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise FrameError(f"unknown codec layout {name!r} (known: {', '.join(LAYOUTS)})") from None


__all__ = ["LAYOUTS", "ORPHEUS", "CodecLayout", "FrameError", "get_layout"]
