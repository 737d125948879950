"""The per-rank sidecar: a daemon thread that says what this rank is doing, every few seconds.

A stuck multi-node job usually shows nothing: every rank waits in a collective until a 10- or
30-minute timeout names no one. The sidecar makes each rank leave evidence a launcher can read
while the rank is blocked: a heartbeat file, and on request its stacks and flight recorder. The
launcher side (``orchestrate.diagnosis.evidence`` reads the files, ``orchestrate.diagnosis.stall``
decides and names the rank) never talks to the rank itself, so a frozen rank is noticed by its
*silence*.

Standard library only, Python 3.8+, and nothing from orchestrate: a launcher copies this file's
text verbatim as ``sitecustomize.py`` into a folder it puts first on ``PYTHONPATH``, so that it
runs inside users' ``command:`` programs without any change to them. torch is never imported
here; it is looked at only once the program itself imported ``torch.distributed``.

Activation as ``sitecustomize`` (``__name__ == "sitecustomize"``)
    When ``ORCHESTRATE_RUN_DIR`` and ``RANK`` are set and ``ORCHESTRATE_SIDECAR`` is not ``0``,
    the sidecar starts once per rank process and records its pid in ``ORCHESTRATE_SIDECAR_PID``.
    Any Python started from the rank (multiprocessing/DataLoader workers with spawn, the
    resource tracker, helper scripts) inherits that variable, sees a live process that is not
    itself, and stays off. A stale value (that process is gone) or our own pid after ``exec``
    starts it anew. Known limit: the *first* Python process of a rank owns the sidecar, so a
    Python wrapper that runs the real program as a child (``accelerate launch``) is what gets
    watched; give such jobs ``ORCHESTRATE_SIDECAR=0``. Afterwards any other ``sitecustomize``
    later on ``sys.path`` (Debian ships one) is loaded too, so we never shadow it.
    Independently of the switch, ``ORCHESTRATE_TIMEOUT_S`` bounds torch.distributed's default
    timeout (see :func:`bound_default_timeout`).

Public API (``orchestrate.train`` and tests)
    ``start(run_dir, rank, interval_s=None)`` (idempotent, also across the two copies of this
    module a trainer process may hold: the live sidecar is kept on the ``sys`` module), and
    ``phase(name, step=None)``, a couple of attribute writes, cheap enough for every step.

Files, under ``<run_dir>/diag/``
    ``hb/rank-<R>.json``: the heartbeat, replaced atomically every ``interval_s`` (default
    2.5 s, ``ORCHESTRATE_HEARTBEAT_S`` overrides)::

        {"rank": 0, "pid": 1234, "host": "node-a", "t": <time.time()>, "beat": 17,
         "interval_s": 2.5, "started": <t>, "phase": "step", "phase_since": <t>, "step": 41,
         "progress_t": <t of the last change in phase, step or any group's seq numbers>,
         "pgs": [{"pg": "0", "desc": "default_pg", "enqueued": 42, "started": -1,
                  "completed": 41, "op": "all_reduce", "op_seq": 42, "op_state": "scheduled",
                  "op_since": <t the entry was created>, "sizes": [[4]]}],
         "stack": [["/w/train.py", 88, "step"], ...],   # main thread, innermost first
         "main_cpu_s": 12.3,  # CPU seconds of the main thread (Linux), null elsewhere
         "user_stack": [...],  # its innermost frames outside the stdlib and *-packages
         "stdlib": "/usr/lib/python3.11", "fr": "ok",
         "cpu_s": 0.012}  # CPU time of the thread that wrote it (the sidecar's cost so far)

    ``pgs`` is ``null`` until ``torch.distributed`` is imported; ``fr`` says why it is empty
    (``"off"``, ``"unavailable"``, or the first error). ``op`` and the ``op_*`` fields are there
    only for a group with a collective in flight (``enqueued > completed``) that made no
    progress since the previous beat: reading them needs the whole flight recorder, which costs
    85-300 ms with its default 2,000 entries, while the group counters cost 0.1 ms.

    Phases of programs that are not our trainer (observed by the thread, no hooks): ``start``
    (the interpreter is up; torch.distributed is not imported or not initialised, and the main
    thread is not inside ``init_process_group``), ``init_process_group`` (the main thread's
    stack holds torch's ``init_process_group``: it waits for its peers at the store),
    ``running`` (``torch.distributed.is_initialized()``), ``finished`` (it was initialised and
    no longer is) and ``exit`` (the last heartbeat, written at interpreter exit). Our trainer
    sets its own: ``init_process_group``, ``setup``, ``step``, ``checkpoint``, ``eval``; once a
    program calls :func:`phase` the automatic phases stop.

    ``request``: ``{"id": "...", "t": ...}`` written by a launcher. The sidecar reads it about
    once a second; on a new id it writes ``<id>/rank-<R>.stacks.txt`` (a header naming the main
    thread, then ``faulthandler.dump_traceback(all_threads=True)``), ``rank-<R>.fr.json`` (the
    full flight-recorder dump, once torch.distributed is imported), ``rank-<R>.state.json`` (a
    fresh heartbeat, with the op of every collective in flight taken from that dump, plus
    ``"proc"``: the main thread's kernel state and wait channel from ``/proc``) and last
    ``rank-<R>.done`` (``{"id", "t", "files"}``). One collector per run dir: a second request
    written before the ranks read the first replaces it. A request older than the sidecar by
    more than a minute (an earlier run's) is ignored.

Flight recorder as measured on torch 2.13.0+cpu, gloo (``_dump_fr_trace_json(False, None)`` for
the counters only, ``(True, True)`` for entries):
    ``pg_status`` maps the group name (``"0"`` for the default group, ``"1"``, ... for
    ``new_group`` in creation order, the same on every rank) to ``last_enqueued_collective``,
    ``last_started_collective`` and ``last_completed_collective`` as *strings*; gloo never sets
    "started" (always ``"-1"``). Each entry has ``collective_seq_id`` (per group, counts from 1,
    barriers included), ``pg_id``, ``process_group`` = ``[name, desc]`` (``"default_pg"``, and
    ``"undefined"`` for a ``new_group`` without description), ``profiling_name`` (e.g.
    ``"gloo:all_reduce"``; ``dist.barrier()`` is ``"gloo:barrier"`` with no sizes),
    ``input_sizes``, ``state`` (always ``"scheduled"`` on gloo), ``retired`` (true once
    completed), ``time_created_ns``; ``frames`` is absent. ``pg_config`` is keyed ``""`` and
    useless on gloo. Before ``init_process_group`` ``pg_status`` is ``{}``, and so it stays
    with the recorder off (``TORCH_FR_BUFFER_SIZE=0``; ``fr`` is then ``"empty"``). Older torch
    without the function, or the recorder off: progress is then the phase and step (and, in a
    program without steps, the innermost frame: see ``orchestrate.diagnosis.stall``).

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
from typing import Any

ENV_RUN_DIR = "ORCHESTRATE_RUN_DIR"
ENV_SWITCH = "ORCHESTRATE_SIDECAR"
ENV_OWNER = "ORCHESTRATE_SIDECAR_PID"
ENV_INTERVAL = "ORCHESTRATE_HEARTBEAT_S"
ENV_TIMEOUT = "ORCHESTRATE_TIMEOUT_S"

# Names inside a run dir; orchestrate.core.layout holds the same names (a test keeps them equal).
DIAG_DIR = "diag"
HEARTBEAT_DIR = "hb"
REQUEST_FILE = "request"

DEFAULT_INTERVAL_S = 2.5
POLL_S = 1.0  # how often the request file is read
STALE_REQUEST_S = 60.0  # a request this much older than the sidecar is from an earlier run
STACK_DEPTH = 10  # innermost frames of the main thread kept in each heartbeat
USER_DEPTH = 6  # innermost frames outside the standard library and installed packages
_LIVE_KEY = "_orchestrate_sidecar"  # attribute of ``sys`` holding the live sidecar
_C10D = "torch.distributed.distributed_c10d"
_SAFE_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class _CannotWrite(Exception):
    """The run dir refuses our files; the sidecar reports once and stops."""


def heartbeat_name(rank: int) -> str:
    """File name of a rank's heartbeat inside ``diag/hb``."""
    return f"rank-{rank}.json"


def enabled(environ: Any) -> bool:
    """Whether the launcher wants the sidecar (``ORCHESTRATE_SIDECAR`` is not ``0``)."""
    return str(environ.get(ENV_SWITCH, "1")).strip() != "0"


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
        self._diag = os.path.join(self.run_dir, DIAG_DIR)
        self._hb_path = os.path.join(self._diag, HEARTBEAT_DIR, heartbeat_name(rank))
        self._signature: Any = None
        self._statuses: dict[str, tuple[int, int]] = {}  # pg -> (enqueued, completed) last beat
        self._ops: dict[tuple[str, int], dict[str, Any]] = {}  # (pg, seq) -> op fields
        self._fr_note = "off"
        self._was_initialised = False
        self._request_text: str | None = None
        self._stdlib = os.path.dirname(os.__file__)
        self._writing = threading.Lock()  # the last heartbeat at exit must not be overwritten

    # --- the thread ---------------------------------------------------------------------

    def launch(self) -> None:
        """Create the folders, skip a stale request, start the thread."""
        try:
            os.makedirs(os.path.dirname(self._hb_path), exist_ok=True)
        except OSError as exc:
            self._give_up(f"cannot create {os.path.dirname(self._hb_path)} ({_why(exc)})")
            return
        text = self._read_request()
        request = _parse_request(text)
        if request is not None and request[1] < self.started - STALE_REQUEST_S:
            self._request_text = text
        thread = threading.Thread(target=self._run, name="orchestrate-sidecar", daemon=True)
        self.thread = thread
        thread.start()
        atexit.register(self._at_exit)

    def _run(self) -> None:
        try:
            due = 0.0
            while not self.stopped:
                now = time.monotonic()
                if now >= due:
                    with self._writing:
                        if self.stopped:
                            break
                        self._write_heartbeat(self.heartbeat())
                    due = now + self.interval_s
                self._poll_request()
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
            self.phase, self.phase_since = "exit", time.time()
            self.explicit = True
            beat = self.heartbeat(look_up_ops=False)
            self._write_heartbeat(beat, suffix="exit")
        except Exception:
            pass
        finally:
            self._writing.release()

    # --- heartbeats ---------------------------------------------------------------------

    def heartbeat(self, look_up_ops: bool = True) -> dict[str, Any]:
        """This rank's state now, as written to its heartbeat file."""
        now = time.time()
        main = threading.main_thread()
        frame = sys._current_frames().get(main.ident or 0)
        stack, user = _frames(frame, STACK_DEPTH, USER_DEPTH, self._stdlib)
        initialised = _dist_initialised()
        if self.explicit:
            phase, since = self.phase, self.phase_since
        else:
            self._observe_phase(stack, now, initialised)
            phase, since = self.auto, self.auto_since
        self._was_initialised = self._was_initialised or initialised
        step = self.step
        pgs = self._flight_recorder(look_up_ops)
        signature = (
            phase,
            step,
            None if pgs is None else [(p["pg"], p["enqueued"], p["completed"]) for p in pgs],
        )
        if signature != self._signature:
            self._signature = signature
            self.progress_t = now
        self.beat += 1
        return {
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "t": now,
            "beat": self.beat,
            "interval_s": self.interval_s,
            "started": self.started,
            "phase": phase,
            "phase_since": since,
            "step": step,
            "progress_t": self.progress_t,
            "pgs": pgs,
            "fr": self._fr_note,
            "stack": stack,
            "main_cpu_s": _main_cpu_s(main.native_id),
            "user_stack": user,
            "stdlib": self._stdlib,
            "cpu_s": round(self.cpu_s, 6),  # the sidecar thread's CPU time: its cost, measured
        }

    def _observe_phase(self, stack: list[list[Any]], now: float, initialised: bool) -> None:
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

    def _flight_recorder(self, look_up_ops: bool = True) -> list[dict[str, Any]] | None:
        """Each process group's counters, and the op of a collective that looks stuck."""
        dump = _fr_dump_function()
        if dump is None:
            self._fr_note = "off" if "torch.distributed" not in sys.modules else "unavailable"
            return None
        try:
            status = json.loads(dump(False, None)).get("pg_status") or {}
            pgs = []
            suspects = []
            for name in sorted(status, key=_pg_order):
                fields = status[name]
                enqueued = int(fields.get("last_enqueued_collective", -1))
                completed = int(fields.get("last_completed_collective", -1))
                pg: dict[str, Any] = {
                    "pg": str(name),
                    "enqueued": enqueued,
                    "started": int(fields.get("last_started_collective", -1)),
                    "completed": completed,
                }
                unchanged = self._statuses.get(name) == (enqueued, completed)
                if enqueued > completed and unchanged and (name, enqueued) not in self._ops:
                    suspects.append((name, enqueued))
                self._statuses[name] = (enqueued, completed)
                pgs.append(pg)
            if suspects and look_up_ops:
                self._ops.update(_ops_of(json.loads(dump(True, True)), suspects))
            for pg in pgs:
                op = self._ops.get((pg["pg"], pg["enqueued"]))
                if op is not None and pg["enqueued"] > pg["completed"]:
                    pg.update(op)
            if len(self._ops) > 64:  # keep only what can still be current
                keep = {(p["pg"], p["enqueued"]) for p in pgs}
                self._ops = {k: v for k, v in self._ops.items() if k in keep}
            # After init an empty status means the recorder is off (TORCH_FR_BUFFER_SIZE=0).
            self._fr_note = "ok" if pgs or not self._was_initialised else "empty"
            return pgs
        except Exception as exc:
            self._fr_note = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            return None

    def _write_heartbeat(self, beat: dict[str, Any], suffix: str = "beat") -> None:
        try:
            _write_atomic(self._hb_path, json.dumps(beat).encode(), suffix)
        except OSError as exc:
            raise _CannotWrite(f"cannot write {self._hb_path} ({_why(exc)})") from None

    # --- dumps on request -----------------------------------------------------------------

    def _read_request(self) -> str | None:
        try:
            with open(os.path.join(self._diag, REQUEST_FILE), encoding="utf-8") as handle:
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
        self.answer(request[0])

    def answer(self, request_id: str) -> list[str]:
        """Write this rank's stacks, flight recorder and state for ``request_id``."""
        folder = os.path.join(self._diag, request_id)
        prefix = os.path.join(folder, f"rank-{self.rank}")
        written = []
        try:
            os.makedirs(folder, exist_ok=True)
            stacks = prefix + ".stacks.txt"
            with open(stacks, "w", encoding="utf-8") as handle:
                handle.write(self._stacks_header())
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
            written.append(stacks)
            state = self.heartbeat(look_up_ops=False)  # the full dump below has the ops
            dump = _fr_dump_function()
            if dump is not None:
                try:
                    raw = dump(None, None)
                except Exception as exc:
                    raw = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                _write_atomic(prefix + ".fr.json", raw, "fr")
                written.append(prefix + ".fr.json")
                _add_ops(state.get("pgs"), raw)
            state["proc"] = _thread_state(threading.main_thread())
            _write_atomic(prefix + ".state.json", json.dumps(state).encode(), "state")
            written.append(prefix + ".state.json")
            done = json.dumps({"id": request_id, "t": time.time(), "files": written})
            _write_atomic(prefix + ".done", done.encode(), "done")
        except OSError as exc:
            raise _CannotWrite(f"cannot write {folder} ({_why(exc)})") from None
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


def _parse_request(text: str | None) -> tuple[str, float] | None:
    """``(id, t)`` of a request; None when it is missing, half-written or unsafe."""
    if not text:
        return None
    try:
        data = json.loads(text)
        request_id, at = str(data["id"]), float(data.get("t", 0.0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not request_id or len(request_id) > 64 or not set(request_id) <= _SAFE_ID:
        return None
    if request_id in (".", "..", HEARTBEAT_DIR) or request_id.startswith("."):
        return None
    return request_id, at


def _frames(
    frame: Any, depth: int, user_depth: int, stdlib: str
) -> tuple[list[list[Any]], list[list[Any]]]:
    """``[file, line, function]`` of the innermost ``depth`` frames, and of the innermost
    ``user_depth`` frames that are not in the standard library or an installed package (the
    program's own code is often far out: a rank importing torch is 80 frames deep), innermost
    first. Which of those are the user's is for the reader (orchestrate.diagnosis.stall) to
    decide."""
    stack: list[list[Any]] = []
    user: list[list[Any]] = []
    while frame is not None and (len(stack) < depth or len(user) < user_depth):
        code = frame.f_code
        where = [code.co_filename, frame.f_lineno, code.co_name]
        if len(stack) < depth:
            stack.append(where)
        name = code.co_filename
        if len(user) < user_depth and not (
            name.startswith("<") or name.startswith(stdlib) or "-packages" in name
            or name == __file__
        ):
            user.append(where)
        frame = frame.f_back
    return stack, user


def _dist_initialised() -> bool:
    """``torch.distributed.is_initialized()``, without importing it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    try:
        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def _in_init_process_group(stack: list[list[Any]]) -> bool:
    for filename, _line, name in stack:
        if name == "init_process_group" and "distributed" in filename:
            return True
    return False


def _pg_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _fr_dump_function() -> Any:
    """torch's ``_dump_fr_trace_json`` once the program imported torch.distributed, else None."""
    if "torch.distributed" not in sys.modules:
        return None
    torch = sys.modules.get("torch")
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    return getattr(c10d, "_dump_fr_trace_json", None)


def _ops_of(dump: dict[str, Any], wanted: list[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    """The flight-recorder entry of each wanted ``(group, seq)``: op, state, since, sizes."""
    found: dict[tuple[str, int], Any] = {}
    want = set(wanted)
    for entry in dump.get("entries") or []:
        group = entry.get("process_group") or [entry.get("pg_id"), ""]
        key = (str(group[0]), int(entry.get("collective_seq_id", -1)))
        if key not in want or entry.get("is_p2p"):
            continue
        name = str(entry.get("profiling_name", ""))
        created = entry.get("time_created_ns") or 0
        found[key] = {
            "desc": str(group[1]) if len(group) > 1 else "",
            "op": name.split(":", 1)[-1],
            "op_seq": key[1],
            "op_state": entry.get("state"),
            "op_since": created / 1e9 if created else None,
            "sizes": entry.get("input_sizes"),
        }
    return found


def _add_ops(pgs: Any, raw: bytes) -> None:
    """Put the op of each group's collective in flight into ``pgs``, from a full dump."""
    if not pgs:
        return
    wanted = [(p["pg"], p["enqueued"]) for p in pgs if p["enqueued"] > p["completed"]]
    if not wanted:
        return
    try:
        ops = _ops_of(json.loads(raw), wanted)
    except Exception:
        return
    for pg in pgs:
        op = ops.get((pg["pg"], pg["enqueued"]))
        if op is not None:
            pg.update(op)


def _main_cpu_s(native: int | None) -> float | None:
    """CPU seconds the main thread used (Linux ``/proc``; None elsewhere): before
    ``init_process_group`` it tells a rank that imports (loading libtorch keeps one frame for
    seconds) from one that sleeps."""
    if native is None or _TICKS is None:
        return None
    try:
        with open(f"/proc/self/task/{native}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


def _clock_ticks() -> float | None:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return None


_TICKS = _clock_ticks()


def _thread_state(thread: threading.Thread) -> dict[str, Any]:
    """The kernel's view of a thread (Linux): ``R`` on CPU, ``S`` sleeping, ``D`` disk, with
    the wait channel when the kernel shows it. Python frames cannot tell sleep from I/O."""
    native = getattr(thread, "native_id", None)
    out: dict[str, Any] = {"state": None, "wchan": None}
    if native is None:
        return out
    base = f"/proc/self/task/{native}/"
    try:
        with open(base + "stat", encoding="ascii", errors="replace") as handle:
            out["state"] = handle.read().rsplit(")", 1)[1].split()[0]
        with open(base + "wchan", encoding="ascii", errors="replace") as handle:
            wchan = handle.read().strip()
            out["wchan"] = wchan if wchan and wchan != "0" else None
    except (OSError, IndexError):
        pass
    return out


# --- the public API ------------------------------------------------------------------------

_live: Sidecar | None = None


def current() -> Sidecar | None:
    """The sidecar running in this process, started by either copy of this module."""
    car = getattr(sys, _LIVE_KEY, None)
    if car is not None and getattr(car, "pid", None) == os.getpid():
        return car  # type: ignore[no-any-return]
    return None


def start(run_dir: str | os.PathLike[str], rank: int, interval_s: float | None = None) -> Any:
    """Start this process's sidecar (once; later calls return the running one)."""
    global _live
    car = current()
    if car is None:
        if interval_s is None:
            interval_s = _interval_from(os.environ)
        car = Sidecar(os.fspath(run_dir), int(rank), interval_s)
        setattr(sys, _LIVE_KEY, car)
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


# --- bounding torch.distributed's default timeout ------------------------------------------


def bound_default_timeout(seconds: float) -> None:
    """Make torch.distributed's *default* process-group timeout ``seconds``, without importing
    torch: patched right after ``torch.distributed.distributed_c10d`` is imported.

    What it bounds: every ``init_process_group``, ``new_group``/``new_subgroups`` and
    ``monitored_barrier`` called without ``timeout=`` (gloo's default is 30 min, nccl's 10 min;
    both become ``seconds``), including the env:// store rendezvous inside
    ``init_process_group``, so a peer that never arrives fails the others after ``seconds``.
    What it does not bound: an explicit ``timeout=`` wins; code outside collectives (a sleep,
    a stuck data loader, I/O) has no timeout at all; a ``TCPStore`` the program builds itself
    keeps its own; nccl enforces the timeout only through its watchdog
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default).
    """
    module: Any = sys.modules.get(_C10D)
    if module is not None:
        _patch_timeouts(module, seconds)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _PatchAfterImport):
            finder.seconds = seconds
            return
    sys.meta_path.insert(0, _PatchAfterImport(seconds))


def _patch_timeouts(module: Any, seconds: float) -> None:
    from datetime import timedelta

    value = timedelta(seconds=seconds)
    # _get_default_timeout() reads these module globals at call time.
    module.default_pg_timeout = value
    if isinstance(getattr(module, "default_pg_nccl_timeout", None), timedelta):
        module.default_pg_nccl_timeout = value
    constants: Any = sys.modules.get("torch.distributed.constants")
    if constants is not None:
        constants.default_pg_timeout = value
        if isinstance(getattr(constants, "default_pg_nccl_timeout", None), timedelta):
            constants.default_pg_nccl_timeout = value


class _PatchAfterImport:
    """A meta-path finder that wraps the loader of distributed_c10d and patches it once
    executed (before ``torch.distributed`` copies its names); costs one string compare per
    import otherwise."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _C10D or self.busy:
            return None
        self.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader, self)  # type: ignore[assignment]
        return spec


class _PatchingLoader:
    def __init__(self, inner: Any, finder: _PatchAfterImport) -> None:
        self.inner = inner
        self.finder = finder

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            _patch_timeouts(module, self.finder.seconds)
        finally:
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.inner, name)


# --- activation as sitecustomize -------------------------------------------------------------


def _owner_elsewhere(environ: Any) -> bool:
    """Whether another live process of this rank (our parent, usually) owns the sidecar."""
    raw = str(environ.get(ENV_OWNER, "")).strip()
    if not raw.isdigit() or int(raw) == os.getpid():
        return False
    try:
        os.kill(int(raw), 0)
    except ProcessLookupError:
        return False  # stale: left by a process that is gone
    except OSError:
        return True  # alive, but not ours to signal
    return True


def activate(environ: Any) -> Sidecar | None:
    """What ``sitecustomize`` does at interpreter start: bound the default timeout, then start
    the sidecar in a rank process (not in its children)."""
    timeout = str(environ.get(ENV_TIMEOUT, "")).strip()
    if timeout:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = 0.0
        if 0 < seconds < float("inf"):
            bound_default_timeout(seconds)
    run_dir = str(environ.get(ENV_RUN_DIR, "")).strip()
    rank = str(environ.get("RANK", "")).strip()
    if not run_dir or not rank.isdigit() or not enabled(environ):
        return None
    if _owner_elsewhere(environ):
        return None
    car: Sidecar | None = start(run_dir, int(rank))
    return car


def _chain_load_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` that ours hides (later on sys.path), as site.py would."""
    import importlib.machinery
    import importlib.util

    mine = os.path.realpath(__file__)
    here = os.path.dirname(mine)
    entries = []
    seen_here = False
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        if real == here:
            seen_here = True
            continue
        if seen_here:
            entries.append(entry)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", entries)
    if spec is None or spec.loader is None or not spec.origin:
        return
    if os.path.realpath(spec.origin) == mine:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(f"Error in sitecustomize {spec.origin}; {type(exc).__name__}: {exc}\n")


if __name__ == "sitecustomize":
    try:
        activate(os.environ)
    except Exception as _exc:  # a broken sidecar must never stop the program
        sys.stderr.write(f"orchestrate sidecar: not started: {type(_exc).__name__}: {_exc}\n")
    _chain_load_next_sitecustomize()
