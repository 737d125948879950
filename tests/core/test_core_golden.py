"""Golden files: the exact scripts and plans of representative jobs, through the real CLI.

Each job in ``jobs/`` is rendered with ``orchestrate render`` and planned with
``orchestrate plan --json``; both outputs must equal ``golden/<job>.render.txt`` and
``golden/<job>.plan.json`` byte for byte, and every rendered script must pass shellcheck.
Run with ``ORCHESTRATE_UPDATE_GOLDEN=1`` after a deliberate change and review the diff.
Paths in the job files are absolute (/srv/...) and this interpreter's path is replaced by
``$PYTHON``, so the goldens are the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.corecli import CORE, cli, compare_golden, normalise, shellcheck

pytestmark = pytest.mark.unit

JOBS = sorted((CORE / "jobs").glob("*.yaml"))


def _render_dir(job: Path, out: Path) -> list[Path]:
    result = cli("render", job, "-o", out)
    assert result.code == 0, result.err
    return sorted(p for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_render_matches_golden(job: Path) -> None:
    result = cli("render", job)
    assert result.code == 0, result.err
    compare_golden(f"{job.stem}.render.txt", normalise(result.out))


@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_plan_json_matches_golden(job: Path) -> None:
    result = cli("plan", "--json", job)
    assert result.code == 0, result.err
    json.loads(result.out)  # it is JSON before it is anything else
    compare_golden(f"{job.stem}.plan.json", normalise(result.out))


@pytest.mark.process
def test_every_rendered_script_passes_shellcheck(tmp_path: Path) -> None:
    scripts = []
    for job in JOBS:
        files = _render_dir(job, tmp_path / job.stem)
        scripts += [f for f in files if f.suffix in (".sh", ".sbatch")]
    assert len(scripts) >= len(JOBS)
    shellcheck(*scripts)


def test_render_output_is_what_render_writes(tmp_path: Path) -> None:
    """``render`` prints each file byte for byte, under a ``==> name <==`` header, and
    ``render -o`` writes exactly those files."""
    for job in JOBS:
        printed = cli("render", job).out
        assert printed.startswith("==> ")
        sections = [chunk.split(" <==\n", 1) for chunk in printed[4:].split("\n==> ")]
        files = _render_dir(job, tmp_path / job.stem)
        assert {name: text for name, text in sections} == {
            str(f.relative_to(tmp_path / job.stem)): f.read_text() for f in files}


def test_goldens_show_what_the_issue_asks() -> None:
    """Spot checks a reader can verify against the issue without reading every golden."""
    mixed = json.loads((CORE / "golden" / "mixed-a6000.plan.json").read_text())
    assert mixed["nodes"][0]["cuda_visible_devices"] == "2,3,4,5,6,7"
    assert set(mixed["nodes"][0]["gpu_models"]) == {"RTX-A6000"}

    uneven = json.loads((CORE / "golden" / "uneven-ssh.plan.json").read_text())
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in uneven["ranks"]] == [
        (0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 0, 1), (4, 1, 1)
    ]
    assert uneven["world_size"] == 5

    subset = json.loads((CORE / "golden" / "subset-shared.plan.json").read_text())
    assert subset["nodes"][0]["cuda_visible_devices"] == "0,1"
    assert subset["master_port"] == 29512

    cpu = json.loads((CORE / "golden" / "cpu-local.plan.json").read_text())
    assert cpu["dist_backend"] == "gloo"
    assert cpu["nodes"][0]["cuda_visible_devices"] is None
    assert "CUDA_DEVICE_ORDER" not in cpu["env"]

    sbatch = (CORE / "golden" / "slurm-full.render.txt").read_text()
    for line in (
        "#SBATCH --partition=gpu-long",
        "#SBATCH --account=proj-llm",
        "#SBATCH --qos=high",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --gres=gpu:h100:8",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
    ):
        assert line + "\n" in sbatch


def test_goldens_show_what_lightning_and_accelerate_read() -> None:
    """What frameworks pick their mode by (docs/frameworks.md): off Slurm, TORCHELASTIC_RUN_ID
    (Lightning then reads RANK/LOCAL_RANK/GROUP_RANK); on Slurm, no TORCHELASTIC_RUN_ID and each
    task's SLURM_NODEID/SLURM_NTASKS_PER_NODE are its plan node's index and rank count;
    ACCELERATE_USE_CPU only without GPUs."""
    golden = CORE / "golden"
    cpu = json.loads((golden / "cpu-local.plan.json").read_text())
    assert cpu["env"]["TORCHELASTIC_RUN_ID"] == cpu["job_id"]
    assert cpu["env"]["ACCELERATE_USE_CPU"] == "true"
    ssh = json.loads((golden / "uneven-ssh.plan.json").read_text())
    assert ssh["env"]["TORCHELASTIC_RUN_ID"] == ssh["job_id"]
    assert "ACCELERATE_USE_CPU" not in ssh["env"]  # GPUs: accelerate picks them itself
    assert not any(k.startswith("SLURM_") for n in ssh["nodes"] for k in n["env"])

    slurm = json.loads((golden / "uneven-slurm.plan.json").read_text())
    assert "TORCHELASTIC_RUN_ID" not in slurm["env"]
    assert [(n["env"]["SLURM_NODEID"], n["env"]["SLURM_NTASKS_PER_NODE"]) for n in slurm["nodes"]
            ] == [("0", "3"), ("1", "2")]
    sbatch = (golden / "uneven-slurm.render.txt").read_text()
    _, _, task = sbatch.partition("if [[ ${1:-} == --task ]]; then")
    assert "TORCHELASTIC_RUN_ID" not in sbatch
    for node, count in (("0) # plan node alpha", 3), ("1) # plan node beta", 2)):
        block = task.split(node, 1)[1].split(";;", 1)[0]
        assert f"export SLURM_NODEID={node[0]}\n" in block
        assert f"export SLURM_NTASKS_PER_NODE={count}\n" in block
    # srun must not see the allocation's maximum as the step's per-node count.
    after = task.partition("# ---- the batch script")[2]
    assert after.index("unset SLURM_NTASKS_PER_NODE") < after.index("\nsrun ")
