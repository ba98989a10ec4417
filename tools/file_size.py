"""No product source file over 500 lines and no class over the object limit, checked.

A newcomer should be able to read any module in one sitting, so every ``.py`` file of the
product packages stays at or under :data:`LIMIT` lines. Declarative files (long lists of
small structs with nothing to follow between them) are exempt by name in :data:`EXEMPT`,
each with the reason. A file is not the only unit: each class is also measured with its
in-house bases (400 lines, 25 methods; :mod:`tools.class_size` says how). Exit status 1
and one line per file or class over the limit: ``python -m tools.file_size [ROOT]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools.class_size import LINES, METHODS, oversize_classes

LIMIT = 500
PACKAGES = ("audio_kit", "duplex_contract", "duplex_server", "engine", "clients")
EXEMPT = {
    # the OpenAI Realtime wire events: ~90 small msgspec structs, one per event type
    "duplex_server/protocol/events.py": "declarative: one small struct per wire event",
}


def oversize(root: Path) -> list[str]:
    """One message per product file over the limit and not exempt."""
    out: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in EXEMPT or "node_modules" in path.parts:
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > LIMIT:
                out.append(f"{rel}: {lines} lines (limit {LIMIT}): split it by job")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path.cwd()
    errors = oversize(root) + oversize_classes(root)
    for line in errors:
        print(line)
    if errors:
        return 1
    print(f"file size: ok (files <= {LIMIT} lines, classes <= {LINES} lines / {METHODS} methods)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
