"""Without the ``[ssh]`` extra (Fabric, paramiko) an SSH probe names the pip command for every
host instead of ``ModuleNotFoundError: paramiko`` (issue #33, item 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

WITHOUT_EXTRA = (
    "import runpy, sys\n"
    "sys.modules['fabric'] = None  # as if never installed: importing it fails\n"
    "sys.modules['paramiko'] = None\n"
    "sys.argv = ['orchestrate', *sys.argv[1:]]\n"
    "runpy.run_module('orchestrate', run_name='__main__')\n"
)


def test_a_missing_ssh_extra_names_the_pip_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, "inventory", "probe", "198.18.8.99",
         "198.18.8.98", "--no-torch", "--connect-timeout", "1"],
        capture_output=True, text=True, timeout=120, check=False)
    said = " ".join((proc.stdout + proc.stderr).split())
    # One sentence for the whole probe (not one per host), a mistake of the install: exit 2.
    assert proc.returncode == 2, said
    assert said.count("pip install 'orchestrate[ssh]'") == 1, said
    assert "needs fabric (orchestrate's [ssh] extra)" in said, said
    assert "Traceback" not in said
