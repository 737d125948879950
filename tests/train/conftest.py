"""Fixtures that start real ranks; every process a test started is killed when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from train_harness import Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Start ranks; all of them are killed when the test ends."""
    starter = Launcher(tmp_path)
    try:
        yield starter
    finally:
        starter.kill_all()


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Like ``launcher``, for runs shared by several tests of a module."""
    starter = Launcher(tmp_path_factory.mktemp("runs"))
    try:
        yield starter
    finally:
        starter.kill_all()
