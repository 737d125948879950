"""The job store: every job this user submitted, with its state and per-rank outcome.

An embedded SQLite database in the user's state directory (``$ORCHESTRATE_HOME``, default
``~/.local/state/orchestrate``; :func:`orchestrate.hostside.host.state_dir`). WAL mode and a busy
timeout make concurrent CLI invocations and job supervisors safe; ``PRAGMA user_version`` versions
the schema and older stores are migrated in place. What it holds is :mod:`orchestrate.run.jobrecord`
(re-exported here, where most readers look for it).

A busy store never decides a job's fate: every transaction is retried while the database is
locked, for ``patience_s`` (30 s for the CLI, which then says the store is busy; minutes for a
supervisor, which must record how its job ended). A store that cannot be opened at all (not a
database, a home that is a file, no permission) is a :class:`~orchestrate.core.errors.UserError`
naming the file, never a traceback.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrate.core.errors import UserError
from orchestrate.core.plan.outcome import Attempt, Failure
from orchestrate.core.plan.plan import Plan
from orchestrate.hostside import host
from orchestrate.run.jobrecord import (
    STOPPED,
    EndFields,
    JobFields,
    JobState,
    RankFields,
    job_state,
    rank_state,
)

# Re-exported: readers of the store (the CLI, the doctor) import the records from here.
from orchestrate.run.jobrecord import TERMINAL as TERMINAL
from orchestrate.run.jobrecord import JobRecord as JobRecord
from orchestrate.run.jobrecord import RankRecord as RankRecord
from orchestrate.run.knobs import seconds

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only mypy needs it

T = TypeVar("T")

SCHEMA_VERSION = 3
#: How long the CLI waits for a locked store before saying so (testing knob: run/knobs.py).
PATIENCE_S = seconds("ORCHESTRATE_STORE_PATIENCE_S", 30.0)
#: How long a supervisor keeps trying to record its job's progress and end.
SUPERVISOR_PATIENCE_S = 900.0

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
    finished_at REAL,
    attempts TEXT NOT NULL DEFAULT '[]',
    diagnosis TEXT,
    lease_books TEXT
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
#: From each version to the next (version 1 had no attempts or diagnosis, version 2 no lease
#: books: its jobs read as not recorded).
_MIGRATIONS = {
    1: "ALTER TABLE jobs ADD COLUMN attempts TEXT NOT NULL DEFAULT '[]';"
       "ALTER TABLE jobs ADD COLUMN diagnosis TEXT;",
    2: "ALTER TABLE jobs ADD COLUMN lease_books TEXT;",
}


def home() -> Path:
    """The state directory (absolute, created on first use, private to the user)."""
    try:
        return Path(host.state_dir())
    except OSError as exc:
        raise UserError.single(
            f"cannot use the state directory: {exc.strerror}", source=str(exc.filename or ""),
            field="ORCHESTRATE_HOME",
            hint="point ORCHESTRATE_HOME (or XDG_STATE_HOME) at a directory you can write",
        ) from None


_JOB_COLUMNS = (
    "id", "name", "backend", "state", "reason", "run_dir", "plan", "external_id",
    "supervisor_pid", "supervisor_host", "hosts", "failure", "submitted_at", "started_at",
    "first_step_at", "finished_at", "attempts", "diagnosis", "lease_books",
)
_JSON_COLUMNS = ("plan", "hosts", "failure", "attempts", "diagnosis", "lease_books")
_RANK_COLUMNS = (
    "rank", "node", "host", "pid", "state", "exit_code", "signal", "started_at", "finished_at",
)


class Store:
    """The job database; each method is one short transaction, retried while the store is
    locked (see the module docstring)."""

    def __init__(self, path: Path | None = None, patience_s: float = PATIENCE_S) -> None:
        self.path = (path or home() / "jobs.db").absolute()
        self.patience_s = patience_s
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unusable(exc) from None
        self._transact(self._create, begin=False)
        with suppress(OSError):
            self.path.chmod(0o600)

    # ---- plumbing ------------------------------------------------------------------------

    def _unusable(self, exc: BaseException) -> UserError:
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        hint = "point ORCHESTRATE_HOME at a directory you can write"
        if "not a database" in what or "malformed" in what:
            hint = (f"the file is damaged or not a job store: move it aside (mv {self.path} "
                    f"{self.path}.broken) to start a new one, or point ORCHESTRATE_HOME elsewhere")
        return UserError.single(f"cannot use the job store: {what}", source=str(self.path),
                                hint=hint)

    def _create(self, db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise UserError.single(
                f"job store schema {version} is newer than this orchestrate knows "
                f"({SCHEMA_VERSION})",
                source=str(self.path),
                hint="upgrade orchestrate, or point ORCHESTRATE_HOME elsewhere",
            )
        if version == 0:
            # executescript commits on its own; IF NOT EXISTS makes racing creators safe.
            db.executescript(_SCHEMA + f"PRAGMA user_version = {SCHEMA_VERSION};")
            return
        while version < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("PRAGMA user_version").fetchone()[0] == version:  # not raced
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
            version = db.execute("PRAGMA user_version").fetchone()[0]

    def _transact(self, body: Callable[[sqlite3.Connection], T], begin: bool = True) -> T:
        """Run ``body`` in one transaction; retried while the database is locked."""
        deadline = time.monotonic() + self.patience_s
        delay = 0.05
        while True:
            try:
                db = sqlite3.connect(self.path, timeout=min(30.0, self.patience_s),
                                     isolation_level=None)
            except sqlite3.Error as exc:
                raise self._unusable(exc) from None
            try:
                db.execute(f"PRAGMA busy_timeout={int(min(30.0, self.patience_s) * 1000)}")
                db.execute("PRAGMA foreign_keys=ON")
                if not begin:
                    return body(db)
                db.execute("BEGIN IMMEDIATE")
                try:
                    result = body(db)
                except BaseException:
                    with suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return result
            except sqlite3.OperationalError as exc:
                busy = "locked" in str(exc) or "busy" in str(exc)
                if not busy:
                    raise self._unusable(exc) from None
                if time.monotonic() > deadline:
                    raise UserError.single(
                        f"the job store stayed locked for {self.patience_s:.0f}s ({exc})",
                        source=str(self.path),
                        hint="another process holds it (a stuck orchestrate or sqlite3 shell?)",
                    ) from None
            except sqlite3.DatabaseError as exc:
                raise self._unusable(exc) from None
            finally:
                db.close()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # ---- writes --------------------------------------------------------------------------

    def add(self, job: JobRecord) -> None:
        """Record a new job and its ranks (a job id is never reused)."""
        row = _job_row(job)

        def body(db: sqlite3.Connection) -> None:
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

        try:
            self._transact(body)
        except sqlite3.IntegrityError:
            raise UserError.single(
                f"a job with id {job.id} exists already", field="--job-id",
                hint=f"choose another id, or `orchestrate resume {job.id}` to run it again",
            ) from None

    def update(self, job_id: str, **fields: Unpack[JobFields]) -> None:
        """Set job columns (typed records and lists as Python values)."""
        unknown = set(fields) - set(_JOB_COLUMNS)
        if unknown:  # mypy refuses these already; a caller that bypassed it still fails
            raise ValueError(f"unknown job fields {sorted(unknown)}")
        values = [_encode(k, v) for k, v in fields.items()]
        self._transact(lambda db: db.execute(
            f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
            [*values, job_id],
        ))

    def finish(self, job_id: str, state: JobState, reason: str = "",
               **fields: Unpack[EndFields]) -> bool:
        """Move a job to a terminal ``state`` unless it already is in one; True if it moved.
        Ranks still recorded as running are marked stopped: a finished job runs nothing."""
        if state not in TERMINAL:
            raise ValueError(f"{state} is not a state a job ends in")

        def body(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", [job_id]).fetchone()
            if row is None or row[0] in TERMINAL:
                return False
            values: dict[str, Any] = {"state": state, "finished_at": time.time(), **fields}
            if reason:  # an empty reason keeps a notice recorded while the job ran
                values["reason"] = reason
            db.execute(
                f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?",
                [*(_encode(k, v) for k, v in values.items()), job_id],
            )
            db.execute("UPDATE ranks SET state = ? WHERE job_id = ? AND state = 'RUNNING'",
                       [STOPPED, job_id])
            return True

        return self._transact(body)

    def reopen(self, job_id: str, attempt: Attempt) -> None:
        """Start another attempt of a job (a restart or ``resume``): not terminal any more,
        its ranks pending again, the attempt appended."""

        def body(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT attempts FROM jobs WHERE id = ?", [job_id]).fetchone()
            attempts = json.loads(row[0]) if row and row[0] else []
            attempts.append(attempt.to_json())
            db.execute(
                "UPDATE jobs SET state = 'PENDING', reason = '', failure = NULL, "
                "finished_at = NULL, diagnosis = NULL, attempts = ? WHERE id = ?",
                [json.dumps(attempts), job_id],
            )
            db.execute(
                "UPDATE ranks SET state = 'PENDING', pid = NULL, exit_code = NULL, "
                "signal = NULL, started_at = NULL, finished_at = NULL WHERE job_id = ?",
                [job_id],
            )

        self._transact(body)

    def end_attempt(self, job_id: str, ended: float, reason: str,
                    resumed_from_step: int | None = None,
                    excluded: tuple[str, ...] = ()) -> None:
        """Record how the current attempt ended (and which nodes the next one avoids)."""

        def body(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT attempts, submitted_at FROM jobs WHERE id = ?",
                             [job_id]).fetchone()
            if row is None:
                return
            attempts = [Attempt.from_json(a) for a in json.loads(row[0] or "[]")]
            if not attempts:
                attempts = [Attempt(1, float(row[1]))]
            last = attempts[-1]
            attempts[-1] = Attempt(last.n, last.started, ended, reason,
                                   (*last.excluded_nodes, *excluded),
                                   resumed_from_step if resumed_from_step is not None
                                   else last.resumed_from_step)
            db.execute("UPDATE jobs SET attempts = ? WHERE id = ?",
                       [json.dumps([a.to_json() for a in attempts]), job_id])

        self._transact(body)

    def update_rank(self, job_id: str, rank: int, **fields: Unpack[RankFields]) -> None:
        """Set rank columns."""
        unknown = set(fields) - set(_RANK_COLUMNS)
        if unknown:
            raise ValueError(f"unknown rank fields {sorted(unknown)}")
        self._transact(lambda db: db.execute(
            f"UPDATE ranks SET {', '.join(f'{k} = ?' for k in fields)} "
            "WHERE job_id = ? AND rank = ?",
            [*fields.values(), job_id, rank],
        ))

    # ---- reads ---------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        """A job by exact id."""

        def body(db: sqlite3.Connection) -> JobRecord | None:
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

        return self._transact(body, begin=False)

    def list(self, limit: int = 50, active_only: bool = False) -> list[JobRecord]:
        """Recent jobs, newest first."""
        where = f"WHERE state NOT IN ({', '.join('?' * len(TERMINAL))})" if active_only else ""
        rows = self._transact(lambda db: db.execute(
            f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs {where} "
            "ORDER BY submitted_at DESC LIMIT ?",
            [*(sorted(TERMINAL) if active_only else []), limit],
        ).fetchall(), begin=False)
        return [_record(row, []) for row in rows]

    def resolve(self, ref: str) -> JobRecord:
        """A job by full id, name (the latest job of that name), or unique id prefix."""
        job = self.get(ref)
        if job is not None:
            return job

        def body(db: sqlite3.Connection) -> list[str]:
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
            return ids

        ids = self._transact(body, begin=False)
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


def _encode(column: str, value: Any) -> Any:
    """A column's value as stored: typed records and lists as JSON text."""
    if column not in _JSON_COLUMNS:
        return value
    if isinstance(value, Plan | Failure):
        value = value.to_json()
    elif isinstance(value, list) and column == "attempts":
        value = [a.to_json() if isinstance(a, Attempt) else a for a in value]
    return json.dumps(value)


def _job_row(job: JobRecord) -> dict[str, Any]:
    return {c: _encode(c, getattr(job, c)) for c in _JOB_COLUMNS}


def _record(row: tuple[Any, ...], ranks: list[tuple[Any, ...]]) -> JobRecord:
    values = dict(zip(_JOB_COLUMNS, row, strict=True))
    for c in _JSON_COLUMNS:
        values[c] = json.loads(values[c]) if values[c] is not None else None
    values["hosts"] = values["hosts"] or []
    values["plan"] = Plan.from_json(values["plan"])
    values["failure"] = None if values["failure"] is None else Failure.from_json(values["failure"])
    values["attempts"] = [Attempt.from_json(a) for a in values["attempts"] or []]
    values["state"] = job_state(values["state"])
    job = JobRecord(**values)
    for r in ranks:
        rank = RankRecord(**dict(zip(_RANK_COLUMNS, r, strict=True)))
        rank.state = rank_state(rank.state)
        job.ranks.append(rank)
    return job
