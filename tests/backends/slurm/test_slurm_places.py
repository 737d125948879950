"""The Slurm run dir on shared storage is a safe place too (issue #32, class 1): in a group
project folder that others may write (``2775``), where a member could rename the run dir and
plant his own ``job.sbatch`` or ``sitecustomize.py`` before the batch job reads them, submit is
refused before sbatch, naming the folder, its owner and mode, and the fix; in a sticky project
folder owned by root the job runs. (Two real users on one machine: tests/backends/local/
test_local_places.py; the rules: tests/hostside/test_safeplace.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrate.core.layout import MERGED_INDEX
from tests.support.clusters import BRING_UP
from tests.support.slurmcli import OrchestrateCli, submitted_id

pytestmark = pytest.mark.slurm


def _job(ocli: OrchestrateCli, project: Path, slurm: str = "") -> Path:
    return ocli.write("placed.yaml", f"""\
        name: placed
        inventory: inventory.yaml
        backend: slurm
        run_root: {project / "runs"}
        resources: {{nodes: 1, gpus_per_node: 1, time: "5"}}
        command: [bash, -c, 'echo ran-$RANK']
        {slurm}
        """)


@pytest.mark.timeout(BRING_UP + 120)
def test_a_run_root_in_a_group_writable_folder_is_refused_before_sbatch(
        ocli: OrchestrateCli) -> None:
    ocli.inventory()
    project = ocli.work / "project"
    project.mkdir()
    project.chmod(0o2775)
    queued = ocli.cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
    proc = ocli.run("submit", str(_job(ocli, project)), "--detach")
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{project} (owner root:" in said and "mode 2775) is writable by group" in said
    assert f"chmod +t {project}" in said, said
    assert not (project / "runs").exists()
    assert ocli.cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split() == queued


@pytest.mark.timeout(BRING_UP + 120)
def test_in_a_sticky_root_folder_the_batch_job_runs(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    project = ocli.work / "project"
    project.mkdir()
    project.chmod(0o3775)  # root's, sticky: nobody may rename what is not theirs
    proc = ocli.run("submit", str(_job(ocli, project)), "--follow", timeout=150)
    assert proc.returncode == 0 and "ran-0" in proc.stdout, proc.stdout + proc.stderr
    status = ocli.status(submitted_id(proc))
    run_dir = Path(status["run_dir"])
    assert status["state"] == "COMPLETED" and run_dir.parent == project / "runs"
    assert run_dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.timeout(BRING_UP + 150)
def test_a_run_dir_swapped_while_the_job_waits_is_refused_by_the_batch_script(
        ocli: OrchestrateCli) -> None:
    """The batch script runs ``monitor.py``, its own ``--task`` copy and the sidecar by their
    paths long after ``sbatch`` (a job may wait in the queue for hours): it checks them again
    first. While the job is held, the project folder loses its sticky bit and a labmate
    (uid 65534 here) renames ``runs/`` and plants his own run dir with his ``monitor.py``: the
    batch refuses, naming the folder, and his program never runs."""
    ocli.inventory()
    project = ocli.work / "project"
    project.mkdir()
    project.chmod(0o3775)
    job_id = ocli.submit(_job(ocli, project, "slurm: {extra_args: [--hold]}"))
    status = ocli.status(job_id)
    run_dir = Path(status["run_dir"])
    project.chmod(0o2775)
    (project / "runs").rename(project / "runs-was-mine")
    marker = project / "planted-ran"
    run_dir.mkdir(parents=True)
    (run_dir / "monitor.py").write_text(f"open({str(marker)!r}, 'w')\n")
    for path in (project / "runs", run_dir.parent, run_dir, run_dir / "monitor.py"):
        os.chown(path, 65534, 65534)
    ocli.cluster.run("scontrol", "release", str(status["external_id"]), check=True)
    ended = ocli.wait(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=90)
    assert ended["state"] == "FAILED" and not marker.exists(), ended
    said = " ".join((run_dir / MERGED_INDEX).read_text().split())
    assert f"refused to run {run_dir}/monitor.py: unsafe place: {project} (owner " in said, said
