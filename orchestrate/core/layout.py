"""The layout of a run directory: one place that names every file in it.

Renderer, backends, supervisor, CLI and training entrypoint all find files through these names,
so the layout can change in one place. Importing this module costs nothing (no third-party
imports): the supervisor and the CLI's fast paths use it.
"""

from __future__ import annotations

from pathlib import Path

PLAN_FILE = "plan.json"
#: The job as it was loaded at submit (spec, inventory, counted parameters): what ``resume``
#: plans again from, so a job file edited since then changes nothing.
LOADED_FILE = "loaded.json"
TRAIN_CONFIG = "train.json"
#: The rank sidecar's folder (``sitecustomize.py`` and ``_orchestrate_rank/``, made by
#: orchestrate/diagnosis/rankpackage.py): the launch scripts put it first on PYTHONPATH, so every
#: Python rank loads it.
SIDECAR_DIR = "sidecar"
#: SSH jobs: the program each host runs to read its ranks' heartbeats and dumps (stdlib only).
EVIDENCE_PROGRAM = "evidence.py"
SBATCH_SCRIPT = "job.sbatch"
#: The merged view's index: the order of every rank's output, and orchestrate's own notes
#: (format: orchestrate/hostside/outputlog.py). The bytes are in each rank's file only.
MERGED_INDEX = "output.idx"
#: What runs before this layout had the merged log in (read by ``logs`` for old run dirs).
OLD_MERGED_LOG = "output.log"
LOG_DIR = "logs"
METRICS = "metrics.jsonl"
SUPERVISOR_LOG = "supervisor.log"
#: While a local job runs: other users' processes on the GPUs it leases, one line each (JSON
#: list), rewritten by its supervisor when they change; ``status`` shows them.
FOREIGN_GPU_USE = "foreign-gpu-use.json"
#: The Slurm backend's records: ``events.jsonl`` (one line per start and end of the batch script)
#: and ``exits/<restart>/rank-R`` (how each rank ended), written by job.sbatch on the nodes.
SLURM_STATE = "slurm"
SLURM_EVENTS = "events.jsonl"
SLURM_EXITS = "exits"
#: The values of the job's ``secret_env``, one a line (0600): ``submit`` writes them for the
#: batch script, which reads them (never sbatch's environment: slurmctld keeps that on disk).
SLURM_SECRETS = "secrets"
#: ``hostfile-<restart>``: each rank's host, one a line (the step's SLURM_HOSTFILE).
SLURM_HOSTFILE = "hostfile-"
#: How far the log merger got in each rank's log (a requeued job's next run goes on from there).
SLURM_MERGE_OFFSETS = "merged-offsets.json"
#: The program beside the batch script that merges logs and judges how the ranks ended.
SLURM_MONITOR = "monitor.py"
#: The batch script's own output (sbatch --output); %j is the Slurm job id.
SLURM_BATCH_LOG = "slurm-%j.out"
#: SSH jobs: how to reach each host (no secrets), so `cancel` works without the supervisor.
SSH_HOSTS = "ssh-hosts.json"
#: Stall diagnosis (orchestrate.diagnosis.sidecar writes, orchestrate.diagnosis.evidence reads):
#: ``diag/hb/rank-R.json`` heartbeats, ``diag/request`` (a launcher asks for dumps),
#: ``diag/<id>/rank-R.*`` the answers, ``diag/diagnosis.json`` the latest diagnosis,
#: ``diag/workers/`` the stacks of the ranks' forked children. Every path in ``diag/`` is built
#: by orchestrate.diagnosis.diagfiles.DiagFiles from these names (the rank sidecar carries a
#: copy of this module).
DIAG_DIR = "diag"
DIAG_HEARTBEATS = "hb"
DIAG_WORKERS = "workers"
DIAG_REQUEST = "request"
DIAG_DIAGNOSIS = "diagnosis.json"
#: ``diag/joined/<attempt>/<host>-<pid>.json``: every process that formed a process group, with
#: the rank and world size it joined with (the world check compares them with the plan's).
DIAG_JOINED = "joined"
#: The heartbeats' folder, for the launch scripts (a rank removes an earlier attempt's beat).
HEARTBEAT_DIR = f"{DIAG_DIR}/{DIAG_HEARTBEATS}"
#: Per-rank step timing of the built-in trainer: ``timing/rank-<R>.jsonl``, one window a line
#: (format in orchestrate/train/timing.py), written by every rank for itself.
TIMING_DIR = "timing"
#: The self-contained HTML report of a run (``orchestrate report``).
REPORT_FILE = "report.html"
#: Files the report and the live view read when they exist (written by the supervisor's restart
#: bookkeeping and ``orchestrate doctor``; shapes accepted are in orchestrate/report/runfiles.py).
ATTEMPTS_FILE = "attempts.json"
DOCTOR_FILE = "doctor.json"
#: The doctor's rank program (``python -m orchestrate.doctor.checkup``): rank 0's result, and the
#: own result of a rank that failed before it could tell rank 0 (``checkup-rank-R.json``).
CHECKUP_RESULT = "checkup.json"


#: A node's container (docs/containers.md): ``container/<node>/`` holds its state (``up``: the
#: attempt and container id, or why it failed; ``rank-R.pid``: each rank's launcher, which the
#: container outlives by at most a second; ``rank-R.exit``: how each rank ended inside;
#: ``host.txt``: the host's IOMMU/ACS settings, for the doctor inside). Mounted at its own path.
CONTAINER_DIR = "container"


def node_script_name(node: str) -> str:
    """File name of a node's launch script."""
    return f"launch-{node}.sh"


def rank_log_name(rank: int) -> str:
    """The file holding one rank's output, relative to the run directory."""
    return f"{LOG_DIR}/rank-{rank}.log"


def rank_log(run_dir: Path, rank: int) -> Path:
    """The file holding one rank's output."""
    return run_dir / rank_log_name(rank)


def checkup_rank_result(rank: int) -> str:
    """File name of one rank's own checkup result (beside :data:`CHECKUP_RESULT`)."""
    return f"checkup-rank-{rank}.json"


def slurm_exit_dir(run_dir: Path, restart: int) -> Path:
    """Where the ranks of one run of a Slurm job (0, then 1 after a requeue, ...) record their
    exit status."""
    return run_dir / SLURM_STATE / SLURM_EXITS / str(restart)


def slurm_secrets(run_dir: Path) -> Path:
    """Where a Slurm job's secrets wait for its batch script."""
    return run_dir / SLURM_STATE / SLURM_SECRETS


def slurm_hostfile(run_dir: Path, restart: int) -> Path:
    """Each rank's host in one run of a Slurm job."""
    return run_dir / SLURM_STATE / f"{SLURM_HOSTFILE}{restart}"


def timing_file(run_dir: Path, rank: int) -> Path:
    """The file one rank appends its step-timing windows to."""
    return run_dir / TIMING_DIR / f"rank-{rank}.jsonl"


#: Set to "1" in a job's env by a program that checks that every node reaches the master itself
#: (the doctor's checkup, whose connect tier names the host that cannot): the SSH launcher's
#: master reach check before launch is left to it.
OWN_REACH_CHECK = "MASTER_REACH_CHECKED_BY_JOB"  # not ORCHESTRATE_: a job may set it
