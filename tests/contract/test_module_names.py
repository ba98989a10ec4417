"""Module names: no two product modules share a file name, but for the names
docs/development.md ("Module names") keeps on purpose, each with its reason."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tools.product import product_files

ROOT = Path(__file__).resolve().parents[2]

#: the names kept in several packages on purpose (docs/development.md says why)
KEPT = frozenset(
    {"errors.py", "config.py", "voices.py", "client.py", "events.py", "audio_input.py"}
)


def _shared(root: Path) -> dict[str, list[str]]:
    paths: dict[str, list[str]] = defaultdict(list)
    for path in product_files(root):
        if path.name != "__init__.py":
            paths[path.name].append(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_only_the_kept_names_are_used_twice() -> None:
    shared = _shared(ROOT)
    assert set(shared) <= KEPT, {n: p for n, p in shared.items() if n not in KEPT}


def test_each_kept_name_is_used_twice_and_explained() -> None:
    shared = _shared(ROOT)
    section = (ROOT / "docs/development.md").read_text().split("## Module names", 1)[1]
    section = section.split("\n## ", 1)[0]
    for name in sorted(KEPT):
        assert name in shared, f"{name} is no longer used twice: drop it from KEPT and the docs"
        assert f"- `{name}`:" in section, name


def test_a_name_used_twice_is_found(tmp_path: Path) -> None:
    for rel in ("engine/a/thing.py", "duplex_server/thing.py", "engine/a/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "duplex_server/__init__.py").write_text("")
    assert _shared(tmp_path) == {"thing.py": ["duplex_server/thing.py", "engine/a/thing.py"]}
