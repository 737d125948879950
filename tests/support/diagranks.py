"""Real ranks with the sidecar as ``sitecustomize``, and a small driver that plays the launcher.

Each rank is a real process talking gloo over loopback; its only link to orchestrate is a folder
on ``PYTHONPATH`` holding the sidecar folder (``sitecustomize.py`` and ``_orchestrate_rank/``,
orchestrate/diagnosis/rankpackage.py), as a launcher installs it. The driver polls heartbeats
into :class:`StallWatch`, and on a stall collects every rank's dump and classifies it, exactly
as a launcher's loop does. Every process a test started is killed when it ends (a stopped one
gets SIGCONT first).

``DIAG_CAPTURE=<folder>`` makes the driver also write what it saw (heartbeat trace, answers,
stall, diagnosis) as a JSON fixture for the pure tests (tests/diagnosis/captures/).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.diagnosis import evidence
from orchestrate.diagnosis.diagfiles import Frame, GroupState, Heartbeat
from orchestrate.diagnosis.evidence import Collection
from orchestrate.diagnosis.hangwatch import held_off
from orchestrate.diagnosis.kernelstate import KernelState
from orchestrate.diagnosis.rankpackage import folder as sidecar_folder
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.diagnosis.stallrule import Stall, StallWatch
from tests.support.ranks import free_port

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "diagnosis" / "programs"
DIGITS = REPO / "examples" / "digits"

_PLACE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "ORCHESTRATE_RUN_DIR", "ORCHESTRATE_SIDECAR_PID", "ORCHESTRATE_SIDECAR",
          "ORCHESTRATE_TIMEOUT_S", "ORCHESTRATE_HEARTBEAT_S", "PYTHONPATH")


def install_site(folder: Path) -> Path:
    """The sidecar folder (``sitecustomize.py`` and its private package), as a launcher
    makes it."""
    for name, text in sidecar_folder().items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


@dataclass
class Job:
    """The ranks of one run."""

    run_dir: Path
    marks: Path
    port: int
    procs: dict[int, subprocess.Popen[bytes]]
    logs: dict[int, Path]
    stopped: set[int] = field(default_factory=set)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.procs)

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> dict[int, bool]:
        return {rank: proc.poll() is None for rank, proc in self.procs.items()}

    def stop(self, rank: int) -> None:
        self.stopped.add(rank)
        self.procs[rank].send_signal(signal.SIGSTOP)

    def wait_mark(self, name: str, timeout: float = 90.0) -> float:
        """Time written in ``marks/name`` by a rank; fails if it does not come."""
        path = self.marks / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return float(path.read_text())
            if not any(self.alive().values()):
                break
            time.sleep(0.05)
        raise AssertionError(f"no mark {name!r} after {timeout} s\n{self.output()}")

    def wait(self, timeout: float) -> dict[int, int]:
        """Exit statuses; kills everything and fails if they take longer."""
        deadline = time.monotonic() + timeout
        while any(self.alive().values()):
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"ranks still running after {timeout} s\n{self.output()}")
            time.sleep(0.05)
        return {rank: int(proc.returncode) for rank, proc in self.procs.items()}

    def kill(self) -> None:
        for rank in sorted(self.stopped):
            if self.procs[rank].poll() is None:
                self.procs[rank].send_signal(signal.SIGCONT)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            # What a rank forked (DataLoader workers stuck in a test's hung read) is in its
            # session: without this it outlived the test.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def output(self) -> str:
        return "\n".join(
            f"--- rank {rank} (exit {self.procs[rank].poll()}):\n"
            + path.read_text(errors="replace")[-3000:]
            for rank, path in sorted(self.logs.items())
        )


class Starter:
    """Starts jobs for a test and remembers them so that none outlives it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.site = install_site(tmp / "site")
        self.jobs: list[Job] = []

    def start(
        self,
        argv: list[str],
        world: int,
        *,
        name: str = "run",
        env: dict[str, str] | None = None,
        per_rank: dict[int, dict[str, str]] | None = None,
        cwd: Path | None = None,
        python_path: list[Path] | None = None,
        heartbeat_s: float = 0.3,
        site: bool = True,
    ) -> Job:
        run_dir = self.tmp / name
        marks = self.tmp / f"{name}-marks"
        run_dir.mkdir(parents=True)
        marks.mkdir()
        port = free_port()
        procs: dict[int, subprocess.Popen[bytes]] = {}
        logs: dict[int, Path] = {}
        for rank in range(world):
            rank_env = {k: v for k, v in os.environ.items() if k not in _PLACE}
            paths = ([self.site] if site else []) + list(python_path or [])
            rank_env.update(
                PYTHONPATH=os.pathsep.join(str(p) for p in paths),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                ORCHESTRATE_RUN_DIR=str(run_dir), ORCHESTRATE_HEARTBEAT_S=str(heartbeat_s),
                ORCHESTRATE_TIMEOUT_S="150", MARKS=str(marks),
            )
            rank_env.update(env or {})
            rank_env.update((per_rank or {}).get(rank, {}))
            log = run_dir / f"rank-{rank}.log"
            with open(log, "wb") as out:
                procs[rank] = subprocess.Popen(  # a session each: kill() ends its children too
                    argv, cwd=cwd or self.tmp, env=rank_env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            logs[rank] = log
        job = Job(run_dir, marks, port, procs, logs)
        self.jobs.append(job)
        return job

    def program(self, scenario: str, world: int = 3, **kwargs: Any) -> Job:
        """``programs/steps.py`` in a scenario (see its docstring)."""
        env = {"SCENARIO": scenario}
        env.update(kwargs.pop("env", {}))
        return self.start(
            [sys.executable, str(PROGRAMS / "steps.py")], world, env=env, name=scenario, **kwargs
        )

    def kill_all(self) -> None:
        for job in self.jobs:
            job.kill()


@dataclass
class Outcome:
    """What the driver saw."""

    stall: Stall | None
    diagnosis: Diagnosis | None
    at: float | None  # wall time of the diagnosis
    observed_s: float  # how long the driver watched
    exit_codes: dict[int, int | None]


def _compact(beat: Heartbeat | None) -> list[Any] | None:
    """What StallWatch reads of a heartbeat, as one short row (a capture's trace):
    ``[pid, beat, phase, step, innermost frame, [[pg, enqueued, completed], ...], main cpu,
    rank clock, main thread's kernel state]`` (captures before the kernel state have only the
    first seven)."""
    if beat is None:
        return None
    return [
        beat.pid, beat.beat, beat.phase, beat.step,
        beat.stack[0].to_json() if beat.stack else None,
        [[p.pg, p.enqueued, p.completed] for p in beat.pgs or ()],
        beat.main_cpu_s, beat.t, None if beat.proc is None else beat.proc.to_json(),
    ]


def expand(row: list[Any] | None) -> Heartbeat | None:
    """A trace row back into the heartbeat fields StallWatch reads."""
    if row is None:
        return None
    pid, beat, phase, step, frame, pgs, cpu = row[:7]
    t, proc = (row[7], row[8]) if len(row) > 7 else (None, None)
    innermost = Frame.from_json(frame) if frame else None
    return Heartbeat(
        pid=pid, beat=beat, phase=phase, step=step, main_cpu_s=cpu, t=t,
        stack=() if innermost is None else (innermost,),
        pgs=tuple(GroupState(pg, enq, -1, comp) for pg, enq, comp in pgs),
        proc=KernelState.from_json(proc),
    )


def drive(
    job: Job,
    *,
    stall_s: float,
    heartbeat_s: float,
    deadline_s: float,
    nodes: dict[int, str] | None = None,
    poll_s: float = 0.25,
    capture: str | None = None,
    busy_s: float | None = None,
    holds: list[str] | None = None,
) -> Outcome:
    """Play the launcher: watch until a stall is diagnosed, every rank exits, or the deadline.
    ``holds`` gets the notice of each stall busy ranks held off (as the supervisor's log)."""
    watch = StallWatch(stall_s, heartbeat_s, busy_s=busy_s)
    nodes = nodes or {rank: "local" for rank in job.ranks}
    started = time.monotonic()
    trace: list[Any] = []
    while time.monotonic() - started < deadline_s:
        alive = job.alive()
        now = time.time()
        beats = evidence.read_heartbeats(job.run_dir, job.ranks)
        if capture:
            trace.append([now, {r: _compact(b) for r, b in beats.items()}, alive])
        stall = watch.observe(now, beats, alive)
        hold = watch.take_hold()
        if hold is not None and holds is not None:
            holds.append(held_off(hold, beats, nodes))
        if stall is not None:
            collected = evidence.collect(job.run_dir, job.ranks, timeout_s=4.0)
            diagnosis = evidence.diagnose(
                job.run_dir, job.ranks, nodes=nodes, master=job.master, interface="lo",
                stall=stall, alive=job.alive(), collected=collected,
            )
            at = diagnosis.at
            beats = evidence.read_heartbeats(job.run_dir, job.ranks)
            if capture:
                _save_capture(capture, job, trace, beats, collected, stall, diagnosis, at, nodes,
                              watch)
            return Outcome(stall, diagnosis, at, time.monotonic() - started,
                           {r: p.poll() for r, p in job.procs.items()})
        if not any(alive.values()):
            break
        time.sleep(poll_s)
    return Outcome(None, None, None, time.monotonic() - started,
                   {r: p.poll() for r, p in job.procs.items()})


def _save_capture(
    name: str, job: Job, trace: list[Any], beats: dict[int, Heartbeat | None],
    collected: Collection, stall: Stall, diagnosis: Diagnosis, at: float,
    nodes: dict[int, str], watch: StallWatch,
) -> None:
    folder = os.environ.get("DIAG_CAPTURE")
    if not folder:
        return
    record = {
        "source": f"tests/diagnosis real run ({name}), torch "
                  f"{__import__('torch').__version__}, Python {sys.version.split()[0]}",
        "stall_s": watch.stall_s, "heartbeat_s": watch.heartbeat_s, "busy_s": watch.busy_s,
        "master": job.master, "nodes": nodes, "now": at,
        "heartbeats": {r: None if b is None else b.to_json() for r, b in beats.items()},
        "dumps": collected.to_json()["ranks"],
        "stall": stall.to_json(),
        "diagnosis": diagnosis.to_json(),
        "trace": "TRACE",
    }
    rows = ",\n".join(json.dumps(entry, separators=(",", ":")) for entry in trace)
    text = json.dumps(record, indent=1, sort_keys=True).replace('"TRACE"', f"[\n{rows}\n]")
    text = text.replace(str(job.run_dir), "/RUN").replace(str(REPO), "/REPO")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.json").write_text(text + "\n")
