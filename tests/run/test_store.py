"""The job store: references, state transitions, and many writers at once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from orchestrate.core.errors import UserError
from orchestrate.core.plan.outcome import Exit, Failure
from orchestrate.core.plan.plan import Plan, make_plan
from orchestrate.core.spec.inventory import InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.run.store import JobRecord, RankRecord, Store

pytestmark = pytest.mark.unit


def _plan(job_id: str, name: str, ranks: int) -> Plan:
    inventory = resolve_inventory(InventorySpec.model_validate(
        {"name": "t", "nodes": [{"name": "n1", "slots": ranks}]}))
    job = JobSpec.model_validate({"name": name, "command": ["true"]})
    return make_plan(job, inventory, job_id=job_id, run_dir=f"/runs/{job_id}", workdir="/w")


def _job(job_id: str, name: str, submitted_at: float, ranks: int = 2) -> JobRecord:
    return JobRecord(
        id=job_id, name=name, backend="local", state="PENDING", run_dir=f"/runs/{job_id}",
        plan=_plan(job_id, name, ranks), submitted_at=submitted_at,
        ranks=[RankRecord(rank=r, node="n1") for r in range(ranks)],
    )


def test_references_by_id_prefix_and_name(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    store.add(_job("train-aaa111", "train", 1.0))
    store.add(_job("train-aab222", "train", 2.0))
    store.add(_job("eval-ccc333", "eval", 3.0))
    assert store.resolve("eval-ccc333").id == "eval-ccc333"
    assert store.resolve("train-aab").id == "train-aab222"
    assert store.resolve("train").id == "train-aab222"  # a name means its latest job
    with pytest.raises(UserError, match="matches 2 jobs"):
        store.resolve("train-aa")
    with pytest.raises(UserError, match="no job 'nothing'"):
        store.resolve("nothing")
    # LIKE wildcards in a reference are literal characters, not patterns.
    with pytest.raises(UserError):
        store.resolve("%")


def test_a_terminal_state_is_final(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    store.add(_job("j-1", "j", 1.0))
    failure = Failure(rank=1, node="n1", exit=Exit(code=3), last_lines=["boom"])
    assert store.finish("j-1", "FAILED", "rank 1 failed", failure=failure)
    assert not store.finish("j-1", "COMPLETED")
    job = store.get("j-1")
    assert job is not None
    assert (job.state, job.reason, job.failure) == ("FAILED", "rank 1 failed", failure)
    assert job.finished_at is not None



def test_a_job_ends_only_in_a_terminal_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    store.add(_job("j-1", "j", 1.0))
    with pytest.raises(ValueError, match="RUNNING is not a state a job ends in"):
        store.finish("j-1", "RUNNING")
    job = store.get("j-1")
    assert job is not None and job.state == "PENDING" and job.finished_at is None


def test_a_misspelled_field_is_refused_even_without_mypy(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    store.add(_job("j-1", "j", 1.0))
    with pytest.raises(ValueError, match="unknown job fields"):
        store.update("j-1", **{"stat": "RUNNING"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown rank fields"):
        store.update_rank("j-1", 0, **{"exit_cod": 1})  # type: ignore[arg-type]


def test_a_state_this_version_does_not_know_reads_as_unknown(tmp_path: Path) -> None:
    """A store written by a newer orchestrate (or a newer Slurm's state) still reads."""
    import sqlite3

    path = tmp_path / "jobs.db"
    store = Store(path)
    store.add(_job("j-1", "j", 1.0))
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET state = 'WARPED' WHERE id = 'j-1'")
        db.execute("UPDATE ranks SET state = 'FROZEN' WHERE job_id = 'j-1'")
    job = store.get("j-1")
    assert job is not None
    assert job.state == "UNKNOWN" and not job.terminal
    assert [r.state for r in job.ranks] == ["PENDING", "PENDING"]


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "jobs.db"
    Store(path)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(UserError, match="newer than this orchestrate knows"):
        Store(path)


def test_the_lease_books_are_recorded_and_an_older_store_reads_none(tmp_path: Path) -> None:
    """A job's lease books go in and come back (None: the host's default book); a job of a
    version-2 store, from before they were recorded, reads as not recorded."""
    import sqlite3

    path = tmp_path / "jobs.db"
    store = Store(path)
    store.add(_job("new-1", "new", 1.0))
    store.update("new-1", lease_books={"n1": "/shared/leases", "n2": None})
    found = store.get("new-1")
    assert found is not None and found.lease_books == {"n1": "/shared/leases", "n2": None}
    with sqlite3.connect(path) as db:  # the store as version 2 wrote it
        db.execute("ALTER TABLE jobs DROP COLUMN lease_books")
        db.execute("PRAGMA user_version = 2")
    old = Store(path).get("new-1")
    assert old is not None and old.lease_books is None and old.id == "new-1"


def _writer(path: str, worker: int, count: int) -> None:
    store = Store(Path(path))
    for i in range(count):
        job_id = f"w{worker}-{i}"
        store.add(_job(job_id, f"w{worker}", float(i)))
        store.update(job_id, state="RUNNING", started_at=float(i))
        for rank in range(2):
            store.update_rank(job_id, rank, state="COMPLETED", exit_code=0)
        store.finish(job_id, "COMPLETED")


@pytest.mark.process
@pytest.mark.timeout(120)
def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    Store(path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode == 0
    store = Store(path)
    jobs = store.list(limit=1000)
    assert len(jobs) == 100
    assert {j.state for j in jobs} == {"COMPLETED"}
    sample = store.get("w3-24")
    assert sample is not None
    assert [(r.state, r.exit_code) for r in sample.ranks] == [("COMPLETED", 0)] * 2
