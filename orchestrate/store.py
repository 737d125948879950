"""The job store: every job this user submitted, with its state and per-rank outcome.

An embedded SQLite database in the user's state directory (``$ORCHESTRATE_HOME``, default
``~/.local/state/orchestrate``). WAL mode and a busy timeout make concurrent CLI invocations and
job supervisors safe; ``PRAGMA user_version`` versions the schema so later releases can migrate.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.errors import UserError

SCHEMA_VERSION = 1

#: States a job ends in: the local backends' and Slurm's terminal states (a preempted Slurm job
#: that Slurm requeues is shown as REQUEUED, not PREEMPTED).
TERMINAL = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
     "DEADLINE", "PREEMPTED", "PREEMPTED_FINAL", "REVOKED"}
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    backend TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    run_dir TEXT NOT NULL,
    plan TEXT NOT NULL,
    external_id TEXT,
    supervisor_pid INTEGER,
    supervisor_host TEXT,
    hosts TEXT NOT NULL DEFAULT '[]',
    failure TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    first_step_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_name ON jobs(name, submitted_at);
CREATE TABLE IF NOT EXISTS ranks (
    job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    node TEXT NOT NULL,
    host TEXT,
    pid INTEGER,
    state TEXT NOT NULL DEFAULT 'PENDING',
    exit_code INTEGER,
    signal INTEGER,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (job_id, rank)
);
"""


def home() -> Path:
    """The state directory (created on first use, private to the user)."""
    base = os.environ.get("ORCHESTRATE_HOME")
    if base:
        path = Path(base).expanduser()
    else:
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        path = Path(state) / "orchestrate"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@dataclass
class RankRecord:
    """What happened to one rank."""

    rank: int
    node: str
    host: str | None = None
    pid: int | None = None
    state: str = "PENDING"
    exit_code: int | None = None
    signal: int | None = None
    started_at: float | None = None
    finished_at: float | None = None


@dataclass
class JobRecord:
    """One submitted job."""

    id: str
    name: str
    backend: str
    state: str
    run_dir: str
    plan: dict[str, Any]
    submitted_at: float
    reason: str = ""
    external_id: str | None = None
    supervisor_pid: int | None = None
    supervisor_host: str | None = None
    hosts: list[str] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    started_at: float | None = None
    first_step_at: float | None = None
    finished_at: float | None = None
    ranks: list[RankRecord] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        """Whether the job has ended."""
        return self.state in TERMINAL

    def to_json(self) -> dict[str, Any]:
        """The status document (``orchestrate status --json``)."""
        return {
            "id": self.id,
            "name": self.name,
            "backend": self.backend,
            "state": self.state,
            "reason": self.reason,
            "run_dir": self.run_dir,
            "external_id": self.external_id,
            "hosts": self.hosts,
            "failure": self.failure,
            "world_size": self.plan.get("world_size"),
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "first_step_at": self.first_step_at,
            "finished_at": self.finished_at,
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "host": r.host,
                    "pid": r.pid,
                    "state": r.state,
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                }
                for r in self.ranks
            ],
        }


_JOB_COLUMNS = (
    "id", "name", "backend", "state", "reason", "run_dir", "plan", "external_id",
    "supervisor_pid", "supervisor_host", "hosts", "failure", "submitted_at", "started_at",
    "first_step_at", "finished_at",
)
_JSON_COLUMNS = ("plan", "hosts", "failure")
_RANK_COLUMNS = (
    "rank", "node", "host", "pid", "state", "exit_code", "signal", "started_at", "finished_at",
)


class Store:
    """The job database; each method is one short transaction."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or home() / "jobs.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise UserError.single(
                    f"job store schema {version} is newer than this orchestrate knows "
                    f"({SCHEMA_VERSION})",
                    source=str(self.path),
                    hint="upgrade orchestrate, or point ORCHESTRATE_HOME elsewhere",
                )
            if version < SCHEMA_VERSION:
                # executescript commits on its own; IF NOT EXISTS makes racing creators safe.
                db.executescript(_SCHEMA + f"PRAGMA user_version = {SCHEMA_VERSION};")
        finally:
            db.close()
        with suppress(OSError):
            self.path.chmod(0o600)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    def add(self, job: JobRecord) -> None:
        """Record a new job and its ranks."""
        row = _job_row(job)
        with self._connect() as db:
            db.execute(
                f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) "
                f"VALUES ({', '.join('?' * len(_JOB_COLUMNS))})",
                [row[c] for c in _JOB_COLUMNS],
            )
            db.executemany(
                f"INSERT INTO ranks (job_id, {', '.join(_RANK_COLUMNS)}) "
                f"VALUES (?, {', '.join('?' * len(_RANK_COLUMNS))})",
                [[job.id, *(getattr(r, c) for c in _RANK_COLUMNS)] for r in job.ranks],
            )

    def update(self, job_id: str, **fields: Any) -> None:
        """Set job columns (JSON columns take Python values)."""
        unknown = set(fields) - set(_JOB_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job fields {sorted(unknown)}")
        values = [json.dumps(v) if k in _JSON_COLUMNS else v for k, v in fields.items()]
        with self._connect() as db:
            db.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                [*values, job_id],
            )

    def finish(self, job_id: str, state: str, reason: str = "", **fields: Any) -> bool:
        """Move a job to a terminal state unless it already is in one; True if it moved."""
        with self._connect() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", [job_id]).fetchone()
            if row is None or row[0] in TERMINAL:
                return False
            values = {"state": state, "finished_at": time.time(), **fields}
            if reason:  # an empty reason keeps a notice recorded while the job ran
                values["reason"] = reason
            db.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?",
                [*(json.dumps(v) if k in _JSON_COLUMNS else v for k, v in values.items()),
                 job_id],
            )
            return True

    def update_rank(self, job_id: str, rank: int, **fields: Any) -> None:
        """Set rank columns."""
        unknown = set(fields) - set(_RANK_COLUMNS)
        if unknown:
            raise ValueError(f"unknown rank fields {sorted(unknown)}")
        with self._connect() as db:
            db.execute(
                f"UPDATE ranks SET {', '.join(f'{k} = ?' for k in fields)} "
                "WHERE job_id = ? AND rank = ?",
                [*fields.values(), job_id, rank],
            )

    def get(self, job_id: str) -> JobRecord | None:
        """A job by exact id."""
        with self._connect() as db:
            row = db.execute(
                f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE id = ?", [job_id]
            ).fetchone()
            if row is None:
                return None
            ranks = db.execute(
                f"SELECT {', '.join(_RANK_COLUMNS)} FROM ranks WHERE job_id = ? ORDER BY rank",
                [job_id],
            ).fetchall()
        return _record(row, ranks)

    def list(self, limit: int = 50, active_only: bool = False) -> list[JobRecord]:
        """Recent jobs, newest first."""
        where = f"WHERE state NOT IN ({', '.join('?' * len(TERMINAL))})" if active_only else ""
        with self._connect() as db:
            rows = db.execute(
                f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs {where} "
                "ORDER BY submitted_at DESC LIMIT ?",
                [*(sorted(TERMINAL) if active_only else []), limit],
            ).fetchall()
        return [_record(row, []) for row in rows]

    def resolve(self, ref: str) -> JobRecord:
        """A job by full id, name (the latest job of that name), or unique id prefix."""
        job = self.get(ref)
        if job is not None:
            return job
        with self._connect() as db:
            # A job name (its latest job) before an id prefix: names are what people type.
            ids = [r[0] for r in db.execute(
                "SELECT id FROM jobs WHERE name = ? ORDER BY submitted_at DESC LIMIT 1", [ref]
            ).fetchall()]
            if not ids:
                ids = [r[0] for r in db.execute(
                    "SELECT id FROM jobs WHERE id LIKE ? ESCAPE '\\' "
                    "ORDER BY submitted_at DESC",
                    [_like_prefix(ref)],
                ).fetchall()]
        if len(ids) > 1:
            raise UserError.single(
                f"'{ref}' matches {len(ids)} jobs",
                field="JOB",
                hint="give more of the id: " + ", ".join(ids[:5]),
            )
        if not ids:
            raise UserError.single(
                f"no job '{ref}'", field="JOB", hint="`orchestrate list` shows your jobs"
            )
        found = self.get(ids[0])
        assert found is not None
        return found


def _like_prefix(ref: str) -> str:
    return ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _job_row(job: JobRecord) -> dict[str, Any]:
    row = {c: getattr(job, c) for c in _JOB_COLUMNS}
    for c in _JSON_COLUMNS:
        row[c] = json.dumps(row[c])
    return row


def _record(row: tuple[Any, ...], ranks: list[tuple[Any, ...]]) -> JobRecord:
    values = dict(zip(_JOB_COLUMNS, row, strict=True))
    for c in _JSON_COLUMNS:
        values[c] = json.loads(values[c]) if values[c] is not None else None
    values["hosts"] = values["hosts"] or []
    job = JobRecord(**values)
    job.ranks = [RankRecord(**dict(zip(_RANK_COLUMNS, r, strict=True))) for r in ranks]
    return job
