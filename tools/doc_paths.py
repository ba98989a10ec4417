"""Every repository path the docs cite exists, checked (docs stay true after moves).

The documents (:data:`DOCS`: README.md, docs/, the notes under clients/) cite files by
their path from the repository root: ``duplex_server/session/live.py``, ``configs/cpu.yaml``,
``tests/e2e/test_soak.py::test_name``, ``bench/realtime.py``. A move that forgets one leaves
a reader at a file that is not there. A cited path is a word, in prose or code, that starts
with one of the repository's top-level folders (:data:`ROOTS`) and a ``/``, or any word
with a ``/`` that ends in a file type of the repository (:data:`FILE_TYPES`: a folder that
is gone, ``mk/vllm.mk``, is caught too; ``Qwen/Qwen2.5-0.5B``, a model id, is not a path):

* a trailing ``/`` names a folder; ``{a,b}`` is expanded (``duplex_server/{ops,http}/``);
  a ``*`` is a glob that must match something; ``::name`` (a pytest node) is dropped;
* words with ``...`` or ``<...>`` are placeholders (``engine/...``), not paths;
* what the tools write or install (:data:`GENERATED`, ignored by git: the benches' results,
  wscat's ``clients/node_modules/``) is not in a fresh clone.

Relative Markdown links (``[text](figures/x.png)``) are checked from the document's own
folder. Exit status 1 and one line per missing path: ``python -m tools.doc_paths [ROOT]``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOTS = (
    "audio_kit",
    "duplex_contract",
    "duplex_server",
    "engine",
    "clients",
    "tests",
    "configs",
    "bench",
    "docs",
    "tools",
    "deploy",
    ".ci",
)
#: the documents checked, globs from the repository root
DOCS = ("README.md", "docs/**/*.md", "clients/*.md")
#: paths the tools write or install (git-ignored): cited as where to find their output
GENERATED = ("bench/results/", "clients/node_modules/")

#: the endings of a repository file's name
FILE_TYPES = "py md mk yaml yml json toml sh cfg js css html png wav txt".split()

_ROOTS = "|".join(re.escape(r) for r in ROOTS)
_TYPES = "|".join(FILE_TYPES)
#: a path word: a top-level folder, a slash, then path characters; or a word with a slash
#: that ends in a file type (never after a word, a slash or a dot: ``http://host/docs/x``
#: and ``a.engine/b`` are not cited paths)
PATH = re.compile(
    rf"(?<![\w/.\-])((?:{_ROOTS})/[\w./{{}},*\-:<>]*|(?:[\w.\-]+/)+[\w.\-]+\.(?:{_TYPES})\b)"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Cited:
    doc: str
    line: int
    path: str


def _expand(word: str) -> list[str]:
    """``a/{b,c}/d`` -> ``a/b/d``, ``a/c/d`` (nested braces are not used)."""
    match = re.search(r"\{([^{}]*)\}", word)
    if match is None:
        return [word]
    head, tail = word[: match.start()], word[match.end() :]
    return [w for part in match.group(1).split(",") for w in _expand(head + part + tail)]


def _clean(word: str) -> str | None:
    word = word.split("::", 1)[0]
    if "..." in word or "<" in word or ">" in word:
        return None
    return word.rstrip(".,:;")


def cited(root: Path) -> list[Cited]:
    """Every repository path the documents cite, with where."""
    out: list[Cited] = []
    docs = sorted({p for pattern in DOCS for p in root.glob(pattern)})
    for doc in docs:
        rel = doc.relative_to(root).as_posix()
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            links = [m.span(1) for m in LINK.finditer(line)]
            for match in PATH.finditer(line):
                word = _clean(match.group(1))
                if word and not any(a <= match.start() < b for a, b in links):
                    out += [Cited(rel, number, w) for w in _expand(word)]
            for match in LINK.finditer(line):  # relative to the document's folder
                target = match.group(1).split("#", 1)[0]
                if target and "://" not in target and not target.startswith("mailto:"):
                    resolved = (doc.parent / target).resolve()
                    if resolved.is_relative_to(root.resolve()):
                        path = resolved.relative_to(root.resolve()).as_posix()
                        out.append(Cited(rel, number, path))
    return out


def _exists(root: Path, path: str) -> bool:
    if any(path.startswith(g) for g in GENERATED):
        return True
    if "*" in path:
        return any(root.glob(path))
    target = root / path
    return target.is_dir() if path.endswith("/") else target.exists()


def missing(root: Path) -> list[str]:
    """One message per cited path that does not exist."""
    return [
        f"{c.doc}:{c.line}: cites {c.path}, which does not exist (moved? fix the doc)"
        for c in cited(root)
        if not _exists(root, c.path)
    ]


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path.cwd()
    errors = missing(root)
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        print(f"doc paths: {len(errors)} missing", file=sys.stderr)
        return 1
    print(f"doc paths: ok ({len(cited(root))} cited paths exist)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
