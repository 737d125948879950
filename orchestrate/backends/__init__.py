"""Backends run a prepared job: ``local`` (this machine), ``slurm`` (sbatch) and ``ssh``.

Each one implements :class:`~orchestrate.backends.base.Backend`; the CLI looks them up by the
job's ``backend`` name and never imports one it does not use (Fabric and submitit are optional).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Not at run time: ``submit`` imports orchestrate.backends.early first, before this
    # package's every model and the plan (0.05 s) would be.
    from orchestrate.backends.base import Backend
    from orchestrate.run.prepare import Prepared

_MODULES = {
    "local": "orchestrate.backends.local.backend",
    "slurm": "orchestrate.backends.slurm.backend",
    "ssh": "orchestrate.backends.ssh.backend",
}


def get_backend(name: str) -> Backend:
    """The backend called ``name``; refuses (exit 2, naming the pip command) when the extra it
    needs is not installed."""
    if name == "ssh":  # Fabric: checked here, not first in a detached supervisor's log
        from orchestrate.run.extras import require

        require("ssh", "backend: ssh")
    module = importlib.import_module(_MODULES[name])
    backend: Backend = module.BACKEND
    return backend


def rendered(prepared: Prepared) -> dict[str, str]:
    """Every file the prepared job's backend would write, as ``render`` prints them."""
    return get_backend(prepared.plan.backend).files(prepared.plan, prepared.templates_dir)
