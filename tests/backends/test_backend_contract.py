"""The lifecycle every detached backend keeps (orchestrate/backends/base.py), on local and SSH.

Through the real CLI, on real processes (and, for SSH, the real test hosts): once ``submit``
returns, the job's record names its run directory, which holds ``plan.json`` and
``loaded.json``, and each node's lease book, and a live supervisor is recorded; ``cancel`` ends
the job CANCELLED within the one cancel grace with nothing of it left running; a supervisor
killed with SIGKILL is reported FAILED ("supervisor process vanished") by the next ``status``,
with nothing left running.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrate.backends import detached
from orchestrate.backends.detached import CANCEL_GRACE_S
from orchestrate.hostside import host
from tests.support.localcli import Cli
from tests.support.sshcli import SshCli
from tests.support.sshhosts import stop_tagged, tagged_by_namespace

SLEEPER = '[bash, -c, "sleep 300 & sleep 300; wait"]'


@dataclass
class Backend:
    """One backend under the contract: its CLI, a long job for it, and what it left running."""

    name: str
    run: Callable[..., Any]  # Cli.run / SshCli.run
    status: Callable[[str], dict[str, Any]]
    home: Path
    job_file: Path
    left: Callable[[str], list[int]]  # the job's processes still running, wherever they run
    job_id: str


def _local(tmp_path: Path) -> Iterator[Backend]:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("ORCHESTRATE_JOB_ID", None)
    cli = Cli(home=home, work=work, env=env, uid=uuid.uuid4().hex[:6])
    job = cli.write("long.yaml", f"""
        name: long
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: {SLEEPER}
        """)
    backend = Backend("local", cli.run, cli.status, home, job, host.job_pids, cli.id("long"))
    yield backend
    host.reap(backend.job_id, 1.0)


def _ssh(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Backend]:
    hosts = request.getfixturevalue("ssh_hosts")
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), ORCHESTRATE_RUNS=str(work / "runs"))
    env.pop("ORCHESTRATE_JOB_ID", None)
    cli = SshCli(hosts=hosts, home=home, work=work, env=env)
    cli.inventory([{"name": n, "slots": 1} for n, _ in hosts.hosts])
    job = cli.write("long.yaml", f"""
        name: long
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        command: {SLEEPER}
        """)

    def left(job_id: str) -> list[int]:
        return [pid for pids in tagged_by_namespace(hosts, job_id).values() for pid in pids]

    backend = Backend("ssh", cli.run, cli.status, home, job, left, f"long-{uuid.uuid4().hex[:6]}")
    yield backend
    stop_tagged(hosts, backend.job_id, grace_s=1.0)


@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.process),
                        pytest.param("ssh", marks=pytest.mark.ssh)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    yield from (_local(tmp_path) if request.param == "local" else _ssh(tmp_path, request))


def _supervisor_pid(backend: Backend) -> int | None:
    with sqlite3.connect(backend.home / "jobs.db") as db:
        (pid,) = db.execute("SELECT supervisor_pid FROM jobs WHERE id = ?",
                            [backend.job_id]).fetchone()
    return None if pid is None else int(pid)


def _submitted(backend: Backend) -> tuple[dict[str, Any], int]:
    """Submit the long job; once ``submit`` returns, its record is complete and its ranks
    start. The status document and the supervisor's pid."""
    backend.run("submit", str(backend.job_file), "--detach", "--job-id", backend.job_id,
                check=True)
    status = backend.status(backend.job_id)
    run_dir = Path(status["run_dir"])
    assert run_dir.name == backend.job_id
    assert (run_dir / "plan.json").is_file() and (run_dir / "loaded.json").is_file()
    supervisor = _supervisor_pid(backend)
    assert supervisor is not None and detached.alive(supervisor, backend.job_id)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = backend.status(backend.job_id)
        if status["state"] == "RUNNING" and all(r["pid"] for r in status["ranks"]):
            return status, supervisor
        assert status["state"] in ("PENDING", "RUNNING"), status
        time.sleep(0.2)
    raise AssertionError(f"the ranks never all ran: {status}")


def _lease_books(backend: Backend) -> dict[str, str | None]:
    """The lease book of each node, as the job's record names them (what stops the job uses)."""
    with sqlite3.connect(backend.home / "jobs.db") as db:
        (books,) = db.execute("SELECT lease_books FROM jobs WHERE id = ?",
                              [backend.job_id]).fetchone()
    found: dict[str, str | None] = json.loads(books)
    return found


def _gone_within(backend: Backend, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := backend.left(backend.job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_submit_records_the_run_dir_and_cancel_ends_it_within_the_grace(backend: Backend) -> None:
    status, supervisor = _submitted(backend)
    assert backend.left(backend.job_id), "the job's ranks should be running"
    assert set(_lease_books(backend)) == {r["node"] for r in status["ranks"]}
    started = time.monotonic()
    out = backend.run("cancel", backend.job_id, check=True, timeout=CANCEL_GRACE_S + 60).stdout
    took = time.monotonic() - started
    assert "CANCELLED" in out
    assert took < CANCEL_GRACE_S, f"cancel took {took:.1f}s"
    final = backend.status(backend.job_id)
    assert final["state"] == "CANCELLED"
    assert all(r["state"] != "RUNNING" for r in final["ranks"])
    assert not detached.alive(supervisor, backend.job_id)
    assert _gone_within(backend, 2) == []
    assert final["run_dir"] == status["run_dir"]


@pytest.mark.timeout(180)
def test_a_killed_supervisor_is_reported_failed_with_nothing_left(backend: Backend) -> None:
    _, supervisor = _submitted(backend)
    os.kill(supervisor, signal.SIGKILL)
    # The ranks go with it (the local watchdog; the SSH agents, when their channels close).
    assert _gone_within(backend, 15) == []
    final = backend.status(backend.job_id)  # status refreshes: the supervisor is gone
    assert final["state"] == "FAILED", final
    assert "supervisor process vanished" in final["reason"]
    assert all(r["state"] != "RUNNING" for r in final["ranks"])
    assert backend.left(backend.job_id) == []
