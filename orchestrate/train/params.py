"""The model's size without building it: what the planner's memory check needs.

The model factory runs under ``torch.device("meta")``, so parameters have shapes but no storage:
a 70B-parameter model is counted in a second on a login node without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrate.core.spec.trainspec import TrainSpec


def param_count(spec: TrainSpec, *, workdir: Path | None = None) -> int:
    """Number of parameters (shared ones once) of ``spec.model`` built with ``model_args``.

    ``workdir`` (the job file's folder) is put on ``sys.path`` while importing, as the training
    entrypoint does with its cwd.
    """
    import torch

    from orchestrate.train import factories

    added = workdir is not None and str(workdir) not in sys.path
    if added:
        sys.path.insert(0, str(workdir))
    try:
        with torch.device("meta"):
            model = factories.call(spec.model, "model factory", dict(spec.model_args))
    finally:
        if added:
            sys.path.remove(str(workdir))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model factory {spec.model} returned {type(model).__name__}")
    return sum(p.numel() for p in model.parameters())
