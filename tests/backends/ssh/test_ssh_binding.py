"""Over SSH, each rank runs on its GPU's NUMA node: ``/proc/self/status`` in the real rank.

Test host h1 stands in for the field notes' server (8 GPUs replayed by the stand-in nvidia-smi;
GPUs 0-3 on NUMA node 0, 4-7 on node 1), its NUMA nodes mapped onto this machine's CPUs 0 and 1
(the test hosts are network namespaces of this machine), so a binding is visible here.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.labserver import gpu_node, gpu_python
from tests.support.sshcli import SshCli

pytestmark = pytest.mark.ssh

RANK = """
import json, os
allowed = next(line.split(":", 1)[1].strip() for line in open("/proc/self/status")
               if line.startswith("Cpus_allowed_list:"))
print(json.dumps({"rank": os.environ["RANK"], "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
                  "cpus": allowed, "omp": os.environ["OMP_NUM_THREADS"]}), flush=True)
"""


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1 to map the two NUMA nodes onto")
@pytest.mark.timeout(120)
def test_each_rank_runs_on_the_cpus_of_its_gpus_numa_node_over_ssh(ssh_cli: SshCli) -> None:
    node = {**gpu_node(ssh_cli), "numa": [{"node": 0, "cpus": "0", "gpus": [0, 1, 2, 3]},
                                          {"node": 1, "cpus": "1", "gpus": [4, 5, 6, 7]}]}
    ssh_cli.inventory([node], python=gpu_python(ssh_cli))
    ssh_cli.write("rank.py", RANK)
    job = ssh_cli.write("bind.yaml", f"""
        name: bind
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: 2, gpu_model: RTX-A6000, placement: spread}}
        distributed: {{backend: gloo}}
        command: [python, {ssh_cli.work / "rank.py"}]
        """)
    proc = ssh_cli.run("submit", str(job), "--follow", "--job-id", "bind-ssh", timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = sorted((json.loads(line.partition(" ")[2]) for line in proc.stdout.splitlines()
                      if line.startswith("[h1:") and line.partition(" ")[2].startswith("{")),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["gpus"], r["cpus"], r["omp"]) for r in records] == [
        ("0", "2,4", "0", "1"), ("1", "2,4", "1", "1")], proc.stdout
