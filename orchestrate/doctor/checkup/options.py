"""What a checkup runs, and its bounds: the tiers, the rank program's options, the deadline.

Pure and light (no torch): the doctor's CLI takes :data:`TIERS` from here for its ``--tier``
choice, and the doctor computes the checkup's deadline with :func:`deadline_s` before it
submits anything. :func:`parse_options` reads ``python -m orchestrate.doctor.checkup``'s
arguments: every numeric option is one row of a table (flag, parser, bound, default), checked
in one loop, so each bad value is reported (``command line: --timeout-s: must be a positive
number of seconds (got 0)``) and all of them at once.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.core.errors import Problem, UserError
from orchestrate.train.env import DistEnv

TIERS = ("static", "health", "connect", "smoke", "bandwidth")
#: Run by node leaders before any process group; the others by every rank.
NODE_TIERS = ("static", "health", "connect")
RANK_TIERS = ("smoke", "bandwidth")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: Default sweeps: one small size for latency, then up to where bandwidth plateaus (§1.1 of the
#: reference notes: >= 256 MiB-1 GiB; CPU memory and gloo's speed keep CPUs at 256 MiB).
CPU_SIZES = "32K,1M,16M,64M,256M"
GPU_SIZES = "32K,1M,16M,256M,1G"
CPU_PAIR = "16M"
GPU_PAIR = "256M"
#: Beyond the roll call's window, what the node tiers may take before rank 0 hosts the store:
#: the facts (commands bounded by hostfacts) and the node-to-node connections (3 s tries).
NODE_TIERS_SLACK_S = 30.0


def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456 (binary units; B, KiB and MB spellings accepted)."""
    found = _SIZE.match(text)
    if not found:
        raise ValueError(f"not a size: {text!r} (expected e.g. 32K, 16M, 1G)")
    value = int(float(found.group(1)) * _UNITS[found.group(2).upper()])
    if value < 4:
        raise ValueError(f"{text!r} is under 4 bytes (one float32)")
    return value


def human(nbytes: int) -> str:
    """``268435456`` -> ``"256 MiB"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Options:
    """What to run, and the bounds."""

    tiers: tuple[str, ...]
    sizes: tuple[int, ...] | None  # None: the device's default
    pair_bytes: int | None
    warmup: int
    iters: int
    min_iters: int
    budget_s: float
    join_timeout_s: float
    timeout_s: float
    deadline_s: float  # 0: computed from the others
    out: Path | None
    names: tuple[str, ...]
    nodes: int | None = None  # how many nodes (node leaders) take part; None: from names
    window_s: float = 20.0  # the roll call's window (static and connect tiers)

    @property
    def node_tiers(self) -> bool:
        """Whether leaders run the static or connect tier first."""
        return any(t in self.tiers for t in NODE_TIERS)

    @property
    def rank_tiers(self) -> bool:
        """Whether every rank joins a process group (smoke, bandwidth)."""
        return any(t in self.tiers for t in RANK_TIERS)

    @property
    def join_allowance_s(self) -> float:
        """How much later than the other ranks rank 0 may host the store: the node tiers come
        first."""
        return self.window_s + NODE_TIERS_SLACK_S if self.node_tiers else 0.0


# ------------------------------------------------------------------------------- the table


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(sorted({parse_size(s) for s in text.split(",") if s.strip()}))


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("must be a whole number") from None


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number of seconds") from None


#: A bound: what a value must satisfy, and what to say when it does not.
Bound = tuple[Callable[[Any], bool], str]
_AT_LEAST_0: Bound = (lambda v: v >= 0, "is too small")
_AT_LEAST_1: Bound = (lambda v: v >= 1, "is too small")
_POSITIVE: Bound = (lambda v: v > 0, "must be a positive number of seconds")
_NODES: Bound = (lambda v: v >= 1, "must be at least 1")


@dataclass(frozen=True)
class Flag:
    """One option of the rank program: how its text is read and what bounds its value."""

    flag: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    bound: Bound | None = None

    @property
    def dest(self) -> str:
        """Its attribute on argparse's namespace (``--min-iters`` -> ``min_iters``)."""
        return self.flag.lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("--sizes", _sizes, None, f"all_reduce sizes (default {CPU_SIZES} on CPUs, "
         f"{GPU_SIZES} on GPUs)"),
    Flag("--pair-size", parse_size, None, f"bytes per node-to-node transfer (default "
         f"{CPU_PAIR} on CPUs, {GPU_PAIR} on GPUs)"),
    Flag("--warmup", _whole, 5, "warm-up operations per size", _AT_LEAST_0),
    Flag("--iters", _whole, 10, "timed iterations at most", _AT_LEAST_1),
    Flag("--min-iters", _whole, 2, "timed iterations at least", _AT_LEAST_1),
    Flag("--budget-s", _seconds, 2.0, "seconds of timed iterations per size (0: exactly "
         "--iters)"),
    Flag("--join-timeout-s", _seconds, 60.0, "how long rank 0 waits for every rank to start "
         "and connect", _POSITIVE),
    Flag("--timeout-s", _seconds, 20.0, "bound of each step and of each operation in a sweep",
         _POSITIVE),
    Flag("--deadline-s", _seconds, 0.0, "hard bound of the whole checkup (default: from the "
         "others)"),
    Flag("--connect-window-s", _seconds, 20.0, "how long the roll call on MASTER_PORT waits "
         "for every node (static and connect tiers)", _POSITIVE),
    Flag("--nodes", _whole, None, "how many nodes take part (default: from the node names, "
         "else WORLD_SIZE / LOCAL_WORLD_SIZE)", _NODES),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrate.doctor.checkup",
        description="Check and measure the job's ranks: static (node facts) and connect "
        "(roll call, node-to-node ports) on node leaders, smoke (join, barrier, checked "
        "all_reduce) and bandwidth (all_reduce sweep, node-to-node matrix) on every rank.",
    )
    parser.add_argument("--tier", action="append", default=None,
                        help="static, connect, smoke, bandwidth or all (repeatable or "
                        "comma-separated; bandwidth includes smoke); default smoke")
    for flag in FLAGS:
        parser.add_argument(flag.flag, default=None, help=flag.help)
    parser.add_argument("--out", type=Path, help="result file (default "
                        "$ORCHESTRATE_RUN_DIR/checkup.json)")
    parser.add_argument("--node-names", default=None,
                        help="node names in GROUP_RANK order, comma-separated (default "
                        "$ORCHESTRATE_NODE_NAMES; else Slurm's SLURMD_NODENAME, else "
                        "'node <GROUP_RANK>')")
    return parser


def _tiers(given: Sequence[str] | None, problems: list[Problem]) -> tuple[str, ...]:
    """The tiers asked for (``all``; ``bandwidth`` brings ``smoke``), in running order."""
    tiers: list[str] = []
    for item in given or ["smoke"]:
        for tier in (t.strip() for t in item.split(",")):
            if tier == "all":
                tiers.extend(TIERS)
            elif tier in TIERS:
                tiers.append(tier)
            else:
                problems.append(Problem("must be static, connect, smoke, bandwidth or all",
                                        source="command line", field="--tier", got=tier))
    if "bandwidth" in tiers:
        tiers.append("smoke")
    return tuple(t for t in TIERS if t in tiers)


def _values(args: argparse.Namespace, problems: list[Problem]) -> dict[str, Any]:
    """Every row of :data:`FLAGS` read and bounded: its value, or its default."""
    values: dict[str, Any] = {}
    for flag in FLAGS:
        text = getattr(args, flag.dest)
        value = flag.default
        if text:
            try:
                value = flag.parse(text)
            except ValueError as exc:
                problems.append(Problem(str(exc), source="command line", field=flag.flag,
                                        got=text))
                continue
        if value is not None and flag.bound is not None and not flag.bound[0](value):
            problems.append(Problem(flag.bound[1], source="command line", field=flag.flag,
                                    got=str(value)))
        values[flag.dest] = value
    return values


def parse_options(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Options:
    """Arguments and ``ORCHESTRATE_NODE_NAMES``; raises UserError on nonsense."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    problems: list[Problem] = []
    tiers = _tiers(args.tier, problems)
    v = _values(args, problems)
    if problems:
        raise UserError(problems)
    given = args.node_names if args.node_names is not None else environ.get(
        "ORCHESTRATE_NODE_NAMES", "")
    names = tuple(n.strip() for n in given.split(","))
    return Options(
        tiers=tiers,
        sizes=v["sizes"],
        pair_bytes=v["pair_size"],
        warmup=max(1, v["warmup"]),
        iters=v["iters"],
        min_iters=min(v["min_iters"], v["iters"]),
        budget_s=max(0.0, v["budget_s"]),
        join_timeout_s=v["join_timeout_s"],
        timeout_s=v["timeout_s"],
        deadline_s=v["deadline_s"],
        out=args.out,
        names=names if any(names) else (),
        nodes=v["nodes"],
        window_s=v["connect_window_s"],
    )


# ----------------------------------------------------------------------------- the bounds


def node_name(names: Sequence[str], group_rank: int | None, slurm_node: str | None = None
              ) -> str:
    """This node's name: ``names[GROUP_RANK]`` (``--node-names``, ORCHESTRATE_NODE_NAMES),
    else Slurm's name for the node it runs on (``SLURMD_NODENAME``: where a Slurm job runs is
    Slurm's choice, not the plan's), else ``"node <GROUP_RANK>"`` (else the host name, when
    not even GROUP_RANK is known)."""
    if group_rank is not None and 0 <= group_rank < len(names) and names[group_rank]:
        return names[group_rank]
    if slurm_node:
        return slurm_node
    if group_rank is None:
        return socket.gethostname()
    return f"node {group_rank}"


def node_count(options: Options, place: DistEnv) -> int:
    """How many nodes take part: ``--nodes``, else the node names, else WORLD_SIZE /
    LOCAL_WORLD_SIZE (uneven nodes need ``--nodes``)."""
    if options.nodes:
        return options.nodes
    if options.names:
        return len(options.names)
    return max(1, place.world_size // max(1, place.local_world_size))


def deadline_s(options: Options, sizes: int, nodes: int) -> float:
    """The hard bound of one rank's whole checkup (``--deadline-s``, else computed from the
    other bounds): the node tiers, the join, the smoke steps, and for bandwidth every size
    twice (all ranks, inside nodes) and every round of node pairs."""
    o = options
    if o.deadline_s > 0:
        return o.deadline_s
    total = o.join_allowance_s
    if not o.rank_tiers:
        return total + 10
    total += o.join_timeout_s + 10 + 6 * o.timeout_s
    if "bandwidth" in o.tiers:
        total += 2 * sizes * (2 * o.budget_s + 2 * o.timeout_s)
        total += max(2, nodes) * round_bound(o)
    return total


def round_bound(o: Options) -> float:
    """How long a node-to-node round may take (both directions of one pair)."""
    return 2 * (1.5 * o.budget_s + (o.min_iters + 2) * o.timeout_s) + o.timeout_s


__all__ = ["FLAGS", "NODE_TIERS", "RANK_TIERS", "TIERS", "Flag", "Options", "deadline_s",
           "human", "node_count", "node_name", "parse_options", "parse_size", "round_bound"]
