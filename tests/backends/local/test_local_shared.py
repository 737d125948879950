"""A shared lab server on the local backend (issue #20, #25 item 5), one user: GPUs in use
outside orchestrate, waiting jobs (``submit --wait``), ``orchestrate gpus``, a hung
``nvidia-smi``, and a rank's double-forked daemon that drops the job tag.

The machine is the lab server of the issue (2x A100 + 6x A6000), replayed by the stand-in
``nvidia-smi`` (tests/support/fakesmi.py); the "foreign" compute processes it lists are real
processes started here, so their pid, owner and name are what ``ps`` says. Two real Unix users
are in test_local_users.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrate.hostside import host
from tests.support.fakesmi import fake_nvidia_smi, set_compute_apps
from tests.support.labserver import LAB
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

@pytest.fixture
def lab(cli: Cli) -> Iterator[Cli]:
    """``cli`` on the lab server: the stand-in nvidia-smi on PATH (no inventory: the local
    backend reads this machine's GPUs from it)."""
    bin_dir = fake_nvidia_smi(cli.work / "bin", LAB)
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    yield cli


@pytest.fixture
def notebook() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside orchestrate (another user's notebook, as far as nvidia-smi says)."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def _job(cli: Cli, name: str, extra: str = "", seconds: float = 60) -> Path:
    return cli.write(f"{name}.yaml", f"""
        name: {name}
        resources: {{nodes: 1, gpus_per_node: 1, gpu_model: A100-80GB}}
        {extra}
        command: [bash, -c, 'echo "gpus=$CUDA_VISIBLE_DEVICES"; sleep {seconds}']
        """)


def _until(cli: Cli, job: str, state: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if cli.run("status", job).returncode == 0:
            status = cli.status(job)
            if status["state"] == state and (state != "RUNNING" or all(
                    r["pid"] for r in status["ranks"])):
                return status
        time.sleep(0.1)
    raise AssertionError(f"job {job} never {state}: {status}")


def _gpus_of(status: dict[str, Any]) -> str:
    plan = json.loads((Path(str(status["run_dir"])) / "plan.json").read_text())
    return str(plan["nodes"][0]["cuda_visible_devices"])


@pytest.mark.timeout(120)
def test_a_gpu_that_a_foreign_process_uses_is_avoided_and_shared_only_when_asked(
        lab: Cli, notebook: subprocess.Popen[bytes]) -> None:
    set_compute_apps(lab.work / "bin", [(notebook.pid, "python3", 0, 30720)])
    first = lab.id("fa")
    lab.run("submit", str(_job(lab, "fa")), "--detach", "--job-id", first, check=True)
    assert _gpus_of(_until(lab, first, "RUNNING")) == "1"  # not GPU 0: the notebook's
    # Both A100s taken now (one by a job, one by the notebook): busy, named, exit 75.
    refused = lab.run("submit", str(_job(lab, "fb")), "--detach", "--job-id", lab.id("fb"))
    assert refused.returncode == 75, refused.stderr
    assert f"GPU 0 in use by pid {notebook.pid} (" in refused.stderr
    assert "python3, 30.0 GB)" in refused.stderr and f"job {first} (" in refused.stderr
    # Sharing: the notebook's GPU, with 50 GB free, takes a job that needs 40 GB of it ...
    shared = lab.id("fs")
    lab.run("submit", str(_job(lab, "fs")), "--detach", "--job-id", shared,
            "--set", "resources.share_gpus=true", "--set", "resources.min_gpu_memory_gb=40",
            check=True)
    assert _gpus_of(_until(lab, shared, "RUNNING")) == "0"
    lab.run("cancel", shared, first, check=True)
    # ... but not when its processes leave too little free memory for the job's need.
    set_compute_apps(lab.work / "bin", [(notebook.pid, "python3", 0, 30720),
                                        (notebook.pid, "python3", 1, 30720)])
    tight = lab.run("submit", str(_job(lab, "ft")), "--detach", "--job-id", lab.id("ft"),
                    "--set", "resources.share_gpus=true",
                    "--set", "resources.min_gpu_memory_gb=60")
    assert tight.returncode == 75, tight.stderr
    assert "50 GB free, too little for the job" in " ".join(tight.stderr.split())


@pytest.mark.timeout(150)
def test_waiting_jobs_start_in_submission_order_as_the_gpus_free(lab: Cli) -> None:
    holder, second, third = lab.id("wa"), lab.id("wb"), lab.id("wc")
    lab.run("submit", str(_job(lab, "wa", seconds=600)), "--detach", "--job-id", holder,
            "--set", "resources.gpus_per_node=2", check=True)
    _until(lab, holder, "RUNNING")
    for job in (second, third):
        sub = lab.run("submit", str(_job(lab, "wb", seconds=600)), "--detach", "--job-id", job,
                      "--wait", "--set", "resources.gpus_per_node=2")
        assert sub.returncode == 0, sub.stderr
        assert f"job {job} is waiting" in sub.stderr
    pending = _until(lab, second, "PENDING")
    assert f"held by job {holder} (" in str(pending["reason"])
    listed = lab.run("list", check=True).stdout
    assert f"{third} is waiting" in " ".join(listed.split())
    # The holder ends: the older waiting job starts within seconds, the younger still waits.
    lab.run("cancel", holder, check=True)
    freed = time.monotonic()
    _until(lab, second, "RUNNING", timeout=10)
    assert time.monotonic() - freed < 5
    assert _until(lab, third, "PENDING")["started_at"] is None
    lab.run("cancel", second, check=True)
    _until(lab, third, "RUNNING", timeout=10)
    # Cancelling a waiting job withdraws it: it never starts.
    fourth = lab.id("wd")
    lab.run("submit", str(_job(lab, "wd")), "--detach", "--job-id", fourth, "--wait",
            "--set", "resources.gpus_per_node=2", check=True)
    _until(lab, fourth, "PENDING")
    lab.run("cancel", fourth, check=True)
    lab.run("cancel", third, check=True)
    gone = lab.status(fourth)
    assert gone["state"] == "CANCELLED" and gone["started_at"] is None
    assert not host.job_pids(fourth)


@pytest.mark.timeout(60)
def test_a_waiting_job_that_can_never_fit_is_refused_at_once(lab: Cli) -> None:
    start = time.monotonic()
    never = lab.run("submit", str(_job(lab, "wn")), "--detach", "--job-id", lab.id("wn"),
                    "--wait", "--set", "resources.gpus_per_node=3")
    assert never.returncode == 2, never.stderr
    assert time.monotonic() - start < 10
    assert lab.run("status", lab.id("wn")).returncode != 0 or \
        lab.status(lab.id("wn"))["state"] != "PENDING"


@pytest.mark.timeout(90)
def test_gpus_names_every_holder(lab: Cli, notebook: subprocess.Popen[bytes]) -> None:
    set_compute_apps(lab.work / "bin", [(notebook.pid, "python3", 0, 30720)])
    job = lab.id("gh")
    lab.run("submit", str(_job(lab, "gh")), "--detach", "--job-id", job, check=True)
    _until(lab, job, "RUNNING")
    answer = json.loads(lab.run("gpus", "--json", check=True).stdout)
    gpus = {g["index"]: g for g in answer["gpus"]}
    assert sorted(gpus) == list(range(8))
    assert gpus[0]["model"] == "A100-80GB" and gpus[0]["memory_total_gb"] == 80.0
    assert gpus[0]["memory_used_gb"] == 30.0
    [process] = gpus[0]["holders"]
    assert process["kind"] == "process" and process["pid"] == notebook.pid
    assert process["user"] == "root" and process["memory_gb"] == 30.0
    [lease] = gpus[1]["holders"]
    assert lease["kind"] == "job" and lease["job_id"] == job and lease["user"] == "root"
    assert all(not gpus[i]["holders"] for i in range(2, 8))
    table = " ".join(lab.run("gpus", check=True).stdout.split())
    assert f"pid {notebook.pid} (root, python3, 30.0 GB)" in table
    assert f"job {job} (root since" in table
    lab.run("cancel", job, check=True)


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_a_hung_nvidia_smi_is_bounded_and_named(lab: Cli) -> None:
    lab.env["FAKE_NVSMI_SLEEP"] = "30"
    lab.env["ORCHESTRATE_NVIDIA_SMI_TIMEOUT_S"] = "1"
    start = time.monotonic()
    answer = lab.run("gpus", check=True)
    assert time.monotonic() - start < 10
    assert "nvidia-smi did not answer within 1s" in " ".join(answer.stdout.split())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["ends", "cancelled"])
def test_a_daemon_that_drops_the_job_tag_does_not_outlive_the_job(cli: Cli, how: str) -> None:
    """#25 item 5: a rank's double-forked daemon with a clean environment (no job tag) is
    found by ancestry (the supervisor is a subreaper: the orphan re-parents to it) and
    stopped; nothing of the job runs afterwards and its lease is gone."""
    marker = f"daemon-{cli.uid}-{how}"
    wait = "sleep 2" if how == "ends" else "sleep 600"
    job = cli.write("d.yaml", f"""
        name: d
        resources: {{nodes: 1, gpus_per_node: 1}}
        command: [bash, -c, '(setsid env -i bash -c "exec -a {marker} sleep 1000" &); {wait}']
        """)
    job_id = cli.id(f"d{how[0]}")
    cli.run("submit", str(job), "--detach", "--job-id", job_id, check=True)
    deadline = time.monotonic() + 20
    while not _named(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _named(marker), "the daemon never started"
    if how == "cancelled":
        cli.run("cancel", job_id, check=True)
        final = cli.status(job_id)
    else:
        final = _until(cli, job_id, "COMPLETED")
    assert final["state"] in ("COMPLETED", "CANCELLED")
    deadline = time.monotonic() + 10
    while _named(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _named(marker), f"the daemon {marker} outlived job {job_id}"
    leases = Path(cli.env["ORCHESTRATE_LEASES"])
    deadline = time.monotonic() + 10  # left by the supervisor, or its watchdog after it
    while list(leases.glob(f"*/{job_id}@*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(leases.glob(f"*/{job_id}@*.json"))
    log = " ".join((Path(str(final["run_dir"])) / "supervisor.log").read_text().split())
    assert "stopping what the ranks left without the job tag (by ancestry or cgroup): pid " \
        in log and ", sleep)" in log


def _named(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[0] == marker.encode():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_a_waiting_job_whose_bound_passes_ends_deadline_naming_the_holder(lab: Cli) -> None:
    """``--wait=0:02``: a job not placed within 2 s ends DEADLINE (never started) saying what
    it waited for and who held it; followed, its submit exits 75 (try again later)."""
    holder = lab.id("dh")
    lab.run("submit", str(_job(lab, "dh", seconds=600)), "--detach", "--job-id", holder,
            "--set", "resources.gpus_per_node=2", check=True)
    _until(lab, holder, "RUNNING")
    bounded = lab.id("dw")
    sub = lab.run("submit", str(_job(lab, "dw")), "--detach", "--job-id", bounded,
                  "--wait=0:02")
    assert sub.returncode == 0 and f"job {bounded} is waiting" in sub.stderr, sub.stderr
    ended = _until(lab, bounded, "DEADLINE", timeout=15)
    reason = " ".join(str(ended["reason"]).split())
    assert ended["started_at"] is None
    assert "not placed within 2s (resources.wait)" in reason
    assert f"held by job {holder} (root, since" in reason, reason
    start = time.monotonic()
    followed = lab.run("submit", str(_job(lab, "df")), "--follow", "--job-id", lab.id("df"),
                       "--wait=0:02")
    assert followed.returncode == 75, followed.stderr
    assert time.monotonic() - start < 15
    lab.run("cancel", holder, check=True)
    assert not list(Path(lab.env["ORCHESTRATE_LEASES"]).glob("*/*.ticket"))


@pytest.mark.timing
@pytest.mark.timeout(60)
def test_cancel_returns_once_the_lease_is_released(lab: Cli) -> None:
    """A submit right after ``cancel`` gets the cancelled job's GPUs (no 75), and the cancel
    took a few seconds at most."""
    first, second = lab.id("ca"), lab.id("cb")
    lab.run("submit", str(_job(lab, "ca", seconds=600)), "--detach", "--job-id", first,
            "--set", "resources.gpus_per_node=2", check=True)
    _until(lab, first, "RUNNING")
    start = time.monotonic()
    lab.run("cancel", first, check=True)
    took = time.monotonic() - start
    again = lab.run("submit", str(_job(lab, "cb", seconds=600)), "--detach", "--job-id",
                    second, "--set", "resources.gpus_per_node=2")
    assert again.returncode == 0, again.stderr
    assert took < 5, f"cancel took {took:.1f}s"
    assert _gpus_of(_until(lab, second, "RUNNING")) == "0,1"
    lab.run("cancel", second, check=True)


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.fixture
def freezer() -> Iterator[Path]:
    """A cgroup v1 freezer cgroup (root): a frozen process that is sent SIGKILL stays (in D
    state) until it is thawed -- a process that outlives SIGKILL, as one in uninterruptible
    sleep on a hung driver or file system would."""
    if os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 freezer hierarchy")
    group = FREEZER / f"orchestrate-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


@pytest.mark.timeout(90)
def test_a_process_that_outlives_sigkill_keeps_the_lease_and_is_named(
        lab: Cli, freezer: Path) -> None:
    """A rank's child frozen (cgroup v1 freezer) when the job is cancelled survives SIGKILL:
    the job's ending names it, its lease stays held with it as the holder, the next job's
    refusal and ``gpus --json`` name it; once it is gone the GPUs free."""
    pidfile = lab.work / "child.pid"
    job = lab.write("sv.yaml", f"""
        name: sv
        resources: {{nodes: 1, gpus_per_node: 2, gpu_model: A100-80GB}}
        command: [bash, -c, 'sleep 600 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}; wait']
        """)
    held = lab.id("sv")
    lab.run("submit", str(job), "--detach", "--job-id", held, check=True)
    _until(lab, held, "RUNNING")
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    (freezer / "cgroup.procs").write_text(str(child))
    (freezer / "freezer.state").write_text("FROZEN")
    lab.run("cancel", held, check=True)
    ended = lab.status(held)
    assert ended["state"] == "CANCELLED"
    assert host.proc_start(child) is not None  # SIGKILLed, frozen: still there
    reason = " ".join(str(ended["reason"]).split())
    assert f"still run after SIGKILL: pid {child} (root, sleep)" in reason, reason
    [lease] = Path(lab.env["ORCHESTRATE_LEASES"]).glob(f"*/{held}@*.json")
    record = json.loads(lease.read_text())
    assert child in [pid for pid, _ in record["holders"]]
    assert [pid for pid, _ in record["survivors"]] == [child]
    refused = lab.run("submit", str(_job(lab, "sn")), "--detach", "--job-id", lab.id("sn"))
    assert refused.returncode == 75, refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"job {held} (root, since" in said
    assert f"pid {child} (root, sleep) outlived SIGKILL and still run" in said, said
    gpus = {g["index"]: g for g in json.loads(lab.run("gpus", "--json", check=True).stdout)
            ["gpus"]}
    for index in (0, 1):
        [holder] = gpus[index]["holders"]
        assert holder["job_id"] == held
        assert holder["survivors"] == [{"pid": child, "user": "root", "name": "sleep"}]
    assert f"still held by pid {child} (root, sleep)" in " ".join(
        lab.run("gpus", check=True).stdout.split())
    # Thawed, the SIGKILL lands: the process is gone, and with it the lease.
    (freezer / "freezer.state").write_text("THAWED")
    after = lab.id("sa")
    deadline = time.monotonic() + 10
    while True:
        got = lab.run("submit", str(_job(lab, "sa", seconds=600)), "--detach", "--job-id",
                      after, "--set", "resources.gpus_per_node=2")
        if got.returncode != 75 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got.returncode == 0, got.stderr
    assert host.proc_start(child) is None  # gone (or a zombie its new parent has not reaped)
    assert _gpus_of(_until(lab, after, "RUNNING")) == "0,1"
    lab.run("cancel", after, check=True)
    assert not host.job_pids(held) and not host.job_pids(after)
