"""The whole suite's hooks: every test carries one tier mark, and ``unit`` tests are guarded
(tests/support/tiers.py says why and how)."""

from __future__ import annotations

import pytest

from tests.support import tiers

pytest_plugins = ["pytester"]  # tests/support/test_tiers.py runs small suites inline


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the resolved tiers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.resolve(items)


pytest_runtest_setup = tiers.guarded_setup
pytest_runtest_call = tiers.guarded_call
pytest_runtest_teardown = tiers.guarded_teardown
