"""The wheel's import names (docs/development.md, "Import names"): the five top-level
packages pyproject.toml installs, and no other installed distribution that provides one."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("audio_kit", "duplex_contract", "duplex_server", "engine", "duplex_client")


def test_pyproject_installs_exactly_the_documented_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{name}*" for name in NAMES)
    development = (ROOT / "docs/development.md").read_text()
    assert all(f"`{name}`" in development for name in NAMES)


def test_no_other_installed_distribution_provides_one_of_them() -> None:
    """A generic name (``engine``) is safe while no dependency ships it too."""
    owners = importlib.metadata.packages_distributions()
    for name in NAMES:
        assert set(owners.get(name, ["duplex-server"])) == {"duplex-server"}, (name, owners[name])
