"""The Slurm job's own GPU health check (issue #35), without the cluster: the batch host's verdict
on what each node's step gathered (recorded nvidia-smi health cases, tests/hostside/gpuhealth),
and the shipped ``monitor.py`` running both halves for real with the stand-in nvidia-smi.
The job on the cluster: tests/backends/slurm/test_slurm_health.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.backends.slurm.healthstep import judge_nodes, verdict
from orchestrate.backends.slurm.script import monitor_program
from orchestrate.core.exits import EXIT_UNHEALTHY
from orchestrate.core.plan.restart import Policy
from tests.support.fakesmi import health_facts, replay_health

SENTENCE = ("GPU 5 (RTX A6000, 00000000:A1:00.0): 2 uncorrectable ECC errors since boot and a "
            "row remap pending: reboot the server (or reset the GPU) to remap")


def _policy(max_: int = 1, exclude: bool = False) -> Policy:
    return Policy(max=max_, on=("failure",), backoff_s=(0.0,), exclude_failed_node=exclude)


def _reports(folder: Path, **cases: str | dict[str, object]) -> Path:
    for node, case in cases.items():
        facts = health_facts(case) if isinstance(case, str) else case
        (folder / f"{node}.json").write_text(json.dumps(facts))
    return folder


@pytest.mark.unit
def test_a_sick_gpu_names_its_node_and_fails_before_launch(tmp_path: Path) -> None:
    found = _reports(tmp_path, c1="healthy", c2="remap-pending", c3={"status": "missing"})
    notes, sick = judge_nodes(str(found), ["c1", "c2", "c3", "c4"])
    assert list(sick) == ["c2"] and sick["c2"][0].startswith(SENTENCE), sick
    assert "GPU health on c3: no GPUs to check (no nvidia-smi)" in notes, notes
    assert any(n.startswith("GPU health on c4: no report") for n in notes), notes
    what, status, _, exclude, reason = verdict(sick, _policy(), 0, pinned=False)
    assert (what, status, exclude) == ("FAILED", EXIT_UNHEALTHY, "-")
    assert reason.startswith(f"GPU health on c2: {SENTENCE}"), reason
    assert "the ranks were not started (restart.exclude_failed_node: true requeues the job " \
        "without c2)" in reason, reason


@pytest.mark.unit
def test_exclude_failed_node_requeues_without_it_within_the_budget(tmp_path: Path) -> None:
    _, sick = judge_nodes(str(_reports(tmp_path, c1="healthy", c2="remap-pending")),
                          ["c1", "c2"])
    what, status, wait, exclude, reason = verdict(sick, _policy(exclude=True), 0, False)
    assert (what, status, wait, exclude) == ("REQUEUE", EXIT_UNHEALTHY, 0.0, "c2"), reason
    assert reason.endswith("requeuing, restart 1 of at most 1 in 0s, without c2"), reason
    spent = verdict(sick, _policy(exclude=True), 1, False)
    assert spent[0] == "FAILED" and "restart budget is spent" in spent[4], spent
    pinned = verdict(sick, _policy(exclude=True), 0, True)
    assert pinned[0] == "FAILED" and "resources.node_names" in pinned[4], pinned
    assert verdict({}, _policy(), 0, False)[0] == "GO"


@pytest.mark.unit
def test_only_the_gpus_slurm_gave_the_job_are_judged(tmp_path: Path) -> None:
    """GPU 5 is sick, but the job was given GPUs 0 and 1 (the driver's bus ids): it goes on;
    a warning on one of its own GPUs is noted."""
    theirs = dict(health_facts("remap-pending"), job_gpus=["0000:01:00.0", "0000:25:00.0"])
    slow = dict(health_facts("pcie-x4"), job_gpus=["0000:01:00.0", "0000:25:00.0"])
    notes, sick = judge_nodes(str(_reports(tmp_path, c1=theirs, c2=slow)), ["c1", "c2"])
    assert sick == {}, sick
    widths = [n for n in notes if "PCIe link at x" in n]
    assert all(n.startswith("GPU health on c2: GPU ") for n in widths), notes


@pytest.mark.process
def test_the_shipped_monitor_gathers_and_judges(tmp_path: Path) -> None:
    """monitor.py as job.sbatch runs it: ``health-gather`` on a node (the stand-in replaying a
    pending row remap, SLURMD_NODENAME set), then ``health`` on the batch host."""
    monitor = tmp_path / "monitor.py"
    monitor.write_text(monitor_program())
    fakes = replay_health(tmp_path / "bin", "remap-pending")
    health = tmp_path / "health"
    health.mkdir()
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}", "SLURMD_NODENAME": "c2"}
    env.pop("SLURM_STEP_GPUS", None)
    env.pop("SLURM_JOB_GPUS", None)
    subprocess.run([sys.executable, "-S", str(monitor), "health-gather", str(health)], env=env,
                   check=True, timeout=60)
    merged = tmp_path / "output.idx"
    policy = json.dumps(_policy().to_json())
    line = subprocess.run([sys.executable, "-S", str(monitor), "health", str(merged),
                           str(health), str(tmp_path), "0", policy, "0", "c1", "c2"],
                          capture_output=True, text=True, check=True, timeout=60).stdout
    assert line.split() == ["FAILED", str(EXIT_UNHEALTHY), "0", "-"], line
    reason = (tmp_path / "REASON").read_text()
    assert reason.startswith(f"GPU health on c2: {SENTENCE}"), reason
    assert "GPU health on c1: no report" in merged.read_text(errors="replace")
