"""The Slurm job checks its own GPUs before any rank starts (issue #35): a first step on its
node(s) runs the GPU health check (the test cluster has no GPUs: the stand-in nvidia-smi replays
a pending row remap on one node, tests/support/fakesmi.py, on PATH for the test's job only).
A GPU that went bad before an in-allocation restart ends the job naming node and GPU, and the
program never runs again there; with ``restart.exclude_failed_node: true`` the job is requeued
without the sick node and runs elsewhere. The verdicts themselves: test_slurm_health_units.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.clusters import BRING_UP
from tests.support.fakesmi import sick_on_one_node
from tests.support.output import merged_text
from tests.support.slurmcli import OrchestrateCli, submitted_id

pytestmark = pytest.mark.slurm

SICK = ("GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors since boot and a row "
        "remap pending")


def _job(ocli: OrchestrateCli, name: str, command: str, restart: str) -> Path:
    return ocli.write(f"{name}.yaml", f"""\
        name: {name}
        inventory: inventory.yaml
        backend: slurm
        resources: {{nodes: 1, gpus_per_node: 1, time: "5"}}
        command: [bash, -c, '{command}']
        restart: {restart}
        """)


def _env(ocli: OrchestrateCli, mark: Path, claim: bool) -> dict[str, str]:
    fakes = sick_on_one_node(ocli.work / "smi", "remap-pending", mark, claim)
    return {**ocli.env, "PATH": f"{fakes}:{ocli.env.get('PATH', os.defpath)}"}


@pytest.mark.timeout(BRING_UP + 120)
def test_a_gpu_gone_bad_before_a_restart_ends_the_job_naming_node_and_gpu(
        ocli: OrchestrateCli) -> None:
    ocli.inventory()
    mark = ocli.work / "sick-node"
    # The first run is healthy; its rank marks its node sick (the GPU goes bad) and fails.
    command = (f'if [ "$ORCHESTRATE_ATTEMPT" = 1 ]; then echo "$SLURMD_NODENAME" >{mark}; '
               'exit 3; fi; echo ran-again')
    job = _job(ocli, "recheck", command, "{max: 1, on: [failure], backoff_s: [0]}")
    proc = ocli.run("submit", str(job), "--follow", timeout=120, env=_env(ocli, mark, False))
    node = mark.read_text().strip()
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    assert f"GPU health on {node}: {SICK}" in said, said
    status = ocli.status(submitted_id(proc))
    assert status["state"] == "FAILED", status
    assert status["reason"].startswith(f"GPU health on {node}: {SICK}"), status["reason"]
    assert "the ranks were not started (restart.exclude_failed_node: true requeues the job " \
        f"without {node})" in status["reason"], status["reason"]
    assert [a["n"] for a in status["attempts"]] == [1, 2], status["attempts"]
    assert "ran-again" not in merged_text(Path(status["run_dir"]))


@pytest.mark.timeout(BRING_UP + 150)
def test_exclude_failed_node_requeues_the_job_without_the_sick_node(ocli: OrchestrateCli) -> None:
    ocli.inventory()
    mark = ocli.work / "sick-node"  # whichever node the job lands on first is the sick one
    job = _job(ocli, "avoid", 'echo ran-on-$SLURMD_NODENAME',
               "{max: 1, on: [failure], backoff_s: [0], exclude_failed_node: true}")
    proc = ocli.run("submit", str(job), "--follow", timeout=150, env=_env(ocli, mark, True))
    said = proc.stdout + proc.stderr
    node = mark.read_text().strip()
    assert proc.returncode == 0, said
    status = ocli.status(submitted_id(proc))
    assert status["state"] == "COMPLETED", status
    first = status["attempts"][0]["reason"]
    assert first.startswith(f"GPU health on {node}: {SICK}"), first
    assert f"requeuing, restart 1 of at most 1 in 0s, without {node}" in first, first
    ran = [line for line in merged_text(Path(status["run_dir"])).splitlines() if "ran-on-" in line]
    assert len(ran) == 1 and f"ran-on-{node}" not in ran[0], ran
