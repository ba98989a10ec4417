"""The product's Python source as the checks see it: its folders, its files, their import names.

The product is the five packages the wheel installs (docs/development.md, "Import names");
``clients/`` is a source root of its own, so ``clients/duplex_client/client.py`` is
``duplex_client.client``. Tests, bench and tools are not product code.
"""

from __future__ import annotations

import ast
from pathlib import Path

#: the product's folders, relative to the repository root
PACKAGES = ("audio_kit", "duplex_contract", "duplex_server", "engine", "clients/duplex_client")
#: the product's top-level import names
FIRST_PARTY = ("audio_kit", "duplex_contract", "duplex_server", "duplex_client", "engine")


def product_files(root: Path) -> list[Path]:
    """Every ``.py`` file of the product, in a stable order."""
    return [p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))]


def module_of(path: Path, root: Path) -> str:
    """The import name of a product file (a package by its ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "clients":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def first_party(module: str) -> bool:
    return module.split(".")[0] in FIRST_PARTY


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` in ``module`` imports from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)
