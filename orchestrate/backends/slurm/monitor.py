"""The program that runs beside a Slurm job's ranks, in its batch script: ``monitor.py``.

``render`` writes it into the run directory (this module's text bundled with the stdlib-only
modules it uses, :mod:`orchestrate.hostside.shipping`), and job.sbatch runs it with the first node's
python, so nothing of orchestrate need be installed on the batch host. Its modes:

``merge MERGED LOG_DIR HOSTFILE OFFSETS [READY]``
    Merge the per-rank log files into one log with ``[host:rank]`` prefixes while the ranks run.
    srun writes each rank's output straight to ``logs/rank-R.log``; this single writer appends
    every complete line to ``output.log``, so a line is never split or interleaved with another
    rank's, even on NFS, where appends from several hosts are not atomic. A line without its
    newline waits for the rest. SIGTERM means: one last pass, then exit. How far each rank file
    has been merged is kept in OFFSETS (after every write): a requeued job appends to the same
    rank files, and its next run goes on from there, so no line is merged twice and none is
    lost. READY is created once SIGTERM is handled, so the batch script never stops the merger
    before it can do its last pass.

``mark RUN_DIR CHECKPOINT_DIR MARKER``
    Before the step: record how far training got
    (:func:`orchestrate.core.plan.restart.progress_marker`), so that ``decide`` can tell whether
    this run moved it on.

``watch RUN_DIR HOSTFILE STALLED MERGED SETTINGS``
    While the step runs: the stall watch (:mod:`orchestrate.diagnosis.hangwatch`) over the run
    directory, which every node shares, with the ranks named by their hosts (HOSTFILE, one line per
    rank, or per node with ``rank_nodes``), and the world check (:mod:`orchestrate.diagnosis.world`:
    a process group that is not the plan's is stopped like a stall under ``on_wrong_world:
    kill``, and ends the run as ``wrong world: ...``, never a stall that a restart retries).
    SETTINGS is JSON: ``stall_s``, ``busy_s``, ``heartbeat_s``, ``on_stall``, ``interface``,
    ``world_size``, ``launcher``, ``on_wrong_world``, ``rank_nodes``; the master is
    MASTER_ADDR:MASTER_PORT from the environment. A stall is noted in the merged log and kept in
    ``diag/diagnosis.json`` (a stall held off by busy ranks is noted too); with ``on_stall:
    kill`` the diagnosis is also written to STALLED and the step is cancelled (``scancel
    JOB.STEP``: SIGCONT, SIGTERM, SIGKILL after Slurm's KillWait), so ``decide`` ends the run as
    a stall. SIGTERM ends the watch.

``decide MERGED EXIT_DIR REQUEUES POLICY RUN_DIR MARKER CHECKPOINT_DIR EXPECTS [STALLED]``
    After the step: read how each rank ended (``EXIT_DIR/rank-R``: status, time in
    microseconds, host, written by each rank's shell), name the first failure in the merged log
    with the same rule every backend uses (:func:`orchestrate.core.plan.outcome.first_failure`),
    apply the job's restart policy (POLICY, JSON; :func:`orchestrate.core.plan.restart.decide`, the
    same
    decision the local and SSH supervisors make; REQUEUES is how often Slurm restarted this job),
    and
    print the verdict for the batch script, one line: ``COMPLETED``, ``REQUEUE``, ``FAILED`` or
    ``NONE`` (no rank recorded anything), the exit status the batch script should end with, the
    seconds to wait before the next run, and the nodes to exclude (``-`` for none); the reason
    goes into the merged log and into ``REASON`` beside EXIT_DIR.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from orchestrate.core.exits import EXIT_FAILED
from orchestrate.core.layout import LOG_DIR
from orchestrate.core.plan.outcome import Exit, RankEnd, first_failure
from orchestrate.core.plan.restart import Policy, decide, ending_of, progress_marker, progressed
from orchestrate.core.plan.workers import REPORT_LINES, worker_end
from orchestrate.diagnosis.hangwatch import HangWatch, RunDirEvidence
from orchestrate.diagnosis.world import KIND as WRONG_WORLD

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

LONGEST = 1 << 16  # a "line" this long without a newline is written as it is


# ------------------------------------------------------------------------------ merge


class _Wake(Exception):
    pass


def merge(merged: str, log_dir: str, hostfile: str, offsets_file: str,
          ready: str | None = None) -> int:
    """Merge rank logs into ``merged`` until SIGTERM (see the module docstring)."""
    with open(hostfile, encoding="utf-8") as listing:
        hosts = [line.strip() for line in listing if line.strip()]
    ranks = _RankFiles(
        [os.path.join(log_dir, f"rank-{r}.log") for r in range(len(hosts))],
        [f"[{host}:{r}] ".encode() for r, host in enumerate(hosts)],
        _load_offsets(offsets_file, len(hosts)),
    )
    state = {"stop": False, "sleeping": False}

    def on_signal(*_: Any) -> None:
        state["stop"] = True
        if state["sleeping"]:  # cut the sleep short: the job is over, write the rest now
            raise _Wake

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if ready:
        with open(ready, "w"):
            pass
    out = open(merged, "ab")  # noqa: SIM115 - held for the whole run, closed on the last pass
    idle = 0.05
    while True:
        last = state["stop"]
        lines = ranks.new_lines(last)
        if lines:
            out.write(b"".join(lines))
            out.flush()
            _save_offsets(offsets_file, ranks.merged(last))
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
    """The rank log files being merged: how far each has been read, and the line each one has
    begun but not ended yet."""

    def __init__(self, paths: list[str], prefixes: list[bytes], offsets: list[int]) -> None:
        self.paths = paths
        self.prefixes = prefixes
        self.offsets = offsets
        self.partial = [b""] * len(paths)

    def new_lines(self, last: bool) -> list[bytes]:
        """Every complete line written since the last call, prefixed; on the ``last`` pass the
        begun lines too."""
        lines: list[bytes] = []
        for r in range(len(self.paths)):
            lines.extend(self.prefixes[r] + piece + b"\n" for piece in self._read(r))
        if last:
            lines.extend(self.prefixes[r] + rest + b"\n"
                         for r, rest in enumerate(self.partial) if rest)
        return lines

    def _read(self, r: int) -> list[bytes]:
        path, size = self.paths[r], _size(self.paths[r])
        if size < self.offsets[r]:  # truncated by someone: start again
            self.offsets[r] = 0
        if size == self.offsets[r]:
            return []
        with open(path, "rb") as f:
            f.seek(self.offsets[r])
            data = f.read(size - self.offsets[r])
        self.offsets[r] += len(data)
        pieces = (self.partial[r] + data).split(b"\n")
        self.partial[r] = pieces.pop()
        if len(self.partial[r]) > LONGEST:
            pieces.append(self.partial[r])
            self.partial[r] = b""
        return pieces

    def merged(self, last: bool) -> list[int]:
        """How far each file is merged into the log (a begun line is not, until the last pass
        writes it)."""
        return [self.offsets[r] - (0 if last else len(self.partial[r]))
                for r in range(len(self.paths))]


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
    try:
        with open(os.path.join(run_dir, LOG_DIR, f"rank-{end.rank}.log"), encoding="utf-8",
                  errors="replace") as f:
            lines = [line.rstrip("\n") for line in deque(f, maxlen=REPORT_LINES)]
    except OSError:
        return end
    return worker_end(end, lines)


class Verdict:
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
               ) -> Verdict:
    """The verdict on one run of the step (see the module docstring), noted in the log.
    ``stalled`` is the file the stall watch wrote if it stopped the step."""
    ends = [_worker_end(end, run_dir) for end in rank_ends(exit_dir)]
    stall = _read_stall(stalled) if stalled else None
    if not ends and stall is None:
        return Verdict("NONE", 0)
    first = first_failure(ends)
    if first is None and stall is None:
        return Verdict("COMPLETED", 0)
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
    reason = f"{sentence}: requeuing, {decision.why}" if decision.restart else \
        f"{sentence}; {decision.why}"
    _note(merged, reason if decision.restart or stall is not None else
          f"{reason}; the other ranks were stopped")
    _write(os.path.join(exit_dir, "REASON"), reason)
    status = (first.exit.status if first is not None else 0) or EXIT_FAILED
    if decision.restart:
        return Verdict("REQUEUE", status, reason, decision.wait_s, decision.exclude)
    return Verdict("FAILED", status, reason)


def _read_stall(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
    hang = HangWatch(Path(run_dir), evidence, nodes, master,
                     stall_s=float(settings["stall_s"]),
                     heartbeat_s=float(settings["heartbeat_s"]),
                     interface=settings.get("interface"),
                     world_size=None if world is None else int(world),
                     launcher=str(settings.get("launcher", "ranks")),
                     busy_s=settings.get("busy_s"), notify=lambda text: _note(merged, text))
    while not stop:
        due = time.monotonic() + hang.interval_s
        while not stop and time.monotonic() < due:  # a handled SIGTERM does not cut a sleep
            time.sleep(0.1)
        if stop:
            break
        try:
            diagnosis = hang.look()
        except Exception as exc:  # never the job's end: say it, keep watching
            _note(merged, f"stall watch: {type(exc).__name__}: {exc}")
            continue
        if diagnosis is None:
            continue
        wrong = diagnosis.kind == WRONG_WORLD
        said, knob = ("wrong world", "on_wrong_world") if wrong else ("stalled", "on_stall")
        if settings.get(knob, "kill" if wrong else "report") != "kill":
            _note(merged, f"{said}: {diagnosis.summary} (distributed.{knob}: report: the "
                          "job goes on)")
            continue
        _write(stalled, json.dumps(diagnosis.to_json()))
        _note(merged, f"{said}: {diagnosis.summary}; stopping every rank "
                      f"(distributed.{knob}: kill)")
        _cancel_step()
        return 0
    return 0


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


def _note(merged: str, text: str) -> None:
    with open(merged, "a", encoding="utf-8") as f:
        f.write(f"[orchestrate] {text}\n")


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["merge"] and len(argv) in (5, 6):
        return merge(*argv[1:])
    if argv[:1] == ["mark"] and len(argv) == 4:
        mark(argv[1], argv[2], argv[3])
        return 0
    if argv[:1] == ["decide"] and len(argv) in (9, 10):
        policy = Policy.from_json(json.loads(argv[4]))
        verdict = verdict_of(argv[1], argv[2], int(argv[3]), policy, argv[5], argv[6],
                             argv[7], argv[8] == "1", argv[9] if len(argv) == 10 else "")
        print(verdict.line())
        return 0
    if argv[:1] == ["watch"] and len(argv) == 6:
        return watch(argv[1], argv[2], argv[3], argv[4], json.loads(argv[5]))
    print("usage: monitor.py merge MERGED LOG_DIR HOSTFILE OFFSETS [READY]\n"
          "       monitor.py mark RUN_DIR CHECKPOINT_DIR MARKER\n"
          "       monitor.py decide MERGED EXIT_DIR REQUEUES POLICY RUN_DIR MARKER "
          "CHECKPOINT_DIR EXPECTS [STALLED]\n"
          "       monitor.py watch RUN_DIR HOSTFILE STALLED MERGED SETTINGS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
