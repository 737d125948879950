"""Fixtures for the core's tests (helpers live in core_support.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from core_support import REPO


@pytest.fixture()
def chdir_tmp(tmp_path: Path) -> Iterator[Path]:
    """Run the test inside ``tmp_path``."""
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def _slurm_fixtures() -> Any:
    """The real Slurm test cluster fixture of tests/backends/slurm, for the few tests here that
    submit."""
    path = REPO / "tests" / "backends" / "slurm" / "conftest.py"
    spec = importlib.util.spec_from_file_location("orchestrate_slurm_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


slurm_cluster = _slurm_fixtures().slurm_cluster
