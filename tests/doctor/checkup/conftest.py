"""Fixtures that start real checkup ranks; every process a test started is killed at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkupranks import Starter
from tests.support.ranks import killed_at_end


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[Starter]:
    """Start checkup ranks; all of them are killed when the test ends."""
    yield from killed_at_end(Starter(tmp_path))


@pytest.fixture(scope="module")
def module_starter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Starter]:
    """Like ``starter``, for runs shared by several tests of a module."""
    yield from killed_at_end(Starter(tmp_path_factory.mktemp("checkups")))
