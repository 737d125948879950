"""What a checkup found: the typed value rank 0 writes as JSON, and reads back for grading.

Pure and cheap to import (no torch, no pydantic): the rank program builds it, the doctor's
grading (:mod:`orchestrate.doctor.grading`) reads it. The JSON shape is documented in
:mod:`orchestrate.doctor.checkup`; :meth:`CheckupResult.to_json` and :meth:`CheckupResult.from_json`
are the only places that know it.

Bandwidth follows nccl-tests (doc/PERFORMANCE.md): ``algbw = bytes / time`` and, for
all_reduce, ``busbw = algbw * 2 (n - 1) / n``, in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.doctor.checkup.options import human

#: Bumped when the JSON shape changes incompatibly.
FORMAT_VERSION = 1


def busbw(algbw_GBps: float, ranks: int) -> float:
    """nccl-tests' all_reduce bus bandwidth: algbw * 2 (n - 1) / n (0 for one rank)."""
    return algbw_GBps * 2.0 * (ranks - 1) / ranks if ranks > 0 else 0.0


@dataclass(frozen=True)
class SizeTiming:
    """One message size of an all_reduce sweep.

    ``time_s`` is the mean over ranks of each rank's mean time per all_reduce (nccl-tests and
    stas00's all_reduce_bench average over ranks too); ``time_max_s`` is the slowest rank's.
    """

    bytes: int
    iters: int
    time_s: float
    time_max_s: float
    ranks: int

    @property
    def algbw_GBps(self) -> float:
        return self.bytes / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def busbw_GBps(self) -> float:
        return busbw(self.algbw_GBps, self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "iters": self.iters,
            "time_s": self.time_s,
            "time_max_s": self.time_max_s,
            "algbw_GBps": round(self.algbw_GBps, 4),
            "busbw_GBps": round(self.busbw_GBps, 4),
        }


@dataclass(frozen=True)
class Sweep:
    """An all_reduce over ``ranks`` ranks on ``nodes`` nodes, at several message sizes."""

    ranks: int
    nodes: int
    sizes: tuple[SizeTiming, ...]

    def best(self) -> SizeTiming | None:
        """The size with the highest busbw (bandwidth is graded where it plateaus)."""
        return max(self.sizes, key=lambda s: s.busbw_GBps, default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "nodes": self.nodes,
            "sizes": [s.to_json() for s in self.sizes],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sweep:
        ranks = int(data["ranks"])
        return cls(
            ranks=ranks,
            nodes=int(data["nodes"]),
            sizes=tuple(
                SizeTiming(
                    bytes=int(s["bytes"]),
                    iters=int(s["iters"]),
                    time_s=float(s["time_s"]),
                    time_max_s=float(s.get("time_max_s", s["time_s"])),
                    ranks=ranks,
                )
                for s in data["sizes"]
            ),
        )


@dataclass(frozen=True)
class PairMatrix:
    """Point-to-point bandwidth between nodes, one rank per node: ``GBps[i][j]`` is node i
    sending to node j (None on the diagonal and where nothing was measured)."""

    nodes: tuple[str, ...]
    bytes: int
    GBps: tuple[tuple[float | None, ...], ...]

    def rate(self, a: int, b: int) -> float | None:
        """The pair's rate: the slower of its two directions (or the one measured)."""
        values = [v for v in (self.GBps[a][b], self.GBps[b][a]) if v is not None]
        return min(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "bytes": self.bytes,
            "GBps": [[None if v is None else round(v, 4) for v in row] for row in self.GBps],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PairMatrix:
        return cls(
            nodes=tuple(str(n) for n in data["nodes"]),
            bytes=int(data["bytes"]),
            GBps=tuple(
                tuple(None if v is None else float(v) for v in row) for row in data["GBps"]
            ),
        )


@dataclass(frozen=True)
class CheckupFailure:
    """Where the checkup stopped, and whom it blames."""

    tier: str  # "smoke" or "bandwidth"
    step: str
    detail: str  # one sentence naming ranks and nodes
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    per_rank: dict[int, str] = field(default_factory=dict)  # what each failing rank saw

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "step": self.step,
            "detail": self.detail,
            "ranks": list(self.ranks),
            "nodes": list(self.nodes),
            "per_rank": {str(r): text for r, text in sorted(self.per_rank.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckupFailure:
        return cls(
            tier=str(data["tier"]),
            step=str(data["step"]),
            detail=str(data["detail"]),
            ranks=tuple(int(r) for r in data.get("ranks", ())),
            nodes=tuple(str(n) for n in data.get("nodes", ())),
            per_rank={int(r): str(t) for r, t in dict(data.get("per_rank", {})).items()},
        )


@dataclass(frozen=True)
class CheckupResult:
    """Everything one checkup found; ``failure`` is None when every step passed."""

    tiers: tuple[str, ...]
    backend: str
    world_size: int
    nodes: tuple[str, ...]  # node names in GROUP_RANK order
    ranks: tuple[dict[str, Any], ...]  # {"rank", "node", "local_rank", "host", "device"}
    elapsed_s: float
    steps_s: dict[str, float] = field(default_factory=dict)  # smoke steps, as rank 0 timed them
    world: Sweep | None = None
    intra: dict[str, Sweep] = field(default_factory=dict)
    pairs: PairMatrix | None = None
    failure: CheckupFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        bandwidth: dict[str, Any] | None = None
        if self.world is not None or self.intra or self.pairs is not None:
            bandwidth = {
                "all_reduce": None if self.world is None else self.world.to_json(),
                "intra_node": {name: s.to_json() for name, s in self.intra.items()},
                "pairs": None if self.pairs is None else self.pairs.to_json(),
            }
        return {
            "format": FORMAT_VERSION,
            "ok": self.ok,
            "tiers": list(self.tiers),
            "backend": self.backend,
            "world_size": self.world_size,
            "nodes": list(self.nodes),
            "ranks": [dict(r) for r in self.ranks],
            "elapsed_s": round(self.elapsed_s, 3),
            "smoke": {"steps_s": {k: round(v, 4) for k, v in self.steps_s.items()}},
            "bandwidth": bandwidth,
            "failure": None if self.failure is None else self.failure.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckupResult:
        bandwidth = data.get("bandwidth") or {}
        world = bandwidth.get("all_reduce")
        pairs = bandwidth.get("pairs")
        failure = data.get("failure")
        return cls(
            tiers=tuple(str(t) for t in data.get("tiers", ())),
            backend=str(data.get("backend", "")),
            world_size=int(data.get("world_size", 0)),
            nodes=tuple(str(n) for n in data.get("nodes", ())),
            ranks=tuple(dict(r) for r in data.get("ranks", ())),
            elapsed_s=float(data.get("elapsed_s", 0.0)),
            steps_s={
                str(k): float(v)
                for k, v in dict((data.get("smoke") or {}).get("steps_s", {})).items()
            },
            world=None if not world else Sweep.from_json(world),
            intra={
                str(n): Sweep.from_json(s)
                for n, s in dict(bandwidth.get("intra_node") or {}).items()
            },
            pairs=None if not pairs else PairMatrix.from_json(pairs),
            failure=None if not failure else CheckupFailure.from_json(failure),
        )


def combine(
    bytes_: int, iters: int, per_rank_mean_s: Sequence[float], ranks: int
) -> SizeTiming:
    """One size's timing from every rank's mean time per operation."""
    values = [t for t in per_rank_mean_s if t > 0]
    if not values:
        return SizeTiming(bytes_, iters, 0.0, 0.0, ranks)
    return SizeTiming(bytes_, iters, sum(values) / len(values), max(values), ranks)


def figures_of(parts: Mapping[int, Mapping[str, Any]], roster: Sequence[Mapping[str, Any]],
               world_size: int, pair_bytes: int) -> dict[str, Any]:
    """Rank 0: every rank's timings (``parts``: rank -> its ``world``, ``intra`` and ``pairs``
    rows) into the sweeps and the node matrix of a :class:`CheckupResult`; ``roster`` names
    each rank's node, in node order."""
    nodes = list(dict.fromkeys(m["node"] for m in roster))
    ranks_of = {n: sorted(int(m["rank"]) for m in roster if m["node"] == n) for n in nodes}
    world = Sweep(world_size, len(nodes), tuple(
        combine(int(nbytes), int(iters),
                [float(parts[r]["world"][i][2]) for r in range(world_size)], world_size)
        for i, (nbytes, iters, _) in enumerate(parts[0]["world"])
    ))
    intra: dict[str, Sweep] = {}
    for n, ranks in ranks_of.items():
        rows = parts[ranks[0]]["intra"]
        if len(ranks) > 1 and rows:
            intra[n] = Sweep(len(ranks), 1, tuple(
                combine(int(nbytes), int(iters),
                        [float(parts[r]["intra"][i][2]) for r in ranks], len(ranks))
                for i, (nbytes, iters, _) in enumerate(rows)
            ))
    pairs = None
    if len(nodes) > 1:
        matrix: list[list[float | None]] = [[None] * len(nodes) for _ in nodes]
        for i, n in enumerate(nodes):
            for receiver, nbytes, _iters, mean in parts[ranks_of[n][0]]["pairs"]:
                if mean > 0:
                    matrix[i][int(receiver)] = nbytes / mean / 1e9
        pairs = PairMatrix(tuple(nodes), pair_bytes, tuple(tuple(row) for row in matrix))
    return {"world": world, "intra": intra, "pairs": pairs}


def summary(result: CheckupResult, path: Path) -> str:
    """Rank 0's one line."""
    nodes = len(result.nodes)
    text = (f"checkup: smoke passed on {result.world_size} rank(s), {nodes} node(s) "
            f"({result.backend})")
    best = result.world.best() if result.world is not None else None
    if best is not None and result.world_size > 1:
        text += f"; all_reduce busbw {best.busbw_GBps:.3g} GB/s at {human(best.bytes)}"
    elif best is not None:
        text += f"; all_reduce algbw {best.algbw_GBps:.3g} GB/s at {human(best.bytes)} (1 rank)"
    if result.pairs is not None:
        rates = [v for row in result.pairs.GBps for v in row if v is not None]
        if rates:
            text += f"; node pairs {min(rates):.3g}-{max(rates):.3g} GB/s"
    return text + f"; {result.elapsed_s:.1f} s; wrote {path}"
