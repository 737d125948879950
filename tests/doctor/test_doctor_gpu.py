"""`orchestrate doctor` on this machine's GPUs (skipped, with the reason, where there are none).

The whole command on the local backend with an inventory probed from this machine
(`inventory probe --local`): the static tier reads the real nvidia-smi (models, memory, PCI
order, driver, NCCL), smoke runs nccl on every GPU, and the bandwidth tier reports the
NVLink/PCIe busbw, graded against the inventory's floor when the model and link have one.
"""

from __future__ import annotations

import json

import pytest

from tests.support.gpus import GPUS, needs_gpu
from tests.support.localcli import Cli

pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.timeout(400)]


@needs_gpu("the doctor's nccl tiers need one")
def test_doctor_on_the_gpus_of_this_machine(cli: Cli) -> None:
    probed = cli.run("inventory", "probe", "--local", "-o", "inv.yaml", timeout=180)
    assert probed.returncode == 0, probed.stdout + probed.stderr
    job = cli.write("gpu.yaml", """
        name: gpudoc
        inventory: inv.yaml
        resources: {nodes: 1, gpus_per_node: all}
        command: [python, -c, "print('the job ran')"]
        """)
    proc = cli.run("doctor", str(job), "--json", "--sizes", "1M,64M,256M,1G", "--budget-s",
                   "1", timeout=360)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    print("\n" + "\n".join(f"{c['tier']:9} {c['name']:24} {c['status']:4} {c['measured'] or ''}"
                           f" | {c['detail']}" for c in doc["checks"]))
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert not failed, failed
    gpus = next(c for c in doc["checks"] if c["name"] == "gpus")
    assert gpus["status"] == "pass"
    assert any(c["name"] == "version: nccl" for c in doc["checks"])
    smoke = next(c for c in doc["checks"] if c["tier"] == "smoke")
    assert f"{GPUS} rank(s) on 1 node(s) joined (nccl)" in smoke["detail"]
    rows = doc["bandwidth"]["allreduce"]
    assert [r["size_bytes"] for r in rows if r["backend"].startswith("all")] == [
        1 << 20, 64 << 20, 256 << 20, 1 << 30]
    best = max(r["busbw_GBps"] if GPUS > 1 else r["algbw_GBps"] for r in rows)
    assert best > (2.0 if GPUS > 1 else 1.0), rows  # PCIe Gen3 moves several GB/s; NVLink 100s
