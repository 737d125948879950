"""Per-rank step timing: where each rank's time goes, written window by window.

Under DDP every rank takes the same number of steps per second, so a slow rank (a slower GPU, a
node with a slow disk) cannot be seen in throughput: the fast ranks wait for it inside the
gradient all-reduce. What tells them apart is each rank's *own* work, which needs timing on every
rank, not just rank 0. Each rank therefore appends one JSON line per window (every
``ORCHESTRATE_TIMING_S`` seconds, default 2) to ``<run_dir>/timing/rank-<R>.jsonl``::

    {"t": 1760000000.5, "rank": 1, "epoch": 2, "first_step": 41, "last_step": 80, "steps": 40,
     "samples": 1280, "data_s": 0.61, "forward_s": 0.09, "backward_s": 0.31,
     "optimizer_s": 0.05, "wall_s": 2.01, "clock": "host"}

- ``t``: wall-clock time (``time.time()``) at the end of the window; ``wall_s``: host seconds the
  window lasted (so it began at ``t - wall_s``), including anything between steps (logging,
  checkpoints, validation).
- ``first_step``/``last_step``: the optimizer steps (1-based, as in metrics.jsonl) done in it;
  ``steps``, ``samples``: how many (samples seen by this rank).
- ``data_s``: host time blocked waiting for the next batch from the DataLoader.
- ``forward_s``: forward pass and loss.
- ``backward_s``: backward pass *and* DDP's gradient synchronisation: DDP all-reduces gradient
  buckets while the backward pass is still running and waits for the last of them before
  ``backward()`` returns, so the two cannot be separated from inside the step. A rank that waits
  for a slower one shows it here (see :mod:`orchestrate.report.straggler` for how the wait is split
  off).
- ``optimizer_s``: gradient clipping, optimizer step, zeroing, LR scheduler.
- ``clock``: ``"host"`` (CPU: ``time.perf_counter``) or ``"cuda"``. On CUDA, forward, backward
  and optimizer are GPU time between CUDA events recorded on the current stream at each
  boundary (no synchronisation per step); the events are read when the window closes, which
  waits once for the last of them, so a window ends at most every 2 s or 512 steps.
  ``data_s`` is host time on both (on CUDA it delays the GPU only once the queue of launched
  kernels has drained).

The cost is a few ``perf_counter`` calls per step and one small append per window (measured in
bench/timing_overhead.py). ``ORCHESTRATE_TIMING=0`` turns it off. Each rank writes its own file
and never talks to the others. A rank that cannot write its file says so once on stderr and
stops timing; training goes on.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from orchestrate.core.layout import timing_file

DEFAULT_INTERVAL_S = 2.0
#: Upper bound on steps per window on CUDA, so the events kept for a window stay few.
MAX_CUDA_STEPS = 512


class StepTiming:
    """One rank's timer; every method is a no-op when timing is off.

    The trainer calls :meth:`resume` where a batch loop (re)starts, :meth:`data_ready` when a
    batch arrived, :meth:`forward_done` and :meth:`backward_done` in each micro-step,
    :meth:`step_done` after the optimizer, and :meth:`close` at the end.
    """

    def __init__(
        self,
        path: Path | None,
        rank: int = 0,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        cuda: bool = False,
    ) -> None:
        self.path = path
        self.on = path is not None
        self.rank = rank
        self.interval_s = interval_s
        self.cuda = cuda and torch.cuda.is_available()
        self._mark = 0.0
        self._window_start = 0.0
        self._t: dict[str, float] = {}
        self._first_step: int | None = None
        self._last_step = 0
        self._epoch = 0
        self._steps = 0
        self._samples = 0
        # CUDA: (bucket, start event, end event) of the window, read at its end; the events
        # recorded in the window (reused in the next one) and the last boundary recorded.
        self._spans: list[tuple[str, Any, Any]] = []
        self._events: list[Any] = []
        self._boundary: Any = None
        self._pool: list[Any] = []
        self._reset(time.perf_counter())

    @classmethod
    def off(cls) -> StepTiming:
        """A timer that records nothing."""
        return cls(None)

    @classmethod
    def for_rank(
        cls, run_dir: Path, rank: int, *, cuda: bool, environ: Mapping[str, str]
    ) -> StepTiming:
        """The timer of one rank, configured by ``ORCHESTRATE_TIMING`` (``0``: off) and
        ``ORCHESTRATE_TIMING_S`` (window length in seconds)."""
        if environ.get("ORCHESTRATE_TIMING", "1").strip() == "0":
            return cls.off()
        try:
            interval = float(environ.get("ORCHESTRATE_TIMING_S", "") or DEFAULT_INTERVAL_S)
        except ValueError:
            interval = DEFAULT_INTERVAL_S
        return cls(timing_file(run_dir, rank), rank, interval_s=max(interval, 0.05), cuda=cuda)

    def _reset(self, now: float) -> None:
        self._window_start = now
        self._t = {"data_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        self._first_step = None
        self._steps = 0
        self._samples = 0
        self._spans = []

    def _event(self) -> Any:
        event = self._pool.pop() if self._pool else torch.cuda.Event(  # type: ignore[no-untyped-call]
            enable_timing=True
        )
        event.record()
        self._events.append(event)
        return event

    def _lap(self, bucket: str) -> None:
        now = time.perf_counter()
        if self.cuda:
            event = self._event()
            if self._boundary is not None:
                self._spans.append((bucket, self._boundary, event))
            self._boundary = event
        else:
            self._t[bucket] += now - self._mark
        self._mark = now

    # --- called by the trainer ---------------------------------------------------------------

    def resume(self) -> None:
        """A batch loop (re)starts: time since the last step (logging, checkpoints, validation)
        is not data loading."""
        if self.on:
            self._mark = time.perf_counter()

    def data_ready(self, samples: int) -> None:
        """A batch of ``samples`` arrived from the loader."""
        if not self.on:
            return
        now = time.perf_counter()
        self._t["data_s"] += now - self._mark
        self._mark = now
        self._samples += samples
        if self.cuda:
            self._boundary = self._event()

    def forward_done(self) -> None:
        """Forward pass and loss are done (launched, on CUDA)."""
        if self.on:
            self._lap("forward_s")

    def backward_done(self) -> None:
        """Backward pass (with DDP's gradient all-reduce when it synchronised) is done."""
        if self.on:
            self._lap("backward_s")

    def step_done(self, step: int, epoch: int) -> None:
        """Optimizer step ``step`` (1-based) of epoch ``epoch`` (1-based) is done; closes the
        window when it is long enough."""
        if not self.on:
            return
        self._lap("optimizer_s")
        if self._first_step is None:
            self._first_step = step
        self._last_step = step
        self._epoch = epoch
        self._steps += 1
        if self._mark - self._window_start >= self.interval_s or (
            self.cuda and self._steps >= MAX_CUDA_STEPS
        ):
            self._flush()

    def cut(self) -> None:
        """End the window here (the batch shares changed: the report compares the windows
        before with those after, so none may hold both)."""
        if self.on and self._steps:
            self._flush()

    def close(self) -> None:
        """Write the last, partial window."""
        if self.on and self._steps:
            self._flush()

    # --- writing -----------------------------------------------------------------------------

    def _flush(self) -> None:
        now = time.perf_counter()
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()
            for bucket, start, end in self._spans:
                self._t[bucket] += start.elapsed_time(end) / 1000.0
            self._pool.extend(self._events)
            self._events = []
            self._boundary = None
        record = {
            "t": round(time.time(), 3),
            "rank": self.rank,
            "epoch": self._epoch,
            "first_step": self._first_step,
            "last_step": self._last_step,
            "steps": self._steps,
            "samples": self._samples,
            **{key: round(value, 6) for key, value in self._t.items()},
            "wall_s": round(now - self._window_start, 6),
            "clock": "cuda" if self.cuda else "host",
        }
        self._reset(now)
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as exc:
            print(f"orchestrate.train: rank {self.rank}: step timing off: cannot write "
                  f"{self.path}: {exc.strerror or exc}", file=sys.stderr, flush=True)
            self.on = False


