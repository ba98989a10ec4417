"""The talker's codec-frame mask in torch alone: per-row state, one batched kernel sequence.

The vLLM logits processor (engine/stages/talker_logits.py) keeps a talker on whole codec
frames; the mask itself lives here so that it imports only torch: the default tier and a
bare GPU machine (``bench/talker_logits.py``) can run and test it without vLLM.

A row's spec is ``(audio_base, codebook_size, frame_size, end_ids)``. With ``position =
len(output_ids) % frame_size`` (the request's live list of sampled ids), the row keeps the
columns ``lo = base + position * size`` to ``lo + size - 1`` (those inside the vocabulary)
and, when ``position == 0``, its end ids; every other column becomes ``-inf``. Rows without
a spec are left alone, and so are row indices at or past ``logits.shape[0]``.

:class:`FrameMaskRows` holds the rows (added, removed, moved as vLLM's batch updates say)
and applies the mask to the whole batch with the same 19 kernels whatever the number of
rows: one host-to-device copy of the rows' output lengths; small ``(rows, 1)`` ops for the
positions and block starts; the kept values gathered (``rows x codebook size`` for the
block, ``rows x ends`` for the end ids) before one fill of the masked rows with ``-inf``
(a memset when every row has a spec, as in a talker's batch), and two ``scatter_`` that put
them back. Only the fill touches ``rows x V``. Entries that keep nothing (block columns
past the vocabulary, a row's shorter block, end ids away from a frame start, padding) all
point at one column per row and carry that column's own final value, so no two writes to
a column disagree. The per-row tensors and work space are rebuilt only when the rows change
or the batch's shape, dtype or device does.
:func:`reference_apply` is the loop it replaces (one clone, fill and assignment per row),
kept as the reference for the tests and the bench.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# (audio_base, codebook_size, frame_size, end ids)
Spec = tuple[int, int, int, tuple[int, ...]]
Rows = Mapping[int, tuple[Spec, Sequence[int]]]

_NO_OUTPUT: tuple[int, ...] = ()
LIMIT = 2**31  # token ids are int32 in vLLM; keeps every index the mask computes in int64


def check_spec(spec: Spec) -> Spec:
    """``spec`` if it is well-formed, else ``ValueError`` saying which part is not."""
    base, size, frame, ends = spec
    if base < 0:
        raise ValueError(f"audio base must be >= 0, got {base}")
    if size < 1 or frame < 1:
        raise ValueError(f"codebook size and frame size must be >= 1, got {size} and {frame}")
    if any(e < 0 for e in ends):
        raise ValueError(f"end ids must be >= 0, got {list(ends)}")
    if max(base, size, frame, *ends) >= LIMIT:
        raise ValueError(f"token ids and sizes must be < 2**31, got {spec}")
    return spec


def reference_apply(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The per-row mask (one clone, fill and assignment per row): O(rows) kernels a step."""
    for index, ((base, size, frame, ends), output_ids) in rows.items():
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


@dataclass(frozen=True)
class _Table:
    """The rows as tensors indexed by batch row ``0 .. n-1``.

    A row without a spec is given the block ``[0, 1)`` and no end ids: the scatters write
    its column 0 back unchanged, and the fill skips it.
    """

    key: tuple[int, int, Any, Any]  # (rows n, vocabulary V, dtype, device)
    outputs: list[Sequence[int]]  # the live output-id lists, () for rows without a spec
    masked: torch.Tensor | None  # (R,) int64: the rows with a spec to fill; None: all n
    base: torch.Tensor  # (n, 1) int64
    size: torch.Tensor  # (n, 1) int64
    frame: torch.Tensor  # (n, 1) int64; 1 for rows without a spec
    offsets: torch.Tensor  # (n, S) int64: 0 .. size-1, then V (S: the largest size, <= V)
    ends: torch.Tensor  # (n, E) int64: the end ids inside the vocabulary, padded with the first
    has_end: torch.Tensor  # (n, 1) bool: the row has an end id inside the vocabulary
    # work space for the (n, S) steps, reused every step (a fresh CPU tensor of this size
    # costs page faults that take longer than the op itself)
    raw: torch.Tensor  # int64
    valid: torch.Tensor  # bool
    block: torch.Tensor  # int64
    kept: torch.Tensor  # the logits' dtype
    minus_inf: torch.Tensor  # () the logits' dtype


def _build(rows: Rows, n: int, vocab: int, dtype: Any, device: Any) -> _Table:
    outputs: list[Sequence[int]] = [_NO_OUTPUT] * n
    masked: list[int] = []
    base, size, frame = [0] * n, [1] * n, [1] * n
    ends: list[list[int]] = [[]] * n
    for index, ((b, s, f, e), output_ids) in sorted(rows.items()):
        if index < n:
            outputs[index] = output_ids
            masked.append(index)
            base[index], size[index], frame[index] = b, s, f
            # an end id outside the vocabulary names no column (the reference would fail)
            ends[index] = [x for x in e if x < vocab]
    width = max([1, *map(len, ends)])
    padded = [e + [e[0] if e else 0] * (width - len(e)) for e in ends]

    def tensor(values: list[Any], dtype: Any = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).reshape(n, -1)

    sizes = tensor(size)
    # a block never keeps more than the vocabulary, however large its codebook size
    block = torch.arange(min(max(size), vocab), dtype=torch.int64, device=device).reshape(1, -1)
    shape = (n, block.shape[1])
    return _Table(
        key=(n, vocab, dtype, device),
        outputs=outputs,
        masked=None if len(masked) == n else torch.tensor(masked, dtype=torch.int64, device=device),
        base=tensor(base),
        size=sizes,
        frame=tensor(frame),
        offsets=torch.where(block < sizes, block, vocab),
        ends=tensor(padded),
        has_end=tensor([bool(e) for e in ends], torch.bool),
        raw=torch.empty(shape, dtype=torch.int64, device=device),
        valid=torch.empty(shape, dtype=torch.bool, device=device),
        block=torch.empty(shape, dtype=torch.int64, device=device),
        kept=torch.empty(shape, dtype=dtype, device=device),
        minus_inf=torch.full((), float("-inf"), dtype=dtype, device=device),
    )


class FrameMaskRows:
    """Batch row -> (spec, live output ids), and the frame mask applied to all rows at once."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[Spec, Sequence[int]]] = {}
        self._table: _Table | None = None

    def add(self, index: int, spec: Spec | None, output_ids: Sequence[int]) -> None:
        """A request enters batch row ``index`` (replacing any there); ``None``: no mask."""
        if spec is None:
            self.rows.pop(index, None)
        else:
            self.rows[index] = (check_spec(spec), output_ids)
        self._table = None

    def remove(self, index: int) -> None:
        self.rows.pop(index, None)
        self._table = None

    def move(self, a: int, b: int, swap: bool) -> None:
        """Row ``a`` moves to ``b``; ``swap``: ``b``'s moves to ``a``, else ``b``'s is gone."""
        ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
        if ra is not None:
            self.rows[b] = ra
        if swap and rb is not None:
            self.rows[a] = rb
        self._table = None

    def apply_per_row(self, logits: torch.Tensor) -> torch.Tensor:
        """The reference: :func:`reference_apply` on these rows."""
        return reference_apply(logits, self.rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` (rows x vocabulary) in place with a fixed number of torch ops."""
        if not self.rows or logits.shape[0] == 0:
            return logits
        n, vocab = int(logits.shape[0]), int(logits.shape[1])
        table = self._table
        if table is None or table.key != (n, vocab, logits.dtype, logits.device):
            table = self._table = _build(self.rows, n, vocab, logits.dtype, logits.device)
        # output_ids are vLLM's live lists: their lengths are read again at every step
        lengths = torch.tensor(
            [[len(o)] for o in table.outputs], dtype=torch.int64, device=logits.device
        )
        position = lengths % table.frame  # (n, 1), as every (n, 1) below
        lo = table.base + position * table.size
        inside = lo < vocab  # else the whole block is past the vocabulary: nothing kept
        # Column c = lo (or V-1) stands in for every entry that keeps nothing, so that all
        # writes to one column carry one value: lo's own where lo is kept, else -inf.
        c = lo.clamp(max=vocab - 1)
        raw = torch.add(lo, table.offsets, out=table.raw)  # the codebook's columns, padding
        block = torch.where(torch.lt(raw, vocab, out=table.valid), raw, c, out=table.block)
        kept = torch.gather(logits, 1, block, out=table.kept)
        kept = torch.where(inside, kept, table.minus_inf, out=kept)
        active = (position == 0) & table.has_end
        ends = torch.where(active, table.ends, c)
        end_kept = torch.where(active, logits.gather(1, ends), kept[:, :1])
        if table.masked is None:  # every row has a spec (a talker's batch): one memset
            logits.fill_(float("-inf"))
        else:
            logits.index_fill_(0, table.masked, float("-inf"))
        logits.scatter_(1, block, kept)
        # after the block: where c = V-1 is also an end id, the end's value is the last write
        return logits.scatter_(1, ends, end_kept)
