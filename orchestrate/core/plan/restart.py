"""Restarts: when a job that ended is started again, and why not.

One policy (the job's ``restart:`` section) for every backend: the local and SSH supervisors
run the decision in-process after an attempt ends, and the Slurm batch job's monitor runs the
same code (this module is bundled into ``monitor.py``) before it asks Slurm to requeue the job,
which keeps its job id and queue position. A restart starts every rank again in the same run
directory; the built-in trainer resumes from its latest checkpoint by itself, and a ``command:``
program learns which attempt it is from ``ORCHESTRATE_ATTEMPT``.

The decision, in order (the first that applies wins):

1. a user or configuration error (exit 2) is never restarted: it can only fail the same way;
2. the ending must be one the policy names (``failure``, ``stall``, ``node_lost``, ``requeue``,
   or an exit code);
3. the budget (``max``) counts every automatic restart of the job, whatever node failed (not per
   node, as torchrun counts);
4. an attempt that made no progress (no newer checkpoint and no later logged step than the
   attempt before it) is not restarted: a crash loop would spend the budget in a minute;
5. then the next wait of ``backoff_s`` (the last one repeats), and the failed node is excluded
   when ``exclude_failed_node`` asks and the ending blames a node.

Standard library only, Python 3.8+, and pure apart from :func:`progress_marker` (which reads the
run directory).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from orchestrate.core.exits import EXIT_REQUEUE, EXIT_USER_ERROR
from orchestrate.core.plan.outcome import STOPPED_BY_LAUNCHER, Exit

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: The endings a policy may name, in the order ``plan`` lists them.
ENDINGS = ("requeue", "node_lost", "failure", "stall")
#: Endings that blame a node, and so may exclude it from the next attempt.
NODE_ENDINGS = ("failure", "node_lost", "stall")
_CHECKPOINT = re.compile(r"step-(\d+)\.pt")


@dataclass(frozen=True)
class Policy:
    """The job's restart policy, as the plan carries it (defaults live in the job spec)."""

    max: int
    on: tuple[str | int, ...]
    backoff_s: tuple[float, ...]
    exclude_failed_node: bool

    def to_json(self) -> dict[str, Any]:
        return {"max": self.max, "on": list(self.on), "backoff_s": list(self.backoff_s),
                "exclude_failed_node": self.exclude_failed_node}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Policy:
        return cls(max=int(data["max"]), on=tuple(data["on"]),
                   backoff_s=tuple(float(x) for x in data["backoff_s"]),
                   exclude_failed_node=bool(data["exclude_failed_node"]))

    def describe(self) -> str:
        """What the policy will and will not restart, in one line (``plan`` prints it)."""
        if self.max == 0:
            return "restart: never (restart.max is 0)"
        named = [x if isinstance(x, str) else f"exit code {x}" for x in self.on]
        text = f"restart: up to {self.max} times after {_either(named)}"
        left = [e for e in ENDINGS if e not in self.on]
        if left:
            text += f"; not after {_either(left)} (restart.on)"
        return text + "; never after exit 2"

    def wait_s(self, restarts_done: int) -> float:
        """How long to wait before the next restart."""
        if not self.backoff_s:
            return 0.0
        return self.backoff_s[min(restarts_done, len(self.backoff_s) - 1)]


@dataclass(frozen=True)
class Ending:
    """How an attempt ended, as far as restarting goes: its kind (``failure``, ``stall``,
    ``node_lost``, ``requeue``, ``user_error``, ``cancelled``, ``completed``, ``timeout``), the
    exit that decided it, the node it blames, and the sentence saying it."""

    kind: str
    reason: str
    exit: Exit | None = None
    node: str | None = None


@dataclass(frozen=True)
class RestartDecision:
    """Restart or not, when, avoiding which nodes, and why (a sentence for the log)."""

    restart: bool
    why: str
    wait_s: float = 0.0
    exclude: tuple[str, ...] = ()


def _either(words: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    if len(words) < 2:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def ending_of(failed: list[Exit], first: Exit | None, node: str | None, reason: str,
              stalled: bool = False, lost: bool = False) -> Ending:
    """The kind of a failed attempt's ending: ``failed`` are the non-zero exits of its ranks,
    ``first`` the first failure's exit (None: no rank failed on its own). A requeue is a first
    exit of 75 with no rank failing otherwise than asking the same or being stopped by signal;
    a rank that crashed (any other code) makes it a failure."""
    if lost:
        return Ending("node_lost", reason, first, node)
    if stalled:
        return Ending("stall", reason, first, node)
    if first is not None and first.code == EXIT_REQUEUE and all(
            e.code == EXIT_REQUEUE or e.signal in STOPPED_BY_LAUNCHER for e in failed):
        # Every rank that ended on its own asked to resume; the rest were stopped after the
        # first did (a rank still finishing its exit when srun killed the step).
        return Ending("requeue", reason, first, node)
    if first is not None and first.code == EXIT_USER_ERROR:
        return Ending("user_error", reason, first, node)
    return Ending("failure", reason, first, node)


def decide(policy: Policy, ending: Ending, restarts_done: int,
           progressed: bool | None) -> RestartDecision:
    """Whether to start the job again after ``ending`` (see the module docstring)."""
    if ending.kind == "user_error":
        return RestartDecision(False, "not restarted: exit 2 is a user or configuration error")
    if ending.kind in ("completed", "cancelled", "timeout"):
        return RestartDecision(False, f"not restarted: the job was {ending.kind}")
    code = ending.exit.code if ending.exit is not None else None
    if ending.kind not in policy.on and (code is None or code not in policy.on):
        return RestartDecision(False, f"not restarted: restart.on does not include {ending.kind}"
                        + (f" or exit code {code}" if code not in (None, EXIT_REQUEUE) else ""))
    if restarts_done >= policy.max:
        return RestartDecision(False, f"not restarted: the restart budget is spent "
                        f"({restarts_done} of restart.max = {policy.max})")
    if progressed is False:
        return RestartDecision(False, "not restarted: the attempt made no progress (no newer "
                        "checkpoint and no later step than the attempt before it), so another "
                        "would most likely fail the same way")
    exclude: tuple[str, ...] = ()
    if policy.exclude_failed_node and ending.kind in NODE_ENDINGS and ending.node:
        exclude = (ending.node,)
    wait = policy.wait_s(restarts_done)
    return RestartDecision(True, f"restart {restarts_done + 1} of at most {policy.max} in {wait:g}s"
                    + (f", without {', '.join(exclude)}" if exclude else ""), wait, exclude)


# ------------------------------------------------------------------------------ progress


def progress_marker(run_dir: str, checkpoint_dir: str | None) -> dict[str, int | None]:
    """Where training got to, from the run directory: the newest checkpoint's step and the
    last step logged in metrics.jsonl (None where there is none)."""
    checkpoint = None
    folder = checkpoint_dir or os.path.join(run_dir, "checkpoints")
    try:
        steps = [int(m.group(1)) for m in map(_CHECKPOINT.fullmatch, os.listdir(folder)) if m]
        checkpoint = max(steps) if steps else None
    except OSError:
        pass
    step = None
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    value = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(value, int):
                    step = value if step is None else max(step, value)
    except OSError:
        pass
    return {"checkpoint_step": checkpoint, "step": step}


def progressed(before: dict[str, int | None], after: dict[str, int | None],
               expects_markers: bool) -> bool | None:
    """Whether an attempt moved training on. None when nothing can tell (a ``command:`` job
    that writes neither orchestrate checkpoints nor metrics): then only the budget bounds it."""
    keys = ("checkpoint_step", "step")
    if not expects_markers and all(before.get(k) is None and after.get(k) is None for k in keys):
        return None
    return any((after.get(k) or -1) > (before.get(k) or -1) for k in keys)
