"""What the CLI's exit status tells a script: 2 "fix your file", 75 "try again later".

A job that would fit the machine but finds its GPUs, CPU slots or master port held by other jobs
exits 75 (sysexits' EX_TEMPFAIL); a request that can never fit, or any mistake in a file, stays
2. The local cases hold a real lease in a private lease book (this test process is its holder)
and go through the real ``submit``, which refuses before it starts anything.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pytest

from orchestrate.core.errors import Problem, UserError
from orchestrate.core.exits import EXIT_BUSY, EXIT_USER_ERROR
from orchestrate.core.plan.plan import Occupancy, make_plan
from orchestrate.core.spec.inventory import load_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.hostside import leases
from tests.support.corecli import CORE, cli

pytestmark = pytest.mark.unit

CPU = CORE / "inventories" / "localhost-cpu.yaml"  # localhost, 3 slots
GPUS = CORE / "inventories" / "uniform.yaml"  # node1-2, 4 GPUs each


def _refusal(job: dict[str, object], inventory: Path, facts: Occupancy) -> UserError:
    spec = JobSpec.model_validate({"name": "j", "command": ["python", "t.py"], **job})
    with pytest.raises(UserError) as caught:
        make_plan(spec, load_inventory(inventory), job_id="j-1", run_dir="/r", workdir="/w",
                  occupancy=facts)
    return caught.value


def test_slots_held_by_other_jobs_are_try_again_later() -> None:
    refused = _refusal({"resources": {"gpus_per_node": 2}}, CPU,
                       Occupancy(busy_slots={"localhost": 2}))
    assert refused.exit_status == EXIT_BUSY == 75
    assert "held by other jobs" in str(refused) and "try again" in str(refused)


def test_gpus_held_by_other_jobs_are_try_again_later() -> None:
    held = frozenset({0, 1, 2})
    refused = _refusal({"backend": "ssh", "resources": {"nodes": 2, "gpus_per_node": 2}}, GPUS,
                       Occupancy(busy_gpus={"node1": held, "node2": held}))
    assert refused.exit_status == EXIT_BUSY
    assert "held by other jobs" in str(refused)


def test_a_request_that_can_never_fit_stays_a_user_error_even_on_a_busy_machine() -> None:
    too_big = _refusal({"resources": {"gpus_per_node": 4}}, CPU,
                       Occupancy(busy_slots={"localhost": 2}))
    assert too_big.exit_status == EXIT_USER_ERROR == 2
    too_many = _refusal({"backend": "ssh", "resources": {"nodes": 3, "gpus_per_node": 1}}, GPUS,
                        Occupancy(busy_gpus={"node1": frozenset({0})}))
    assert too_many.exit_status == EXIT_USER_ERROR
    # One real mistake among busy problems: fix the file first.
    mixed = UserError([Problem("held", busy=True), Problem("a typo")])
    assert mixed.exit_status == EXIT_USER_ERROR


def test_a_spare_node_held_by_other_jobs_is_try_again_later() -> None:
    job = {"backend": "ssh", "resources": {"nodes": 1, "gpus_per_node": 4},
           "restart": {"exclude_failed_node": True}}
    refused = _refusal(job, GPUS, Occupancy(busy_gpus={"node2": frozenset({3})}))
    assert refused.exit_status == EXIT_BUSY
    assert "no spare node" in str(refused) and "other jobs hold them now" in str(refused)


def test_the_busy_mark_survives_the_ssh_supervisors_verdict() -> None:
    """The SSH supervisor sends its problems as ``asdict`` JSON; submit rebuilds them."""
    sent = UserError.single("0 usable GPU(s) (4 held by other jobs)", busy=True)
    received = UserError([Problem(**asdict(p)) for p in sent.problems])
    assert received.exit_status == EXIT_BUSY


@pytest.fixture()
def lease_book(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> leases.LeaseBook:
    """A private state directory (store) and lease book for this test."""
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("ORCHESTRATE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("ORCHESTRATE_LEASES", str(tmp_path / "leases"))
    return leases.LeaseBook()


def _local_job(tmp_path: Path, extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: busy\ninventory: {CPU}\nbackend: local\n"
                   f"command: [python, -c, pass]\nworkdir: {tmp_path}\n{extra}")
    return job


def _hold(book: leases.LeaseBook, slots: int, port: int | None = None) -> None:
    with book.locked():
        book.record(leases.new_lease("other-1", "localhost", [], slots, port, [os.getpid()]))


@pytest.mark.process
def test_submit_on_a_busy_machine_exits_75(tmp_path: Path, lease_book: leases.LeaseBook) -> None:
    _hold(lease_book, slots=2)
    result = cli("submit", "--detach", _local_job(tmp_path, "resources: {gpus_per_node: 2}\n"))
    assert result.code == EXIT_BUSY, result.err
    assert "1 free slots (2 held by other jobs), 2 requested" in result.err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_submit_that_can_never_fit_exits_2(tmp_path: Path, lease_book: leases.LeaseBook) -> None:
    _hold(lease_book, slots=2)
    result = cli("submit", "--detach", _local_job(tmp_path, "resources: {gpus_per_node: 4}\n"))
    assert result.code == EXIT_USER_ERROR, result.err
    assert "4 requested" in result.err


@pytest.mark.process  # the supervisor decides, after it started
def test_submit_whose_fixed_port_another_job_holds_exits_75(tmp_path: Path,
                                                            lease_book: leases.LeaseBook) -> None:
    _hold(lease_book, slots=1, port=29517)
    job = _local_job(tmp_path, "resources: {gpus_per_node: 1}\n"
                     "distributed: {master_port: 29517}\n")
    result = cli("submit", "--detach", job)
    assert result.code == EXIT_BUSY, result.err
    assert "master port 29517 is held by another orchestrate job" in result.err
