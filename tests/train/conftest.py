"""Fixtures that start real ranks; every process a test started is killed when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ranks import killed_at_end
from tests.support.trainranks import Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Start ranks; all of them are killed when the test ends."""
    yield from killed_at_end(Launcher(tmp_path))


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Like ``launcher``, for runs shared by several tests of a module."""
    yield from killed_at_end(Launcher(tmp_path_factory.mktemp("runs")))
