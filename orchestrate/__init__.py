"""orchestrate: launch PyTorch DDP training on Slurm, bare SSH servers, or this machine.

The pure core turns an inventory and a job file into a :class:`~orchestrate.core.plan.plan.Plan`
(:mod:`orchestrate.core.plan.plan`) and scripts (:mod:`orchestrate.core.render.render`); the
backends run them. ``orchestrate.submit_function(fn, job, *args)`` runs a Python function on every
rank of a Slurm
job (:mod:`orchestrate.api`); it is imported on first use, so ``import orchestrate`` stays cheap
and needs no submitit.
"""

from __future__ import annotations

from typing import Any

from orchestrate.version import __version__

__all__ = ["__version__", "submit_function"]


def __getattr__(name: str) -> Any:
    if name == "submit_function":
        from orchestrate.api import submit_function

        return submit_function
    raise AttributeError(f"module 'orchestrate' has no attribute {name!r}")
