"""A job whose ranks start in podman under srun, on the real test cluster (docs/containers.md).

pyxis and apptainer cannot be installed here (golden renders cover them:
tests/core/test_core_containers.py); podman is a runtime some sites allow under Slurm. The image
is built here (tests/support/containers.py); the nodes share this machine's podman store.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.containers import container_section, containers_of
from tests.support.output import merged_text
from tests.support.slurmcli import OrchestrateCli, submitted_id

pytestmark = pytest.mark.slurm

PROGRAM = """
import datetime, json, os, socket
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("seen " + json.dumps({"rank": os.environ["RANK"], "sum": t.item(),
      "inside": os.path.exists("/run/.containerenv"),
      "tag": os.environ.get("ORCHESTRATE_JOB_ID")}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.timeout(240)
def test_ranks_start_in_podman_under_srun(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    (ocli.work / "boxed.py").write_text(PROGRAM)
    job = ocli.write("boxed.yaml", f"""\
        name: boxed
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 2, gpus_per_node: 2, time: "5"}}
        command: [python, boxed.py]
        distributed: {{timeout_s: 60}}
        container: {container_section()}
        """)
    proc = ocli.run("submit", str(job), "--follow", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = submitted_id(proc)
    status = ocli.status(job_id)
    assert status["state"] == "COMPLETED"
    log = merged_text(Path(status["run_dir"]))
    seen = [json.loads(line.split(" seen ", 1)[1]) for line in log.splitlines()
            if " seen " in line]
    assert sorted(s["rank"] for s in seen) == ["0", "1", "2", "3"], log
    assert all(s["inside"] and s["sum"] == 10.0 and s["tag"] == job_id for s in seen)
    deadline = time.monotonic() + 15
    while containers_of(job_id) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert containers_of(job_id) == [], subprocess.run(
        ["podman", "ps", "-a"], capture_output=True, text=True).stdout
