"""What a Slurm job submits: ``job.sbatch`` and ``monitor.py``, from the plan. Pure.

The batch script is the template ``sbatch.sh.j2`` over the plan and its allocation
(:mod:`~orchestrate.backends.slurm.allocation` decides every option, host and environment; the
template only lays them out). ``monitor.py`` is the shipped program that merges the ranks' logs,
runs the stall watch beside them and names the first failure (:mod:`.monitor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orchestrate.backends.slurm.healthstep
import orchestrate.backends.slurm.monitor
import orchestrate.core.exits
import orchestrate.core.gpuhealth
import orchestrate.core.layout
import orchestrate.core.plan.outcome
import orchestrate.core.plan.restart
import orchestrate.core.plan.workers
import orchestrate.diagnosis.diagfiles
import orchestrate.diagnosis.evidence
import orchestrate.diagnosis.hangwatch
import orchestrate.diagnosis.kernelstate
import orchestrate.diagnosis.rankview
import orchestrate.diagnosis.stacks
import orchestrate.diagnosis.stall
import orchestrate.diagnosis.stallrule
import orchestrate.diagnosis.world
import orchestrate.hostside.cpubind
import orchestrate.hostside.gpuhealth
import orchestrate.hostside.outputlog
import orchestrate.hostside.smi
import orchestrate.hostside.smicsv
import orchestrate.run.knobs
import orchestrate.run.linger
from orchestrate.backends.base import place_check_program
from orchestrate.backends.slurm.allocation import slurm_layout
from orchestrate.core.errors import UserError
from orchestrate.core.layout import (
    LOG_DIR,
    MERGED_INDEX,
    SBATCH_SCRIPT,
    SLURM_BATCH_LOG,
    SLURM_EVENTS,
    SLURM_EXITS,
    SLURM_HOSTFILE,
    SLURM_MERGE_OFFSETS,
    SLURM_MONITOR,
    SLURM_SECRETS,
    SLURM_STATE,
)
from orchestrate.core.plan.plan import Plan
from orchestrate.hostside.shipping import Manifest, program

#: The Slurm batch job's ``monitor.py``: the run rules, the stall watch and what it reads, the
#: merged log's index, the GPU health check (gathered on each node, judged on the batch host),
#: then the monitor (logs, the watch, the health step, and the end of a run).
MONITOR = Manifest("monitor", (
    orchestrate.core.exits, orchestrate.core.plan.outcome, orchestrate.core.plan.restart,
    orchestrate.core.layout, orchestrate.core.plan.workers, orchestrate.diagnosis.kernelstate,
    orchestrate.diagnosis.diagfiles, orchestrate.diagnosis.stallrule, orchestrate.diagnosis.stacks,
    orchestrate.diagnosis.rankview, orchestrate.diagnosis.stall, orchestrate.diagnosis.evidence,
    orchestrate.diagnosis.world, orchestrate.diagnosis.hangwatch, orchestrate.hostside.outputlog,
    orchestrate.hostside.smicsv, orchestrate.hostside.smi, orchestrate.hostside.gpuhealth,
    orchestrate.hostside.cpubind, orchestrate.core.gpuhealth, orchestrate.run.knobs,
    orchestrate.run.linger, orchestrate.backends.slurm.healthstep,
    orchestrate.backends.slurm.monitor))


def monitor_program() -> str:
    """``monitor.py``: the Slurm batch job's monitor, shipped beside job.sbatch."""
    return program(MONITOR, "from orchestrate.backends.slurm.monitor import main\n"
                            "sys.exit(main(sys.argv[1:]))")


def batch_files(plan: Plan, templates_dir: Path | None) -> dict[str, str]:
    """``job.sbatch`` and ``monitor.py``, in that order."""
    from orchestrate.core.render.render import context, render_template

    if not (plan.run_dir.isprintable() and "\\" not in plan.run_dir):
        # The run directory is part of an #SBATCH line (--output), which sbatch reads alone.
        raise UserError.single(
            "the run directory cannot go into an #SBATCH line (line break, control character "
            "or backslash)",
            field="run_root",
            got=plan.run_dir,
            hint="choose a run_root without them (or set $ORCHESTRATE_RUNS)",
        )
    script = render_template("sbatch.sh.j2", {**context(plan), **slurm_context(plan)},
                             templates_dir)
    return {SBATCH_SCRIPT: script, SLURM_MONITOR: monitor_program()}


def slurm_context(plan: Plan) -> dict[str, Any]:
    """What sbatch.sh.j2 lays out beyond the plan: the allocation, the run dir's file names."""
    return {
        "slurm": slurm_layout(plan),
        # Every node has the same runtime under Slurm (the job's, or pyxis): its srun options
        # (pyxis) and command (apptainer) are the first node's (docs/containers.md).
        "container": plan.nodes[0].container,
        # What the batch script checks again right before it runs monitor.py and the tasks.
        "place_check": place_check_program(),
        "files": {
            "script": SBATCH_SCRIPT,
            "merged": MERGED_INDEX,
            "log_dir": LOG_DIR,
            "state": SLURM_STATE,
            "events": SLURM_EVENTS,
            "exits": SLURM_EXITS,
            "hostfile": SLURM_HOSTFILE,
            "merge_offsets": SLURM_MERGE_OFFSETS,
            "batch_log": SLURM_BATCH_LOG,
            "monitor": SLURM_MONITOR,
            "secrets": SLURM_SECRETS,
        },
    }
