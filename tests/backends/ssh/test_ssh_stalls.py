"""A stuck SSH job names the stuck rank and its host (the stall watch over SSH, ``diagnose``).

Each rank's sidecar writes on its own host; the supervisor reads the heartbeats and asks for
dumps with one short command per host (``evidence.py`` in the run directory) and mirrors them
into the controller's run directory. The ranks run tests/diagnosis/programs/steps.py, a plain Python
program that imports nothing of orchestrate, one rank per host on h1 and h2.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.output import merged_text
from tests.support.sshcli import SshCli

pytestmark = [pytest.mark.ssh, pytest.mark.torch, pytest.mark.timing]

STEPS = Path(__file__).resolve().parents[2] / "diagnosis" / "programs" / "steps.py"
STALL_S = 10


def _job(cli: SshCli, name: str, scenario: str, on_stall: str, extra_env: str = "") -> Path:
    cli.inventory([{"name": "h1", "slots": 3}, {"name": "h2", "slots": 3}])  # room for three
    marks = cli.work / f"marks-{name}"
    marks.mkdir()
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        distributed: {{backend: gloo, stall_s: {STALL_S}, on_stall: {on_stall}, timeout_s: 300}}
        restart: {{max: 0}}
        env: {{SCENARIO: {scenario}, BAD_RANK: 1, TRIGGER_STEP: 8, MARKS: '{marks}'{extra_env}}}
        command: [python3, '{STEPS}']
        """)


def _until(cli: SshCli, job: str, done: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = cli.status(job)
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def _mark(cli: SshCli, name: str, mark: str, timeout: float = 90) -> float:
    path = cli.work / f"marks-{name}" / mark
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"the program never reached its {mark} mark"
        time.sleep(0.1)
    time.sleep(0.05)
    return float(path.read_text())


def test_a_laggard_on_another_host_is_named_and_the_job_stopped(ssh_cli: SshCli) -> None:
    job = "lag-ssh-" + os.urandom(3).hex()
    ssh_cli.run("submit", str(_job(ssh_cli, "lag", "laggard", "kill")), "--detach",
                "--job-id", job, check=True, timeout=120)
    began = _mark(ssh_cli, "lag", "trigger")
    status = _until(ssh_cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
    diagnosis = status["diagnosis"]
    assert status["state"] == "FAILED" and diagnosis is not None, status
    assert diagnosis["kind"] == "laggard" and diagnosis["ranks"] == [1], diagnosis
    assert diagnosis["nodes"] == ["h2"]
    assert diagnosis["summary"].startswith("rank 1 (node h2) has not reached collective #")
    assert "rank 0 waits in all_reduce" in diagnosis["summary"]
    assert diagnosis["at"] - began < STALL_S + 30
    # The controller holds the evidence: the mirrored heartbeats and rank 1's stacks.
    run_dir = Path(status["run_dir"])
    stacks = [Path(f) for f in diagnosis["files"] if f.endswith("rank-1.stacks.txt")]
    assert stacks and str(run_dir) in str(stacks[0]) and "steps.py" in stacks[0].read_text()
    assert json.loads((run_dir / "diag" / "hb" / "rank-1.json").read_text())["host"] == "h2"


def test_a_frozen_rank_on_another_host_and_diagnose(ssh_cli: SshCli) -> None:
    job = "frz-ssh-" + os.urandom(3).hex()
    ssh_cli.run("submit", str(_job(ssh_cli, "frz", "frozen", "report")), "--detach",
                "--job-id", job, check=True, timeout=120)
    _mark(ssh_cli, "frz", "ready")
    status = ssh_cli.status(job)
    remote_pid = next(r["pid"] for r in status["ranks"] if r["rank"] == 1)
    pid = ssh_cli.hosts.root_pid("h2", remote_pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        status = _until(ssh_cli, job, lambda s: s["diagnosis"] is not None, 90)
        diagnosis = status["diagnosis"]
        assert diagnosis is not None and diagnosis["kind"] == "frozen", status
        assert diagnosis["ranks"] == [1] and diagnosis["nodes"] == ["h2"]
        assert f"rank 1 (node h2, pid {remote_pid}) stopped answering" in diagnosis["summary"]
        assert status["state"] == "RUNNING"
        started = time.monotonic()
        table = json.loads(ssh_cli.run("diagnose", job, "--json", check=True,
                                       timeout=60).stdout)
        assert time.monotonic() - started < 20
        rows = {r["rank"]: r for r in table["ranks"]}
        assert rows[0]["node"] == "h1" and rows[1]["node"] == "h2"
        assert rows[1]["answered"] is False and rows[0]["answered"] is True
        assert table["diagnosis"]["kind"] == "frozen"
    finally:
        os.kill(pid, signal.SIGCONT)
        ssh_cli.run("cancel", job, timeout=60)


def test_mismatch_rendezvous_and_teardown_on_two_hosts_side_by_side(ssh_cli: SshCli) -> None:
    """The rest of the matrix, three jobs at once on the same two hosts. In ``teardown`` rank 1
    (on h2) hangs in the interpreter's teardown after its program ended, and rank 0 exits 0:
    the supervisor knows which processes still run on each host and names that one."""
    jobs = {"mismatch": "mis-ssh-" + os.urandom(3).hex(),
            "rendezvous": "rdv-ssh-" + os.urandom(3).hex(),
            "teardown": "tdn-ssh-" + os.urandom(3).hex()}
    extra = {"teardown": ", STEPS: 12"}
    for kind, job in jobs.items():
        ssh_cli.run("submit", str(_job(ssh_cli, kind[:3], kind, "kill", extra.get(kind, ""))),
                    "--detach", "--job-id", job, check=True, timeout=120)
    for kind, job in jobs.items():
        status = _until(ssh_cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 120)
        diagnosis = status["diagnosis"]
        assert status["state"] == "FAILED" and diagnosis is not None, (kind, status)
        assert diagnosis["kind"] == kind and diagnosis["ranks"] == [1], diagnosis
        assert diagnosis["nodes"] == ["h2"], diagnosis
        assert not [r for r in status["ranks"] if r["state"] == "RUNNING"], status["ranks"]
    summaries = {kind: ssh_cli.status(job)["diagnosis"]["summary"] for kind, job in jobs.items()}
    assert summaries["mismatch"].startswith("rank 1 (node h2) is in barrier #"), summaries
    assert "never reached init_process_group" in summaries["rendezvous"], summaries
    assert summaries["teardown"].startswith("rank 1 (node h2, pid "), summaries
    assert " ended its program " in summaries["teardown"], summaries
    assert summaries["teardown"].endswith("; rank 0 has exited"), summaries


def test_a_rank_computing_alone_on_another_host_is_not_a_stall(ssh_cli: SshCli) -> None:
    """Issue #25 item 1 over SSH: rank 1 (on h2) computes alone for 22 s while rank 0 waits in
    a barrier, ``stall_s`` 10, ``on_stall: kill``: its CPU time, read from its heartbeat on h2
    by the supervisor's watch, is activity; the job completes and the merged log says why the
    stall was held off."""
    job = "solo-ssh-" + os.urandom(3).hex()
    path = _job(ssh_cli, "solo", "solo", "kill", ", STEPS: 15, BUSY_S: 22")
    ssh_cli.run("submit", str(path), "--detach", "--job-id", job, check=True, timeout=120)
    _mark(ssh_cli, "solo", "trigger")
    status = _until(ssh_cli, job, lambda s: s["state"] not in ("PENDING", "RUNNING"), 180)
    assert status["state"] == "COMPLETED" and status["diagnosis"] is None, status
    merged = merged_text(Path(status["run_dir"]))
    notes = [line for line in merged.splitlines()
             if line.startswith("[orchestrate] no progress for")]
    assert len(notes) == 1, merged
    assert "but not stalled: rank 1 (node h2) computing at steps.py:" in notes[0], notes
    assert "rank 0" not in notes[0], notes
