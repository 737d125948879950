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
    assert proc.returncode == 1, said
    for host in ("198.18.8.99", "198.18.8.98"):
        assert (f"{host}: SSH needs the [ssh] extra (fabric is not installed): "
                "pip install 'orchestrate[ssh]'") in said, said
    assert "Traceback" not in said
