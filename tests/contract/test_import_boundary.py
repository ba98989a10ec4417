"""The layering rule: the protocol core and the SDK import no engine module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tools.import_boundary import check, main

ROOT = Path(__file__).resolve().parents[2]


def _copy_layers(tmp: Path) -> Path:
    for rel in ("duplex_contract", "duplex_server/protocol", "clients/duplex_client"):
        shutil.copytree(ROOT / rel, tmp / rel, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "duplex_server/__init__.py", tmp / "duplex_server/__init__.py")
    return tmp


def test_the_repository_keeps_the_rule() -> None:
    assert check(ROOT) == []
    assert main(["import_boundary", str(ROOT)]) == 0


def test_a_planted_engine_import_in_the_core_fails(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    assert check(root) == []
    target = root / "duplex_server/protocol/session.py"
    # hidden inside a function, where a module-level scan would miss it
    target.write_text(
        target.read_text() + "\n\ndef _sneaky() -> None:\n    from engine.errors import X\n"
    )
    errors = check(root)
    assert len(errors) == 1 and "protocol/session.py" in errors[0]
    assert "the protocol core imports engine.errors" in errors[0]
    assert main(["import_boundary", str(root)]) == 1


def test_planted_violations_in_the_sdk_and_the_contract_fail(tmp_path: Path) -> None:
    root = _copy_layers(tmp_path)
    sdk = root / "clients/duplex_client/client.py"
    sdk.write_text(sdk.read_text() + "\nimport engine.messages\n")
    contract = root / "duplex_contract/fence.py"
    contract.write_text(contract.read_text() + "\nfrom duplex_server.protocol import events\n")
    core = root / "duplex_server/protocol/codec.py"  # the core may not reach the adapters
    core.write_text(core.read_text() + "\nfrom .. import turns\n")
    errors = "\n".join(check(root))
    assert "client SDK imports engine.messages" in errors
    assert "contract imports duplex_server.protocol" in errors
    assert "protocol core imports duplex_server.turns" in errors


def test_importing_the_sdk_and_the_core_loads_no_engine_module() -> None:
    code = (
        "import sys, duplex_client, duplex_client.cli, duplex_server.protocol.session;"
        "bad = sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
