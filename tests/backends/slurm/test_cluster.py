"""The Slurm test cluster is real and usable for the orchestrate backend.

Each test asserts what a user of a real cluster would check: a multi-node DDP job gets the right
all-reduce sum, scancel leaves no process behind, and finished jobs stay visible to
`scontrol show job` even though this cluster (like many small ones) has no accounting.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from orchestrate.backends.slurm.ctl import SlurmClient, job_state_name
from orchestrate.backends.slurm.version import cluster_version, forget_versions
from tests.support.clusters import BRING_UP
from tests.support.slurmcluster import FINISHED, SlurmCluster

pytestmark = pytest.mark.slurm

PYTHON = sys.executable
# One rank of a DDP job: the torchrun env names, filled from what srun gives each task.
DDP_WORKER = """
import datetime, json, os, socket, sys
import torch
import torch.distributed as dist

os.environ["RANK"] = os.environ["SLURM_PROCID"]
os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
result = {
    "rank": rank,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "world_size": dist.get_world_size(),
    "hostname": socket.gethostname(),
    "node": os.environ["SLURMD_NODENAME"],
    "master_addr": os.environ["MASTER_ADDR"],
    "sum": value.item(),
}
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
"""

# Rank 0 listens on every address of its node; rank 1 reaches it through MASTER_ADDR, and
# checks that its own node name (a typical wrong MASTER_ADDR) does not reach it.
MASTER_ADDR_PROBE = """
import json, os, socket, sys, time
rank = int(os.environ["SLURM_PROCID"])
port = int(os.environ["MASTER_PORT"])
out = os.path.join(sys.argv[1], f"probe{rank}.json")
if rank == 0:
    server = socket.create_server(("", port))
    server.settimeout(20)
    conn, _ = server.accept()
    conn.close()
    result = {"served": True}
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=2).close()
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        socket.create_connection((socket.gethostname(), port), timeout=2).close()
        wrong = "connected"
    except ConnectionRefusedError:
        wrong = "refused"
    result = {"master_addr": "connected", "own_node_name": wrong}
with open(out, "w") as f:
    json.dump(result, f)
"""


def write_batch(path: Path, body: str, *directives: str) -> Path:
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", body]
    path.write_text("\n".join(lines) + "\n")
    return path


def first_node(cluster: SlurmCluster, job: dict[str, str]) -> str:
    names = cluster.run("scontrol", "show", "hostnames", job["NodeList"]).stdout.split()
    return names[0]


@pytest.mark.torch
@pytest.mark.timeout(BRING_UP + 120)
def test_ddp_allreduce_2_nodes_x_2_tasks(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    batch = write_batch(
        tmp_path / "ddp.sbatch",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n"
        f"srun --kill-on-bad-exit=1 {PYTHON} {worker} {tmp_path}",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--time=2",
        f"--output={tmp_path}/slurm-%j.out",
    )
    job_id = slurm_cluster.sbatch(batch)
    job = slurm_cluster.wait(job_id, timeout=100)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["sum"] for r in ranks] == [10.0] * 4  # 1 + 2 + 3 + 4
    assert [r["world_size"] for r in ranks] == [4] * 4
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    first, second = ranks[0]["node"], ranks[2]["node"]
    assert first != second
    assert [r["node"] for r in ranks] == [first, first, second, second]
    assert {r["master_addr"] for r in ranks} == {first_node(slurm_cluster, job)} == {first}
    if slurm_cluster.layout == "netns":  # each rank runs on its own node's "machine"
        assert [r["hostname"] for r in ranks] == [r["node"] for r in ranks]


@pytest.mark.timeout(BRING_UP + 60)
def test_wrong_master_addr_does_not_reach_rank0(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    if slurm_cluster.layout != "netns":
        pytest.skip("the loopback layout shares one port space between nodes")
    probe = tmp_path / "probe.py"
    probe.write_text(MASTER_ADDR_PROBE)
    batch = write_batch(
        tmp_path / "probe.sbatch",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n"
        f"srun --kill-on-bad-exit=1 {PYTHON} {probe} {tmp_path}",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=1",
        f"--output={tmp_path}/slurm-%j.out",
    )
    job_id = slurm_cluster.sbatch(batch)
    job = slurm_cluster.wait(job_id, timeout=50)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert json.loads((tmp_path / "probe0.json").read_text()) == {"served": True}
    assert json.loads((tmp_path / "probe1.json").read_text()) == {
        "master_addr": "connected",
        "own_node_name": "refused",
    }


def stepd_pids(job_id: str) -> list[int]:
    """slurmstepd processes of one job: their command line reads `slurmstepd: [JOBID.STEP]`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()):
            found.append(int(proc.name))
    return found


def alive(pid: int) -> bool:
    """Whether the process still runs; a zombie waiting for its parent to reap it does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.timeout(BRING_UP + 60)
def test_scancel_leaves_nothing_running(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    batch = write_batch(
        tmp_path / "sleep.sbatch",
        f"echo $$ > {tmp_path}/batch.pid\n"
        "srun bash -c 'echo $$ > " + str(tmp_path) + "/task.$SLURM_PROCID.pid; exec sleep 600'",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--output={tmp_path}/slurm-%j.out",
    )
    job_id = slurm_cluster.sbatch(batch)
    pid_files = [tmp_path / name for name in ("batch.pid", "task.0.pid", "task.1.pid")]
    deadline = time.monotonic() + 20
    while not all(f.exists() and f.read_text().strip() for f in pid_files):
        assert time.monotonic() < deadline, (
            f"job {job_id} never started: {slurm_cluster.job(job_id)}"
        )
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pid_files]
    assert all(alive(p) for p in pids)
    assert stepd_pids(job_id)

    slurm_cluster.run("scancel", job_id)
    job = slurm_cluster.wait(job_id, until=frozenset({"CANCELLED"}), timeout=20)
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) or stepd_pids(job_id):
        assert time.monotonic() < deadline, (
            f"left running after scancel: {pids}, {stepd_pids(job_id)}"
        )
        time.sleep(0.1)
    assert slurm_cluster.run("squeue", "-h", "-j", job_id, check=False).stdout.strip() == ""
    # The tasks got SIGTERM: the batch shell killed by it ("0:15"), or, when the signal reached
    # it while it waited for srun, exiting 128 + 15 once srun's step ended ("143:0"): which one
    # is a race inside Slurm, seen on a busy machine.
    assert job["ExitCode"] in ("0:15", "143:0"), job["ExitCode"]


@pytest.mark.timeout(BRING_UP + 60)
def test_finished_jobs_stay_visible_without_accounting(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    ok = slurm_cluster.sbatch(
        write_batch(tmp_path / "ok.sbatch", "hostname", f"--output={tmp_path}/ok.out")
    )
    failing = slurm_cluster.sbatch(
        write_batch(tmp_path / "fail.sbatch", "exit 3", f"--output={tmp_path}/fail.out")
    )
    assert slurm_cluster.wait(ok)["JobState"] == "COMPLETED"
    assert slurm_cluster.wait(failing)["JobState"] == "FAILED"

    time.sleep(1)  # long after the end, as a backend polling late would ask
    done, failed = slurm_cluster.job(ok), slurm_cluster.job(failing)
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0")
    assert (failed["JobState"], failed["ExitCode"]) == ("FAILED", "3:0")
    assert done["NodeList"] in slurm_cluster.nodes
    assert slurm_cluster.run("squeue", "-h", "-j", ok, check=False).stdout.strip() == ""

    # No accounting on purpose: the backend must not rely on sacct.
    sacct = slurm_cluster.run("sacct", "-j", ok, check=False)
    assert sacct.returncode != 0
    assert "accounting storage is disabled" in sacct.stderr
    # jobcomp/filetxt keeps one line per finished job instead.
    jobcomp = (slurm_cluster.state_dir / "log" / "jobcomp.txt").read_text()
    assert f"JobId={ok} " in jobcomp
    assert f"JobId={failing} " in jobcomp


def test_keys_in_a_job_name_and_comment_do_not_change_its_state(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A held job named and commented with `` JobState=COMPLETED``: the backend's client reads
    PENDING (JobHeldUser), then COMPLETED once released and run; its name stays whole. The
    cluster's release is found with one ``sbatch --version``."""
    name = "evil JobState=COMPLETED Reason=None x"
    job_id = slurm_cluster.sbatch(
        write_batch(tmp_path / "evil.sbatch", "true", f"--output={tmp_path}/evil.out"),
        "--hold", f"--job-name={name}", "--comment=c JobState=COMPLETED ExitCode=0:0")
    client = SlurmClient(slurm_cluster.env)
    held = client.show_job(job_id)
    assert held is not None
    assert (held["JobState"], held["Reason"], held["JobName"]) == ("PENDING", "JobHeldUser", name)
    assert held["Comment"] == "c JobState=COMPLETED ExitCode=0:0"
    slurm_cluster.run("scontrol", "release", job_id)
    deadline = time.monotonic() + 30
    while (info := client.show_job(job_id)) and job_state_name(info) not in FINISHED:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert info is not None and (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    forget_versions()
    version = cluster_version(client)
    assert version is not None and str(version) in slurm_cluster.run("sinfo", "-V").stdout
