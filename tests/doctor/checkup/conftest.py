"""Fixtures that start real checkup ranks; every process a test started is killed at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from checkup_harness import Starter


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[Starter]:
    """Start checkup ranks; all of them are killed when the test ends."""
    ranks = Starter(tmp_path)
    try:
        yield ranks
    finally:
        ranks.kill_all()


@pytest.fixture(scope="module")
def module_starter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Starter]:
    """Like ``starter``, for runs shared by several tests of a module."""
    ranks = Starter(tmp_path_factory.mktemp("checkups"))
    try:
        yield ranks
    finally:
        ranks.kill_all()
