"""A run's final checkpoint as the restart and resume tests compare it: the one the trainer's
``latest`` pointer names (read by the trainer's own find_latest and load), the parameters in
which two runs differ, and the model's weights alone (the batch-share tests)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def latest_state(run_dir: Path) -> dict[str, Any]:
    """The state in the checkpoint ``run_dir/checkpoints/latest`` names (the pointer must exist:
    the trainer writes it after every checkpoint)."""
    from orchestrate.train import checkpoint

    directory = run_dir / "checkpoints"
    named = directory / (directory / checkpoint.LATEST).read_text().strip()
    assert checkpoint.find_latest(directory) == named, f"latest names no whole file in {directory}"
    return checkpoint.load(named)


def differing_parameters(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> list[str]:
    """The model parameters whose tensors differ in two checkpoint states: not bit-identical,
    or with ``atol`` more than that apart somewhere (runs that sum in another order)."""
    import torch

    if atol == 0.0:
        return [key for key, tensor in a["model"].items()
                if not torch.equal(tensor, b["model"][key])]
    return [key for key, tensor in a["model"].items()
            if not torch.allclose(tensor, b["model"][key], rtol=0.0, atol=atol)]


def latest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in the checkpoint ``run_dir/checkpoints/latest`` names (a whole file
    or an FSDP folder), with DDP's ``module.`` prefix dropped so that layouts compare."""
    import torch

    directory = run_dir / "checkpoints"
    latest = directory / (directory / "latest").read_text().strip()
    if latest.is_dir():
        from orchestrate.train.checkpoint import load

        state = load(latest)["model"]  # a sharded checkpoint, read in this one process
    else:
        state = torch.load(latest, weights_only=True)["model"]
    return {k.removeprefix("module."): v for k, v in state.items()}
