"""Talking to Slurm: its client commands, each with a time limit, and parsers for their output.

The parsers are pure (text in, values out) and tested on recorded output. Every command has a
timeout because a Slurm client blocks while the controller is down or restarting (``scontrol
ping`` was seen to hang for seconds): a status query must never leave its caller waiting forever.
Job state comes from ``scontrol show job`` (which keeps finished jobs for ``MinJobAge``) and
``squeue``; ``sacct`` only where accounting is enabled, which small clusters often lack.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.run.jobrecord import JobState

#: Slurm job states after which the job never runs again (unless someone requeues it by hand).
FINAL_STATES: frozenset[JobState] = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
     "PREEMPTED", "REVOKED", "TIMEOUT"}
)
#: Slurm states that are flags of a job about to be queued again (20.11-25.11): REQUEUED while a
#: requeue is under way, REQUEUED_CRON (20.11), REQUEUE_FED, EXPEDITING (25.11, an expedited
#: requeue) and the held ones (REQUEUE_HOLD, SPECIAL_EXIT, RESV_DEL_HOLD): each is PENDING to
#: orchestrate, with Slurm's reason kept.
QUEUED_AGAIN_STATES = frozenset(
    {"REQUEUED", "REQUEUED_CRON", "REQUEUE_FED", "EXPEDITING", "REQUEUE_HOLD", "SPECIAL_EXIT",
     "RESV_DEL_HOLD"}
)
#: How long one client command may take before we stop waiting for it.
COMMAND_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 3.0

_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")
_JOB_ID = re.compile(r"^\s*(\d+)(?:;\S+)?\s*$")
_INVALID_JOB = "Invalid job id"


class SlurmError(Exception):
    """A Slurm client failed: the command, its exit status and its last stderr lines."""


class SlurmTimeout(SlurmError):
    """A Slurm client did not answer in time: the controller is down, restarting or frozen.
    What it was asked may still happen (a queued job runs once the controller wakes)."""


@dataclass(frozen=True)
class Completed:
    """What a client command did."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        """``sbatch --parsable job.sbatch exited 1: <last stderr lines>``."""
        tail = " | ".join(self.stderr.strip().splitlines()[-3:]) or self.stdout.strip()[-300:]
        return f"{' '.join(self.argv)} exited {self.returncode}: {tail}"


# ---- parsers ---------------------------------------------------------------------------------


def parse_show_job(text: str) -> list[dict[str, str]]:
    """``scontrol show job`` output (multi-line, or ``--oneliner``) as one dict per job record.

    A heterogeneous job prints one record per component; a record starts at ``JobId=``. Values
    may contain spaces (``Command=/a b/c``): a value runs until the next `` Key=``, except the
    free-text ones a user writes (``JobName``, ``Comment``, ``Command``, ``WorkDir``, ``StdOut``
    ...), which Slurm prints last on their line (20.11 to 25.11): there the value is the rest of
    the line. The first occurrence of a key wins, so a value containing `` JobState=COMPLETED``
    never replaces the job's state. Prefer the multi-line form: in ``--oneliner`` only JobName is
    bounded (by the ``UserId=`` after it) and a later free-text value can still shadow a key
    printed after it.
    """
    return _records(text, "JobId", JOB_TEXT_KEYS)


def parse_show_node(text: str) -> list[dict[str, str]]:
    """``scontrol show node [--oneliner]`` output as one dict per node record (``NodeName``,
    ``NodeAddr``, ``CPUTot``, ``RealMemory``, ``Gres``, ``State``, ``Partitions``, ``Reason``...;
    values with spaces, such as ``OS=Linux 6.1.0 #1 SMP`` or a ``Reason``, are kept whole; the
    first occurrence of a key wins, as for jobs)."""
    return _records(text, "NodeName", NODE_TEXT_KEYS)


#: ``scontrol show job`` keys whose values are free text, each printed last on its line.
JOB_TEXT_KEYS = frozenset({
    "JobName", "Command", "SubmitLine", "WorkDir", "AdminComment", "SystemComment", "Comment",
    "Extra", "StdErr", "StdIn", "StdOut",
})
#: ``scontrol show node`` keys whose values are free text, each printed last on its line.
NODE_TEXT_KEYS = frozenset({"OS", "Reason", "Comment", "Extra"})
#: In ``--oneliner`` output, what ends a JobName: the next line's first key.
_AFTER_NAME = re.compile(r" (?:SLUID|HetJobIdSet|UserId)=")


def _records(text: str, first: str, free_text: frozenset[str]) -> list[dict[str, str]]:
    records: list[dict[str, str]] = []
    for block in re.split(rf"(?m)(?=^{first}=)", text.strip()):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines or not lines[0].startswith(f"{first}="):
            continue
        record: dict[str, str] = {}
        if len(lines) == 1:  # --oneliner: no line ends to bound free text, but JobName's
            name, rest = _split_oneliner_name(lines[0])
            _add_line(record, name, free_text)
            _add_line(record, rest, frozenset())
        else:
            for line in lines:
                _add_line(record, line, free_text)
        records.append(record)
    return records


def _split_oneliner_name(line: str) -> tuple[str, str]:
    """A one-line record as the part up to its JobName's end and the rest (JobName may hold
    `` Key=``; what follows it on the multi-line form's next line ends it)."""
    at = line.find(" JobName=")
    after = _AFTER_NAME.search(line, at + 1) if at >= 0 else None
    if after is None:
        return "", line
    return line[:after.start()], line[after.start() + 1:]


def _add_line(record: dict[str, str], line: str, free_text: frozenset[str]) -> None:
    matches = list(_KEY.finditer(line))
    for i, match in enumerate(matches):
        key = match.group(1)
        last = key in free_text or i + 1 == len(matches)
        end = len(line) if last else matches[i + 1].start()
        record.setdefault(key, " ".join(line[match.end():end].split()))
        if last:
            return


def job_state_name(record: dict[str, str]) -> str:
    """The base state of a ``scontrol show job`` record: Slurm's own name, with the flag states
    of a job queued again (:data:`QUEUED_AGAIN_STATES`) as PENDING; ``UNKNOWN`` when missing."""
    named = record.get("JobState", "UNKNOWN").split("+")[0]
    return "PENDING" if named in QUEUED_AGAIN_STATES else named


def tres_gpus(tres: str) -> int:
    """The GPU count of a TRES list (``cpu=16,mem=400G,gres/gpu=8,gres/gpu:a100=8`` -> 8): the
    untyped ``gres/gpu`` total, else the sum of the typed ones; 0 without GPUs."""
    untyped, typed = None, 0
    for item in tres.split(","):
        name, _, count = item.partition("=")
        if not count.isdigit():
            continue
        if name == "gres/gpu":
            untyped = int(count)
        elif name.startswith("gres/gpu:"):
            typed += int(count)
    return typed if untyped is None else untyped


def job_gpus(record: dict[str, str]) -> int:
    """The GPUs a ``scontrol show job`` record has (allocated) or asks for (pending): from
    ``AllocTRES`` (23.02+) or ``TRES`` (up to 22.05), never from ``TresPerNode``/squeue's
    ``%b``, which say ``N/A`` for a job that asked with ``--gpus`` or ``--gpus-per-task``."""
    for key in ("AllocTRES", "TRES", "ReqTRES"):  # a pending job's AllocTRES is (null)
        if record.get(key) not in (None, "", "(null)"):
            return tres_gpus(record[key])
    return 0


def parse_job_id(text: str) -> str:
    """The job id from ``sbatch --parsable`` output (``123`` or ``123;cluster``)."""
    for line in text.splitlines():
        match = _JOB_ID.match(line)
        if match:
            return match.group(1)
    raise ValueError(f"no job id in sbatch output {text.strip()[:200]!r}")


def parse_exit_code(value: str) -> tuple[int, int]:
    """Slurm's ``ExitCode=3:0`` (exit status, signal) as two integers."""
    status, _, signal = value.partition(":")
    try:
        return int(status), int(signal or 0)
    except ValueError:
        return 0, 0


def parse_node_states(text: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N %T'`` output: node name to state (``down*``, ``idle``, ...)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2:
            states[words[0]] = words[1]
    return states


def parse_sacct(text: str) -> tuple[str, str] | None:
    """``sacct -n -P -X -o State,ExitCode`` output: the job's (state, exit code), if any.

    sacct writes ``CANCELLED by 0``; the first word is the state.
    """
    for line in text.splitlines():
        state, _, code = line.partition("|")
        if state.strip():
            return state.split()[0], code.strip()
    return None


# ---- commands --------------------------------------------------------------------------------


class SlurmClient:
    """Runs Slurm's client commands with ``env``, by default this process's environment as it
    is at each call (SLURM_CONF included)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = None if env is None else dict(env)

    def run(
        self,
        *argv: str,
        timeout: float = COMMAND_TIMEOUT_S,
        cwd: Path | None = None,
        stdin: str | None = None,
        unset: Collection[str] = (),
    ) -> Completed:
        """Run one client, without the variables named in ``unset``; a timeout or a missing
        program is a :class:`SlurmError`."""
        env = self.env
        if unset:
            env = {k: v for k, v in (os.environ if env is None else env).items()
                   if k not in unset}
        try:
            proc = subprocess.run(
                argv, env=env, cwd=cwd, input=stdin, capture_output=True, text=True,
                timeout=timeout, check=False,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SlurmTimeout(
                f"{' '.join(argv)} did not answer within {timeout:g}s (is slurmctld up?)"
            ) from None
        except OSError as exc:
            raise SlurmError(f"{argv[0]}: {exc.strerror}") from None
        return Completed(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def ping(self, timeout: float = PING_TIMEOUT_S) -> bool:
        """Whether a controller answers ``scontrol ping`` in time."""
        try:
            done = self.run("scontrol", "ping", timeout=timeout)
        except SlurmError:
            return False
        return done.returncode == 0 and "is UP" in done.stdout

    def sbatch(self, script: Path | None, *options: str, cwd: Path | None = None,
               text: str | None = None, unset: Collection[str] = ()) -> Completed:
        """``sbatch OPTIONS SCRIPT`` (or the script's text on stdin), without the variables
        named in ``unset``: sbatch hands its environment to the job, and slurmctld keeps that
        on its disk (``StateSaveLocation/hash.N/job.ID/environment``), so secrets stay out."""
        argv = ["sbatch", *options]
        if script is not None:
            argv.append(str(script))
        return self.run(*argv, cwd=cwd, stdin=text, unset=unset)

    def show_job(self, job_id: str) -> dict[str, str] | None:
        """The job's record (the first component of a heterogeneous job); None when the
        controller no longer knows the job (purged after MinJobAge, or never existed)."""
        done = self.run("scontrol", "show", "job", job_id)  # multi-line: exact free text
        if done.returncode != 0:
            if _INVALID_JOB in done.stderr or _INVALID_JOB in done.stdout:
                return None
            raise SlurmError(done.describe())
        records = parse_show_job(done.stdout)
        for record in records:
            if record.get("JobId") == job_id:
                return record
        return records[0] if records else None

    def find_batch_job(self, name: str, script: Path, newer_than: str | None = None
                       ) -> str | None:
        """The id of the job named ``name`` whose batch script is ``script``, among the jobs the
        controller still knows (queued, running or recently ended), if there is one (the newest,
        and newer than ``newer_than`` when given)."""
        done = self.run("squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%o")
        if done.returncode != 0:
            raise SlurmError(done.describe())
        floor = int(newer_than) if newer_than and newer_than.isdigit() else -1
        found = [int(job_id) for job_id, _, command in
                 (line.strip().partition("|") for line in done.stdout.splitlines())
                 if command == str(script) and job_id.isdigit() and int(job_id) > floor]
        return str(max(found)) if found else None

    def in_queue(self, job_id: str) -> bool:
        """Whether squeue still lists the job (pending, running or completing)."""
        done = self.run("squeue", "-h", "-j", job_id, "-o", "%T")
        return done.returncode == 0 and bool(done.stdout.strip())

    def cancel(self, job_id: str, *options: str) -> Completed:
        """``scancel [OPTIONS] JOB_ID``."""
        return self.run("scancel", *options, job_id)

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        """The Slurm state of each node (``down*``, ``allocated``, ...)."""
        if not nodes:
            return {}
        done = self.run("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T")
        return parse_node_states(done.stdout) if done.returncode == 0 else {}

    def accounted(self, job_id: str) -> tuple[str, str] | None:
        """(state, exit code) from accounting, or None where sacct does not work."""
        try:
            done = self.run("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode")
        except SlurmError:
            return None
        return parse_sacct(done.stdout) if done.returncode == 0 else None
