"""The shipped examples and inventories stay valid, and what they render passes shellcheck."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted(ROOT.glob("examples/**/*.yaml"))
INVENTORIES = sorted(ROOT.glob("inventory/*.yaml"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("path", INVENTORIES + JOBS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_validates(path: Path) -> None:
    proc = _cli("validate", str(path))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", JOBS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_renders_clean_scripts(path: Path, tmp_path: Path) -> None:
    proc = _cli("render", str(path), "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    scripts = [p for p in tmp_path.iterdir() if p.suffix in (".sh", ".sbatch")]
    assert scripts
    check = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
