from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import TEST_YAML, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The real server on configs/test.yaml (test stage), shared by one module's tests."""
    with running_server(Path(TEST_YAML)) as addr:
        yield addr
