"""What ``batch_split: measured`` did to a run: the shares at the start and in force now, the step
where they changed, and the step time before and after (from the timing windows). Pure.

Under DDP all ranks' steps last as long as the slowest rank's, so the step time (a window's
data, forward, backward and optimizer time per step) is the figure balancing shortens; the
windows before the first change are "before", those after the last change "after" (the trainer
ends a window where the shares change).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrate.core.metricrecord import MetricRecord


@dataclass(frozen=True)
class Balance:
    """The run's batch shares over time."""

    first: tuple[int, ...]
    now: tuple[int, ...]
    changed_at: int | None  # the step after which the shares first changed (None: never)
    step_s_before: float | None
    step_s_after: float | None

    def to_json(self) -> dict[str, Any]:
        return {"first": list(self.first), "now": list(self.now), "changed_at_step":
                self.changed_at, "step_s_before": _rounded(self.step_s_before),
                "step_s_after": _rounded(self.step_s_after)}

    def line(self) -> str:
        """``status``'s sentence."""
        shares = f"batch shares by rank: {', '.join(map(str, self.now))} of {sum(self.now)}"
        if self.changed_at is None:
            return shares
        text = (f"{shares} since step {self.changed_at} ({', '.join(map(str, self.first))} "
                "before)")
        if self.step_s_before is not None and self.step_s_after is not None:
            text += (f"; step {self.step_s_before * 1e3:.0f} ms before, "
                     f"{self.step_s_after * 1e3:.0f} ms after")
        return text


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


_STEP_PARTS = ("data_s", "forward_s", "backward_s", "optimizer_s")


def _step_s(windows: Mapping[int, Sequence[Mapping[str, Any]]], keep: Any) -> float | None:
    """The median over ranks of the time per step in the windows ``keep`` accepts: data,
    forward, backward with its wait, optimizer (not validation or checkpoints between steps)."""
    per_rank = []
    for rank_windows in windows.values():
        chosen = [w for w in rank_windows if keep(w)]
        steps = sum(float(w.get("steps") or 0) for w in chosen)
        if steps > 0:
            per_rank.append(sum(float(w.get(k) or 0) for w in chosen for k in _STEP_PARTS)
                            / steps)
    return statistics.median(per_rank) if per_rank else None


def balance(records: Sequence[MetricRecord],
            windows: Mapping[int, Sequence[Mapping[str, Any]]]) -> Balance | None:
    """The shares of a run with a global batch split (None without one)."""
    shared = [r for r in records if r.batch_shares]
    if not shared:
        return None
    last_start = max((i for i, r in enumerate(shared) if r.kind == "start"), default=0)
    shared = shared[last_start:]  # the latest attempt: a resumed run starts from the plan again
    first, now = shared[0].batch_shares or (), shared[-1].batch_shares or ()
    changes = [r for r in shared if r.kind == "shares" and r.step is not None]
    if not changes:
        return Balance(first, now, None, None, None)
    begin, end = changes[0].step or 0, changes[-1].step or 0
    since = shared[0].step or 0

    def before(w: Mapping[str, Any]) -> bool:
        return since <= float(w.get("first_step") or 0) and float(w.get("last_step") or 0) <= begin

    def after(w: Mapping[str, Any]) -> bool:
        return float(w.get("first_step") or 0) > end

    return Balance(first, now, begin, _step_s(windows, before), _step_s(windows, after))
