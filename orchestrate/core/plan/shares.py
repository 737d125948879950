"""Batch shares: how many samples of each step's global batch each rank takes.

Under DDP every rank does the same work per step, so mixed GPUs train at the pace of the slowest
one. With ``train.global_batch_size`` the step's ``B`` samples are split instead: rank ``r``
takes ``b_r`` of them (``sum b_r = B``) and scales its mean loss by ``b_r * W / B``, which makes
the averaged gradient exactly the one of the whole batch (docs/train.md, "Mixed GPUs"). This
module decides the ``b_r``, pure:

- ``equal``: ``B / W`` each (the first ``B mod W`` ranks one more);
- ``proportional``: in proportion to each GPU's speed, its dense BF16 throughput from
  :data:`SPEEDS` (or the inventory's ``tflops`` for that GPU), CPU ranks alike;
- a list: the user's shares, checked;
- ``measured``: starts as ``proportional`` on GPUs (``equal`` on CPUs); the trainer then sets
  the shares from its ranks' measured compute time per sample, through :func:`apportion` too.

Every share is at least 1 and at most the rank's memory cap (the largest batch whose estimate
fits its GPU, :func:`orchestrate.core.plan.memory.max_batch`); what a capped rank cannot take
goes to the others in proportion to their speed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Dense (no sparsity) BF16 tensor TFLOPS from the vendors' datasheets; FP16 for GPUs without
#: BF16 (V100, T4). Only ratios matter: a share is proportional to these. Matched against the
#: inventory's model names by the longest key contained in the name (letters and digits only,
#: lowercase), so "RTX-A6000" is an a6000 and "A100-80GB" an a100.
SPEEDS: dict[str, float] = {
    "b200": 2250.0, "b100": 1750.0, "h200": 989.0, "gh200": 989.0, "h100": 989.0,
    "h100pcie": 756.0, "h800": 989.0, "a100": 312.0, "a800": 312.0, "a30": 165.0,
    "a40": 149.7, "a10": 125.0, "l40s": 362.0, "l40": 181.0, "l4": 121.0,
    "6000ada": 364.2, "a6000": 154.8, "a5000": 111.1, "a4500": 94.6, "a4000": 76.7,
    "4090": 165.2, "4080": 97.5, "3090": 71.0, "3080": 59.5, "v100": 125.0, "t4": 65.0,
    "mi300x": 1307.0, "mi250x": 383.0, "mi210": 181.0,
}
_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def known_speed(model: str) -> float | None:
    """The datasheet speed of a GPU model name, or None when no known model matches."""
    name = _NOT_ALNUM.sub("", model.lower())
    matches = [key for key in SPEEDS if key in name]
    return SPEEDS[max(matches, key=len)] if matches else None


class NoSplit(ValueError):
    """The global batch cannot be split this way; the text says why."""


@dataclass(frozen=True)
class BatchShares:
    """The split of one plan (``plan --json`` "batch"; the trainer gets it in train.json)."""

    global_batch_size: int
    split: str  # equal | proportional | measured | manual
    shares: tuple[int, ...]
    caps: tuple[int | None, ...]  # the largest batch each rank's memory holds (None: unbounded)
    speeds: tuple[float, ...] = ()  # what proportional used, per rank (1.0 each otherwise)

    @property
    def balanced(self) -> bool:
        """Whether the split follows the ranks' speeds (not equal by design)."""
        return self.split != "equal"

    def to_json(self) -> dict[str, Any]:
        return {"global_batch_size": self.global_batch_size, "split": self.split,
                "shares": list(self.shares), "caps": list(self.caps),
                "speeds": list(self.speeds)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchShares:
        return cls(int(data["global_batch_size"]), str(data["split"]),
                   tuple(int(s) for s in data["shares"]),
                   tuple(None if c is None else int(c) for c in data.get("caps", ())),
                   tuple(float(s) for s in data.get("speeds", ())))


def apportion(total: int, weights: Sequence[float], caps: Sequence[int | None]) -> list[int]:
    """``total`` samples over the ranks in proportion to ``weights``, each at least 1 and at
    most its cap (None: no cap); raises :class:`NoSplit` saying why it cannot be done."""
    count = len(weights)
    if total < count:
        raise NoSplit(f"a global batch of {total} cannot give each of the {count} ranks a sample")
    bounds = [math.inf if c is None else c for c in caps]
    short = [r for r, b in enumerate(bounds) if b < 1]
    if short:
        raise NoSplit(f"rank(s) {', '.join(map(str, short))} cannot hold even one sample")
    if sum(bounds) < total:
        raise NoSplit(f"the ranks' memory holds {int(sum(bounds))} samples per step in all, "
                      f"fewer than the global batch of {total}")
    ideal = _water_fill(float(total), [max(w, 1e-12) for w in weights], bounds)
    shares = [max(1, min(math.floor(x), int(b) if b != math.inf else total))
              for x, b in zip(ideal, bounds, strict=True)]
    # Largest remainders first; never above a cap, never below 1.
    order = sorted(range(count), key=lambda r: ideal[r] - math.floor(ideal[r]), reverse=True)
    while sum(shares) != total:
        step = 1 if sum(shares) < total else -1
        moved = False
        for r in order if step > 0 else reversed(order):
            if (step > 0 and shares[r] < bounds[r]) or (step < 0 and shares[r] > 1):
                shares[r] += step
                moved = True
                if sum(shares) == total:
                    break
        if not moved:  # pragma: no cover - the bounds checks above rule this out
            raise NoSplit("no split satisfies every rank's bounds")
    return shares


def _water_fill(total: float, weights: list[float], bounds: list[float]) -> list[float]:
    """Real-valued shares proportional to ``weights`` with those above their bound clipped and
    the rest handed to the others, in proportion again."""
    result = [0.0] * len(weights)
    free = set(range(len(weights)))
    left = total
    while free:
        mass = sum(weights[r] for r in free)
        over = {r for r in free if left * weights[r] / mass > bounds[r]}
        if not over:
            for r in free:
                result[r] = left * weights[r] / mass
            break
        for r in over:
            result[r] = bounds[r]
            left -= bounds[r]
        free -= over
    return result


def manual(total: int, given: Sequence[int], caps: Sequence[int | None]) -> list[int]:
    """The user's own shares, checked: one per rank, summing to the global batch, each within
    its rank's memory."""
    if len(given) != len(caps):
        raise NoSplit(f"{len(given)} shares for {len(caps)} ranks: list one share per rank")
    if sum(given) != total:
        raise NoSplit(f"the shares add up to {sum(given)}, not the global batch of {total}")
    over = [f"rank {r}: {s} > {c}" for r, (s, c) in enumerate(zip(given, caps, strict=True))
            if c is not None and s > c]
    if over:
        raise NoSplit("a share is above what its rank's memory holds (" + "; ".join(over) + ")")
    return list(given)
