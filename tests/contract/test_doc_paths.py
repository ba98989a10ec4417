"""tools/doc_paths.py: every repository path README.md and docs/ cite exists, with planted
stale paths and the spellings the check reads (folders, braces, globs, pytest nodes, links)."""

from __future__ import annotations

from pathlib import Path

from tools.doc_paths import DOCS, cited, main, missing

ROOT = Path(__file__).resolve().parents[2]


def _repo(tmp: Path, readme: str, doc: str = "") -> Path:
    for rel in ("engine/spans.py", "duplex_server/ops/tracing.py", "duplex_server/http/x.py"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text("")
    (tmp / "docs/figures").mkdir(parents=True)
    (tmp / "docs/figures/a.png").write_bytes(b"")
    (tmp / "tests/e2e").mkdir(parents=True)
    (tmp / "tests/e2e/test_soak.py").write_text("")
    (tmp / "README.md").write_text(readme)
    (tmp / "docs/guide.md").write_text(doc)
    return tmp


def test_the_repository_keeps_the_rule() -> None:
    assert missing(ROOT) == []
    assert main(["doc_paths", str(ROOT)]) == 0
    assert len(cited(ROOT)) > 100  # the check does read the docs


def test_a_stale_path_is_named_with_its_line(tmp_path: Path) -> None:
    root = _repo(
        tmp_path,
        "# x\nThe spans: `engine/spans.py`.\nOld: engine/tracing.py, and duplex_server/media.py.\n",
    )
    assert missing(root) == [
        "README.md:3: cites engine/tracing.py, which does not exist (moved? fix the doc)",
        "README.md:3: cites duplex_server/media.py, which does not exist (moved? fix the doc)",
    ]
    assert main(["doc_paths", str(root)]) == 1


def test_folders_braces_globs_nodes_and_links(tmp_path: Path) -> None:
    doc = "\n".join(
        [
            "rooms: duplex_server/{ops,http}/ and engine/",  # ok: both folders exist
            "a node: tests/e2e/test_soak.py::test_soak_runs, a glob: duplex_server/ops/*.py",
            "a placeholder: engine/... and configs/<name>.yaml; output: bench/results/x.json",
            "a link: [figure](figures/a.png), a URL: https://example.com/engine/nothing.py",
            "stale: duplex_server/{ops,transports}/ and tests/e2e/*.txt and [gone](gone.md)",
            "a folder that is gone: (`mk/vllm.mk`); a model id: Qwen/Qwen2.5-0.5B-Instruct",
        ]
    )
    root = _repo(tmp_path, "", doc)
    assert [m.split(": cites ")[1].split(",")[0] for m in missing(root)] == [
        "duplex_server/transports/",
        "tests/e2e/*.txt",
        "docs/gone.md",
        "mk/vllm.mk",
    ]


def test_the_docs_checked_include_readme_and_docs() -> None:
    assert "README.md" in DOCS and "docs/**/*.md" in DOCS
    lint = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.doc_paths" in lint
