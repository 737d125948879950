"""The program that runs beside a Slurm job's ranks, in its batch script: ``monitor.py``.

``render`` writes it into the run directory (this module's text bundled with the stdlib-only
modules it uses, :mod:`orchestrate.hostside.shipping`), and job.sbatch runs it with the first node's
python, so nothing of orchestrate need be installed on the batch host. Its modes:

``merge INDEX LOG_DIR HOSTFILE OFFSETS [READY [CAP_BYTES [RANKS]]]``
    Index the per-rank log files into the merged view while the ranks run
    (:mod:`orchestrate.hostside.outputlog`: the bytes stay in the rank files only). srun writes
    each rank's output straight to ``logs/rank-R.log``; this single writer of the parts appends
    one record per rank and pass to INDEX (``output.idx``) naming the whole lines (or
    LINE_MAX pieces of a longer one) that the file gained, so a line is never split or
    interleaved with another rank's, even on NFS, where appends from several hosts are not
    atomic; a line without its newline waits for the rest, and memory stays a block per file
    whatever the ranks print. Each run first declares each rank's host (the ``[host:rank]``
    prefix). SIGTERM means: one last pass, then exit. How far each rank file is indexed is kept
    in OFFSETS (after every pass): a requeued job appends to the same rank files, and its next
    run goes on from there, so no line is shown twice and none is lost. READY is created once
    SIGTERM is handled, so the batch script never stops the merger before its last pass.
    CAP_BYTES (``logs.max_mb_per_rank``; 0: none): the ranks' shells stop writing a rank's
    output past it; the merger says so in the view when a rank's file reaches it. RANKS
    (``0,3``: a per-node launcher's tasks, one per HOSTFILE line) names the rank file each
    task writes.

``mark RUN_DIR CHECKPOINT_DIR MARKER``
    Before the step: record how far training got
    (:func:`orchestrate.core.plan.restart.progress_marker`), so that ``decide`` can tell whether
    this run moved it on.

``watch RUN_DIR HOSTFILE STALLED INDEX SETTINGS``
    While the step runs: the stall watch (:mod:`orchestrate.diagnosis.hangwatch`) over the run
    directory, which every node shares, with the ranks named by their hosts (HOSTFILE, one line per
    rank, or per node with ``rank_nodes``), and the world check (:mod:`orchestrate.diagnosis.world`:
    a process group that is not the plan's is stopped like a stall under ``on_wrong_world:
    kill``, and ends the run as ``wrong world: ...``, never a stall that a restart retries).
    SETTINGS is JSON: ``stall_s``, ``busy_s``, ``heartbeat_s``, ``on_stall``, ``interface``,
    ``world_size``, ``launcher``, ``on_wrong_world``, ``rank_nodes``, ``timeout_s``; the master is
    MASTER_ADDR:MASTER_PORT from the environment. A rank lives until its task records its end
    in ``ORCHESTRATE_EXIT_DIR`` (what ``decide`` reads): one whose program ended but whose
    process lives on is named as hung in its teardown. A stall is noted in the merged view and
    kept in ``diag/diagnosis.json`` (a stall held off by busy ranks is noted too); with
    ``on_stall: kill`` the diagnosis is also written to STALLED and the step is cancelled (``scancel
    JOB.STEP``: SIGCONT, SIGTERM, SIGKILL after Slurm's KillWait), so ``decide`` ends the run as
    a stall. Ranks hung in their exit are stopped so under ``on_stall: report`` too, once
    ``timeout_s`` + 30 s passed since they were named (:mod:`orchestrate.run.linger`). SIGTERM
    (the step ended) ends the watch after one last world check: a wrong world found then is
    written to STALLED too, so the run never ends COMPLETED.


``decide INDEX EXIT_DIR REQUEUES POLICY RUN_DIR MARKER CHECKPOINT_DIR EXPECTS [STALLED]``
    After the step: read how each rank ended (``EXIT_DIR/rank-R``: status, time in
    microseconds, host, written by each rank's shell), name the first failure in the merged view
    with the same rule every backend uses (:func:`orchestrate.core.plan.outcome.first_failure`,
    which reads each failed rank's last log lines: the rank that explains the failure is named),
    apply the job's restart policy (POLICY, JSON; :func:`orchestrate.core.plan.restart.decide`, the
    same
    decision the local and SSH supervisors make; REQUEUES is how often this Slurm job was
    restarted, requeued or in its allocation),
    and
    print the verdict for the batch script, one line: ``COMPLETED``, ``RESTART`` (a new step
    in this allocation: a rank failed or stalled, no node to avoid), ``REQUEUE`` (``scontrol
    requeue``: the ranks asked to resume, or a node is to be avoided), ``FAILED`` or
    ``NONE`` (no rank recorded anything), the exit status the batch script should end with, the
    seconds to wait before the next run, and the nodes to exclude (``-`` for none); the reason
    goes into the merged view and into ``REASON`` beside EXIT_DIR.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import orchestrate.backends.slurm.healthstep as healthstep
from orchestrate.core.exits import EXIT_FAILED
from orchestrate.core.layout import LOG_DIR
from orchestrate.core.plan.outcome import Exit, RankEnd, first_failure
from orchestrate.core.plan.restart import Policy, decide, ending_of, progress_marker, progressed
from orchestrate.core.plan.workers import REPORT_LINES, worker_end
from orchestrate.diagnosis.hangwatch import HangWatch, RunDirEvidence, handle_owners, living
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.diagnosis.world import KIND as WRONG_WORLD
from orchestrate.hostside.outputlog import Index, append_note, cut
from orchestrate.run.linger import Linger, linger_s

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MB = 1 << 20  # the cap's unit (logs.max_mb_per_rank), as orchestrate.run.logsink counts it
# ------------------------------------------------------------------------------ merge


class _Wake(Exception):
    pass


def merge(index: str, log_dir: str, hostfile: str, offsets_file: str,
          ready: str | None = None, cap_bytes: int = 0, labels: list[int] | None = None) -> int:
    """Index the rank logs into the merged view until SIGTERM (see the module docstring).
    ``labels`` are the ranks whose files the tasks write, one per HOSTFILE line (a per-node
    launcher's task writes its node's first rank's file); by default 0, 1, ... per line."""
    with open(hostfile, encoding="utf-8") as listing:
        hosts = [line.strip() for line in listing if line.strip()]
    names = labels if labels else list(range(len(hosts)))
    ranks = _RankFiles([os.path.join(log_dir, f"rank-{r}.log") for r in names],
                       _load_offsets(offsets_file, len(hosts)), cap_bytes, names)
    state = {"stop": False, "sleeping": False}

    def on_signal(*_: Any) -> None:
        state["stop"] = True
        if state["sleeping"]:  # cut the sleep short: the job is over, index the rest now
            raise _Wake

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if ready:
        with open(ready, "w"):
            pass
    out = Index(index)
    folder = os.path.dirname(os.path.abspath(index))
    for i, host in enumerate(hosts):  # this run's hosts: a requeued job may run elsewhere
        out.declare(names[i], os.path.relpath(os.path.abspath(ranks.paths[i]), folder), host)
    idle = 0.05
    while True:
        last = state["stop"]
        if ranks.index_new(out, last):
            _save_offsets(offsets_file, ranks.offsets)
            idle = 0.05
        else:
            idle = min(idle * 1.5, 0.5)
        if last:
            out.close()
            return 0
        try:
            state["sleeping"] = True
            if not state["stop"]:
                time.sleep(idle)
        except _Wake:
            pass
        finally:
            state["sleeping"] = False


class _RankFiles:
    """The rank log files being indexed: how far each is in the merged view."""

    def __init__(self, paths: list[str], offsets: list[int], cap_bytes: int,
                 labels: list[int] | None = None) -> None:
        self.paths = paths
        # The rank each file is declared as in the view.
        self.labels = labels if labels is not None else list(range(len(paths)))
        self.offsets = offsets
        self.started = list(offsets)  # where this run's output begins in each file
        self.cap_bytes = cap_bytes
        self.capped: set[int] = set()

    def index_new(self, out: Index, last: bool) -> bool:
        """Record what each file gained: whole lines (or LINE_MAX pieces of a longer one); on
        the ``last`` pass every byte. Whether anything was recorded."""
        wrote = False
        for r, path in enumerate(self.paths):
            size = _size(path)
            if size < self.offsets[r]:  # truncated by someone: start again
                self.offsets[r] = self.started[r] = 0
            # Nothing new (a rank that has not written yet has no file): nothing to cut.
            end = self.offsets[r] if size == self.offsets[r] else \
                size if last else cut(path, self.offsets[r], size)
            if end > self.offsets[r]:
                out.part(self.labels[r], self.offsets[r], end - self.offsets[r])
                self.offsets[r] = end
                wrote = True
            if self.cap_bytes and r not in self.capped and \
                    self.offsets[r] - self.started[r] >= self.cap_bytes:
                self.capped.add(r)
                out.note(f"rank {self.labels[r]} reached logs.max_mb_per_rank "
                         f"({self.cap_bytes / MB:g} MB): the rest of its output in this run is "
                         "dropped")
        return wrote


def _load_offsets(path: str, count: int) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            saved = [int(x) for x in json.load(f)]
    except (OSError, ValueError, TypeError):
        saved = []
    return (saved + [0] * count)[:count]


def _save_offsets(path: str, offsets: list[int]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(offsets, f)
    os.replace(path + ".tmp", path)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


# ------------------------------------------------------------------------------ decide


def rank_ends(exit_dir: str) -> list[RankEnd]:
    """How each rank of one run ended, from the files its shell wrote (unreadable ones are
    skipped: a rank killed with its node wrote nothing)."""
    ends: list[RankEnd] = []
    try:
        names = os.listdir(exit_dir)
    except OSError:
        return ends
    for name in names:
        if not name.startswith("rank-"):
            continue
        try:
            rank = int(name[len("rank-"):])
            with open(os.path.join(exit_dir, name), encoding="utf-8") as f:
                status, at_us, host = f.read().split()[:3]
            ends.append(RankEnd(rank, host, Exit.from_status(int(status)), int(at_us) / 1e6))
        except (OSError, ValueError):
            continue
    return ends


def _worker_end(end: RankEnd, run_dir: str) -> RankEnd:
    """Under a launcher that starts workers (``ORCHESTRATE_LAUNCHER``: per_node, torchrun), a
    node's task ends as the worker its launcher's report names as failed (its log's last lines:
    :func:`orchestrate.core.plan.workers.worker_end`)."""
    if os.environ.get("ORCHESTRATE_LAUNCHER", "ranks") == "ranks" or end.exit.ok:
        return end
    return worker_end(end, _last_lines(run_dir, end.rank, REPORT_LINES))


def _last_lines(run_dir: str, rank: int, count: int = 10) -> list[str]:
    """A rank's last log lines ([] when it has no log)."""
    try:
        with open(os.path.join(run_dir, LOG_DIR, f"rank-{rank}.log"), encoding="utf-8",
                  errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=count)]
    except OSError:
        return []


class StepVerdict:
    """What the batch script does after the step."""

    def __init__(self, verdict: str, status: int, reason: str = "", wait_s: float = 0.0,
                 exclude: tuple[str, ...] = ()) -> None:
        self.verdict = verdict
        self.status = status
        self.reason = reason
        self.wait_s = wait_s
        self.exclude = exclude

    def line(self) -> str:
        return f"{self.verdict} {self.status} {self.wait_s:g} {','.join(self.exclude) or '-'}"


def mark(run_dir: str, checkpoint_dir: str, marker: str) -> None:
    """Record training's progress before a run (see the module docstring)."""
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(progress_marker(run_dir, checkpoint_dir or None), f)


def verdict_of(merged: str, exit_dir: str, requeues: int, policy: Policy, run_dir: str,
               marker: str, checkpoint_dir: str, expects_markers: bool, stalled: str = ""
               ) -> StepVerdict:
    """The verdict on one run of the step (see the module docstring), noted in the log.
    ``stalled`` is the file the stall watch wrote if it stopped the step."""
    logged = {}  # a failed worker's rank -> the rank whose log its node's task wrote
    ends = []
    for end in rank_ends(exit_dir):
        ends.append(_worker_end(end, run_dir))
        logged[ends[-1].rank] = end.rank
    stall = healthstep.read_object(stalled) if stalled else None
    if not ends and stall is None:
        return StepVerdict("NONE", 0)
    first = first_failure(ends, lambda rank: _last_lines(run_dir, logged.get(rank, rank)))
    if first is None and stall is None:
        return StepVerdict("COMPLETED", 0)
    failed = [end.exit for end in ends if not end.exit.ok]
    if stall is not None:
        nodes = stall.get("nodes") or []
        wrong = stall.get("kind") == WRONG_WORLD  # not a stall: no restart.on: [stall]
        sentence = f"{'wrong world' if wrong else 'stalled'}: {stall.get('summary')}"
        ending = ending_of(failed, first.exit if first else None,
                           nodes[0] if len(nodes) == 1 else None, sentence, stalled=not wrong)
    else:
        assert first is not None
        sentence = f"rank {first.rank} on {first.node} failed with {first.exit.describe()}"
        ending = ending_of(failed, first.exit, first.node, sentence)
    try:
        with open(marker, encoding="utf-8") as f:
            before = json.load(f)
    except (OSError, ValueError):
        before = {}
    after = progress_marker(run_dir, checkpoint_dir or None)
    decision = decide(policy, ending, requeues, progressed(before, after, expects_markers))
    if ending.kind == "requeue" and first is not None:
        sentence = (f"rank {first.rank} on {first.node} checkpointed and asks to resume "
                    f"(exit {first.exit.code})")
    # A rank's failure or a stall leaves the allocation as it was: the next run is a new step
    # of the same job (seconds), unless a node is to be avoided. A requeue (the stop signal
    # before the time limit, a preemption) needs a new allocation from the queue.
    here = decision.restart and ending.kind != "requeue" and not decision.exclude
    how = "restarting in the allocation" if here else "requeuing"
    reason = f"{sentence}: {how}, {decision.why}" if decision.restart else \
        f"{sentence}; {decision.why}"
    _note(merged, reason if decision.restart or stall is not None else
          f"{reason}; the other ranks were stopped")
    _write(os.path.join(exit_dir, "REASON"), reason)
    status = (first.exit.status if first is not None else 0) or EXIT_FAILED
    if decision.restart:
        return StepVerdict("RESTART" if here else "REQUEUE", status, reason, decision.wait_s,
                           decision.exclude)
    return StepVerdict("FAILED", status, reason)


# ------------------------------------------------------------------------------ watch


def watch(run_dir: str, hostfile: str, stalled: str, merged: str, settings: dict[str, Any]
          ) -> int:
    """The stall watch beside the step (see the module docstring)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with open(hostfile, encoding="utf-8") as f:
        hosts = [line.strip() for line in f if line.strip()]
    nodes = dict(enumerate(hosts))
    if settings.get("rank_nodes"):  # a line per node (per_node, torchrun): each rank's node
        nodes = {rank: hosts[i] for rank, i in enumerate(settings["rank_nodes"])}
    master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    attempt = os.environ.get("ORCHESTRATE_ATTEMPT", "1")
    evidence = RunDirEvidence(Path(run_dir), sorted(nodes), int(attempt or 1))
    world = settings.get("world_size")
    owners = handle_owners(nodes, per_node=bool(settings.get("rank_nodes")))
    hang = HangWatch(Path(run_dir), evidence, nodes, master,
                     stall_s=float(settings["stall_s"]),
                     heartbeat_s=float(settings["heartbeat_s"]),
                     interface=settings.get("interface"),
                     world_size=None if world is None else int(world),
                     launcher=str(settings.get("launcher", "ranks")),
                     busy_s=settings.get("busy_s"), notify=lambda text: _note(merged, text))
    linger = Linger(linger_s(float(settings.get("timeout_s", 600.0))))
    hung: Diagnosis | None = None  # ranks hung in their exit, named under on_stall: report
    while not stop:
        due = time.monotonic() + hang.interval_s
        while not stop and time.monotonic() < due:  # a handled SIGTERM does not cut a sleep
            time.sleep(0.1)
        if stop:
            break
        if hung is not None and (overdue := linger.overdue(time.monotonic(), hung.ranks)):
            _write(stalled, json.dumps(hung.to_json()))
            _note(merged, f"{overdue.reason}; stopping them")
            _cancel_step()
            return 0
        try:
            diagnosis = hang.look(tasks_living(os.environ.get("ORCHESTRATE_EXIT_DIR"), owners))
        except Exception as exc:  # never the job's end: say it, keep watching
            _note(merged, f"stall watch: {type(exc).__name__}: {exc}")
            continue
        if diagnosis is None:
            continue
        wrong = diagnosis.kind == WRONG_WORLD
        said, knob = ("wrong world", "on_wrong_world") if wrong else ("stalled", "on_stall")
        if settings.get(knob, "kill" if wrong else "report") != "kill":
            then = linger.named(diagnosis.kind, time.monotonic())  # hung in their exit: later
            if then is not None:
                hung = diagnosis
            else:
                then = f"distributed.{knob}: report: the job goes on"
            _note(merged, f"{said}: {diagnosis.summary} ({then})")
            continue
        _write(stalled, json.dumps(diagnosis.to_json()))
        _note(merged, f"{said}: {diagnosis.summary}; stopping every rank "
                      f"(distributed.{knob}: kill)")
        _cancel_step()
        return 0
    _last_look(hang, stalled, merged, settings)
    return 0


def tasks_living(exit_dir: str | None, owners: Mapping[int, int]) -> dict[int, bool] | None:
    """Whether each rank's process runs: its task (``owners``:
    :func:`~orchestrate.diagnosis.hangwatch.handle_owners`) has not recorded its end in
    ``exit_dir``. None without the folder: every rank then counts as living."""
    if not exit_dir:
        return None
    ended = {end.rank for end in rank_ends(exit_dir)}
    return living(owners, set(owners.values()) - ended)


def _last_look(hang: HangWatch, stalled: str, merged: str, settings: dict[str, Any]) -> None:
    """The step has ended: one more world check, so that ranks whose worlds came and went
    between two looks (or that re-initialised one just before the end) never end COMPLETED."""
    try:
        found = hang.world_check()
    except Exception as exc:
        _note(merged, f"world check: {type(exc).__name__}: {exc}")
        return
    if found is None:
        return
    if settings.get("on_wrong_world", "kill") != "kill":
        _note(merged, f"wrong world: {found.summary} (distributed.on_wrong_world: report: the "
                      "job goes on)")
        return
    _write(stalled, json.dumps(found.to_json()))
    _note(merged, f"wrong world: {found.summary}; the job fails (distributed.on_wrong_world: "
                  "kill)")


def _cancel_step() -> None:
    """Cancel this job's running step(s), not the batch script: it judges the run after."""
    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"],
                                capture_output=True, text=True, timeout=30).stdout.split()
        steps = [s for s in listed if s.partition(".")[2].isdigit()]
        if steps:
            subprocess.run(["scancel", *steps], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pass


def _note(index: str, text: str) -> None:
    append_note(index, text)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["merge"] and len(argv) in (5, 6, 7, 8):
        ready = argv[5] if len(argv) > 5 else None
        cap = int(argv[6]) if len(argv) > 6 else 0
        labels = [int(r) for r in argv[7].split(",")] if len(argv) > 7 else None
        return merge(argv[1], argv[2], argv[3], argv[4], ready, cap, labels)
    if argv[:1] == ["mark"] and len(argv) == 4:
        mark(argv[1], argv[2], argv[3])
        return 0
    if argv[:1] == ["decide"] and argv[-1] == "per_node":  # the launcher is in the environment
        argv = argv[:-1]  # (ORCHESTRATE_LAUNCHER); job.sbatch says it for per-node launchers
    if argv[:1] == ["decide"] and len(argv) in (9, 10):
        policy = Policy.from_json(json.loads(argv[4]))
        verdict = verdict_of(argv[1], argv[2], int(argv[3]), policy, argv[5], argv[6],
                             argv[7], argv[8] == "1", argv[9] if len(argv) == 10 else "")
        print(verdict.line())
        return 0
    if argv[:1] == ["watch"] and len(argv) == 6:
        return watch(argv[1], argv[2], argv[3], argv[4], json.loads(argv[5]))
    if argv[:1] == ["health-gather"] and len(argv) == 2:
        return healthstep.gather_node(argv[1])
    if argv[:1] == ["health"] and len(argv) >= 8:
        print(healthstep.check(argv[1], argv[2], argv[3], int(argv[4]),
                               Policy.from_json(json.loads(argv[5])), argv[6] == "1", argv[7:]))
        return 0
    print("usage: monitor.py merge INDEX LOG_DIR HOSTFILE OFFSETS [READY [CAP_BYTES]]\n"
          "       monitor.py mark RUN_DIR CHECKPOINT_DIR MARKER\n"
          "       monitor.py decide INDEX EXIT_DIR REQUEUES POLICY RUN_DIR MARKER "
          "CHECKPOINT_DIR EXPECTS [STALLED]\n"
          "       monitor.py watch RUN_DIR HOSTFILE STALLED INDEX SETTINGS\n"
          "       monitor.py health-gather DIR\n"
          "       monitor.py health INDEX DIR EXIT_DIR RESTARTS POLICY PINNED HOST...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
