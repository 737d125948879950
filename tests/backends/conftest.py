"""Fixtures every backend's tests share: the SSH test hosts, one bring-up per session.

Here rather than in ssh/conftest.py so that the backend contract test
(test_backend_contract.py), which runs against local and SSH alike, sees the same session of
hosts as the tests in ssh/ (see :func:`tests.backends.ssh.conftest.hosts_up`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends.ssh.conftest import SshHosts, hosts_up


@pytest.fixture(scope="session")
def ssh_hosts() -> Iterator[SshHosts]:
    """Three real SSH hosts h1..h3 for the whole session; torn down and checked clean at the end."""
    yield from hosts_up()
