"""The step relay: a ``command:`` program that is not Python reports its steps through a file.

A shell script, a C++ or Julia trainer cannot ``from orchestrate_steps import report``. Run it
under the relay instead (docs/launchers.md)::

    command: [python, -m, orchestrate_steps, --, ./train.sh, --epochs, "3"]

and have it append one JSON line per step to the file named by ``ORCHESTRATE_STEP_FILE``::

    echo "{\\"step\\": $step, \\"loss\\": $loss, \\"samples\\": 32}" >> "$ORCHESTRATE_STEP_FILE"

Fields: ``step`` and ``loss`` (a number; ``"nan"``/``NaN``/``"inf"`` are read as such), and
optionally ``samples``, ``epoch``, ``data_s``, ``backward_s`` (the Python ``report``'s
arguments) and ``t``, when the step ended in epoch seconds (``date +%s.%N``; without it, when
the relay read the line, within :data:`POLL_S`). Each line goes through the same
:class:`orchestrate.diagnosis.stepreport.StepReporter` as the Python call: rank 0's
``metrics.jsonl``, every rank's timing windows, the heartbeat's step (the relay is the rank's
Python process, so the sidecar runs in it) and the NaN stop, which here stops the program
(SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`) and ends the rank with the trainer's sentence
and exit status 1. A line that is not a step record is named once on stderr and skipped; a
line still being written waits for its newline.

The file is ``RUN_DIR/steps/rank-<RANK>.jsonl`` (emptied when the relay starts: one attempt's
lines), unless ``ORCHESTRATE_STEP_FILE`` is already set. Otherwise the relay is the program:
its signals are passed on and it ends as the program ended (:mod:`orchestrate.hostside.childrun`).
Standard library only, Python 3.8+ (carried in the sidecar folder as ``orchestrate_steps``'s
``-m`` entry).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from orchestrate.diagnosis.stepreport import LossNotFinite, StepReporter, from_environ
from orchestrate.hostside.childrun import NOT_FOUND, exit_as, start

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_STEP_FILE = "ORCHESTRATE_STEP_FILE"
#: The folder of the run directory that holds each rank's step file.
STEPS_DIR = "steps"
POLL_S = 0.1
STOP_GRACE_S = 5.0
WHO = "orchestrate step relay"
USAGE = f"usage: python -m orchestrate_steps -- PROGRAM [ARG...]  ({WHO}: docs/launchers.md)"
_NUMBERS = ("samples", "epoch", "data_s", "backward_s", "t")


class StepLines:
    """The whole lines appended to a file since the last read (a partial last line waits)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.tail = b""

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        self.offset += len(data)
        *whole, self.tail = (self.tail + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in whole if line.strip()]


def step_of(line: str) -> dict[str, Any] | None:
    """The report arguments of one line, or None when it is not a step record."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            return None
        found: dict[str, Any] = {"step": int(record["step"]), "loss": float(record["loss"])}
        for name in _NUMBERS:
            if record.get(name) is not None:
                found[name] = float(record[name])
    except (ValueError, KeyError, TypeError):
        return None
    if "samples" in found:
        found["samples"] = int(found["samples"])
    if "epoch" in found:
        found["epoch"] = int(found["epoch"])
    found["at"] = found.pop("t", None)
    return found


class Relay:
    """One rank's relay: the file's lines into the reporter (see the module docstring)."""

    def __init__(self, path: str, reporter: StepReporter) -> None:
        self.lines = StepLines(path)
        self.reporter = reporter
        self.bad = 0

    def pump(self) -> None:
        """Report every step line written since the last call; raises LossNotFinite."""
        for line in self.lines.read():
            step = step_of(line)
            if step is None:
                self.bad += 1
                if self.bad == 1:
                    sys.stderr.write(
                        f"{WHO}: rank {self.reporter.rank}: {self.lines.path}: not a step "
                        f'record ({{"step": N, "loss": X}}; got {line[:120]!r}); skipped, as '
                        "any later ones are\n")
                continue
            self.reporter.report(step.pop("step"), step.pop("loss"), **step)


def step_file(environ: Any, rank: int) -> str:
    """Where this rank's program writes its steps (see the module docstring)."""
    named = str(environ.get(ENV_STEP_FILE, "")).strip()
    if named:
        return named
    run_dir = str(environ.get("ORCHESTRATE_RUN_DIR", "")).strip() or tempfile.gettempdir()
    return os.path.join(run_dir, STEPS_DIR, f"rank-{rank}.jsonl")


def main(argv: list[str], environ: Any = None) -> int:
    """``python -m orchestrate_steps -- PROGRAM [ARG...]``: run PROGRAM, relaying its steps."""
    environ = os.environ if environ is None else environ
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write(USAGE + "\n")
        return 2
    reporter = from_environ(environ, clock=time.time)
    path = step_file(environ, reporter.rank)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        open(path, "w").close()  # this attempt's steps only
    except OSError as exc:
        sys.stderr.write(f"{WHO}: cannot make {path} ({exc}); steps are not reported\n")
    child = start(argv, dict(environ, **{ENV_STEP_FILE: path}), WHO)
    if child is None:
        return NOT_FOUND
    relay = Relay(path, reporter)
    try:
        while True:
            code = child.poll()
            relay.pump()  # after the poll: an ended program's last lines are all there
            if code is not None:
                break
            time.sleep(POLL_S)
    except LossNotFinite as stop:
        child.stop(STOP_GRACE_S)
        reporter.flush()
        sys.stderr.write(f"{stop}\n")
        return 1
    reporter.flush()
    return exit_as(code)
