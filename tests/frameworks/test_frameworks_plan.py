"""`framework:` in a job: layouts Lightning cannot run are refused by `plan`, with the reason and
what to do, before anything is queued; the others say what to pass. Through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.corecli import TEST_INVENTORIES, cli

pytestmark = pytest.mark.unit


def _job(tmp_path: Path, framework: str, backend: str, gpus_per_node: int | str = "all",
         name: str = "fw") -> Path:
    path = tmp_path / f"{name}-{framework}-{backend}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        inventory: {TEST_INVENTORIES / "uneven.yaml"}
        backend: {backend}
        framework: {framework}
        resources: {{nodes: 2, gpus_per_node: {gpus_per_node}, time: "10"}}
        command: [python, train.py]
        """))
    return path


@pytest.mark.process
@pytest.mark.parametrize("backend", ["slurm", "ssh"])
def test_trainer_on_uneven_nodes_is_refused_before_launch(tmp_path: Path, backend: str) -> None:
    job = _job(tmp_path, "lightning-trainer", backend)
    # A separate interpreter: what a user sees, exit status and all, and no traceback.
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "plan", str(job)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    first, hint = proc.stderr.strip().splitlines()
    assert first.startswith(f"error: {job}: framework: the Lightning Trainer cannot run nodes "
                            "with different rank counts (alpha: 3, beta: 2)")
    assert "num_nodes x devices (6 on alpha, 4 on beta), not 5" in first
    assert first.endswith("(got 'lightning-trainer')")
    assert hint.strip().startswith("hint: give every node the same count "
                                   "(resources.gpus_per_node)")
    # submit refuses it the same way, before any backend is touched.
    submit = cli("submit", job, "--dry-run")
    assert submit.code == 2 and "the Lightning Trainer cannot run" in submit.err


def test_trainer_on_even_nodes_is_told_what_to_pass(tmp_path: Path) -> None:
    result = cli("plan", _job(tmp_path, "lightning-trainer", "slurm", gpus_per_node=2))
    assert result.code == 0, result.err
    assert ("note: Lightning will use its SLURMEnvironment: pass devices=2 and num_nodes=2"
            in result.out)
    result = cli("plan", _job(tmp_path, "lightning-trainer", "ssh", gpus_per_node=2))
    assert ("note: Lightning will use its TorchElasticEnvironment: pass devices=2 and "
            "num_nodes=2" in result.out)


def test_fabric_on_uneven_nodes_runs_on_slurm_only(tmp_path: Path) -> None:
    ssh = cli("plan", _job(tmp_path, "lightning-fabric", "ssh"))
    assert ssh.code == 2
    assert ("framework: Lightning Fabric reads the torchrun variables on the ssh backend and "
            "requires devices x num_nodes = WORLD_SIZE" in ssh.err)
    assert "run on Slurm" in ssh.err

    slurm = cli("plan", _job(tmp_path, "lightning-fabric", "slurm"))
    assert slurm.code == 0, slurm.err
    out = " ".join(slurm.out.split())  # rich wraps long lines
    assert "use_distributed_sampler=False" in out
    assert ("pass devices=int(os.environ['LOCAL_WORLD_SIZE']) (alpha: 3, beta: 2) and "
            "num_nodes=2") in out


def test_accelerate_and_no_framework_run_any_layout(tmp_path: Path) -> None:
    for framework in ("accelerate", "none"):
        for backend in ("slurm", "ssh"):
            result = cli("plan", "--json", _job(tmp_path, framework, backend))
            assert result.code == 0, result.err
            plan = json.loads(result.out)
            assert [n["nproc"] for n in plan["nodes"]] == [3, 2]
            assert plan["notes"] == [] and plan["warnings"] == []


def test_lightning_in_a_slurm_job_named_interactive_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path, "lightning-fabric", "slurm", gpus_per_node=2, name="interactive")
    result = cli("plan", job)
    assert result.code == 2
    assert f"{job}: name: Lightning ignores Slurm's variables in a job named 'interactive'" in (
        result.err)


def test_unknown_framework_names_the_choices(tmp_path: Path) -> None:
    result = cli("plan", _job(tmp_path, "lightning", "ssh"))
    assert result.code == 2
    assert "framework" in result.err
    for choice in ("'none'", "'lightning-fabric'", "'lightning-trainer'", "'accelerate'"):
        assert choice in result.err
