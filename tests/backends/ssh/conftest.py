"""The SSH tests' rule: every test in this folder leaves the test hosts as it found them.

The hosts (``ssh_hosts``), the CLI that reaches them (``ssh_cli``) and the check itself
(``no_stray_remote_processes``) are fixtures of tests/conftest.py, shared with the backend
contract test and the frameworks' tests; their helpers are tests/support/sshhosts.py and
sshcli.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _nothing_left_on_the_hosts(no_stray_remote_processes: None) -> None:
    """Runs ``no_stray_remote_processes`` (tests/conftest.py) around each test here."""
