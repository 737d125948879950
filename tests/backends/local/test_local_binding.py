"""Ranks run on their GPU's NUMA node: what ``/proc/self/status`` says, in real rank processes.

The field notes' server (8 GPUs; GPUs 0-3 on NUMA node 0, 4-7 on node 1) is replayed by the
stand-in nvidia-smi, and its two NUMA nodes are mapped onto this machine's first two CPUs
(node 0 = CPU 0, node 1 = CPU 1), so that a binding is visible here: each rank reads its own
``Cpus_allowed_list``, as a person checking a running job would (``grep Cpus_allowed_list
/proc/PID/status``), and so does a Python child it starts (the binding is inherited).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.fakesmi import fake_nvidia_smi
from tests.support.labserver import LAB
from tests.support.localcli import Cli

pytestmark = pytest.mark.process

#: The notes' server with its NUMA nodes on CPUs 0 and 1 of this machine.
INVENTORY = """
name: notes-server
nodes:
  - name: localhost
    address: 127.0.0.1
    gpus:
      - {model: A100-80GB, memory_gb: 80, indices: [0, 1]}
      - {model: RTX-A6000, memory_gb: 48, indices: [2, 3, 4, 5, 6, 7]}
    numa:
      - {node: 0, cpus: "0", gpus: [0, 1, 2, 3]}
      - {node: 1, cpus: "1", gpus: [4, 5, 6, 7]}
"""

RANK = """
import json, os, subprocess, sys
def allowed():
    for line in open("/proc/self/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout.strip()
record = {"gpus": os.environ["CUDA_VISIBLE_DEVICES"], "local_rank": os.environ["LOCAL_RANK"],
          "cpus": allowed(), "child": child, "omp": os.environ["OMP_NUM_THREADS"]}
with open(os.path.join(os.environ["OUT"], f"bound-{os.environ['RANK']}.json"), "w") as out:
    json.dump(record, out)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1 to map the two NUMA nodes onto")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher", ["ranks", "torchrun"])
def test_each_rank_runs_on_the_cpus_of_its_gpus_numa_node(cli: Cli, launcher: str) -> None:
    """``ranks``: the launch script starts each rank; ``torchrun``: one torchrun per node starts
    the workers (each binds itself at its start, by its LOCAL_RANK)."""
    bin_dir = fake_nvidia_smi(cli.work / "bin", [(i, f"NVIDIA {m}", mib) for i, m, mib in LAB])
    cli.env["PATH"] = f"{bin_dir}:{cli.env['PATH']}"
    cli.write("inv.yaml", INVENTORY)
    cli.write("rank.py", RANK)
    # spread: one rank on each NUMA node, so each rank's binding differs from its peer's
    job = cli.write("bind.yaml", f"""
        name: bind
        inventory: inv.yaml
        launcher: {launcher}
        resources: {{gpus_per_node: 2, gpu_model: RTX-A6000, placement: spread}}
        distributed: {{backend: gloo}}
        env: {{OUT: "{cli.work}"}}
        command: [python, {cli.work / "rank.py"}]
        """)
    plan = cli.run("plan", str(job), check=True)
    assert "GPUs 2,4 spread across NUMA nodes 0, 1" in " ".join(plan.stdout.split())
    cli.run("submit", str(job), "--job-id", cli.id("bind"), "--follow", timeout=80, check=True)
    ranks = [json.loads((cli.work / f"bound-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["gpus"], r["local_rank"]) for r in ranks] == [("2,4", "0"), ("2,4", "1")]
    # local rank 0 drives cuda:0 = GPU 2 (NUMA node 0 = CPU 0), local rank 1 GPU 4 (CPU 1)
    assert [r["cpus"] for r in ranks] == ["0", "1"]
    assert [r["child"] for r in ranks] == ["[0]", "[1]"]
    assert [r["omp"] for r in ranks] == ["1", "1"]
