"""What PyTorch Lightning and Hugging Face accelerate read from a rank's environment, made to
agree with the plan; and the layouts a declared framework cannot run, refused before launch.
Pure: values in, values out.

The facts this rests on (lightning 2.6 and accelerate 1.15 read from their source; sources and
details in docs/frameworks.md):

- Lightning (Fabric and the Trainer) takes the first cluster environment that detects itself:
  ``TorchElasticEnvironment`` when ``TORCHELASTIC_RUN_ID`` is set (ranks from RANK, LOCAL_RANK,
  GROUP_RANK, WORLD_SIZE; it insists on ``devices * num_nodes == WORLD_SIZE``), then
  ``SLURMEnvironment`` when ``SLURM_NTASKS`` is set (ranks from SLURM_PROCID, SLURM_LOCALID,
  SLURM_NODEID; it checks ``devices`` against ``SLURM_NTASKS_PER_NODE`` on each node alone), then
  LSF and MPI, else ``LightningEnvironment``, which *computes* ranks from the devices and
  num_nodes arguments and checks nothing.
- accelerate reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE. Without a GPU it joins the
  process group but believes it is process 0 of 1 unless ``cpu=True`` or ``ACCELERATE_USE_CPU``.

Hence: local and SSH ranks get ``TORCHELASTIC_RUN_ID`` (Lightning then reads the torchrun
variables, which are the plan's, and never looks at leftover ``SLURM_*`` variables or warns about
an unused ``srun``). Slurm ranks keep Lightning's ``SLURMEnvironment``, the only one of its
environments that accepts nodes with different rank counts, with ``SLURM_NODEID`` and
``SLURM_NTASKS_PER_NODE`` set to the plan's node index and that node's rank count (Slurm numbers
nodes in its own order, not the plan's, and the batch script must unset the per-node count for
an uneven ``srun``). CPU-only plans set ``ACCELERATE_USE_CPU``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from orchestrate.core.errors import UserError
from orchestrate.core.spec.backendtraits import traits

Framework = Literal["none", "lightning-fabric", "lightning-trainer", "accelerate"]

#: Slurm job names for which Lightning ignores the Slurm variables ("interactive mode").
LIGHTNING_INTERACTIVE_NAMES = ("bash", "interactive")


def common_env(backend: str, job_id: str, any_gpu: bool) -> dict[str, str]:
    """Variables every rank of the plan gets, on top of the torchrun contract."""
    env: dict[str, str] = {}
    if traits(backend).scheduler_env == "torchelastic":
        # torchrun sets it to the rendezvous id; Lightning takes it as "ranks come from RANK &c".
        env["TORCHELASTIC_RUN_ID"] = job_id
    if not any_gpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def node_env(backend: str, node_rank: int, nproc: int) -> dict[str, str]:
    """Variables of one node's ranks: under Slurm, the plan's node and count in Slurm's names."""
    if traits(backend).scheduler_env != "slurm":
        return {}
    return {"SLURM_NODEID": str(node_rank), "SLURM_NTASKS_PER_NODE": str(nproc)}


def check(
    framework: Framework,
    backend: str,
    job_name: str,
    nodes: Sequence[tuple[str, int]],
    source: str,
    warnings: list[str],
    notes: list[str],
) -> None:
    """Refuse a layout ``framework`` cannot run (:class:`UserError`); else add what to pass.

    ``nodes`` are the plan's (name, rank count) pairs in node-rank order.
    """
    if not framework.startswith("lightning"):
        return
    counts = [n for _, n in nodes]
    uneven = len(set(counts)) > 1
    shown = ", ".join(f"{name}: {n}" for name, n in nodes)
    trainer = framework == "lightning-trainer"
    slurm = traits(backend).scheduler_env == "slurm"
    if slurm and job_name in LIGHTNING_INTERACTIVE_NAMES:
        raise UserError.single(
            f"Lightning ignores Slurm's variables in a job named '{job_name}' (its interactive "
            "mode) and numbers ranks from devices x num_nodes instead",
            source=source,
            field="name",
            got=job_name,
            hint="give the job another name",
        )
    if uneven and trainer:
        sizes = ", ".join(f"{len(nodes) * n} on {name}" for name, n in nodes)
        raise UserError.single(
            f"the Lightning Trainer cannot run nodes with different rank counts ({shown}): its "
            f"DistributedSampler sizes the world as num_nodes x devices ({sizes}), not "
            f"{sum(counts)}, and fails at start",
            source=source,
            field="framework",
            got=framework,
            hint="give every node the same count (resources.gpus_per_node), or use "
            "Lightning Fabric on Slurm, or accelerate (docs/frameworks.md)",
        )
    if uneven and not slurm:
        raise UserError.single(
            f"Lightning Fabric reads the torchrun variables on the {backend} backend and "
            f"requires devices x num_nodes = WORLD_SIZE, which nodes with different rank counts "
            f"({shown}) cannot meet",
            source=source,
            field="framework",
            got=framework,
            hint="give every node the same count (resources.gpus_per_node), or run on Slurm, "
            "where Lightning accepts a count per node (docs/frameworks.md)",
        )
    where = "SLURMEnvironment" if slurm else "TorchElasticEnvironment"
    if uneven:
        devices = "int(os.environ['LOCAL_WORLD_SIZE']) (" + shown + ")"
        warnings.append(
            "Lightning Fabric on nodes with different rank counts: its own distributed sampler "
            "sizes the world as num_nodes x devices; call setup_dataloaders(..., "
            "use_distributed_sampler=False) with a DistributedSampler(num_replicas="
            "fabric.world_size, rank=fabric.global_rank) of your own"
        )
    else:
        devices = str(counts[0])
    notes.append(
        f"Lightning will use its {where}: pass devices={devices} and num_nodes={len(nodes)}"
    )
