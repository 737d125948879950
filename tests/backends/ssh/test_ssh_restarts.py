"""Restarts over SSH (issue 13): a rank killed with SIGKILL on another host restarts under the
job's policy and ends where an uninterrupted run ends, parameter for parameter; with
``exclude_failed_node`` the restart leaves the failed host out and lands on a spare."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import differing_parameters, latest_state
from tests.support.output import merged_text
from tests.support.sshcli import SshCli
from tests.support.sshhosts import SshHosts, agents_on, tagged_on

pytestmark = [pytest.mark.ssh, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[3]
DIGITS = REPO / "examples" / "digits"


def _train_job(cli: SshCli, name: str) -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 2, gpus_per_node: 1}}
        workdir: {DIGITS}
        env: {{PYTHONPATH: "{REPO}"}}
        train:
          model: digits:build_model
          model_args: {{hidden: 64}}
          dataset: digits:build_dataset
          optimizer: {{name: adamw, lr: 3.0e-3}}
          epochs: 40
          batch_size: 32
          seed: 7
          checkpoint_every_steps: 5
        restart: {{max: 1, on: [failure], backoff_s: [0]}}
        """)


# 40 epochs of this small model take ~12 s on a quiet machine: the kill, sent once 2 are done,
# must land mid-training; with 12 a busy machine's status call came after the last step once
# (the restart then found the final checkpoint and had nothing to resume).
def _epochs(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return text.count('"kind": "epoch"')


@pytest.mark.timeout(360)
def test_a_killed_rank_on_another_host_restarts_and_ends_where_a_straight_run_ends(
    ssh_cli: SshCli,
) -> None:
    ssh_cli.inventory([{"name": "h1", "slots": 2}, {"name": "h2", "slots": 2}])
    straight = "straight-" + os.urandom(3).hex()
    killed = "killed-" + os.urandom(3).hex()
    for job, name in ((straight, "straight"), (killed, "killed")):
        ssh_cli.run("submit", str(_train_job(ssh_cli, name)), "--detach", "--job-id", job,
                    check=True, timeout=120)
    status = ssh_cli.wait_running(killed, timeout=90)
    run_dir = Path(status["run_dir"])
    deadline = time.monotonic() + 120
    while _epochs(run_dir) < 2:  # checkpoints exist, training is well under way
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    rank1 = next(r for r in ssh_cli.status(killed)["ranks"] if r["rank"] == 1)
    assert rank1["host"] == "h2"
    os.kill(ssh_cli.hosts.root_pid("h2", int(rank1["pid"])), signal.SIGKILL)

    done = ssh_cli.wait_state(killed, {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    assert done["state"] == "COMPLETED", done
    attempts = done["attempts"]
    assert [a["n"] for a in attempts] == [1, 2], attempts
    assert "rank 1 on h2 failed with signal 9 (SIGKILL)" in attempts[0]["reason"], attempts
    assert attempts[1]["resumed_from_step"], attempts
    reference = ssh_cli.wait_state(straight, {"COMPLETED", "FAILED"}, 240)
    assert reference["state"] == "COMPLETED", reference
    a, b = latest_state(Path(reference["run_dir"])), latest_state(run_dir)
    assert a["step"] == b["step"] > 0
    assert differing_parameters(a, b) == []
    assert not any(tagged_on(ssh_cli.hosts, killed, ["h1", "h2"]).values())  # nothing left


FAILS_ON_H2 = """\
import os, socket, sys, time
if os.environ.get("ORCHESTRATE_ATTEMPT") == "1" and socket.gethostname() == "h2":
    print("h2: giving up", flush=True)
    sys.exit(3)
time.sleep(1)
print("ran on", socket.gethostname(), flush=True)
"""


@pytest.mark.timeout(240)
def test_a_failed_host_is_left_out_and_the_restart_lands_on_a_spare(ssh_cli: SshCli) -> None:
    ssh_cli.inventory([{"name": n, "slots": 1} for n in ("h1", "h2", "h3")])
    job_id = _submit(ssh_cli, "spare", "fails.py", FAILS_ON_H2, nodes=2, per_node=1,
                     restart=", exclude_failed_node: true")
    done = ssh_cli.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 180)
    assert done["state"] == "COMPLETED", done
    attempts = done["attempts"]
    assert [a["n"] for a in attempts] == [1, 2], attempts
    assert "rank 1 on h2 failed with exit code 3" in attempts[0]["reason"], attempts
    assert "without h2" in attempts[0]["reason"], attempts
    assert sorted(r["host"] for r in done["ranks"]) == ["h1", "h3"], done["ranks"]
    log = merged_text(Path(done["run_dir"]))
    assert "ran on h1" in log and "ran on h3" in log


def _submit(cli: SshCli, name: str, program: str, text: str, *, nodes: int, per_node: int,
            restart: str = "") -> str:
    """Write ``program`` and a job ``name`` running it on ``nodes`` x ``per_node`` ranks that
    restarts once on a failure (``restart``: more of the policy), submit it; its job id."""
    (cli.work / program).write_text(text)
    job = cli.write(f"{name}.yaml", f"""
        name: {name}
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: {nodes}, gpus_per_node: {per_node}}}
        workdir: {cli.work}
        command: [python3, {program}]
        restart: {{max: 1, on: [failure], backoff_s: [0]{restart}}}
        """)
    job_id = f"{name}-" + os.urandom(3).hex()
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True, timeout=120)
    return job_id


def _logins(cli: SshCli, host: str) -> int:
    """Key logins the host's sshd has accepted so far (its log: tests/clusters/sshhosts.sh)."""
    log = cli.hosts.state_dir / host / "sshd.log"
    return (log.read_text(errors="replace") if log.exists() else "").count("Accepted ")


@pytest.mark.timeout(240)
def test_a_restart_on_the_same_hosts_logs_in_no_more(ssh_cli: SshCli) -> None:
    """Issue #37: the restart reuses the attempt's connections: one login per host for the
    whole job, two attempts (each host's sshd counts them)."""
    ssh_cli.inventory([{"name": n, "slots": 1} for n in ("h1", "h2")])
    before = {h: _logins(ssh_cli, h) for h in ("h1", "h2")}
    agents = agents_on(ssh_cli.hosts)
    job_id = _submit(ssh_cli, "again", "fails.py", FAILS_ON_H2, nodes=2, per_node=1)
    done = ssh_cli.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 180)
    assert done["state"] == "COMPLETED", done
    assert [a["n"] for a in done["attempts"]] == [1, 2], done["attempts"]
    assert "ran on h1" in merged_text(Path(done["run_dir"]))
    assert {h: _logins(ssh_cli, h) - before[h] for h in before} == {"h1": 1, "h2": 1}
    # The restart's agents were started while attempt 1 ran (spares), and none outlives the job.
    log = (Path(done["run_dir"]) / "supervisor.log").read_text()
    assert "attempt 2 placed, 2 spare agent(s) taken" in log, log
    _no_agents_beyond(ssh_cli.hosts, agents)


FAILS_RANK_6 = """\
import os, sys, time
if os.environ.get("ORCHESTRATE_ATTEMPT") == "1" and os.environ["RANK"] == "6":
    sys.exit(3)
time.sleep(1)
print("rank", os.environ["RANK"], "ran", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_host_full_of_ranks_gets_its_spares_at_the_attempts_end(ssh_cli: SshCli) -> None:
    """Issue #37: 7 ranks fill the connection (8 sessions, two kept free for kill-by-tag and
    the stall watch): the spares start once the attempt's sessions closed, and the restart
    takes 6 (8 less the two), logged in once."""
    ssh_cli.inventory([{"name": "h1", "slots": 7}])
    before, agents = _logins(ssh_cli, "h1"), agents_on(ssh_cli.hosts)
    job_id = _submit(ssh_cli, "full", "fails.py", FAILS_RANK_6, nodes=1, per_node=7)
    done = ssh_cli.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 180)
    assert done["state"] == "COMPLETED", done
    assert [a["n"] for a in done["attempts"]] == [1, 2], done["attempts"]
    log = (Path(done["run_dir"]) / "supervisor.log").read_text()
    assert "attempt 2 placed, 6 spare agent(s) taken" in log, log
    assert _logins(ssh_cli, "h1") - before == 1
    _no_agents_beyond(ssh_cli.hosts, agents)


def _no_agents_beyond(hosts: SshHosts, before: dict[str, set[int]]) -> None:
    """Wait (generously) until each host serves no agent that was not there ``before``."""
    deadline = time.monotonic() + 30
    while True:
        extra = {h: pids - before.get(h, set()) for h, pids in agents_on(hosts).items()}
        if not any(extra.values()):
            return
        assert time.monotonic() < deadline, f"agents left on the hosts: {extra}"
        time.sleep(0.2)


SLEEPS = """import time
print("up", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("end", ["cancel", "supervisor killed"])
def test_spare_agents_run_beside_the_ranks_and_go_with_the_job(ssh_cli: SshCli, end: str
                                                                ) -> None:
    """Issue #37: a job that may restart has its next attempt's agents running beside its
    ranks (one spare per rank); a cancel, or its supervisor's death, ends them with the job
    on every host."""
    ssh_cli.inventory([{"name": n, "slots": 1} for n in ("h1", "h2")])
    agents = agents_on(ssh_cli.hosts)
    job_id = _submit(ssh_cli, "spares", "sleeps.py", SLEEPS, nodes=2, per_node=1)
    ssh_cli.wait_running(job_id, timeout=90)
    deadline = time.monotonic() + 60
    while True:  # the rank's agent and its spare, on each host
        extra = {h: len(pids - agents.get(h, set())) for h, pids in agents_on(ssh_cli.hosts)
                 .items() if h in ("h1", "h2")}
        if extra == {"h1": 2, "h2": 2}:
            break
        assert time.monotonic() < deadline, f"agents beside the ranks: {extra}"
        time.sleep(0.2)
    if end == "cancel":
        ssh_cli.run("cancel", job_id, check=True)
        done = ssh_cli.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 90)
        assert done["state"] == "CANCELLED", done
    else:
        with sqlite3.connect(ssh_cli.home / "jobs.db") as conn:
            (pid,) = conn.execute("SELECT supervisor_pid FROM jobs WHERE id = ?",
                                  [job_id]).fetchone()
        os.kill(int(pid), signal.SIGKILL)  # no handler runs: the closed connections end them
    _no_agents_beyond(ssh_cli.hosts, agents)
    assert not any(tagged_on(ssh_cli.hosts, job_id, ["h1", "h2"]).values())
