from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import REALTIME_TTS, running_server, write_config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real server on configs/test.yaml with a real-time test TTS (replies last long
    enough to interrupt or cut), shared by one module's tests."""
    path = write_config(tmp_path_factory.mktemp("client"), engine=REALTIME_TTS)
    with running_server(Path(path)) as addr:
        yield addr
