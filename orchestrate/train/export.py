"""A job's trained weights as one plain state dict: ``orchestrate export``.

Either strategy's checkpoint (a DDP file or an FSDP folder of shards) becomes the same thing: a
``torch.save`` file of ``{parameter name: tensor}`` on the CPU, without DDP's ``module.`` prefix
or activation checkpointing's wrapper names, that ``model.load_state_dict`` takes as it is and
that ``train.init_from`` accepts for either strategy. A sharded checkpoint is gathered in this
process (its optimizer state is not read), so the machine running it needs the model's size in
memory, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orchestrate.train import checkpoint
from orchestrate.train.failure import TrainFailure

#: Prefixes of wrappers that are not part of the user's model.
_WRAPPERS = ("module.", "_orig_mod.")
_INNER = "_checkpoint_wrapped_module."


def plain_names(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with wrapper prefixes and inner wrapper names taken out of every key."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = key
        for prefix in _WRAPPERS:
            name = name.removeprefix(prefix)
        out[name.replace(_INNER, "")] = value
    return out


def pick(directory: Path, step: int | None, skipped: list[str] | None = None) -> Path:
    """The checkpoint of ``step`` in ``directory``, or its latest complete one (why newer ones
    were passed over goes to ``skipped``); a :class:`TrainFailure` naming the steps there when
    there is none."""
    found = checkpoint.checkpoints_in(directory)
    if step is None:
        latest = checkpoint.find_latest(directory, skipped)
        if latest is None:
            raise TrainFailure(f"no checkpoint in {directory}")
        return latest
    for number, path in found:
        if number == step:
            return path
    steps = ", ".join(str(n) for n, _ in found[-12:]) or "none"
    raise TrainFailure(f"no checkpoint of step {step} in {directory} (steps there: {steps})")


def export(source: Path, output: Path, step: int | None = None,
           skipped: list[str] | None = None) -> tuple[Path, int]:
    """Write the weights of ``source`` (a checkpoint directory, or one checkpoint) to
    ``output``; returns the checkpoint read and the number of tensors written. A checkpoint
    cut short is a :class:`TrainFailure` naming the file (the latest: passed over for the one
    before it, and why goes to ``skipped``)."""
    chosen = source if _is_one(source) else pick(source, step, skipped)
    loaded = checkpoint.load(chosen)
    weights = plain_names(dict(checkpoint.model_state_of(loaded)))
    tensors = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
               for k, v in weights.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(output, lambda handle: torch.save(tensors, handle))
    return chosen, len(tensors)


def _is_one(path: Path) -> bool:
    return path.is_file() or checkpoint.is_sharded(path)
