"""The per-rank sidecar: a daemon thread that says what this rank is doing, every few seconds.

A stuck multi-node job usually shows nothing: every rank waits in a collective until a 10- or
30-minute timeout names no one. The sidecar makes each rank leave evidence a launcher can read
while the rank is blocked: a heartbeat file, and on request its stacks and flight recorder (the
files and their records: :mod:`orchestrate.diagnosis.diagfiles`). The launcher side
(:mod:`orchestrate.diagnosis.evidence` reads the files, :mod:`orchestrate.diagnosis.stall`
decides and names the rank) never talks to the rank itself, so a frozen rank is noticed by its
*silence*.

Standard library only, Python 3.8+. It runs inside users' ``command:`` programs without any
change to them: every Python rank loads a copy of it at start-up
(:mod:`orchestrate.diagnosis.activation`, :mod:`orchestrate.diagnosis.rankpackage`). torch is
never imported here; it is looked at only once the program itself imported
``torch.distributed``.

Public API (``orchestrate.train`` and tests): ``start(run_dir, rank, interval_s=None)``
(idempotent, also across the two copies of this module a trainer process holds,
``_orchestrate_rank.sidecar`` and ``orchestrate.diagnosis.sidecar``: the live sidecar is kept on
the ``sys`` module), and ``phase(name, step=None)``, a couple of attribute writes, cheap enough
for every step.

Phases of programs that are not our trainer (observed by the thread, no hooks): ``start`` (the
interpreter is up; torch.distributed is not imported or not initialised, and the main thread is
not inside ``init_process_group``), ``init_process_group`` (the main thread's stack holds
torch's ``init_process_group``: it waits for its peers at the store), ``running``
(``torch.distributed.is_initialized()``), ``finished`` (it was initialised and no longer is)
and ``exit`` (the last heartbeat, written at interpreter exit). Our trainer sets its own:
``init_process_group``, ``setup``, ``step``, ``checkpoint``, ``eval``; once a program calls
:func:`phase` the automatic phases stop.

Requests: the sidecar reads ``diag/request`` about once a second; on a new id it writes its
answer (stacks, flight recorder, a fresh state, then ``done``). One collector per run dir: a
second request written before the ranks read the first replaces it. A request older than the
sidecar by more than a minute (an earlier run's) is ignored.

The flight recorder's counters and ops: :mod:`orchestrate.diagnosis.flightrecorder`. Without
it (older torch, or ``TORCH_FR_BUFFER_SIZE=0``) progress is the phase and step (and, in a
program without steps, the innermost frame: see :mod:`orchestrate.diagnosis.stallrule`).

Never crash or slow the rank: every error in the thread is caught; a sidecar that cannot write
prints one line to stderr and stops; the thread is a daemon and never delays exit.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrate.diagnosis.diagfiles import (
    EXIT_PHASE,
    DiagFiles,
    Done,
    Frame,
    Heartbeat,
    Request,
)
from orchestrate.diagnosis.flightrecorder import FlightRecorder, dump_function, with_ops
from orchestrate.diagnosis.joinwatch import (
    ENV_OWNER,
    LIVE_KEY,
    destroy_at_exit,
    dist_world,
    live_sidecar,
    record,
    wait_for_store,
)
from orchestrate.diagnosis.threadstate import read_thread, run_wait
from orchestrate.diagnosis.workers import arm, cleanup, sections

ENV_INTERVAL = "ORCHESTRATE_HEARTBEAT_S"

DEFAULT_INTERVAL_S = 2.5
POLL_S = 1.0  # how often the request file is read
STALE_REQUEST_S = 60.0  # a request this much older than the sidecar is from an earlier run
CLEANUP_S = 60.0  # how often the stacks files of forked children that ended are removed
STACK_DEPTH = 10  # innermost frames of the main thread kept in each heartbeat
USER_DEPTH = 6  # innermost frames outside the standard library and installed packages
#: Frames of this folder (the sidecar's modules: the timeout hook, the exit beat) and of the
#: sitecustomize entry beside it are never the user's.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_ENTRY = os.path.join(os.path.dirname(_OWN_DIR), "sitecustomize.py")


class _CannotWrite(Exception):
    """The run dir refuses our files; the sidecar reports once and stops."""


class Sidecar:
    """One rank's heartbeat writer and dump responder (use :func:`start`)."""

    def __init__(self, run_dir: str, rank: int, interval_s: float) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.rank = rank
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.started = time.time()
        # Written by phase() from the main thread and only read here (plain attribute reads
        # and writes are atomic under the GIL; a torn (phase, step) pair lasts one beat). The
        # phases this thread observes go to ``auto`` so they never overwrite an explicit one.
        self.phase = "start"
        self.phase_since = self.started
        self.step: int | None = None
        self.explicit = False
        self.auto = "start"
        self.auto_since = self.started
        self.beat = 0
        self.cpu_s = 0.0
        self.progress_t = self.started
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.files = DiagFiles(Path(self.run_dir))
        self._hb_path = str(self.files.heartbeat(rank))
        self._signature: Any = None
        self.recorder = FlightRecorder()
        self._was_initialised = False
        self._joined = False  # its process group's rank and world size recorded
        self._request_text: str | None = None
        self._stdlib = os.path.dirname(os.__file__)
        self._writing = threading.Lock()  # the last heartbeat at exit must not be overwritten

    # --- the thread ---------------------------------------------------------------------

    def launch(self) -> None:
        """Create the folders, skip a stale request, start the thread."""
        folder = os.path.dirname(self._hb_path)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            self._give_up(f"cannot create {folder} ({_why(exc)})")
            return
        text = self._read_request()
        request = _parse_request(text)
        if request is not None and request.t < self.started - STALE_REQUEST_S:
            self._request_text = text
        arm(self.files, self.rank)
        thread = threading.Thread(target=self._run, name="orchestrate-sidecar", daemon=True)
        self.thread = thread
        thread.start()
        atexit.register(self._at_exit)

    def _run(self) -> None:
        try:
            due = 0.0
            tidy = time.monotonic() + CLEANUP_S
            while not self.stopped:
                now = time.monotonic()
                if now >= due:
                    with self._writing:
                        if self.stopped:
                            break
                        self._write_heartbeat(self.heartbeat())
                    due = now + self.interval_s
                self._poll_request()
                if now >= tidy:
                    cleanup(self.files, self.rank)
                    tidy = now + CLEANUP_S
                self.cpu_s = time.thread_time()
                time.sleep(max(0.05, min(POLL_S, due - time.monotonic())))
        except _CannotWrite as exc:
            self._give_up(str(exc))
        except BaseException as exc:  # never let an error of ours reach the rank
            self._give_up(f"stopped after an error: {type(exc).__name__}: {exc}")

    def _give_up(self, why: str) -> None:
        self.stopped = True
        if sys.is_finalizing():
            return
        try:
            sys.stderr.write(
                f"orchestrate sidecar: rank {self.rank}: {why}; no heartbeats or stall "
                "diagnosis for this rank\n"
            )
            sys.stderr.flush()
        except Exception:
            pass

    def _at_exit(self) -> None:
        """Last heartbeat: the rank ended on purpose (a forked child inherits this: skip)."""
        if self.stopped or os.getpid() != self.pid:
            return
        # Never wait long: a thread stuck writing (a hung file system) must not hold the exit.
        if not self._writing.acquire(timeout=0.5):
            self.stopped = True
            return
        try:
            self.stopped = True
            self.phase, self.phase_since = EXIT_PHASE, time.time()
            self.explicit = True
            self._write_heartbeat(self.heartbeat(look_up_ops=False), suffix="exit")
        except Exception:
            pass
        finally:
            self._writing.release()

    # --- heartbeats ---------------------------------------------------------------------

    def heartbeat(self, look_up_ops: bool = True) -> Heartbeat:
        """This rank's state now, as written to its heartbeat file."""
        now = time.time()
        main = threading.main_thread()
        frame = sys._current_frames().get(main.ident or 0)
        stack, user = _frames(frame, STACK_DEPTH, USER_DEPTH, self._stdlib)
        world = dist_world()
        initialised = world is not None
        if world is not None and not self._joined:
            self._joined = True  # for the world check: the rank and world it joined with
            record(self.run_dir, world[0], world[1], heartbeats=True)
            destroy_at_exit()
        if self.explicit:
            phase, since = self.phase, self.phase_since
        else:
            self._observe_phase(stack, now, initialised)
            phase, since = self.auto, self.auto_since
        self._was_initialised = self._was_initialised or initialised
        step = self.step
        pgs = self.recorder.groups(self._was_initialised, look_up_ops)
        signature = (
            phase, step, None if pgs is None else [(p.pg, p.enqueued, p.completed) for p in pgs],
        )
        if signature != self._signature:
            self._signature = signature
            self.progress_t = now
        self.beat += 1
        cpu, proc = read_thread("self", main.native_id) if main.native_id else (None, None)
        wait = run_wait("self", main.native_id) if main.native_id else None
        return Heartbeat(
            rank=self.rank, pid=self.pid, host=self.host, t=now, beat=self.beat,
            interval_s=self.interval_s, started=self.started, phase=phase, phase_since=since,
            step=step, progress_t=self.progress_t, pgs=pgs, fr=self.recorder.note, stack=stack,
            main_cpu_s=cpu, main_wait_s=wait, user_stack=user, stdlib=self._stdlib,
            cpu_s=round(self.cpu_s, 6),  # the sidecar thread's CPU time: its cost, measured
            proc=proc,  # what the main thread does as the kernel sees it: I/O, CPU, a wait
        )

    def _observe_phase(self, stack: tuple[Frame, ...], now: float, initialised: bool) -> None:
        if initialised:
            name = "running"
        elif self._was_initialised:
            name = "finished"
        elif _in_init_process_group(stack):
            name = "init_process_group"
        else:
            name = "start"
        if name != self.auto:
            self.auto, self.auto_since = name, now

    def _write_heartbeat(self, beat: Heartbeat, suffix: str = "beat") -> None:
        try:
            _write_atomic(self._hb_path, json.dumps(beat.to_json()).encode(), suffix)
        except OSError as exc:
            raise _CannotWrite(f"cannot write {self._hb_path} ({_why(exc)})") from None

    # --- dumps on request -----------------------------------------------------------------

    def _read_request(self) -> str | None:
        try:
            with open(self.files.request, encoding="utf-8") as handle:
                return handle.read(4096)
        except OSError:
            return None

    def _poll_request(self) -> None:
        text = self._read_request()
        if text is None or text == self._request_text:
            return
        request = _parse_request(text)
        if request is None:
            return  # half-written, or not ours: read it again next time
        self._request_text = text
        self.answer(request.id)

    def answer(self, request_id: str) -> list[str]:
        """Write this rank's stacks, flight recorder and state for ``request_id``."""
        paths = self.files.answer(request_id, self.rank)
        written: list[str] = []
        try:
            os.makedirs(paths.folder, exist_ok=True)
            with open(paths.stacks, "w", encoding="utf-8") as handle:
                handle.write(self._stacks_header())
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
                handle.write(sections(self.files, self.rank))  # forked children's
            written.append(str(paths.stacks))
            state = self.heartbeat(look_up_ops=False)  # the full dump below has the ops
            dump = dump_function()
            if dump is not None:
                try:
                    raw = dump(None, None)
                except Exception as exc:
                    raw = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                _write_atomic(str(paths.flight_recorder), raw, "fr")
                written.append(str(paths.flight_recorder))
                state = replace(state, pgs=with_ops(state.pgs, raw))
            _write_atomic(str(paths.state), json.dumps(state.to_json()).encode(), "state")
            written.append(str(paths.state))
            done = Done(request_id, time.time(), tuple(written))
            _write_atomic(str(paths.done), json.dumps(done.to_json()).encode(), "done")
        except OSError as exc:
            raise _CannotWrite(f"cannot write {paths.folder} ({_why(exc)})") from None
        return written

    def _stacks_header(self) -> str:
        main = threading.main_thread().ident or 0
        return (
            f"# orchestrate sidecar: rank {self.rank} pid {self.pid} host {self.host} "
            f"at {time.time():.3f}\n"
            f"# main thread 0x{main:016x}; sidecar thread 0x{threading.get_ident():016x}\n"
            f"# stdlib {self._stdlib}\n"
        )


# --- helpers (no state) --------------------------------------------------------------------


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _write_atomic(path: str, data: bytes, suffix: str) -> None:
    """Replace ``path`` at once: a reader sees the old file or the new one, never half."""
    temporary = f"{path}.{os.getpid()}-{suffix}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


def _parse_request(text: str | None) -> Request | None:
    """The request in ``text``; None when it is missing, half-written or unsafe."""
    if not text:
        return None
    try:
        return Request.from_json(json.loads(text))
    except ValueError:
        return None


def _frames(
    frame: Any, depth: int, user_depth: int, stdlib: str
) -> tuple[tuple[Frame, ...], tuple[Frame, ...]]:
    """The innermost ``depth`` frames, and the innermost ``user_depth`` frames that are not in
    the standard library, an installed package or the sidecar itself (the program's own code
    is often far out: a rank importing torch is 80 frames deep), innermost first. Which of
    those are the user's is for the reader (orchestrate.diagnosis.stacks) to decide."""
    stack: list[Frame] = []
    user: list[Frame] = []
    own = _OWN_DIR + os.sep
    while frame is not None and (len(stack) < depth or len(user) < user_depth):
        code = frame.f_code
        name = code.co_filename
        where = Frame(name, frame.f_lineno, code.co_name)
        if len(stack) < depth:
            stack.append(where)
        if len(user) < user_depth and not (
            name.startswith("<") or name.startswith(stdlib) or "-packages" in name
            or name.startswith(own) or name == _ENTRY
        ):
            user.append(where)
        frame = frame.f_back
    return tuple(stack), tuple(user)


def _in_init_process_group(stack: tuple[Frame, ...]) -> bool:
    """In torch's ``init_process_group``, or in the join watch's wait for rank 0's store just
    before it (:func:`~orchestrate.diagnosis.joinwatch.wait_for_store`)."""
    return any((f.function == "init_process_group" and "distributed" in f.file)
               or f.function == wait_for_store.__name__ for f in stack)


# --- the public API ------------------------------------------------------------------------

_live: Sidecar | None = None


def current() -> Sidecar | None:
    """The sidecar running in this process, started by either copy of this module."""
    car: Sidecar | None = live_sidecar()
    return car


def start(run_dir: str | os.PathLike[str], rank: int, interval_s: float | None = None) -> Any:
    """Start this process's sidecar (once; later calls return the running one)."""
    global _live
    car = current()
    if car is None:
        if interval_s is None:
            interval_s = _interval_from(os.environ)
        car = Sidecar(os.fspath(run_dir), int(rank), interval_s)
        setattr(sys, LIVE_KEY, car)
        os.environ[ENV_OWNER] = str(car.pid)
        car.launch()
    _live = car
    return car


def phase(name: str, step: int | None = None) -> None:
    """Say what this rank does now (``step``, ``checkpoint``, ``eval``...); cheap."""
    car = _live
    if car is None:
        return
    if name != car.phase or not car.explicit:
        car.phase = name
        car.phase_since = time.time()
    car.step = step
    car.explicit = True


def _interval_from(environ: Any) -> float:
    raw = str(environ.get(ENV_INTERVAL, "")).strip()
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        value = DEFAULT_INTERVAL_S
    return value if 0.05 <= value <= 3600 else DEFAULT_INTERVAL_S
