"""The program that runs beside a Slurm job's ranks, in its batch script: ``monitor.py``.

``render`` writes it into the run directory (this module's text bundled with the stdlib-only
modules it uses, :mod:`orchestrate.shipping`), and job.sbatch runs it with the first node's
python, so nothing of orchestrate need be installed on the batch host. Two modes:

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
    Before the step: record how far training got (:func:`orchestrate.restart.progress_marker`),
    so that ``decide`` can tell whether this run moved it on.

``decide MERGED EXIT_DIR REQUEUES POLICY RUN_DIR MARKER CHECKPOINT_DIR EXPECTS``
    After the step: read how each rank ended (``EXIT_DIR/rank-R``: status, time in
    microseconds, host, written by each rank's shell), name the first failure in the merged log
    with the same rule every backend uses (:func:`orchestrate.outcome.first_failure`), apply the
    job's restart policy (POLICY, JSON; :func:`orchestrate.restart.decide`, the same decision
    the local and SSH supervisors make; REQUEUES is how often Slurm restarted this job), and
    print the verdict for the batch script, one line: ``COMPLETED``, ``REQUEUE``, ``FAILED`` or
    ``NONE`` (no rank recorded anything), the exit status the batch script should end with, the
    seconds to wait before the next run, and the nodes to exclude (``-`` for none); the reason
    goes into the merged log and into ``REASON`` beside EXIT_DIR.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from orchestrate.exits import EXIT_FAILED
from orchestrate.outcome import Exit, RankEnd, first_failure
from orchestrate.restart import Policy, decide, ending_of, progress_marker, progressed

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
    paths = [os.path.join(log_dir, f"rank-{r}.log") for r in range(len(hosts))]
    prefixes = [f"[{host}:{r}] ".encode() for r, host in enumerate(hosts)]
    offsets = _load_offsets(offsets_file, len(paths))
    partial = [b""] * len(paths)
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
        lines: list[bytes] = []
        for r, path in enumerate(paths):
            size = _size(path)
            if size < offsets[r]:  # truncated by someone: start again
                offsets[r] = 0
            if size == offsets[r]:
                continue
            with open(path, "rb") as f:
                f.seek(offsets[r])
                data = f.read(size - offsets[r])
            offsets[r] += len(data)
            pieces = (partial[r] + data).split(b"\n")
            partial[r] = pieces.pop()
            if len(partial[r]) > LONGEST:
                pieces.append(partial[r])
                partial[r] = b""
            lines.extend(prefixes[r] + piece + b"\n" for piece in pieces)
        if last:
            lines.extend(prefixes[r] + rest + b"\n" for r, rest in enumerate(partial) if rest)
        if lines:
            out.write(b"".join(lines))
            out.flush()
            done = [offsets[r] - (0 if last else len(partial[r])) for r in range(len(paths))]
            _save_offsets(offsets_file, done)
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
               marker: str, checkpoint_dir: str, expects_markers: bool) -> Verdict:
    """The verdict on one run of the step (see the module docstring), noted in the log."""
    ends = rank_ends(exit_dir)
    if not ends:
        return Verdict("NONE", 0)
    first = first_failure(ends)
    if first is None:
        return Verdict("COMPLETED", 0)
    sentence = f"rank {first.rank} on {first.node} failed with {first.exit.describe()}"
    failed = [end.exit for end in ends if not end.exit.ok]
    ending = ending_of(failed, first.exit, first.node, sentence)
    try:
        with open(marker, encoding="utf-8") as f:
            before = json.load(f)
    except (OSError, ValueError):
        before = {}
    after = progress_marker(run_dir, checkpoint_dir or None)
    decision = decide(policy, ending, requeues, progressed(before, after, expects_markers))
    if ending.kind == "requeue":
        sentence = (f"rank {first.rank} on {first.node} checkpointed and asks to resume "
                    f"(exit {first.exit.code})")
    reason = f"{sentence}: requeuing, {decision.why}" if decision.restart else \
        f"{sentence}; {decision.why}"
    _note(merged, reason if decision.restart else
          f"{reason}; the other ranks were stopped")
    _write(os.path.join(exit_dir, "REASON"), reason)
    if decision.restart:
        return Verdict("REQUEUE", first.exit.status, reason, decision.wait_s, decision.exclude)
    return Verdict("FAILED", first.exit.status or EXIT_FAILED, reason)


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
    if argv[:1] == ["decide"] and len(argv) == 9:
        policy = Policy.from_json(json.loads(argv[4]))
        verdict = verdict_of(argv[1], argv[2], int(argv[3]), policy, argv[5], argv[6],
                             argv[7], argv[8] == "1")
        print(verdict.line())
        return 0
    print("usage: monitor.py merge MERGED LOG_DIR HOSTFILE OFFSETS [READY]\n"
          "       monitor.py mark RUN_DIR CHECKPOINT_DIR MARKER\n"
          "       monitor.py decide MERGED EXIT_DIR REQUEUES POLICY RUN_DIR MARKER "
          "CHECKPOINT_DIR EXPECTS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
