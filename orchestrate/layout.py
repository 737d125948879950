"""The layout of a run directory: one place that names every file in it.

Renderer, backends, supervisor, CLI and training entrypoint all find files through these names,
so the layout can change in one place. Importing this module costs nothing (no third-party
imports): the supervisor and the CLI's fast paths use it.
"""

from __future__ import annotations

from pathlib import Path

PLAN_FILE = "plan.json"
TRAIN_CONFIG = "train.json"
SBATCH_SCRIPT = "job.sbatch"
MERGED_LOG = "output.log"
LOG_DIR = "logs"
METRICS = "metrics.jsonl"
SUPERVISOR_LOG = "supervisor.log"


def node_script_name(node: str) -> str:
    """File name of a node's launch script."""
    return f"launch-{node}.sh"


def rank_log(run_dir: Path, rank: int) -> Path:
    """The file holding one rank's output."""
    return run_dir / LOG_DIR / f"rank-{rank}.log"
