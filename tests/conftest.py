"""The whole suite's hooks: every test carries one tier mark, and ``unit`` tests are guarded
(tests/support/tiers.py says why and how)."""

from __future__ import annotations

import signal

import pytest

from tests.support import busy, tiers

pytest_plugins = ["pytester"]  # tests/support/test_tiers.py runs small suites inline


def pytest_addoption(parser: pytest.Parser) -> None:
    busy.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()
    # A run started as a background job of a script (``cmd &``) inherits SIGINT ignored, and so
    # would every process the tests start: the tests that press Ctrl-C on the CLI need it
    # delivered as a terminal delivers it. A caught signal is reset to the default in children.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    busy.start(config)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the resolved tiers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.resolve(items)
    tiers.group(items)


pytest_runtest_setup = tiers.guarded_setup
pytest_runtest_call = tiers.guarded_call
pytest_runtest_teardown = tiers.guarded_teardown


@pytest.fixture(autouse=True)
def private_lease_book(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets a lease book of its own (``ORCHESTRATE_LEASES``, inherited by every
    orchestrate it starts): the machine's shared book (/var/tmp/orchestrate/leases) would let a
    job of one test session -- another engineer's, on a shared box -- refuse another's. Tests of
    the shared book itself set their own."""
    monkeypatch.setenv("ORCHESTRATE_LEASES", str(tmp_path_factory.mktemp("leases")))
