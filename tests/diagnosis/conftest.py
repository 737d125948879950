"""Fixtures that start real ranks; every process a test started is killed when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from diag_harness import Starter


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[Starter]:
    """Start ranks with the sidecar installed as sitecustomize; all are killed at the end."""
    jobs = Starter(tmp_path)
    try:
        yield jobs
    finally:
        jobs.kill_all()
