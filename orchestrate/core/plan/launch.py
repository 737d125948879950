"""How each node's processes start (the job's ``launcher:``), and commands that cannot work.

Pure. Three launchers (docs/launchers.md):

- ``ranks`` (the default): orchestrate starts one process per rank, each with the torchrun
  environment (RANK, LOCAL_RANK, WORLD_SIZE, ...); the program calls ``init_process_group()``.
- ``per_node``: orchestrate starts the command once per node, with ``NODE_RANK``, ``NNODES``,
  ``NPROC_PER_NODE`` (this node's count; nodes may differ), ``ORCHESTRATE_FIRST_RANK`` (the
  node's first rank), ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and all of the node's
  planned GPUs visible, and no RANK or LOCAL_RANK: the program starts its own workers (the
  ``torch.multiprocessing.spawn`` of the field notes), each joining as
  ``ORCHESTRATE_FIRST_RANK + i`` (``NODE_RANK * NPROC_PER_NODE + i`` when nodes are even).
- ``torchrun``: orchestrate runs the node's ``python -m torch.distributed.run`` itself with the
  plan's static rendezvous (``--nnodes``, ``--node-rank``, ``--nproc-per-node``, the master's
  address and port) and its restarts off (``--max-restarts=0``: the job's ``restart:`` decides),
  so a torchrun script runs unchanged.

What cannot work is refused here with the fix, before anything starts: a command that is itself
a launcher (torchrun, ``python -m torch.distributed.run``, ``accelerate launch``, deepspeed)
would start a world of its own inside every process orchestrate starts.
"""

from __future__ import annotations

import posixpath
import re
from typing import TYPE_CHECKING

from orchestrate.core.errors import UserError

if TYPE_CHECKING:
    from orchestrate.core.spec.job import JobSpec

RANKS = "ranks"
PER_NODE = "per_node"
TORCHRUN = "torchrun"
#: Variables of a ``per_node`` node's one process (beside WORLD_SIZE, MASTER_ADDR/PORT and the
#: node's GROUP_RANK and LOCAL_WORLD_SIZE).
PER_NODE_VARS = ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "ORCHESTRATE_FIRST_RANK")
#: Positions of the master's address and port in a torchrun node command (a Slurm batch script
#: fills them in at run time, when it knows the first host and the port).
MASTER_ADDR_WORD = 6
MASTER_PORT_WORD = 7
#: torchrun's ``--signals-to-handle`` as its environment gives it (torch 2.9 and later), and
#: torch's default for it.
TORCHRUN_SIGNALS_VAR = "PET_SIGNALS_TO_HANDLE"
#: torchrun's ``--shutdown-timeout``: how long its agent waits for the workers it signalled
#: before it kills them (torch's default 30 s would cut a checkpoint on the stop signal short).
TORCHRUN_SHUTDOWN_VAR = "PET_SHUTDOWN_TIMEOUT"
_TORCH_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
#: What each known launcher is called in a message, and how to drop it.
_DROP_ACCELERATE = ("drop `accelerate launch` and its options: command: [python, train.py, ...]"
                    "; Accelerator() reads the plan's environment (docs/frameworks.md)")
_DROP_DEEPSPEED = ("drop the deepspeed launcher: command: [python, train.py, ...]; "
                   "deepspeed.init_distributed() reads RANK, LOCAL_RANK, WORLD_SIZE, "
                   "MASTER_ADDR and MASTER_PORT, which every rank gets")


def is_python(word: str) -> bool:
    """Whether a command word names a Python interpreter (``python``, ``/env/bin/python3.11``)."""
    return bool(_PYTHON.match(posixpath.basename(word)))


def _python_module(command: tuple[str, ...]) -> str | None:
    """The module of ``python [options] -m MODULE ...``, None for a script or no python."""
    if not command or not is_python(command[0]):
        return None
    words = iter(command[1:])
    for word in words:
        if word == "-m":
            return next(words, None)
        if word.startswith("-m") and len(word) > 2:
            return word[2:]
        if word in ("-W", "-X", "-c"):  # options that take the next word
            if word == "-c":
                return None
            next(words, None)
            continue
        if not word.startswith("-"):
            return None
    return None


def launcher_in(command: tuple[str, ...]) -> str | None:
    """The launcher a command starts with, as a person would name it; None for a program."""
    if not command:
        return None
    first = posixpath.basename(command[0])
    module = _python_module(command)
    if first == "torchrun" or module in _TORCHRUN_MODULES:
        return "torchrun" if first == "torchrun" else f"python -m {module}"
    if (first == "accelerate" and command[1:2] == ("launch",)) or \
            module == "accelerate.commands.launch":
        return "accelerate launch"
    if first == "deepspeed" or (module or "").startswith("deepspeed.launcher"):
        return "deepspeed"
    return None


def check(job: JobSpec, source: str) -> None:
    """Refuse a launcher and command that cannot run as the plan says (:class:`UserError`)."""
    launcher = job.launcher
    if job.train is not None and launcher != RANKS:
        raise UserError.single(
            f"the built-in trainer (train:) runs one process per rank; launcher: {launcher} "
            "is for command: programs that start their own workers",
            source=source, field="launcher", got=launcher,
            hint="leave launcher out (ranks): orchestrate starts every rank of the trainer")
    command = tuple(job.command or ())
    found = launcher_in(command)
    if found is not None:
        _refuse_nested(found, launcher, command, source)
    if launcher == TORCHRUN:
        torchrun_program(command, source)


def _refuse_nested(found: str, launcher: str, command: tuple[str, ...], source: str) -> None:
    """A command that is a launcher itself, under any of ours."""
    got = " ".join(command[:4]) + (" ..." if len(command) > 4 else "")
    if found == "accelerate launch":
        message, hint = ("starts `accelerate launch`, which starts workers of its own in "
                         "every process orchestrate starts"), _DROP_ACCELERATE
    elif found == "deepspeed":
        message, hint = ("starts the deepspeed launcher, which starts workers of its own in "
                         "every process orchestrate starts"), _DROP_DEEPSPEED
    elif launcher == TORCHRUN:
        message = (f"starts {found}, and launcher: torchrun already runs "
                   "torch.distributed.run on every node")
        hint = ("drop it and its options: command: [python, train.py, ...] (orchestrate "
                "passes --nnodes, --node-rank, --nproc-per-node and the master itself)")
    else:
        each = "every rank" if launcher == RANKS else "every node"
        message = (f"starts {found}, which starts workers of its own: under launcher: "
                   f"{launcher} {each} would build a separate world")
        hint = ("write launcher: torchrun and the command without it: command: [python, "
                "train.py, ...]; orchestrate runs torch.distributed.run on each node with the "
                "plan's rendezvous (docs/launchers.md)")
    raise UserError.single(message, source=source, field="command", got=got, hint=hint)


def torchrun_program(command: tuple[str, ...], source: str) -> tuple[str, ...]:
    """What follows torchrun's options for ``command``: ``SCRIPT ARGS``, ``-m MODULE ARGS``, or
    ``--no-python PROGRAM ARGS`` for a program that is not Python. torchrun runs every worker as
    ``python -u``; other interpreter options cannot be passed (refused, saying so)."""
    if not is_python(command[0]):
        return ("--no-python", *command)
    rest = list(command[1:])
    while rest and rest[0] == "-u":  # torchrun passes -u itself
        rest.pop(0)
    if rest[:1] == ["-m"] and len(rest) > 1:
        return tuple(rest)
    if not rest or rest[0].startswith("-"):
        raise UserError.single(
            "launcher: torchrun runs each worker as `python -u SCRIPT` or `python -u -m "
            "MODULE`: interpreter options cannot be passed to it",
            source=source, field="command", got=" ".join(command[:3]),
            hint="drop the interpreter options (PYTHONUNBUFFERED is set already), or set them "
            "in env (PYTHONOPTIMIZE, PYTHONWARNINGS, ...)")
    return tuple(rest)


def torchrun_command(command: tuple[str, ...], python: str, *, nnodes: int, node_rank: int,
                     nproc: int, master_addr: str, master_port: int, job_id: str
                     ) -> tuple[str, ...]:
    """One node's ``python -m torch.distributed.run`` line: the plan's static rendezvous, no
    restarts of its own, the job id as its run id (``TORCHELASTIC_RUN_ID``), then the program.
    The master's address and port are words :data:`MASTER_ADDR_WORD` and
    :data:`MASTER_PORT_WORD`."""
    head = (python, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
            f"--master-addr={master_addr}", f"--master-port={master_port}",
            "--rdzv-backend=static", f"--rdzv-id={job_id}", "--max-restarts=0")
    return head + torchrun_program(command, "job")


def environment_bin(python: str) -> str | None:
    """The folder of a node's interpreter when the inventory gives it as a path (its Python
    environment's ``bin``): the launch scripts look up commands there first, so a bare
    ``torchrun``, ``accelerate`` or any executable installed with the program is found on
    servers whose login PATH has no training environment."""
    if not python.startswith("/"):
        return None
    return posixpath.dirname(python) or None


def not_found(word: str, python: str) -> str:
    """What a launch script says when a node cannot find the command's first word (the host's
    name follows: ``torchrun: not in /opt/envs/train/bin or on PATH on h2``)."""
    if "/" in word:
        return f"{word}: no such program"
    where = environment_bin(python)
    return f"{word}: not in {where} or on PATH" if where else f"{word}: not on PATH"


def torchrun_signals(stop_signal: str) -> str:
    """The signals a torchrun agent catches and passes to its workers: torch's own four, SIGUSR2
    (a rank's stop signal: ``train.stop_signals``) and the job's Slurm signal before the time
    limit (``slurm.signal``). Slurm signals every process of a step; an agent that does not
    catch SIGUSR2 dies of it, its task ends, and Slurm kills the workers in their checkpoint."""
    names = [*_TORCH_SIGNALS, "SIGUSR2", "SIG" + stop_signal.upper().removeprefix("SIG")]
    return ",".join(dict.fromkeys(names))


def node_env(launcher: str, *, nnodes: int, node_rank: int, nproc: int, first_rank: int,
             stop_signal: str = "USR2", shutdown_s: int = 120) -> dict[str, str]:
    """What a ``per_node`` node's process gets beyond the plan's usual node variables; under
    ``torchrun``, :data:`TORCHRUN_SIGNALS_VAR` (torchrun's ``--signals-to-handle``, read from
    the environment: a torch without that option, before 2.9, ignores it where the option
    itself would stop its torchrun with ``unrecognized arguments``) and
    :data:`TORCHRUN_SHUTDOWN_VAR`: the agent gives its workers, once signalled, as long as the
    job gives its ranks before the time limit (``slurm.signal_seconds_before``) to save."""
    if launcher == TORCHRUN:
        return {TORCHRUN_SIGNALS_VAR: torchrun_signals(stop_signal),
                TORCHRUN_SHUTDOWN_VAR: str(shutdown_s)}
    if launcher != PER_NODE:
        return {}
    return {"NODE_RANK": str(node_rank), "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc),
            "ORCHESTRATE_FIRST_RANK": str(first_rank)}


def node_command(launcher: str, start: tuple[tuple[str, ...], str, int, str], python: str,
                 node_rank: int, nproc: int, nnodes: int) -> tuple[str, ...]:
    """What the node runs: the plan's command, or (``launcher: torchrun``) the node's
    torch.distributed.run line running it."""
    command, master_addr, master_port, job_id = start
    if launcher == TORCHRUN:
        return torchrun_command(command, python, nnodes=nnodes, node_rank=node_rank,
                                       nproc=nproc, master_addr=master_addr,
                                       master_port=master_port, job_id=job_id)
    # "python train.py" in a job means the node's interpreter (inventory 'python'), which is
    # what people mean on servers whose PATH has no training environment.
    if command and command[0] in ("python", "python3"):
        return (python, *command[1:])
    return command
