"""A supervisor started before its job is planned, so that ``submit`` overlaps two Python starts.

Why: a local ``submit --follow`` ran two Python processes in series before the first rank: the
CLI (its imports, the job loaded and planned) and then the supervisor (its own imports, 0.1-0.3
s). ``submit`` now starts this program as its first step (:meth:`Early.start`). It imports what
a supervisor needs while the CLI plans, then waits on stdin for a :class:`Go` line: which
supervisor module to run, for which job and store, writing its log where. It then runs that
module's ``main([JOB, STORE])``, as ``python -m MODULE JOB STORE`` would, and the supervisor
reads its handshake next on the same stdin: every later step is the supervisor's own
(:mod:`orchestrate.backends.detached`). The end of stdin before a Go line (the CLI refused the
job or was interrupted; a Slurm job; a dry run) ends it silently: it started nothing.

Its command line names the job by ``*-SUFFIX`` (the fresh suffix of ``<name>-<suffix>``, which
the CLI draws before it reads the job), or by the id ``--job-id`` gave: :func:`orchestrate.
backends.detached.alive` accepts a process whose command line holds the job id or that pattern.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import IO, Any

#: This program, run as ``python -m MODULE WORD``.
MODULE = "orchestrate.backends.early"
#: The start of a command-line word that names every job id ending in what follows it.
PATTERN = "*-"
#: Whether ``submit`` starts the supervisor early: in the CLI's own process (set by
#: :func:`orchestrate.cli.entry`), where two Python starts overlap; not where :func:`orchestrate.
#: cli.main` runs inside another program (a test, a notebook), which keeps the order it had.
ENABLED = False
#: The program :func:`prestart` started, until ``submit`` takes it (:meth:`Early.start`).
_PRESTARTED: tuple[Early | None, str | None] | None = None


def draw_suffix() -> str:
    """A job id's fresh suffix, ``<name>-<6 hex>`` (:func:`orchestrate.run.prepare.
    new_id_suffix`, drawn here before the job is read: the pattern on the command line)."""
    return secrets.token_hex(3)


def names(word: bytes, job_id: bytes) -> bool:
    """Whether a command-line word names ``job_id``: the id itself, or ``*-SUFFIX`` of it."""
    if word == job_id:
        return True
    return word.startswith(PATTERN.encode()) and job_id.endswith(word[1:]) and len(word) > 2


@dataclass(frozen=True)
class Go:
    """What the started program runs: ``python -m module job_id store``, its stderr ``log``."""

    module: str
    job_id: str
    store: str
    log: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Go:
        return cls(**{k: str(data[k]) for k in ("module", "job_id", "store", "log")})


def prestart(argv: list[str]) -> None:
    """Start the program at once when the command line is a plain ``submit`` (no ``--job-id``,
    which the program's command line would name; not a dry run or a help text, which start
    nothing): before the CLI imports click and its commands, about 0.1 s sooner than the
    ``submit`` command itself could. :meth:`Early.start` hands it over."""
    global _PRESTARTED
    if not ENABLED or argv[:1] != ["submit"] or _PRESTARTED is not None or any(
            word.startswith(("--job-id", "--dry-run", "--help", "-h")) for word in argv):
        return
    _PRESTARTED = Early.start(None)


class Early:
    """The CLI's side: the program started before planning, handed a job or let go."""

    def __init__(self, proc: subprocess.Popen[bytes], word: str) -> None:
        self.proc = proc
        self.word = word
        self.taken = False

    @classmethod
    def start(cls, job_id: str | None) -> tuple[Early | None, str | None]:
        """Start the program, naming ``job_id`` (``--job-id``) or a fresh suffix's pattern;
        returns it and the suffix the job id must end with (None with ``job_id``). In its own
        session (it outlives the CLI, as a supervisor does); its stderr goes nowhere until it
        has its log: a program that fails before then is replaced (:meth:`take`). None when
        not :data:`ENABLED`."""
        if not ENABLED:
            return None, None
        global _PRESTARTED
        if job_id is None and _PRESTARTED is not None:
            started, _PRESTARTED = _PRESTARTED, None
            return started
        suffix = None if job_id is not None else draw_suffix()
        word = job_id if job_id is not None else PATTERN + str(suffix)
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, word], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True)
        return cls(proc, word), suffix

    def take(self, go: Go) -> subprocess.Popen[bytes] | None:
        """Hand the program its job (the handshake follows on the same stdin); None when it
        cannot run it (it ended, or names another job): start a supervisor the usual way."""
        assert self.proc.stdin is not None
        if self.taken or self.proc.poll() is not None or \
                not names(self.word.encode(), go.job_id.encode()):
            self.close()
            return None
        try:
            self.proc.stdin.write((json.dumps(go.to_json()) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it ended meanwhile
            self.close()
            return None
        self.taken = True
        return self.proc

    def close(self) -> None:
        """Let it go unused: the end of its stdin ends it (nothing is waited for)."""
        if self.taken:
            return
        self.taken = True
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def main(stdin: IO[str]) -> int:
    """The started program: import while the CLI plans, then run the supervisor it names."""
    import importlib

    # A local job's supervisor (an SSH job's shares most of it) and the launch scripts'
    # templates (jinja). Not the job's models (pydantic, the slowest import, which the CLI
    # imports too, on the same cores): a local supervisor claims with the facts the CLI sent
    # and launches without them (orchestrate/run/loaded.py); what needs them imports them.
    importlib.import_module("orchestrate.core.render.render")
    importlib.import_module("orchestrate.diagnosis.rankpackage")  # the ranks' sidecar
    local = importlib.import_module("orchestrate.backends.local.supervisor")
    with contextlib.suppress(Exception):  # only a speed-up: the launch says what fails
        local.prewarm()  # what every local launch computes alike, while the CLI plans
    line = stdin.readline()
    if not line.strip():
        return 0
    go = Go.from_json(json.loads(line))
    log = os.open(go.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 2)
    os.close(log)
    # As ``python -m MODULE JOB STORE`` runs it: the module's main(argv).
    return int(importlib.import_module(go.module).main([go.job_id, go.store]))


if __name__ == "__main__":
    sys.exit(main(sys.stdin))
