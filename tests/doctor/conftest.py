"""Fixtures for the doctor's tests: the local backend's CLI runner (a private job store)."""

from tests.backends.local.conftest import cli  # noqa: F401  (the fixture, shared with tests/backends/local)
