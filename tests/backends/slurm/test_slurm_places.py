"""The Slurm run dir on shared storage is a safe place too (issue #32, class 1): in a group
project folder that others may write (``2775``), where a member could rename the run dir and
plant his own ``job.sbatch`` or ``sitecustomize.py`` before the batch job reads them, submit is
refused before sbatch, naming the folder, its owner and mode, and the fix; in a sticky project
folder owned by root the job runs. (Two real users on one machine: tests/backends/local/
test_local_places.py; the rules: tests/hostside/test_safeplace.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.clusters import BRING_UP
from tests.support.slurmcli import OrchestrateCli, submitted_id

pytestmark = pytest.mark.slurm


def _job(ocli: OrchestrateCli, project: Path) -> Path:
    return ocli.write("placed.yaml", f"""\
        name: placed
        inventory: inventory.yaml
        backend: slurm
        run_root: {project / "runs"}
        resources: {{nodes: 1, gpus_per_node: 1, time: "5"}}
        command: [bash, -c, 'echo ran-$RANK']
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
