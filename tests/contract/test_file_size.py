"""tools/file_size.py: the 500-line rule for product files, and that make lint runs it."""

from __future__ import annotations

from pathlib import Path

from tools.file_size import EXEMPT, LIMIT, main, oversize

ROOT = Path(__file__).resolve().parents[2]


def test_the_product_is_within_the_limit() -> None:
    assert oversize(ROOT) == []


def test_a_long_file_is_named_and_fails(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    errors = oversize(tmp_path)
    assert errors == [f"engine/long.py: {LIMIT + 1} lines (limit {LIMIT}): split it by job"]
    assert main(["file_size", str(tmp_path)]) == 1


def test_exempt_files_exist_and_say_why() -> None:
    for rel, why in EXEMPT.items():
        assert (ROOT / rel).is_file() and why


def test_make_lint_runs_it() -> None:
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.file_size" in lint
