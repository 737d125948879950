"""The files of a run's ``diag/`` folder: where each one is (:class:`DiagFiles`) and what it
holds (:class:`Heartbeat`, :class:`Request`, :class:`Done`), for the rank that writes them and
the launcher that reads them.

The rank sidecar (:mod:`orchestrate.diagnosis.sidecar`) writes heartbeats and answers; the
launcher's readers (:mod:`orchestrate.diagnosis.evidence`, the SSH hosts' ``evidence.py``, the
report) read them. Both sides use these records, so a renamed field is one edit and a type
error, not a ``.get()`` that quietly returns None in a detached supervisor. Reading is tolerant:
a field that is missing or of the wrong type (a file from another version, a half-written
line) reads as its default, never as an exception.

Standard library only, Python 3.8+: the sidecar folder carries a copy of this module
(:mod:`orchestrate.diagnosis.rankpackage`), and the Slurm monitor and SSH ``evidence.py``
bundle it.

Files, under ``<run_dir>/diag/`` (names from :mod:`orchestrate.core.layout`)
    ``hb/rank-<R>.json``: the heartbeat (:class:`Heartbeat`), replaced atomically every
    interval (default 2.5 s)::

        {"rank": 0, "pid": 1234, "host": "node-a", "t": <time.time()>, "beat": 17,
         "interval_s": 2.5, "started": <t>, "phase": "step", "phase_since": <t>, "step": 41,
         "progress_t": <t of the last change in phase, step or any group's seq numbers>,
         "pgs": [{"pg": "0", "enqueued": 42, "started": -1, "completed": 41,
                  "desc": "default_pg", "op": "all_reduce", "op_seq": 42,
                  "op_state": "scheduled", "op_since": <t the entry was created>,
                  "sizes": [[4]]}],
         "stack": [["/w/train.py", 88, "step"], ...],   # main thread, innermost first
         "main_cpu_s": 12.3,  # CPU seconds of the main thread (Linux), null elsewhere
         "main_wait_s": 0.8,  # seconds it was runnable but waited for a CPU (schedstat)
         "user_stack": [...],  # its innermost frames outside the stdlib and *-packages
         "stdlib": "/usr/lib/python3.11", "fr": "ok",
         "cpu_s": 0.012,  # CPU time of the thread that wrote it (the sidecar's cost so far)
         "proc": {"state": "S", "wchan": "pipe_read", "syscall": "read",
                  "target": "/ckpt/step-9.pt"}}  # the main thread, as the kernel sees it

    ``proc`` (:class:`KernelState`) is what tells a rank blocked in file I/O, or computing
    (``main_cpu_s`` plus ``main_wait_s`` grow), from one that waits
    (:mod:`orchestrate.diagnosis.stallrule`).

    ``pgs`` is ``null`` until ``torch.distributed`` is imported; ``fr`` says why it is empty
    (``"off"``, ``"unavailable"``, ``"empty"``, or the first error). The ``desc`` and ``op*``
    fields and ``sizes`` (:class:`InFlight`) are there only for a group with a collective in
    flight (``enqueued > completed``) that made no progress since the previous beat.

    ``request``: ``{"id": "...", "t": ...}`` (:class:`Request`), written by a launcher to ask
    every rank for a dump.

    ``<id>/rank-<R>.stacks.txt`` (a header naming the main thread, then faulthandler's dump of
    every thread), ``rank-<R>.fr.json`` (the full flight-recorder dump, once torch.distributed
    is imported), ``rank-<R>.state.json`` (a fresh heartbeat) and last ``rank-<R>.done``
    (``{"id", "t", "files"}``, :class:`Done`): one rank's answer (:class:`AnswerFiles`). The
    stacks file ends with a section per forked child of the rank that answered (DataLoader
    workers: :mod:`orchestrate.diagnosis.workers`), each after a ``# worker pid P ...`` line.

    ``workers/rank-<R>.pid-<P>.stacks.txt``: where a forked child of rank R writes its stacks
    when the sidecar asks it (:mod:`orchestrate.diagnosis.workers`).

    ``diagnosis.json``: the latest diagnosis of the stall watch (also beside its dumps, in
    ``<id>/``).

    ``joined/<attempt>/<host>-<pid>.json`` (:class:`Joined`): a process that formed a process
    group, with the rank and world size it joined with, written once by the sidecar or the
    join watch of that process (``attempt`` is ``ORCHESTRATE_ATTEMPT``)::

        {"pid": 1234, "host": "h2", "rank": 1, "world_size": 4, "env_rank": 1,
         "t": <time.time()>, "heartbeats": true}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.core.layout import (
    DIAG_DIAGNOSIS,
    DIAG_DIR,
    DIAG_HEARTBEATS,
    DIAG_JOINED,
    DIAG_REQUEST,
    DIAG_WORKERS,
)
from orchestrate.diagnosis.kernelstate import KernelState

_SAFE_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# --- where -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerFiles:
    """The files of one rank's answer to one dump request."""

    folder: Path  # diag/<request id>
    rank: int

    def _named(self, suffix: str) -> Path:
        return self.folder / f"rank-{self.rank}.{suffix}"

    @property
    def done(self) -> Path:
        """Written last: the answer is complete."""
        return self._named("done")

    @property
    def stacks(self) -> Path:
        return self._named("stacks.txt")

    @property
    def state(self) -> Path:
        return self._named("state.json")

    @property
    def flight_recorder(self) -> Path:
        return self._named("fr.json")


@dataclass(frozen=True)
class DiagFiles:
    """Every path of a run's ``diag/`` folder, for writers and readers alike."""

    run_dir: Path

    @property
    def folder(self) -> Path:
        return self.run_dir / DIAG_DIR

    @property
    def heartbeats(self) -> Path:
        """The folder of the ranks' heartbeats."""
        return self.folder / DIAG_HEARTBEATS

    def heartbeat(self, rank: int) -> Path:
        """One rank's latest heartbeat."""
        return self.heartbeats / f"rank-{rank}.json"

    @property
    def request(self) -> Path:
        """Where a launcher asks every rank for a dump."""
        return self.folder / DIAG_REQUEST

    def answers(self, request_id: str) -> Path:
        """The folder of every rank's answer to one request."""
        return self.folder / request_id

    def answer(self, request_id: str, rank: int) -> AnswerFiles:
        """One rank's answer to one request."""
        return AnswerFiles(self.answers(request_id), rank)

    @property
    def diagnosis(self) -> Path:
        """The latest diagnosis (``status --json`` shows it)."""
        return self.folder / DIAG_DIAGNOSIS

    def diagnosis_of(self, request_id: str) -> Path:
        """The diagnosis kept beside the dumps it was made of."""
        return self.answers(request_id) / DIAG_DIAGNOSIS

    def joined(self, attempt: int) -> Path:
        """The folder of one attempt's :class:`Joined` records."""
        return self.folder / DIAG_JOINED / str(attempt)

    def joined_by(self, attempt: int, host: str, pid: int, n: int = 1) -> Path:
        """One process's :class:`Joined` record of its ``n``-th process group (a process that
        re-initialises its world keeps a record of each)."""
        name = f"{host}-{pid}" if n <= 1 else f"{host}-{pid}-{n}"
        return self.joined(attempt) / f"{name}.json"

    @property
    def workers(self) -> Path:
        """The folder where the ranks' forked children write their stacks when asked."""
        return self.folder / DIAG_WORKERS

    def worker_stacks(self, rank: int, pid: int) -> Path:
        """Where child ``pid`` of rank ``rank`` writes its stacks."""
        return self.workers / f"rank-{rank}.pid-{pid}.stacks.txt"


# --- what: the rank's records ------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One Python frame: where a rank is."""

    file: str
    line: int
    function: str

    def short(self) -> str:
        """``train.py:88``."""
        return f"{os.path.basename(self.file)}:{self.line}"

    def text(self) -> str:
        """``train.py:88 `step```."""
        return f"{self.short()} `{self.function}`"

    def to_json(self) -> list[Any]:
        """``[file, line, function]``."""
        return [self.file, self.line, self.function]

    @classmethod
    def from_json(cls, data: Any) -> Frame | None:
        """The inverse of :meth:`to_json`; None for anything else."""
        try:
            return cls(str(data[0]), int(data[1]), str(data[2]))
        except (IndexError, KeyError, TypeError, ValueError):
            return None


def frames_from_json(data: Any) -> tuple[Frame, ...]:
    """The frames of a JSON list, skipping malformed ones."""
    found = (Frame.from_json(item) for item in data or ()) if isinstance(data, list) else ()
    return tuple(frame for frame in found if frame is not None)


def pg_order(name: str) -> tuple[int, str]:
    """Process groups in creation order: ``"0"``, ``"1"``, ..., then any other name."""
    return (int(name), "") if name.isdigit() else (1 << 30, name)


@dataclass(frozen=True)
class InFlight:
    """The flight recorder's entry of a group's collective in flight."""

    seq: int  # the collective's number in its group (counts from 1, barriers included)
    op: str  # "all_reduce", "barrier", ...
    desc: str = ""  # the group's description ("default_pg")
    state: str | None = None  # "scheduled" (always, on gloo)
    since: float | None = None  # the rank's clock: when the entry was created
    sizes: Any = None  # input sizes, [[4]]

    def to_json(self) -> dict[str, Any]:
        return {"desc": self.desc, "op": self.op, "op_seq": self.seq, "op_state": self.state,
                "op_since": self.since, "sizes": self.sizes}


@dataclass(frozen=True)
class GroupState:
    """One process group's collective counters in a heartbeat (``-1``: none yet)."""

    pg: str  # "0" for the default group, "1", ... in creation order
    enqueued: int = -1
    started: int = -1  # gloo never sets it
    completed: int = -1
    in_flight: InFlight | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pg": self.pg, "enqueued": self.enqueued,
                               "started": self.started, "completed": self.completed}
        if self.in_flight is not None:
            out.update(self.in_flight.to_json())
        return out

    @classmethod
    def from_json(cls, data: Any) -> GroupState | None:
        """The inverse of :meth:`to_json`; None without a group name or with bad counters."""
        if not isinstance(data, dict) or data.get("pg") is None:
            return None
        try:
            enqueued = int(data.get("enqueued", -1))
            started = int(data.get("started", -1))
            completed = int(data.get("completed", -1))
        except (TypeError, ValueError):
            return None
        seq = _int(data.get("op_seq"))
        op = InFlight(seq, str(data.get("op") or ""), str(data.get("desc") or ""),
                      _str(data.get("op_state")), _float(data.get("op_since")),
                      data.get("sizes")) if seq is not None else None
        return cls(str(data["pg"]), enqueued, started, completed, op)

#: The phase of a rank's last heartbeat, written by its sidecar's exit handler: the program has
#: ended and the interpreter is going. The process may live on for a moment (torch's teardown
#: takes a few tenths of a second), or hang there (docs/hangs.md, kind ``teardown``).
EXIT_PHASE = "exit"


@dataclass(frozen=True)
class Heartbeat:
    """What a rank is doing, as its sidecar wrote it (``hb/rank-R.json``; with ``proc``, a
    dump's ``rank-R.state.json``). Fields the file lacks are None (or empty)."""

    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    t: float | None = None  # the rank's clock
    beat: int | None = None  # counts from 1 in each process
    interval_s: float | None = None
    started: float | None = None
    phase: str | None = None
    phase_since: float | None = None
    step: int | None = None
    progress_t: float | None = None
    pgs: tuple[GroupState, ...] | None = None  # None: torch.distributed not imported
    fr: str | None = None
    stack: tuple[Frame, ...] = ()  # the main thread's innermost frames
    main_cpu_s: float | None = None
    main_wait_s: float | None = None  # seconds the main thread waited, runnable, for a CPU
    user_stack: tuple[Frame, ...] = ()
    stdlib: str | None = None
    cpu_s: float | None = None
    proc: KernelState | None = None  # the main thread's kernel state when the beat was made

    def to_json(self) -> dict[str, Any]:
        """The file's JSON object (see the module docstring)."""
        out: dict[str, Any] = {
            "rank": self.rank, "pid": self.pid, "host": self.host, "t": self.t,
            "beat": self.beat, "interval_s": self.interval_s, "started": self.started,
            "phase": self.phase, "phase_since": self.phase_since, "step": self.step,
            "progress_t": self.progress_t,
            "pgs": None if self.pgs is None else [g.to_json() for g in self.pgs],
            "fr": self.fr, "stack": [f.to_json() for f in self.stack],
            "main_cpu_s": self.main_cpu_s, "user_stack": [f.to_json() for f in self.user_stack],
            "stdlib": self.stdlib, "cpu_s": self.cpu_s,
        }
        if self.main_wait_s is not None:  # absent where the kernel keeps no schedstat
            out["main_wait_s"] = self.main_wait_s
        if self.proc is not None:
            out["proc"] = self.proc.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> Heartbeat | None:
        """The inverse of :meth:`to_json`, tolerant field by field; None for anything but a
        non-empty object."""
        if not isinstance(data, dict) or not data:
            return None
        pgs = data.get("pgs")
        groups = None
        if isinstance(pgs, list):
            found = (GroupState.from_json(item) for item in pgs)
            groups = tuple(g for g in found if g is not None)
        return cls(
            rank=_int(data.get("rank")), pid=_int(data.get("pid")), host=_str(data.get("host")),
            t=_float(data.get("t")), beat=_int(data.get("beat")),
            interval_s=_float(data.get("interval_s")), started=_float(data.get("started")),
            phase=_str(data.get("phase")), phase_since=_float(data.get("phase_since")),
            step=_int(data.get("step")), progress_t=_float(data.get("progress_t")),
            pgs=groups, fr=_str(data.get("fr")), stack=frames_from_json(data.get("stack")),
            main_cpu_s=_float(data.get("main_cpu_s")),
            main_wait_s=_float(data.get("main_wait_s")),
            user_stack=frames_from_json(data.get("user_stack")),
            stdlib=_str(data.get("stdlib")), cpu_s=_float(data.get("cpu_s")),
            proc=KernelState.from_json(data.get("proc")),
        )


@dataclass(frozen=True)
class Joined:
    """A process that formed a process group: the rank and world size it joined with, as the
    process itself saw them at ``init_process_group`` (``diag/joined/<attempt>/``). ``env_rank``
    is RANK in its environment (the plan's, or torchrun's for its workers; None without one);
    ``heartbeats`` says whether it writes ``hb/rank-<rank>.json`` (a sidecar of its own)."""

    pid: int | None = None
    host: str | None = None
    rank: int | None = None
    world_size: int | None = None
    env_rank: int | None = None
    t: float | None = None
    heartbeats: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "rank": self.rank,
                "world_size": self.world_size, "env_rank": self.env_rank, "t": self.t,
                "heartbeats": self.heartbeats}

    @classmethod
    def from_json(cls, data: Any) -> Joined | None:
        """The inverse of :meth:`to_json`; None without a rank and a world size."""
        if not isinstance(data, dict):
            return None
        rank, world = _int(data.get("rank")), _int(data.get("world_size"))
        if rank is None or world is None:
            return None
        return cls(_int(data.get("pid")), _str(data.get("host")), rank, world,
                   _int(data.get("env_rank")), _float(data.get("t")),
                   data.get("heartbeats") is True)


@dataclass(frozen=True)
class Request:
    """A launcher's request for every rank's dump (``diag/request``); its id names the
    folder the answers go to."""

    id: str
    t: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "t": self.t}

    @classmethod
    def from_json(cls, data: Any) -> Request | None:
        """The request, or None when it is malformed or its id is not a safe folder name."""
        try:
            request_id, at = str(data["id"]), float(data.get("t", 0.0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if not request_id or len(request_id) > 64 or not set(request_id) <= _SAFE_ID:
            return None
        if request_id in (".", "..", DIAG_HEARTBEATS, DIAG_WORKERS) or request_id.startswith("."):
            return None
        return cls(request_id, at)


@dataclass(frozen=True)
class Done:
    """The last file of a rank's answer (``rank-R.done``): the answer is complete."""

    id: str
    t: float
    files: tuple[str, ...]  # the files the rank wrote, as it named them

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "t": self.t, "files": list(self.files)}

    @classmethod
    def from_json(cls, data: Any) -> Done | None:
        if not isinstance(data, dict):
            return None
        files = data.get("files")
        return cls(str(data.get("id") or ""), _float(data.get("t")) or 0.0,
                   tuple(str(f) for f in files) if isinstance(files, list) else ())


@dataclass(frozen=True)
class Answer:
    """One rank's answer to a dump request, as the launcher reads it (:class:`AnswerFiles`);
    an SSH host sends it back as :meth:`to_json`, with the flight recorder's text."""

    state: Heartbeat | None  # rank-R.state.json: a fresh heartbeat with ``proc``
    stacks: str | None  # rank-R.stacks.txt
    files: tuple[str, ...]  # where the answer's files are (on SSH: their mirrored copies)
    done: Done | None  # rank-R.done
    fr_text: str | None = None  # rank-R.fr.json's text, as far as an SSH host sent it

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "state": None if self.state is None else self.state.to_json(),
            "stacks": self.stacks, "files": list(self.files),
            "done": None if self.done is None else self.done.to_json(),
        }
        if self.fr_text is not None:
            out["fr_text"] = self.fr_text
        return out

    @classmethod
    def from_json(cls, data: Any) -> Answer | None:
        if not isinstance(data, dict):
            return None
        files = data.get("files")
        return cls(Heartbeat.from_json(data.get("state")), _str(data.get("stacks")),
                   tuple(str(f) for f in files) if isinstance(files, list) else (),
                   Done.from_json(data.get("done")), _str(data.get("fr_text")))
