"""The talker's batched frame mask equals the per-row reference, and its op count is flat.

engine/stages/talker_mask.py needs only torch, so these tests need no vLLM engine; they sit
in the vLLM tier because that venv is where torch is installed (the default one has none).
Equality is exact: the same columns become -inf and every kept value is the same bits.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from engine.stages.talker_mask import (  # noqa: E402
    FrameMaskRows,
    Spec,
    check_spec,
    reference_apply,
)

pytestmark = pytest.mark.vllm

ORPHEUS_VOCAB = 156_940
ORPHEUS_SPEC: Spec = (128_266, 4096, 7, (128_258,))


@st.composite
def specs(draw: st.DrawFn, vocab: int) -> Spec:
    size = draw(st.integers(1, max(1, vocab // 3)))
    # a base near the end makes later positions run past the vocabulary (kept: nothing)
    base = draw(st.integers(0, vocab))
    frame = draw(st.integers(1, 8))
    ends = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
    return base, size, frame, ends


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, int, dict[int, tuple[Spec, list[int]]], int]:
    vocab = draw(st.integers(2, 300))
    n = draw(st.integers(1, 12))
    # row indices with holes, some past the logits' rows (ignored); the rest have no spec
    indices = draw(st.lists(st.integers(0, n + 3), unique=True, max_size=n + 4))
    if draw(st.booleans()):  # every row masked, as in a talker's batch
        indices = sorted({*range(n), *indices})
    rows: dict[int, tuple[Spec, list[int]]] = {}
    for index in indices:
        spec = draw(specs(vocab))
        # lengths at frame starts (where the end ids count) as often as anywhere else
        k = draw(st.integers(0, 5))
        length = k * spec[2] if draw(st.booleans()) else k * spec[2] + draw(st.integers(0, 7))
        rows[index] = (spec, [0] * length)
    seed = draw(st.integers(0, 2**31 - 1))
    return vocab, n, rows, seed


def random_logits(n: int, vocab: int, seed: int, dtype: Any = None) -> Any:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float32) * 10
    # some -inf already there (another processor's ban): they stay -inf either way
    logits[torch.rand(n, vocab, generator=gen) < 0.05] = float("-inf")
    return logits.to(dtype or torch.float32)


def assert_same(got: Any, want: Any) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want), (got != want).nonzero()[:5]


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from(["float32", "bfloat16", "float16"]), st.integers(1, 4))
def test_batched_mask_equals_the_per_row_reference(
    batch: tuple[int, int, dict[int, tuple[Spec, list[int]]], int], dtype: str, steps: int
) -> None:
    vocab, n, rows, seed = batch
    mask = FrameMaskRows()
    for index, (spec, output_ids) in rows.items():
        mask.add(index, spec, output_ids)
    for step in range(steps):
        logits = random_logits(n, vocab, seed + step, getattr(torch, dtype))
        want = reference_apply(logits.clone(), rows)
        got = mask.apply(logits)
        assert got is logits  # in place, as vLLM expects
        assert_same(got, want)
        # vLLM appends to the live lists between steps: positions move on, tables stay cached
        for index, (_, output_ids) in rows.items():
            output_ids.extend([0] * (index % 3))


def finite_columns(row: Any) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_orpheus_frame_positions_keep_their_codebook_and_the_end_only_at_frame_starts() -> None:
    base, size, frame, (end,) = ORPHEUS_SPEC
    mask = FrameMaskRows()
    lengths = [0, 1, 6, 7, 9, 13]  # positions 0, 1, 6, 0, 2, 6
    outputs = [[0] * length for length in lengths]
    for index, output_ids in enumerate(outputs):
        mask.add(index, ORPHEUS_SPEC, output_ids)
    mask.add(len(lengths), None, [])  # a request without the processor: untouched
    logits = torch.randn(len(lengths) + 1, ORPHEUS_VOCAB)
    before = logits.clone()
    mask.apply(logits)
    for index, length in enumerate(lengths):
        p = length % frame
        lo = base + p * size
        expect = set(range(lo, lo + size)) | ({end} if p == 0 else set())
        assert finite_columns(logits[index]) == expect
        kept = sorted(expect)
        assert torch.equal(logits[index, kept], before[index, kept])
    assert torch.equal(logits[-1], before[-1])


def test_a_block_past_the_vocabulary_keeps_only_what_is_inside() -> None:
    mask = FrameMaskRows()
    mask.add(0, (8, 4, 3, (1,)), [0])  # position 1: columns 12..15 of a 14-column vocabulary
    mask.add(1, (8, 4, 3, (1, 99)), [0] * 2)  # position 2: 16..19, none inside
    mask.add(2, (8, 4, 3, (1, 99)), [])  # position 0: 8..11 and end 1 (99 names no column)
    mask.add(3, (20, 4, 3, (13, 2)), [])  # no block at all; ends 13 (the last column) and 2
    mask.add(4, (20, 4, 3, (13, 2)), [0])  # ... away from a frame start: nothing
    mask.add(5, (3, 2**30, 2, ()), [])  # a codebook larger than the vocabulary: 3..13
    logits = torch.arange(6 * 14, dtype=torch.float32).reshape(6, 14)
    want = reference_apply(logits.clone(), {i: r for i, r in mask.rows.items() if i != 2})
    mask.apply(logits)
    assert finite_columns(logits[0]) == {12, 13}
    assert finite_columns(logits[1]) == set()
    assert finite_columns(logits[2]) == {1, 8, 9, 10, 11}
    assert finite_columns(logits[3]) == {2, 13}
    assert finite_columns(logits[4]) == set()
    assert finite_columns(logits[5]) == set(range(3, 14))
    assert_same(logits[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]])  # the reference fails on 2: 99


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ((-1, 4, 7, ()), "audio base must be >= 0"),
        ((0, 0, 7, ()), "codebook size and frame size must be >= 1"),
        ((0, 4, 0, ()), "codebook size and frame size must be >= 1"),
        ((0, 4, 7, (3, -2)), "end ids must be >= 0"),
        ((2**31, 4, 7, ()), "token ids and sizes must be < 2\\*\\*31"),
        ((0, 4, 7, (2**40,)), "token ids and sizes must be < 2\\*\\*31"),
    ],
)
def test_malformed_specs_are_refused_naming_the_part(spec: Spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_spec(spec)
    with pytest.raises(ValueError, match=message):
        FrameMaskRows().add(0, spec, [])


# --- batch updates: added / removed / moved (SWAP and UNIDIRECTIONAL) -------------------

Op = tuple[str, int, int, int]  # (kind, a, b, spec choice)
SPECS: list[Spec] = [(10, 5, 3, (1,)), (2, 7, 2, (0, 40)), (20, 3, 4, ()), (0, 50, 1, (49,))]
VOCAB = 60


class SlotModel:
    """vLLM's persistent batch as slots: what each row holds after each kind of update."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[Spec, list[int]] | None] = {}

    def do(self, op: Op) -> None:
        kind, a, b, choice = op
        if kind == "add":
            spec = SPECS[choice] if choice < len(SPECS) else None
            self.slots[a] = None if spec is None else (spec, [0] * (a + choice))
        elif kind == "remove":
            self.slots[a] = None
        elif kind == "swap":
            self.slots[a], self.slots[b] = self.slots.get(b), self.slots.get(a)
        else:  # unidirectional a -> b: b's request is replaced, a's slot is empty
            self.slots[b], self.slots[a] = self.slots.get(a), None

    def rows(self) -> dict[int, tuple[Spec, list[int]]]:
        return {i: s for i, s in self.slots.items() if s is not None}


def drive(mask: FrameMaskRows, model: SlotModel, op: Op) -> None:
    kind, a, b, _ = op
    model.do(op)
    if kind == "add":
        entry = model.slots[a]
        mask.add(a, None if entry is None else entry[0], [] if entry is None else entry[1])
    elif kind == "remove":
        mask.remove(a)
    else:
        mask.move(a, b, swap=kind == "swap")


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "remove", "swap", "unidirectional"]),
        st.integers(0, 7),
        st.integers(0, 7),
        st.integers(0, len(SPECS)),  # len(SPECS): a request without the processor
    ).filter(lambda op: op[0] in ("add", "remove") or op[1] != op[2]),  # vLLM never moves a to a
    max_size=25,
)


def check_step(mask: FrameMaskRows, model: SlotModel, seed: int) -> None:
    logits = random_logits(6, VOCAB, seed)  # rows 6 and 7 are past the batch: ignored
    want = reference_apply(logits.clone(), model.rows())
    assert_same(mask.apply(logits.clone()), want)
    assert_same(mask.apply_per_row(logits.clone()), want)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 2**31 - 1))
def test_moves_keep_each_request_on_its_row(updates: list[Op], seed: int) -> None:
    mask, model = FrameMaskRows(), SlotModel()
    for step, op in enumerate(updates):
        drive(mask, model, op)
        if step % 3 == 0:  # apply between some updates: the cached tables must follow
            check_step(mask, model, seed + step)
        for _, output_ids in model.rows().values():
            output_ids.append(0)
    check_step(mask, model, seed)


def count_ops(fn: Any, logits: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(logits)
    # top-level aten ops (an op's own sub-calls are not separate launches), views included
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def orpheus_batch(rows: int) -> tuple[FrameMaskRows, list[list[int]]]:
    mask = FrameMaskRows()
    outputs = [[0] * (i % 7) for i in range(rows)]
    for index, output_ids in enumerate(outputs):
        mask.add(index, ORPHEUS_SPEC, output_ids)
    return mask, outputs


def test_the_batched_mask_runs_the_same_ops_for_1_and_64_rows() -> None:
    counts: dict[int, tuple[int, int]] = {}
    for rows in (1, 64):
        mask, outputs = orpheus_batch(rows)
        logits = torch.randn(rows, ORPHEUS_VOCAB)
        mask.apply(logits.clone())  # builds the cached tables
        for output_ids in outputs:
            output_ids.append(0)
        counts[rows] = (
            count_ops(mask.apply, logits.clone()),
            count_ops(mask.apply_per_row, logits),
        )
    assert counts[1][0] == counts[64][0] <= 24, counts  # 19 kernels, tensor creation, views
    assert counts[64][1] > 20 * counts[1][1], counts  # the reference grows with the rows


def test_an_empty_batch_and_no_rows_leave_logits_alone() -> None:
    mask = FrameMaskRows()
    logits = torch.randn(3, 20)
    assert torch.equal(mask.apply(logits.clone()), logits)
    mask.add(5, (0, 4, 2, ()), [])
    assert torch.equal(mask.apply(logits.clone()), logits)  # row 5 is past the batch
    empty = torch.empty(0, 20)
    assert mask.apply(empty) is empty


# --- the vLLM processor itself (needs vLLM's classes, not an engine) -------------------


def batch_update(op: Op, model: SlotModel, batch_size: int) -> Any:
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    kind, a, b, _ = op
    removed: list[int] = []
    added: list[Any] = []
    moved: list[Any] = []
    if kind == "add":
        entry = model.slots[a]
        extra = None if entry is None else {"codec_frames": [*entry[0][:3], list(entry[0][3])]}
        params = SamplingParams(extra_args=extra)
        added.append((a, params, [1, 2, 3], [] if entry is None else entry[1]))
    elif kind == "remove":
        removed.append(a)
    else:
        swap = MoveDirectionality.SWAP if kind == "swap" else MoveDirectionality.UNIDIRECTIONAL
        moved.append((a, b, swap))
    return BatchUpdate(batch_size=batch_size, removed=removed, added=added, moved=moved)


@settings(max_examples=100, deadline=None)
@given(ops, st.integers(0, 2**31 - 1))
def test_the_vllm_processor_follows_batch_updates(updates: list[Op], seed: int) -> None:
    pytest.importorskip("vllm")
    from engine.stages.talker_logits import CodecFrameLogits

    proc = CodecFrameLogits(None, torch.device("cpu"), False)
    model = SlotModel()
    for step, op in enumerate(updates):
        model.do(op)
        proc.update_state(batch_update(op, model, 6))
        logits = random_logits(6, VOCAB, seed + step)
        want = reference_apply(logits.clone(), model.rows())
        assert_same(proc.apply(logits.clone()), want)
        assert_same(proc.apply_per_row(logits), want)
        for _, output_ids in model.rows().values():
            output_ids.append(0)


def test_the_vllm_processor_refuses_malformed_specs() -> None:
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from engine.stages.talker_logits import CodecFrameLogits

    for spec, message in [
        ([0, 0, 7, []], "codebook size and frame size must be >= 1"),
        ([0, 4, 7, [-1]], "end ids must be >= 0"),
        ([0, 4], "expected \\[base, size, frame, \\[ends\\]\\]"),
        ([0, 4, 7, "x"], "expected \\[base, size, frame, \\[ends\\]\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            CodecFrameLogits.validate_params(SamplingParams(extra_args={"codec_frames": spec}))
    # the in-process form, and the flat form vllm_xargs carries (a remote talker's request)
    for spec in ([0, 4, 7, [3]], [0, 4, 7, 3], [0, 4, 7]):
        CodecFrameLogits.validate_params(SamplingParams(extra_args={"codec_frames": spec}))
