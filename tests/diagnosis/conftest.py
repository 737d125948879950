"""Fixtures that start real ranks; every process a test started is killed when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.diagranks import Starter
from tests.support.ranks import killed_at_end


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[Starter]:
    """Start ranks with the sidecar installed as sitecustomize; all are killed at the end."""
    yield from killed_at_end(Starter(tmp_path))
