"""The report tests' shared runs: one slow-reading run and one even run per session (the helpers
that make them are tests/support/reportruns.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.reportruns import SLOW_ITEM_S, Runs, make_cli, reap_all, run_job


@pytest.fixture(scope="session")
def pace_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """A run whose rank 1 reads slowly, and one without the sleep (run one after the other,
    so that neither disturbs the other's timing)."""
    cli = make_cli(tmp_path_factory.mktemp("pace"))
    try:
        slow = run_job(cli, "slow", SLOW_ITEM_S)
        even = run_job(cli, "even", 0.0)
        if even.status["straggler"] is not None:
            # On an oversubscribed machine one rank can get less CPU for a whole short run: a
            # real straggler, not a measuring error. Once is the machine; twice in a row would
            # be the measurement (a bias towards one rank), and then the tests fail.
            print(f"even run named a straggler {even.status['straggler']}; running it again")
            even = run_job(cli, "even-again", 0.0)
        yield Runs(cli, slow, even)
    finally:
        reap_all(cli)
