"""Fixtures for the probe tests (helpers live in probe_support.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture()
def chdir_tmp(tmp_path: Path) -> Iterator[Path]:
    """Run the test inside ``tmp_path``."""
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)
