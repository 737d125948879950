"""The step reporter: one call a step gives a ``command:`` program what ``train:`` jobs get.

The built-in trainer writes rank 0's ``metrics.jsonl`` (the curves, ``submit --follow``'s
progress line, the first step's time) and every rank's ``timing/rank-<R>.jsonl`` (the straggler
split), and stops every rank when the loss is not finite. A program of the user's own does none
of that, so its job had no loss curve, no NaN stop and no straggler split. With the rank
sidecar's folder first on every Python rank's path (:mod:`orchestrate.diagnosis.rankpackage`),
one line in the training loop is enough::

    from orchestrate_steps import report          # provided to every rank by orchestrate
    report(step, loss.item(), samples=len(batch))  # every step, on every rank

What each call does, writing the same records as the trainer (the formats:
:mod:`orchestrate.core.metricrecord`, orchestrate/train/timing.py):

- on rank 0, one ``step`` record in ``metrics.jsonl`` (a ``start`` record before the first):
  step, train_loss, samples_per_s over the steps since the last call, time;
- on every rank, the steps, samples and host seconds go into a timing window, appended every
  ``ORCHESTRATE_TIMING_S`` seconds (default 2) and at exit. The time between two calls is the
  rank's own compute (``forward_s``) unless the program says where part of it went: ``data_s``
  (waiting for the batch) and ``backward_s`` (the backward pass with DDP's gradient
  all-reduce, where a rank waits for a slower one): give ``backward_s`` and the report splits
  the wait off and names the straggler exactly as for ``train:`` jobs;
- the rank's heartbeat says ``step`` and the step number (the stall watch's progress);
- a loss that is not finite (NaN or inf) stops the rank at once with the trainer's sentence
  (``rank R: the loss is not finite ...``, exit status 1), before the program can checkpoint NaN
  weights; its peers' collectives then fail and the job ends FAILED naming it.

Which rank and world: the process group's (``torch.distributed``, looked at, never imported),
else ``RANK`` and ``WORLD_SIZE``. Nothing here ever raises into the program except the NaN
stop: a file that cannot be written is said once on stderr and reporting goes on in memory.
Standard library only, Python 3.8+ (it is carried to every host in the sidecar folder).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sys
import time

from orchestrate.core.layout import METRICS, TIMING_DIR
from orchestrate.diagnosis.joinwatch import dist_world
from orchestrate.diagnosis.sidecar import phase

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

ENV_RUN_DIR = "ORCHESTRATE_RUN_DIR"
ENV_TIMING_S = "ORCHESTRATE_TIMING_S"
DEFAULT_WINDOW_S = 2.0
#: What a NaN stop tells the user to try (the trainer's advice, less its own knobs).
ADVICE = "lower the learning rate, clip the gradients, or check the data"


class LossNotFinite(SystemExit):
    """The loss went NaN or infinite: the rank stops (exit status 1) with this sentence."""


class StepReporter:
    """One rank's reporter (use :func:`report`, which makes one per process)."""

    def __init__(self, run_dir: str | None, rank: int, world_size: int | None,
                 window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.window_s = window_s
        self.clock = clock
        self.last: tuple[int, float] | None = None  # (step, clock) of the previous call
        self.window: dict[str, Any] = {}
        self.window_started = 0.0
        self.broken = run_dir is None  # True: nothing is written any more

    def report(self, step: int, loss: Any, samples: int | None = None, *,
               epoch: int | None = None, data_s: float | None = None,
               backward_s: float | None = None, at: float | None = None) -> None:
        """Record one step (see the module docstring); stops the rank on a non-finite loss.
        ``at``: when the step ended, on this reporter's clock, where it was not just now
        (the step relay's file lines)."""
        now, wall = (self.clock() if at is None else at), time.time()
        value = float(loss)
        step = int(step)
        phase("step", step)
        if self.last is None:
            self._metrics({"kind": "start", "epoch": epoch, "step": step, "time": wall,
                           "world_size": self.world_size, "resumed_from_step": None})
            self.window_started = now
            rate = None
        else:
            steps, seconds = max(0, step - self.last[0]), max(0.0, now - self.last[1])
            self._add(step, steps, samples, seconds, data_s, backward_s, epoch)
            rate = steps * samples / seconds if samples and steps and seconds > 0 else None
        self.last = (step, now)
        self._metrics({"kind": "step", "epoch": epoch, "step": step,
                       "train_loss": value if math.isfinite(value) else None,
                       "val_loss": None, "val_accuracy": None, "samples_per_s": rate,
                       "epoch_s": None, "lr": None, "time": wall})
        if not math.isfinite(value):
            self.flush()
            raise LossNotFinite(
                f"rank {self.rank}: the loss is not finite ({value}) at step {step}; "
                f"training stopped ({ADVICE})")
        if self.window and now - self.window_started >= self.window_s:
            self.flush()

    def _add(self, step: int, steps: int, samples: int | None, seconds: float,
             data_s: float | None, backward_s: float | None, epoch: int | None) -> None:
        """Add the steps since the previous call to the open timing window."""
        if not steps:
            return
        data = min(seconds, max(0.0, float(data_s or 0.0)))
        backward = min(seconds - data, max(0.0, float(backward_s or 0.0)))
        window = self.window
        if not window:
            window.update(first_step=step - steps + 1, steps=0, samples=0, data_s=0.0,
                          forward_s=0.0, backward_s=0.0, wall_s=0.0)
        window["epoch"] = epoch
        window["last_step"] = step
        window["steps"] += steps
        window["samples"] += int(samples or 0) * steps
        window["data_s"] += data
        window["backward_s"] += backward
        window["forward_s"] += seconds - data - backward
        window["wall_s"] += seconds

    def flush(self) -> None:
        """Append the open timing window to ``timing/rank-<R>.jsonl``."""
        window, self.window = self.window, {}
        self.window_started = self.clock()
        if not window or self.run_dir is None:
            return
        line = {"t": time.time(), "rank": self.rank, "epoch": window.get("epoch"),
                "first_step": window["first_step"], "last_step": window["last_step"],
                "steps": window["steps"], "samples": window["samples"],
                "data_s": window["data_s"], "forward_s": window["forward_s"],
                "backward_s": window["backward_s"], "optimizer_s": 0.0,
                "wall_s": window["wall_s"], "clock": "host"}
        folder = os.path.join(self.run_dir, TIMING_DIR)
        self._append(os.path.join(folder, f"rank-{self.rank}.jsonl"), line, folder)

    def _metrics(self, record: dict[str, Any]) -> None:
        if self.rank == 0 and self.run_dir is not None:
            self._append(os.path.join(self.run_dir, METRICS), record, None)

    def _append(self, path: str, record: dict[str, Any], folder: str | None) -> None:
        if self.broken:
            return
        try:
            if folder is not None:
                os.makedirs(folder, exist_ok=True)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, allow_nan=False) + "\n")
        except (OSError, ValueError) as exc:
            self.broken = True
            with contextlib.suppress(Exception):  # stderr closed: nothing left to tell
                sys.stderr.write(f"orchestrate step report: rank {self.rank}: cannot write "
                                 f"{path} ({exc}); no curves or timing for this rank\n")


_reporters: dict[int, StepReporter] = {}  # by pid: a forked child makes its own


def reporter(environ: Any = None) -> StepReporter:
    """This process's reporter, made on first use from its process group and environment."""
    pid = os.getpid()
    found = _reporters.get(pid)
    if found is not None:
        return found
    made = from_environ(os.environ if environ is None else environ)
    _reporters[pid] = made
    atexit.register(made.flush)  # the last, partial window
    return made


def from_environ(environ: Any, clock: Callable[[], float] = time.perf_counter) -> StepReporter:
    """A reporter for the rank this process is: its process group's, else ``RANK``."""
    world = dist_world()
    rank_text = str(environ.get("RANK", "")).strip()
    size_text = str(environ.get("WORLD_SIZE", "")).strip()
    rank = world[0] if world else (int(rank_text) if rank_text.isdigit() else 0)
    size = world[1] if world else (int(size_text) if size_text.isdigit() else None)
    run_dir = str(environ.get(ENV_RUN_DIR, "")).strip() or None
    try:
        window_s = float(environ.get(ENV_TIMING_S, DEFAULT_WINDOW_S))
    except ValueError:
        window_s = DEFAULT_WINDOW_S
    return StepReporter(run_dir, rank, size, window_s if window_s > 0 else DEFAULT_WINDOW_S,
                        clock)


def report(step: int, loss: Any, samples: int | None = None, *,
           epoch: int | None = None, data_s: float | None = None,
           backward_s: float | None = None) -> None:
    """Report one optimizer step of this rank: its number, its loss (a float: ``loss.item()``)
    and the samples it took; see the module docstring."""
    reporter().report(step, loss, samples, epoch=epoch, data_s=data_s, backward_s=backward_s)
