"""Framework-level FSDP asked for in a ``command:`` job's own files is seen at plan time, read
(never imported): a warning on a job without GPUs (accelerate and the HF Trainer would run DDP
without a word, Lightning refuses at start), a note with GPUs (docs/frameworks.md, issue #33).
The program texts are the frameworks' documented forms."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrate.core.plan.frameworkfsdp import signs_in
from orchestrate.run.prepare import prepare
from orchestrate.run.programtext import program_files

pytestmark = pytest.mark.unit

HF_TRAINER = """\
from transformers import Trainer, TrainingArguments
# fsdp="full_shard" was tried here once
args = TrainingArguments(output_dir="out", per_device_train_batch_size=8,
                         fsdp="full_shard auto_wrap")
"""
LIGHTNING = 'trainer = L.Trainer(accelerator="gpu", devices=2, strategy="fsdp")\n'
FABRIC = "fabric = Fabric(strategy=FSDPStrategy(auto_wrap_policy=policy))\n"
ACCELERATE = "accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())\n"
ACCELERATE_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
DDP_ONLY = "accelerator = Accelerator(fsdp_plugin=None)\nmodel = DDP(model)\n"


def test_each_frameworks_fsdp_is_named_at_its_line_and_ddp_is_not() -> None:
    assert [s.shown() for s in signs_in("train.py", HF_TRAINER)] == [
        "train.py:4: the HF Trainer's fsdp="]  # the comment is not a request
    assert signs_in("l.py", LIGHTNING)[0].what == 'Lightning strategy="fsdp"'
    assert signs_in("f.py", FABRIC)[0].what == "Lightning FSDPStrategy"
    assert signs_in("a.py", ACCELERATE)[0].what == "accelerate's FSDP plugin"
    assert signs_in("b.py", "Accelerator(fsdp_plugin=plugin)")[0].what == (
        "accelerate's fsdp_plugin=")
    assert signs_in("c.yaml", ACCELERATE_YAML)[0].shown() == (
        "c.yaml:2: accelerate's config distributed_type: FSDP")
    assert signs_in("ddp.py", DDP_ONLY) == []
    assert signs_in("cli.sh", "python run.py --fsdp 'full_shard auto_wrap'")[0].what == (
        "the HF Trainer's --fsdp")


def test_the_files_a_command_names_are_read_from_the_workdir(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    for name in ("train.py", "cfg.yaml", "pkg/main.py"):
        (tmp_path / name).write_text("")
    found = program_files(["sh", "-c", "exec python train.py --config=cfg.yaml other.py"],
                          tmp_path)
    assert found == [tmp_path / "train.py", tmp_path / "cfg.yaml"]  # other.py does not exist
    assert program_files(["python", "-m", "pkg.main"], tmp_path) == [tmp_path / "pkg/main.py"]


def _job(tmp_path: Path, gpus: str, command: str, env: str = "") -> Path:
    (tmp_path / "inv.yaml").write_text(textwrap.dedent(f"""\
        name: lab
        defaults: {{python: python3}}
        nodes:
          - name: box
            address: 198.18.8.11
            {gpus}
        """))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        name: hf
        backend: ssh
        inventory: inv.yaml
        resources: {{nodes: 1, gpus_per_node: 2}}
        command: {command}
        """) + env)
    return job


def test_a_cpu_job_asking_for_framework_fsdp_is_warned_and_a_gpu_job_noted(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(HF_TRAINER)
    cpu = prepare(_job(tmp_path, "slots: 2", "[python, train.py]")).plan
    (warning,) = [w for w in cpu.warnings if "framework-level FSDP" in w]
    assert "train.py:4: the HF Trainer's fsdp=" in warning
    assert "run DDP with every rank holding the whole model" in warning
    gpu = prepare(_job(tmp_path, "gpus: [{model: A100-80GB, memory_gb: 80, count: 2}]",
                       "[python, train.py]")).plan
    assert not [w for w in gpu.warnings if "FSDP" in w]
    (note,) = [n for n in gpu.notes if "framework-level FSDP" in n]
    assert "the plan's memory figures do not count its sharding" in note
    (tmp_path / "plain.py").write_text(DDP_ONLY)
    plain = prepare(_job(tmp_path, "slots: 2", "[python, plain.py]")).plan
    assert not [t for t in (*plain.warnings, *plain.notes) if "FSDP" in t]
    env = prepare(_job(tmp_path, "slots: 2", "[python, plain.py]",
                       "env: {ACCELERATE_USE_FSDP: 'true'}\n")).plan
    assert any("env: ACCELERATE_USE_FSDP=true" in w for w in env.warnings)
