"""Where this process sits in the job, read from its environment.

The launcher (torchrun, or orchestrate's own scripts) states every rank's place with the torchrun
contract: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT.
Under a bare ``srun`` only Slurm's variables exist, so the same facts are derived from them.
Either way a missing or contradictory value is a one-line error naming the variable: a rank that
guessed would wait in the rendezvous until the timeout instead.

This module is pure (a mapping in, a :class:`DistEnv` out) and imports no torch, so a bad
environment is reported before paying for ``import torch``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from orchestrate.core.errors import Problem, UserError, show_value
from orchestrate.core.plan.ports import PORT_BASE, PORT_SPAN
from orchestrate.core.spec import hostlist

#: Slurm has no MASTER_PORT; derive one from the job id like this so that two jobs sharing a node
#: rarely collide, and every rank of one job agrees without talking.

_TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_INT = re.compile(r"\s*\d+\s*")
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class DistEnv:
    """One rank's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int | None
    master_addr: str
    master_port: int
    source: Literal["torchrun", "slurm", "standalone"]


def _problem(var: str, message: str, got: str | None = None) -> UserError:
    return UserError(
        Problem(message, source="environment", field=var, got=None if got is None else got)
    )


def _integer(env: Mapping[str, str], var: str, *, minimum: int = 0) -> int:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        raise _problem(var, "is not set")
    if not _INT.fullmatch(raw):
        raise _problem(var, "must be a whole number", show_value(raw))
    value = int(raw)
    if value < minimum:
        raise _problem(var, f"must be at least {minimum}", show_value(raw))
    return value


def _port(env: Mapping[str, str], var: str) -> int:
    port = _integer(env, var, minimum=1)
    if port > 65535:
        raise _problem(var, "must be a TCP port, 1-65535", show_value(env[var]))
    return port


def _required(env: Mapping[str, str], var: str) -> str:
    raw = env.get(var, "").strip()
    if not raw:
        raise _problem(var, "is not set")
    return raw


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` -> ``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for item in value.split(","):
        found = _TASKS_ITEM.fullmatch(item.strip())
        if found is None:
            raise ValueError(f"bad item {item!r} (expected N or N(xM))")
        counts.extend([int(found.group(1))] * int(found.group(2) or 1))
    return counts


def _check(env: DistEnv, names: dict[str, str]) -> DistEnv:
    """Reject a place that cannot exist; ``names`` maps each fact to the variable it came from."""
    if env.world_size < 1:
        raise _problem(names["world_size"], "must be at least 1", str(env.world_size))
    if env.rank >= env.world_size:
        raise _problem(
            names["rank"],
            f"must be below {names['world_size']}={env.world_size}",
            str(env.rank),
        )
    if env.local_world_size < 1 or env.local_world_size > env.world_size:
        raise _problem(
            names["local_world_size"],
            f"must be between 1 and {names['world_size']}={env.world_size}",
            str(env.local_world_size),
        )
    if env.local_rank >= env.local_world_size:
        raise _problem(
            names["local_rank"],
            f"must be below {names['local_world_size']}={env.local_world_size}",
            str(env.local_rank),
        )
    return env


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    group_rank = _integer(env, "GROUP_RANK") if env.get("GROUP_RANK", "").strip() else None
    place = DistEnv(
        rank=_integer(env, "RANK"),
        local_rank=_integer(env, "LOCAL_RANK"),
        world_size=_integer(env, "WORLD_SIZE", minimum=1),
        local_world_size=_integer(env, "LOCAL_WORLD_SIZE", minimum=1),
        group_rank=group_rank,
        master_addr=_required(env, "MASTER_ADDR"),
        master_port=_port(env, "MASTER_PORT"),
        source="torchrun",
    )
    return _check(
        place,
        {
            "rank": "RANK",
            "local_rank": "LOCAL_RANK",
            "world_size": "WORLD_SIZE",
            "local_world_size": "LOCAL_WORLD_SIZE",
        },
    )


def _slurm_local_world_size(env: Mapping[str, str]) -> tuple[int, int | None, str]:
    """Tasks on this node, this node's index, and the variable the count came from."""
    node_id = (
        _integer(env, "SLURM_NODEID") if env.get("SLURM_NODEID", "").strip() else None
    )
    if env.get("SLURM_NTASKS_PER_NODE", "").strip():
        return _integer(env, "SLURM_NTASKS_PER_NODE", minimum=1), node_id, "SLURM_NTASKS_PER_NODE"
    raw = _required(env, "SLURM_TASKS_PER_NODE")
    try:
        counts = parse_tasks_per_node(raw)
    except ValueError as exc:
        raise _problem("SLURM_TASKS_PER_NODE", str(exc), show_value(raw)) from None
    if sum(counts) != _integer(env, "SLURM_NTASKS", minimum=1):
        raise _problem(
            "SLURM_TASKS_PER_NODE",
            f"adds up to {sum(counts)} tasks, not SLURM_NTASKS={env['SLURM_NTASKS']}",
            show_value(raw),
        )
    if node_id is None:
        if len(set(counts)) != 1:
            raise _problem("SLURM_NODEID", "is not set (needed: nodes run different task counts)")
        return counts[0], None, "SLURM_TASKS_PER_NODE"
    if node_id >= len(counts):
        raise _problem(
            "SLURM_NODEID", f"must be below the {len(counts)} nodes of the job", str(node_id)
        )
    return counts[node_id], node_id, "SLURM_TASKS_PER_NODE"


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    local_world_size, node_id, lws_var = _slurm_local_world_size(env)
    if env.get("MASTER_ADDR", "").strip():
        master_addr = env["MASTER_ADDR"].strip()
    else:
        var = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
        raw = _required(env, var)
        try:
            master_addr = hostlist.expand(raw)[0]
        except ValueError as exc:
            raise _problem(var, str(exc), show_value(raw)) from None
    if env.get("MASTER_PORT", "").strip():
        master_port = _port(env, "MASTER_PORT")
    else:
        job_id = _integer(env, "SLURM_JOB_ID")
        master_port = PORT_BASE + job_id % PORT_SPAN  # as the sbatch script derives it
    place = DistEnv(
        rank=_integer(env, "SLURM_PROCID"),
        local_rank=_integer(env, "SLURM_LOCALID"),
        world_size=_integer(env, "SLURM_NTASKS", minimum=1),
        local_world_size=local_world_size,
        group_rank=node_id,
        master_addr=master_addr,
        master_port=master_port,
        source="slurm",
    )
    return _check(
        place,
        {
            "rank": "SLURM_PROCID",
            "local_rank": "SLURM_LOCALID",
            "world_size": "SLURM_NTASKS",
            "local_world_size": lws_var,
        },
    )


def parse_dist_env(env: Mapping[str, str]) -> DistEnv:
    """This rank's place from the torchrun variables, else Slurm's, else a single process.

    Raises :class:`~orchestrate.core.errors.UserError` naming the variable that is missing, not a
    number, or inconsistent with the others.
    """
    if any(env.get(var, "").strip() for var in _TORCHRUN_MARKERS):
        return _from_torchrun(env)
    if env.get("SLURM_PROCID", "").strip():
        return _from_slurm(env)
    port = _port(env, "MASTER_PORT") if env.get("MASTER_PORT", "").strip() else 0
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        group_rank=0,
        master_addr=env.get("MASTER_ADDR", "").strip() or "127.0.0.1",
        master_port=port,
        source="standalone",
    )
