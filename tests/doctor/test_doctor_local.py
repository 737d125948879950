"""`orchestrate doctor` and `submit --preflight` on the local backend: the real CLI, real rank
processes through the local supervisor, real gloo. What a user checks: the table or the JSON,
the exit status, the files, and that a bad job file or a broken node is named."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from tests.support.localcli import Cli

pytestmark = [pytest.mark.process, pytest.mark.torch]

FAST = ["--sizes", "32K,1M", "--pair-size", "1M", "--budget-s", "0.2", "--timeout-s", "15"]


def _job(cli: Cli, name: str = "job.yaml", extra: str = "") -> Path:
    return cli.write(name, f"""
        name: ddp
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: [python, -c, "print('the job ran')"]
        {extra}
        """)


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_every_tier_passes_on_a_healthy_two_rank_job(cli: Cli) -> None:
    job = _job(cli)
    started = time.monotonic()
    proc = cli.run("doctor", str(job), "--json", *FAST)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "pass"
    assert [c["tier"] for c in doc["checks"]] == sorted(
        (c["tier"] for c in doc["checks"]),
        key=("static", "health", "connect", "smoke", "bandwidth").index)
    names = {(c["tier"], c["name"]) for c in doc["checks"]}
    assert {("static", "version: torch"), ("static", "/dev/shm"), ("connect", "master port"),
            ("smoke", "process group"), ("bandwidth", "all_reduce")} <= names
    smoke = next(c for c in doc["checks"] if c["tier"] == "smoke")
    assert smoke["detail"].startswith("2 rank(s) on 1 node(s) joined (gloo)")
    sizes = [r["size_bytes"] for r in doc["bandwidth"]["allreduce"]]
    assert sizes == [32 << 10, 1 << 20]
    meta = doc["doctor"]
    assert meta["backend"] == "local" and meta["tiers"] == ["static", "health", "connect",
                                                            "smoke", "bandwidth"]
    run_dir = Path(meta["run_dir"])
    assert json.loads((run_dir / "doctor.json").read_text()) == doc
    assert 'id="busbw"' in (run_dir / "doctor.html").read_text()
    assert f"wrote {run_dir / 'doctor.json'}" in proc.stderr
    assert took < 60, f"doctor took {took:.0f} s"


@pytest.mark.timeout(120)
def test_a_missing_interface_fails_static_with_the_table_and_exit_1(cli: Cli) -> None:
    cli.write("inv.yaml", f"""
        name: here
        nodes:
          - {{name: {socket.gethostname()}, address: 127.0.0.1, slots: 2,
              network: {{interface: nope0}}}}
        """)
    job = _job(cli, extra="inventory: inv.yaml")
    proc = cli.run("doctor", str(job), "--tier", "static")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "nope0" in line)
    assert "interface" in row and "fail" in row
    assert "nope0 does not exist on" in proc.stdout
    assert "verdict: fail" in proc.stdout and "took" in proc.stdout
    assert f"failed: static interface ({socket.gethostname()})" in proc.stderr
    assert "connect" not in {line.split()[1] for line in proc.stdout.splitlines()
                             if line.startswith("│")}


def test_a_job_file_mistake_exits_2_before_anything_runs(cli: Cli) -> None:
    job = _job(cli, extra="resources2: {nodes: 1}")
    proc = cli.run("doctor", str(job))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "job.yaml" in proc.stderr and "resources2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (cli.work / "runs").exists()
    assert cli.run("doctor", str(job), "--tier", "nope").returncode == 2


@pytest.mark.timeout(150)
def test_submit_preflight_submits_a_healthy_job_with_the_doctors_figures(
        cli: Cli) -> None:
    job = _job(cli)
    proc = cli.run("submit", str(job), "--preflight", "--detach", "--job-id", cli.id("pre"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == cli.id("pre")
    assert "verdict: pass" in proc.stderr
    deadline = time.monotonic() + 60
    while cli.status(cli.id("pre"))["state"] not in ("COMPLETED", "FAILED"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert cli.status(cli.id("pre"))["state"] == "COMPLETED"
    run_dir = cli.work / "runs" / cli.id("pre")
    doc = json.loads((run_dir / "doctor.json").read_text())
    assert doc["doctor"]["tiers"] == ["static", "health", "connect", "smoke"]
    assert cli.run("report", cli.id("pre")).returncode == 0
    assert 'id="doctor"' in (run_dir / "report.html").read_text()
