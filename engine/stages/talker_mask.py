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
and applies the mask to the whole batch with a fixed sequence of 12 kernels whatever
the number of rows: one host-to-device copy of the rows' output lengths, a few ``(rows,)``
ops for the bounds, two comparisons against a cached column range, one ``scatter_`` for the
end ids (padded per row to the longest list with a spare column past the vocabulary) and
one ``masked_fill_``. The per-row tensors (base, size, frame, end ids, by batch row) are
rebuilt only when the rows change or the batch's shape or device does.
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


def check_spec(spec: Spec) -> Spec:
    """``spec`` if it is well-formed, else ``ValueError`` saying which part is not."""
    base, size, frame, ends = spec
    if base < 0:
        raise ValueError(f"audio base must be >= 0, got {base}")
    if size < 1 or frame < 1:
        raise ValueError(f"codebook size and frame size must be >= 1, got {size} and {frame}")
    if any(e < 0 for e in ends):
        raise ValueError(f"end ids must be >= 0, got {list(ends)}")
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
    """The rows as tensors indexed by batch row ``0 .. n-1`` (no spec: keeps every column)."""

    key: tuple[int, int, Any]  # (rows n, vocabulary V, device)
    outputs: list[Sequence[int]]  # the live output-id lists, () for rows without a spec
    base: torch.Tensor  # (n, 1) int64
    size: torch.Tensor  # (n, 1) int64; V + 1 for rows without a spec
    frame: torch.Tensor  # (n, 1) int64; 1 for rows without a spec
    ends: torch.Tensor  # (n, E) int64; padded with V (the spare column)
    columns: torch.Tensor  # (1, V + 1) int64: 0 .. V


def _build(rows: Rows, n: int, vocab: int, device: Any) -> _Table:
    outputs: list[Sequence[int]] = [_NO_OUTPUT] * n
    base = [0] * n
    size = [vocab + 1] * n
    frame = [1] * n
    ends: list[tuple[int, ...]] = [()] * n
    for index, ((b, s, f, e), output_ids) in rows.items():
        if index < n:
            outputs[index] = output_ids
            base[index], size[index], frame[index] = b, s, f
            # an end id outside the vocabulary names no column: it goes to the spare one
            ends[index] = tuple(x if x < vocab else vocab for x in e)
    width = max([1, *map(len, ends)])
    padded = [list(e) + [vocab] * (width - len(e)) for e in ends]

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device).reshape(n, 1)

    return _Table(
        key=(n, vocab, device),
        outputs=outputs,
        base=column(base),
        size=column(size),
        frame=column(frame),
        ends=torch.tensor(padded, dtype=torch.int64, device=device).reshape(n, width),
        columns=torch.arange(vocab + 1, dtype=torch.int64, device=device).reshape(1, -1),
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
        if table is None or table.key != (n, vocab, logits.device):
            table = self._table = _build(self.rows, n, vocab, logits.device)
        # output_ids are vLLM's live lists: their lengths are read again at every step
        lengths = torch.tensor(
            [[len(o)] for o in table.outputs], dtype=torch.int64, device=logits.device
        )
        position = lengths % table.frame  # (n, 1), as lo and hi
        lo = table.base + position * table.size
        hi = lo + table.size
        ends = torch.where(position == 0, table.ends, vocab)
        drop = (table.columns < lo) | (table.columns >= hi)  # (n, V + 1)
        drop.scatter_(1, ends, False)
        return logits.masked_fill_(drop[:, :vocab], float("-inf"))
