"""The rank that explained a failure is the one named everywhere (issue #33 item 3).

Real local jobs of the built-in trainer where rank 0 says why the job stops (a NaN stop,
``model_args`` the factory does not take, a global batch larger than the training set, weights
that cannot learn: issue #33 item 7's sentences) and then ends last: rank 0 lingers 1.5 s at
exit, so rank 1, which says nothing, ends first. The job's reason, ``status``, the summary and
the HTML report must still name rank 0, with its last lines, never rank 1's empty log.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.blamejob import PROGRAM
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

def _job(cli: Cli, name: str, model_args: str = "{}", batch: str = "batch_size: 8",
         model: str = "nanmodel:build_model") -> Path:
    cli.write("nanmodel.py", PROGRAM)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        train:
          model: {model}
          model_args: {model_args}
          dataset: nanmodel:build_dataset
          optimizer: {{name: sgd, lr: 0.1}}
          epochs: 1
          {batch}
        """)


def _blamed_rank_0(cli: Cli, job_id: str, proc: Any, says: str) -> dict[str, Any]:
    """Rank 0 is named in the reason, status, the summary and the report, with its line."""
    status = cli.status(job_id)
    assert status["state"] == "FAILED", status
    failure = status["failure"]
    assert failure["rank"] == 0, failure
    assert any(says in line for line in failure["last_lines"]), failure
    assert str(status["reason"]).startswith("rank 0 on localhost"), status["reason"]
    assert "last lines of rank 0 (localhost):" in proc.stderr, proc.stderr
    assert f"full log: orchestrate logs {job_id} --rank 0" in proc.stderr
    shown = cli.run("status", job_id)
    assert "last lines of rank 0 (localhost):" in shown.stdout + shown.stderr
    report = (Path(str(status["run_dir"])) / "report.html").read_text()
    assert re.search(r'id="failure" data-rank="0"', report), report[:2000]
    assert says in report
    return status


@pytest.mark.timeout(180)
def test_a_nan_stop_explained_by_rank_0_names_rank_0(cli: Cli) -> None:
    job_id = cli.id("nanstop")
    proc = cli.run("submit", str(_job(cli, "nanstop")), "--follow",
                   "--job-id", job_id, timeout=170)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    _blamed_rank_0(cli, job_id, proc, "the loss is not finite")


@pytest.mark.timeout(180)
def test_a_model_args_typo_names_rank_0_whose_rank_exits_2(cli: Cli) -> None:
    """Every rank fails the same way; rank 0 says it once, for all (and ends last)."""
    job_id = cli.id("typo")
    proc = cli.run("submit", str(_job(cli, "typo", "{hiden: 4}")), "--follow",
                   "--job-id", job_id, timeout=170)
    status = _blamed_rank_0(cli, job_id, proc, "hiden")
    assert status["failure"]["exit_code"] == 2, status["failure"]
    # a mistake in the job, found by a rank at its start: submit --follow says 2, as validate does
    assert proc.returncode == 2, proc.stderr


@pytest.mark.timeout(180)
def test_a_global_batch_larger_than_the_training_set_is_named_as_such(cli: Cli) -> None:
    """Issue #33 item 7: 64 samples, a global batch of 128: not "fewer than the 2 ranks"."""
    job_id = cli.id("bigbatch")
    proc = cli.run("submit", str(_job(cli, "bigbatch", "{hidden: 2}", "global_batch_size: 128")),
                   "--follow", "--job-id", job_id, timeout=170)
    status = _blamed_rank_0(cli, job_id, proc, "fewer than one global batch (128 samples")
    assert status["failure"]["exit_code"] == 2, status["failure"]
    assert proc.returncode == 2, proc.stderr
    assert "fewer than the 2 ranks" not in "\n".join(status["failure"]["last_lines"])


@pytest.mark.timeout(180)
def test_weights_that_cannot_learn_end_failed_with_a_sentence(cli: Cli) -> None:
    """Issue #33 item 7: an MLP initialised to 0 trains nothing; not a quiet COMPLETED."""
    job_id = cli.id("zeros")
    proc = cli.run("submit", str(_job(cli, "zeros", model="nanmodel:build_zero")), "--follow",
                   "--job-id", job_id, timeout=170)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    _blamed_rank_0(cli, job_id, proc, "was exactly 0 for the first 3 steps on every rank")
