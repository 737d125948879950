"""An FSDP job as the backend tests run it (the digits example, sharded over 2 ranks) and what a
user checks of it afterwards: the sharded checkpoint and ``orchestrate export``'s plain state
dict, which must load into a freshly built model with no ``module.`` prefix."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits"

#: The ``train:`` section of the sharded jobs (indented for a job file's top level).
FSDP_TRAIN = """\
train:
  model: digits:build_model
  model_args: {hidden: 64, dropout: 0.0}
  dataset: digits:build_dataset
  optimizer: {name: adamw, lr: 3.0e-3}
  strategy: fsdp
  epochs: 1
  batch_size: 32
  seed: 5
  checkpoint_every_steps: 10
"""


def sharded_checkpoint(run_dir: Path) -> Path:
    """The checkpoint ``latest`` names in ``run_dir``; it must be a completed sharded one (the
    trainer's own test: a folder with torch.distributed.checkpoint's metadata)."""
    from orchestrate.train import checkpoint

    directory = run_dir / "checkpoints"
    named = directory / (directory / checkpoint.LATEST).read_text().strip()
    assert checkpoint.is_sharded(named), f"not a sharded checkpoint: {named}"
    return named


def exported_loads(run: Callable[..., subprocess.CompletedProcess[str]], job_id: str,
                   output: Path) -> dict[str, Any]:
    """``orchestrate export JOB -o output`` through ``run`` (the test's CLI); the state dict it
    wrote, checked to be ``module.``-free and to load strictly into a new digits model."""
    import torch

    done = run("export", job_id, "-o", str(output), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    state: dict[str, Any] = torch.load(output, weights_only=True)
    assert state and not any(key.startswith("module.") for key in state), sorted(state)
    spec = importlib.util.spec_from_file_location("digits_for_export", DIGITS / "digits.py")
    assert spec is not None and spec.loader is not None
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    digits.build_model(hidden=64, dropout=0.0).load_state_dict(state, strict=True)
    return state
