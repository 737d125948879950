"""Jobs in a container on the local backend: podman, one container per node (docs/containers.md).

The image is built here (tests/support/containers.py); ranks run this machine's Python with
torch CPU, mounted read-only into it. Each test checks what a user would: the job completes
inside the container with the plan's environment, ``/dev/shm`` is the host's (or the sized
one), and nothing is left behind (no container, no process) however the job ends.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrate.hostside import host
from tests.support.containers import container_section, containers_of
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[3]

#: A rank that reports what it sees inside, as JSON, after one all_reduce.
PROGRAM = """
import json, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
shm = os.statvfs("/dev/shm")
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "ORCHESTRATE_JOB_ID", "CUDA_VISIBLE_DEVICES")}
print("SEEN " + json.dumps({"sum": t.item(), "shm": shm.f_blocks * shm.f_frsize,
      "inside": os.path.exists("/run/.containerenv"), "env": seen}), flush=True)
time.sleep(float(os.environ.get("HOLD_S", "0")))
dist.destroy_process_group()
"""


def _job(cli: Cli, name: str, *, hold_s: float = 0, **container: Any) -> Path:
    cli.write("seen.py", PROGRAM)
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: [python, seen.py]
        env: {{HOLD_S: "{hold_s}"}}
        distributed: {{timeout_s: 60}}
        container: {container_section(**container)}
        """)


def _seen(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line.split("SEEN ", 1)[1]) for line in stdout.splitlines()
            if "SEEN " in line]


def _gone(job: str, seconds: float = 15) -> bool:
    """True once the job has no container and no process left (polled, up to ``seconds``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not containers_of(job) and not host.job_pids(job):
            return True
        time.sleep(0.2)
    return False


def _wait_running(cli: Cli, job: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cli.run("status", job).returncode == 0:
            status = cli.status(job)
            if status["state"] == "RUNNING" and all(r["pid"] for r in status["ranks"]) \
                    and len(host.job_pids(job)) >= 2 and containers_of(job):
                return
        time.sleep(0.2)
    raise AssertionError(f"{job} never ran: {cli.status(job)}")


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_a_command_job_completes_inside_with_the_plans_env_and_host_shm(cli: Cli) -> None:
    job = _job(cli, "boxed")
    job_id = cli.id("boxed-1")
    plan = json.loads(cli.run("plan", "--json", "--job-id", job_id, str(job), check=True).stdout)
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(_seen(proc.stdout), key=lambda s: int(s["env"]["RANK"]))
    assert [s["env"]["RANK"] for s in seen] == ["0", "1"]
    host_shm = os.statvfs("/dev/shm")
    for s in seen:
        assert s["inside"] is True and s["sum"] == 3.0
        assert s["shm"] == host_shm.f_blocks * host_shm.f_frsize  # --ipc=host: the host's
        assert s["env"]["ORCHESTRATE_JOB_ID"] == job_id  # the tag: kill-by-tag finds it
        assert s["env"]["WORLD_SIZE"] == "2"
        assert s["env"]["MASTER_PORT"] == str(plan["master_port"])
        assert s["env"]["MASTER_ADDR"] == plan["master_addr"]
    assert seen[1]["env"]["LOCAL_RANK"] == "1"
    assert cli.status(job_id)["state"] == "COMPLETED"
    assert _gone(job_id, 5)


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_private_ipc_gives_a_shm_sized_from_the_plan(cli: Cli) -> None:
    job = _job(cli, "shm", ipc="private")
    proc = cli.run("submit", str(job), "--follow", "--job-id", cli.id("shm-1"), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = _seen(proc.stdout)
    assert len(seen) == 2
    assert {s["shm"] for s in seen} == {2 << 30}  # 1 GiB for each of the node's 2 ranks


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_the_built_in_trainer_completes_inside(cli: Cli) -> None:
    digits = REPO / "examples" / "digits"
    section = container_section(extra_mounts=(f"{REPO}:{REPO}:ro",), env=("PYTHONPATH",))
    job = cli.write("digits.yaml", f"""
        name: digits
        resources: {{nodes: 1, gpus_per_node: 2}}
        workdir: {digits}
        train: {{model: "digits:build_model", dataset: "digits:build_dataset", epochs: 1,
                 batch_size: 64, seed: 7}}
        container: {section}
        """)
    cli.env["PYTHONPATH"] = str(REPO)
    job_id = cli.id("digits-1")
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    status = cli.status(job_id)
    assert status["state"] == "COMPLETED"
    metrics = (Path(str(status["run_dir"])) / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(m).get("kind") == "epoch" for m in metrics)
    assert _gone(job_id, 5)


@pytest.mark.timeout(120)
def test_cancel_leaves_no_container_and_no_process(cli: Cli) -> None:
    job = cli.write("sleepy.yaml", f"""
        name: sleepy
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: [bash, -c, "sleep 300 & sleep 300; wait"]
        container: {container_section()}
        """)
    job_id = cli.id("sleepy-1")
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    _wait_running(cli, job_id)
    assert containers_of(job_id) == [f"orchestrate-{job_id}-localhost"]
    assert len(host.job_pids(job_id)) >= 4  # the tag is on the ranks inside the container
    out = cli.run("cancel", job_id, check=True).stdout
    assert "CANCELLED" in out
    assert _gone(job_id, 10), (containers_of(job_id), host.job_pids(job_id))
    assert cli.status(job_id)["state"] == "CANCELLED"


@pytest.mark.timeout(120)
def test_a_killed_supervisor_leaves_no_container_and_no_process(cli: Cli) -> None:
    job = cli.write("orphan.yaml", f"""
        name: orphan
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: [sleep, "300"]
        container: {container_section()}
        """)
    job_id = cli.id("orphan-1")
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    _wait_running(cli, job_id)
    db = sqlite3.connect(cli.home / "jobs.db")
    try:
        (pid,) = db.execute("SELECT supervisor_pid FROM jobs WHERE id = ?", [job_id]).fetchone()
    finally:
        db.close()
    os.kill(int(pid), signal.SIGKILL)
    assert _gone(job_id, 20), (containers_of(job_id), host.job_pids(job_id))


@pytest.mark.timeout(120)
def test_a_missing_image_fails_the_job_at_once_with_podmans_message(cli: Cli) -> None:
    job = _job(cli, "noimage", image="localhost/orchestrate-absent:0")
    job_id = cli.id("noimage-1")
    started = time.monotonic()
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - started < 30
    status = cli.status(job_id)
    assert status["state"] == "FAILED"
    logs = proc.stdout + proc.stderr + json.dumps(status)
    assert "no container on" in logs and "orchestrate-absent" in logs, logs
    assert _gone(job_id, 5)


@pytest.mark.timeout(120)
def test_a_mount_of_a_missing_path_fails_naming_the_node(cli: Cli) -> None:
    job = _job(cli, "nomount", extra_mounts=("/nonexistent/data:/data:ro",))
    job_id = cli.id("nomount-1")
    proc = cli.run("submit", str(job), "--follow", "--job-id", job_id, timeout=90)
    assert proc.returncode != 0
    logs = proc.stdout + proc.stderr + json.dumps(cli.status(job_id))
    assert "container.mounts: /nonexistent/data does not exist on" in logs, logs
    assert _gone(job_id, 5)


@pytest.mark.timeout(120)
def test_a_runtime_missing_here_is_refused_before_launch(cli: Cli) -> None:
    job = _job(cli, "nodocker")
    text = job.read_text().replace("runtime: podman", "runtime: docker")
    job.write_text(text)
    cli.env["PATH"] = "/usr/sbin:/sbin"  # python runs by its full path; no docker here
    if any(Path(d, "docker").exists() for d in cli.env["PATH"].split(":")):
        pytest.fail("docker is on /usr/sbin or /sbin: this test needs a PATH without it")
    proc = cli.run("submit", str(job), "--detach", "--job-id", cli.id("nodocker-1"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # Refused by the planner (the machine probed for the job has no docker) or, where the
    # probe is not redone, by the supervisor's check on this PATH: before anything starts.
    assert ("container.runtime: node localhost has no docker" in proc.stderr
            or "container.runtime: docker is not installed on this machine" in proc.stderr), \
        proc.stderr
    assert containers_of(cli.id("nodocker-1")) == []
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_kill_by_tag_also_removes_a_container_left_behind(cli: Cli) -> None:
    """What every stop runs on a host (cancel, the watchdog of a dead supervisor, the SSH
    backend's reap of a lost host once it answers again) removes the job's containers there,
    even one whose ranks and guard are gone (a host that died under it)."""
    import subprocess

    from tests.support.containers import PYTHON_ROOT, VM_OPTIONS, built_image

    job_id = cli.id("leftover-1")
    subprocess.run(["podman", "run", "--detach", "--name", f"orchestrate-{job_id}-localhost",
                    "--label", f"orchestrate.job={job_id}", *VM_OPTIONS,
                    "--volume=/usr:/usr:ro", f"--volume={PYTHON_ROOT}:{PYTHON_ROOT}:ro",
                    "--entrypoint=sleep", built_image(), "infinity"],
                   check=True, capture_output=True, timeout=60)
    assert containers_of(job_id) == [f"orchestrate-{job_id}-localhost"]
    host.reap(job_id, 1.0)
    assert containers_of(job_id) == []
