"""The rank program: ``python -m orchestrate.doctor.checkup``, run on every planned rank.

Each step is bounded (see :mod:`orchestrate.doctor.checkup.control`) and named, so a failure says
which rank on which node, in which step:

static, connect
    run by each node's leader (its local rank 0) before any process group exists
    (:mod:`orchestrate.doctor.checkup.leader`): the node's facts, the roll call on MASTER_PORT and
    the node-to-node connections; printed as one marked line per node and judged by the doctor.
smoke
    ``join`` (every rank reaches rank 0's store; who did not is named), ``init`` (the process
    group with the job's backend), ``monitored_barrier`` (gloo, names ranks that did not arrive),
    ``barrier``, ``all_reduce`` (every element of the result checked).
bandwidth
    an all_reduce sweep over message sizes on all ranks; the same sweep inside each node with
    more than one rank (when there are several nodes); point-to-point transfers between one rank
    per node, every pair in both directions, in rounds where each node is in one pair at a time.

Rank 0 gathers every rank's figures through the store, writes one JSON result (the shape is in
:mod:`orchestrate.doctor.checkup`), prints it as a marked line
(:mod:`orchestrate.doctor.checkup.transcript`) and a one-line summary. Exit status: 0 when every
step passed (the node tiers are judged by the
doctor, not here), 1 when one failed, 2 for bad arguments or a bad environment.

A rank other than 0 that fails and could tell rank 0 waits (a few seconds at most) until rank 0
has written and printed the result before it exits non-zero: launchers stop every rank at the
first non-zero exit, and rank 0 must not be stopped before it said whom to blame.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.core import layout
from orchestrate.core.errors import Problem, UserError
from orchestrate.doctor.checkup import transcript
from orchestrate.doctor.checkup.blame import Kind, Member, Report, blame, locate, never_joined
from orchestrate.doctor.checkup.result import CheckupResult, Failure, PairMatrix, Sweep, combine
from orchestrate.doctor.checkup.schedule import pair_rounds
from orchestrate.train.env import DistEnv, parse_dist_env

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
TIERS = ("static", "connect", "smoke", "bandwidth")
#: Run by node leaders before any process group; the others by every rank.
NODE_TIERS = ("static", "connect")
RANK_TIERS = ("smoke", "bandwidth")
SMOKE_STEPS = frozenset({"join", "init", "monitored_barrier", "barrier", "all_reduce"})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: Default sweeps: one small size for latency, then up to where bandwidth plateaus (§1.1 of the
#: reference notes: >= 256 MiB-1 GiB; CPU memory and gloo's speed keep CPUs at 256 MiB).
CPU_SIZES = "32K,1M,16M,64M,256M"
GPU_SIZES = "32K,1M,16M,256M,1G"
CPU_PAIR = "16M"
GPU_PAIR = "256M"
#: Grace for the other ranks to report after a failure (their watchdogs poll every second).
GRACE_S = 4.0
#: How long a failed rank other than 0 waits for rank 0 to print the result before it exits.
LINGER_S = GRACE_S + 8.0
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


def parse_options(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Options:
    """Arguments and ``ORCHESTRATE_NODE_NAMES``; raises UserError on nonsense."""
    parser = argparse.ArgumentParser(
        prog="python -m orchestrate.doctor.checkup",
        description="Check and measure the job's ranks: static (node facts) and connect "
        "(roll call, node-to-node ports) on node leaders, smoke (join, barrier, checked "
        "all_reduce) and bandwidth (all_reduce sweep, node-to-node matrix) on every rank.",
    )
    parser.add_argument("--tier", action="append", default=None,
                        help="static, connect, smoke, bandwidth or all (repeatable or "
                        "comma-separated; bandwidth includes smoke); default smoke")
    parser.add_argument("--sizes", help=f"all_reduce sizes (default {CPU_SIZES} on CPUs, "
                        f"{GPU_SIZES} on GPUs)")
    parser.add_argument("--pair-size", help=f"bytes per node-to-node transfer (default "
                        f"{CPU_PAIR} on CPUs, {GPU_PAIR} on GPUs)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up operations per size")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations at most")
    parser.add_argument("--min-iters", type=int, default=2, help="timed iterations at least")
    parser.add_argument("--budget-s", type=float, default=2.0,
                        help="seconds of timed iterations per size (0: exactly --iters)")
    parser.add_argument("--join-timeout-s", type=float, default=60.0,
                        help="how long rank 0 waits for every rank to start and connect")
    parser.add_argument("--timeout-s", type=float, default=20.0,
                        help="bound of each step and of each operation in a sweep")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="hard bound of the whole checkup (default: from the others)")
    parser.add_argument("--out", type=Path, help="result file (default "
                        "$ORCHESTRATE_RUN_DIR/checkup.json)")
    parser.add_argument("--node-names", default=None,
                        help="node names in GROUP_RANK order, comma-separated (default "
                        "$ORCHESTRATE_NODE_NAMES; else Slurm's SLURMD_NODENAME, else "
                        "'node <GROUP_RANK>')")
    parser.add_argument("--nodes", type=int, default=None,
                        help="how many nodes take part (default: from the node names, else "
                        "WORLD_SIZE / LOCAL_WORLD_SIZE)")
    parser.add_argument("--connect-window-s", type=float, default=20.0,
                        help="how long the roll call on MASTER_PORT waits for every node "
                        "(static and connect tiers)")
    args = parser.parse_args(list(argv) if argv is not None else None)

    problems: list[Problem] = []

    def bad(field: str, message: str, got: object) -> None:
        problems.append(Problem(message, source="command line", field=field, got=str(got)))

    tiers: list[str] = []
    for item in args.tier or ["smoke"]:
        for tier in (t.strip() for t in item.split(",")):
            if tier == "all":
                tiers.extend(TIERS)
            elif tier in TIERS:
                tiers.append(tier)
            else:
                bad("--tier", "must be static, connect, smoke, bandwidth or all", tier)
    if "bandwidth" in tiers:
        tiers.append("smoke")
    sizes: tuple[int, ...] | None = None
    if args.sizes:
        try:
            sizes = tuple(sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()}))
        except ValueError as exc:
            bad("--sizes", str(exc), args.sizes)
    pair: int | None = None
    if args.pair_size:
        try:
            pair = parse_size(args.pair_size)
        except ValueError as exc:
            bad("--pair-size", str(exc), args.pair_size)
    for name in ("warmup", "iters", "min_iters"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            bad("--" + name.replace("_", "-"), "is too small", getattr(args, name))
    for name in ("join_timeout_s", "timeout_s", "connect_window_s"):
        if not getattr(args, name) > 0:
            bad("--" + name.replace("_", "-"), "must be a positive number of seconds",
                getattr(args, name))
    given = args.node_names if args.node_names is not None else environ.get(
        "ORCHESTRATE_NODE_NAMES", "")
    names = tuple(n.strip() for n in given.split(","))
    if args.nodes is not None and args.nodes < 1:
        bad("--nodes", "must be at least 1", args.nodes)
    if problems:
        raise UserError(problems)
    return Options(
        tiers=tuple(t for t in TIERS if t in tiers),
        sizes=sizes,
        pair_bytes=pair,
        warmup=max(1, args.warmup),
        iters=args.iters,
        min_iters=min(args.min_iters, args.iters),
        budget_s=max(0.0, args.budget_s),
        join_timeout_s=args.join_timeout_s,
        timeout_s=args.timeout_s,
        deadline_s=args.deadline_s,
        out=args.out,
        names=names if any(names) else (),
        nodes=args.nodes,
        window_s=args.connect_window_s,
    )


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


class _Stop(Exception):
    """Leave the checkup with this exit status (the failure was reported)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Checkup:
    """One rank's checkup."""

    def __init__(self, options: Options, place: DistEnv, environ: Mapping[str, str]) -> None:
        import torch

        from orchestrate.doctor.checkup.control import Control, Watchdog

        self.options = options
        self.place = place
        self.rank = place.rank
        self.node = node_name(options.names, place.group_rank,
                              environ.get("SLURMD_NODENAME") or None)
        self.started = time.monotonic()
        cuda = torch.cuda.is_available() and torch.cuda.device_count() > place.local_rank
        self.device = torch.device("cuda", place.local_rank) if cuda else torch.device("cpu")
        self.environ = environ
        from orchestrate.train.distributed import backend_from

        self.backend = backend_from(environ, cuda)  # a UserError here: exit 2
        self.gloo: Any = None  # the gloo group for monitored_barrier (None: the default group)
        self.control = Control(place.master_addr, place.master_port, self.rank,
                               place.world_size)
        self.sizes = options.sizes or tuple(
            parse_size(s) for s in (GPU_SIZES if cuda else CPU_SIZES).split(",")
        )
        self.pair_bytes = options.pair_bytes or parse_size(GPU_PAIR if cuda else CPU_PAIR)
        self.steps_s: dict[str, float] = {}
        self.roster: list[dict[str, Any]] = []
        self.node_of: dict[int, str] = {}
        self._failing = False
        self._fail_lock = threading.Lock()
        self.watchdog = Watchdog(self._expired, self._deadline(), backstop_s=GRACE_S + 15)

    # -- bounds ----------------------------------------------------------------------------

    def _wait_bound(self) -> float:
        """How long a rank may legitimately wait for others in one bandwidth step."""
        o = self.options
        return 1.5 * o.budget_s + (o.warmup + o.min_iters + 2) * o.timeout_s

    def _round_bound(self) -> float:
        return round_bound(self.options)

    def _deadline(self) -> float:
        # The node tiers ran before this rank's clock started (rank 0) or ran meanwhile on
        # its leader (other ranks, which count them in through the join allowance).
        return deadline_s(self.options, len(self.sizes), node_count(self.options, self.place))

    @contextmanager
    def step(self, name: str, bound_s: float) -> Iterator[None]:
        """Run one named, bounded step; an error in it takes the failure path."""
        self.watchdog.arm(name, bound_s)
        began = time.monotonic()
        try:
            self.control.enter(name)
            yield
        except _Stop:
            raise
        except Exception as exc:
            kind = _kind(exc)
            if kind == "local":  # not a peer's doing: the traceback helps whoever fixes it
                traceback.print_exc()
            raise _Stop(self._fail(name, kind, _one_line(exc))) from None
        self.steps_s[name] = time.monotonic() - began

    # -- the failure path --------------------------------------------------------------------

    def _expired(self, step: str, kind: str, detail: str) -> None:
        """The watchdog's way in (its thread): a step timed out, or rank 0 said stop."""
        self._fail(step, "timeout" if kind == "timeout" else "collective", detail,
                   aborted=kind == "aborted")

    def _fail(self, step: str, kind: Kind, detail: str, aborted: bool = False) -> int:
        """Report a failure of this rank; on rank 0, also find whom to blame and write the
        result. Returns the exit status (or never returns, when another thread got here
        first and will exit the process)."""
        with self._fail_lock:
            if self._failing:
                threading.Event().wait(GRACE_S + 20)  # the other path exits the process
                return EXIT_FAILED
            self._failing = True
        tier = "smoke" if step in SMOKE_STEPS or "bandwidth" not in self.options.tiers \
            else "bandwidth"
        report = {"step": step, "kind": "aborted" if aborted else kind, "detail": detail}
        told_master = False
        try:
            self.control.report_failure(report)
            told_master = True
        except Exception as exc:
            report["detail"] += f" (and rank 0's store did not answer: {_one_line(exc)})"
        if self.rank == 0 and told_master:
            failure = self._collect(tier, step)
            self._write(self._result(failure))
            print(f"checkup: FAILED in {failure.step}: {failure.detail}", file=sys.stderr,
                  flush=True)
            with suppress(Exception):
                self.control.mark_done()
        else:
            if aborted:
                print(f"checkup: rank {self.rank} ({self.node}) stopped in {step}: {detail}",
                      file=sys.stderr, flush=True)
            else:
                print(f"checkup: rank {self.rank} ({self.node}) failed in {step}: "
                      f"{report['detail']}", file=sys.stderr, flush=True)
            if not told_master or self.rank == 0:
                own = Failure(tier=tier, step=step, detail=f"rank {self.rank} ({self.node}) "
                              f"failed in {step}: {report['detail']}", ranks=(self.rank,),
                              nodes=(self.node,), per_rank={self.rank: report["detail"]})
                self._write(self._result(own), rank_file=self.rank != 0)
            if told_master and self.rank != 0:
                self.control.wait_done(LINGER_S)
        return EXIT_FAILED

    def _collect(self, tier: str, step: str) -> Failure:
        """Rank 0: stop everyone, wait for their reports, and decide whom to blame."""
        control = self.control
        with suppress(Exception):
            control.stop_all(f"rank 0 stopped the checkup: a rank failed in {step}")
        reports: dict[int, Report] = {}
        aborted: dict[int, Report] = {}
        pending = set(range(self.place.world_size))
        deadline = time.monotonic() + GRACE_S
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                try:
                    state = control.accounted(r)
                    if state == "fail":
                        data = control.read("fail", r)
                        rep = Report(str(data["step"]), data["kind"] if data["kind"] != "aborted"
                                     else "collective", str(data["detail"]))
                        (aborted if data["kind"] == "aborted" else reports)[r] = rep
                        pending.discard(r)
                    elif state == "result":
                        pending.discard(r)
                except Exception:
                    pass
            if pending:
                time.sleep(0.1)
        silent = sorted(pending)
        last: dict[int, str] = {}
        for r in silent:
            try:
                seen = control.last_step(r)
            except Exception:
                seen = None
            if seen:
                last[r] = seen
        if not reports and aborted:
            reports = aborted  # everyone was waiting: name them all
        failure = blame(tier, step, reports, silent, last, self.node_of)
        for r, rep in aborted.items():
            failure.per_rank.setdefault(r, f"{rep.step}: waiting ({rep.detail})")
        return failure

    # -- results -------------------------------------------------------------------------------

    def _out(self) -> Path:
        if self.options.out is not None:
            return self.options.out
        run_dir = self.environ.get("ORCHESTRATE_RUN_DIR", "").strip()
        return (Path(run_dir) if run_dir else Path.cwd()) / layout.CHECKUP_RESULT

    def _write(self, result: CheckupResult, rank_file: bool = False) -> None:
        """Write the result file and print it as a marked line (files on an SSH host stay
        there; the output comes back)."""
        data = result.to_json()
        transcript.emit({**data, "kind": "rank" if rank_file else "result",
                         "rank": self.rank, "node": self.node})
        path = self._out()
        if rank_file:
            path = path.with_name(layout.checkup_rank_result(self.rank))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            print(f"checkup: could not write {path}: {exc}", file=sys.stderr, flush=True)

    def _result(self, failure: Failure | None, **figures: Any) -> CheckupResult:
        nodes = tuple(dict.fromkeys(m["node"] for m in self.roster)) or (self.node,)
        return CheckupResult(
            tiers=self.options.tiers,
            backend=self.backend,
            world_size=self.place.world_size,
            nodes=nodes,
            ranks=tuple(self.roster),
            elapsed_s=time.monotonic() - self.started,
            steps_s=dict(self.steps_s),
            failure=failure,
            **figures,
        )

    # -- the steps -------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._join()
            self._smoke()
            figures: dict[str, Any] = {}
            if "bandwidth" in self.options.tiers:
                figures = self._bandwidth()
            return self._finish(figures)
        except _Stop as stop:
            return stop.status
        finally:
            self.watchdog.stop()

    def _info(self) -> dict[str, Any]:
        import torch

        device = str(self.device)
        if self.device.type == "cuda":
            device += " " + torch.cuda.get_device_name(self.device)
        nccl = None
        if self.device.type == "cuda":
            try:
                version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
                nccl = ".".join(str(v) for v in version)
            except Exception:
                nccl = None
        return {
            "rank": self.rank,
            "local_rank": self.place.local_rank,
            "local_world_size": self.place.local_world_size,
            "group_rank": self.place.group_rank,
            "node": self.node,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": device,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": nccl,
        }

    def _join(self) -> None:
        o = self.options
        place = self.place
        # Other ranks start joining while rank 0's node leader is still in the node tiers.
        wait_s = o.join_timeout_s + (0.0 if self.rank == 0 else o.join_allowance_s)
        bound = wait_s + (5 if self.rank == 0 else 10)
        self.watchdog.arm("join", bound)
        began = time.monotonic()
        try:
            self.control.connect(wait_s)
        except Exception as exc:
            detail = (f"could not reach rank 0's store at {self.control.master} within "
                      f"{wait_s:g} s: {_one_line(exc)}")
            if self.rank == 0:
                detail = (f"could not listen on MASTER_PORT {place.master_port} "
                          f"({self.control.master}): {_one_line(exc)}")
            raise _Stop(self._fail_alone("join", detail)) from None
        info = self._info()
        self.control.announce(info)
        self.watchdog.polling(self._poll)
        if self.rank == 0:
            deadline = began + o.join_timeout_s
            while (self.control.joined_count() < place.world_size
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            joined = self.control.joined()
            members = self.control.members(joined)
            self.roster = members
            self.node_of = {int(m["rank"]): str(m["node"]) for m in members}
            missing = [r for r in range(place.world_size) if r not in joined]
            if missing:
                where = locate(missing, [
                    Member(int(m["rank"]), str(m["node"]),
                           int(m["rank"]) - int(m["local_rank"]), int(m["local_world_size"]))
                    for m in members
                ], o.names)
                failure = never_joined(missing, {**self.node_of, **where}, place.world_size,
                                       o.join_timeout_s, self.control.master)
                self._failing = True
                # Written (and printed) before the others are told: they exit at once, and
                # a launcher stops rank 0 at the first non-zero exit.
                self._write(self._result(failure))
                print(f"checkup: FAILED in join: {failure.detail}", file=sys.stderr, flush=True)
                self.control.publish_roster({"ok": False, "failure": failure.to_json()})
                self.control.wait_roster_read(len(joined) - 1, GRACE_S)
                raise _Stop(EXIT_FAILED)
            self.control.publish_roster({"ok": True, "ranks": members})
        else:
            try:
                roster = self.control.roster(wait_s + 5)
            except Exception as exc:
                raise _Stop(self._fail_alone(
                    "join", f"rank 0 did not answer within {wait_s + 5:g} s: "
                    f"{_one_line(exc)}")) from None
            if not roster.get("ok"):
                failure = Failure.from_json(roster["failure"])
                self._failing = True
                print(f"checkup: rank {self.rank} ({self.node}) stopped: {failure.detail}",
                      file=sys.stderr, flush=True)
                raise _Stop(EXIT_FAILED)
            self.roster = list(roster["ranks"])
            self.node_of = {int(m["rank"]): str(m["node"]) for m in self.roster}
        self.steps_s["join"] = time.monotonic() - began

    def _fail_alone(self, step: str, detail: str) -> int:
        """A failure before rank 0 can be told: print it and write this rank's own file."""
        with self._fail_lock:
            self._failing = True
        failure = Failure(tier="smoke", step=step,
                          detail=f"rank {self.rank} ({self.node}) failed in {step}: {detail}",
                          ranks=(self.rank,), nodes=(self.node,), per_rank={self.rank: detail})
        self._write(self._result(failure), rank_file=self.rank != 0)
        print(f"checkup: {failure.detail}", file=sys.stderr, flush=True)
        return EXIT_FAILED

    def _poll(self) -> str | None:
        """The watchdog's question, every second: should this rank stop?"""
        if self._failing:
            return None
        if self.rank == 0:
            if self.control.failures() > 0:
                return "another rank reported a failure"
            return None
        return self.control.stop_reason()

    def _smoke(self) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]

        from orchestrate.doctor.checkup.measure import checked_all_reduce

        o = self.options
        place = self.place
        pg_timeout = timedelta(seconds=max(o.timeout_s, self._wait_bound(),
                                           self._round_bound()) + 10)
        with self.step("init", o.timeout_s):
            assert self.control.store is not None
            if self.device.type == "cuda":
                import torch

                torch.cuda.set_device(self.device)
            dist.init_process_group(
                self.backend,
                store=PrefixStore("checkup-pg/", self.control.store),
                rank=place.rank,
                world_size=place.world_size,
                timeout=pg_timeout,
                device_id=self.device if self.backend == "nccl" else None,
            )
            self.gloo = None if self.backend == "gloo" else dist.new_group(
                backend="gloo", timeout=pg_timeout)
        with self.step("monitored_barrier", o.timeout_s + 5):
            dist.monitored_barrier(group=self.gloo, timeout=timedelta(seconds=o.timeout_s),
                                   wait_all_ranks=True)
        with self.step("barrier", o.timeout_s):
            dist.barrier()
        with self.step("all_reduce", o.timeout_s):
            checked_all_reduce(self.device, place.rank, place.world_size)

    def _bandwidth(self) -> dict[str, Any]:
        from orchestrate.doctor.checkup.measure import Bench, Budget, node_groups

        o = self.options
        bench = Bench(self.device, Budget(o.warmup, o.iters, o.min_iters, o.budget_s),
                      self.gloo, self.watchdog.tick)
        nodes = list(dict.fromkeys(m["node"] for m in self.roster))
        members = [sorted(int(m["rank"]) for m in self.roster if m["node"] == n) for n in nodes]
        mine = nodes.index(self.node)
        part: dict[str, Any] = {"world": [], "intra": [], "pairs": []}
        for nbytes in self.sizes:
            with self.step(f"all_reduce {human(nbytes)}", o.timeout_s):
                iters, mean = bench.all_reduce_size(nbytes, None, True)
            part["world"].append([nbytes, iters, mean])
        if len(nodes) > 1 and any(len(m) > 1 for m in members):
            with self.step("intra-node groups", o.timeout_s):
                groups = node_groups(members, self.backend, self._wait_bound() + 10)
            group = groups[mine]
            for nbytes in self.sizes:
                bound = o.timeout_s if group is not None else self._wait_bound()
                with self.step(f"intra-node all_reduce {human(nbytes)}", bound):
                    iters, mean = bench.all_reduce_size(nbytes, group, group is not None)
                if group is not None:
                    part["intra"].append([nbytes, iters, mean])
        leader = members[mine][0] == self.rank
        for number, pairs in enumerate(pair_rounds(len(nodes)), start=1):
            partner = next((b if a == mine else a for a, b in pairs if mine in (a, b)), None)
            if leader and partner is not None:
                a, b = sorted((mine, partner))
                name = f"pairs round {number} ({nodes[a]} <-> {nodes[b]})"
                with self.step(name, o.timeout_s):
                    for sender, receiver in ((a, b), (b, a)):
                        if sender == mine:
                            iters, mean = bench.send_to(members[receiver][0], self.pair_bytes)
                            part["pairs"].append([receiver, self.pair_bytes, iters, mean])
                        else:
                            bench.receive_from(members[sender][0], self.pair_bytes)
            with self.step(f"pairs round {number} done", self._round_bound()):
                import torch.distributed as dist

                dist.barrier(group=self.gloo)
        return part

    def _finish(self, part: dict[str, Any]) -> int:
        import torch.distributed as dist

        o = self.options
        part = {**part, "steps_s": self.steps_s}
        with self.step("gather", o.timeout_s):
            self.control.post_result(part)
            parts = self.control.results(o.timeout_s) if self.rank == 0 else {}
        result = None
        if self.rank == 0:
            figures = self._figures(parts) if "bandwidth" in o.tiers else {}
            result = self._result(None, **figures)
            self._write(result)
        self.watchdog.polling(None)
        with self.step("leave", o.timeout_s):
            dist.destroy_process_group()
        if result is not None:
            print(summary(result, self._out()), flush=True)
        else:
            print(f"checkup: rank {self.rank} ({self.node}) ok", flush=True)
        return EXIT_OK

    def _figures(self, parts: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """Rank 0: every rank's timings into sweeps and the node matrix."""
        nodes = list(dict.fromkeys(m["node"] for m in self.roster))
        ranks_of = {n: sorted(int(m["rank"]) for m in self.roster if m["node"] == n)
                    for n in nodes}
        world_size = self.place.world_size
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
            pairs = PairMatrix(tuple(nodes), self.pair_bytes,
                               tuple(tuple(row) for row in matrix))
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


def _kind(exc: BaseException) -> Kind:
    """How a step failed: a checked result differed (wrong), this rank's own trouble (local:
    memory, a bug), or a collective that broke, usually because of a peer."""
    import torch

    from orchestrate.doctor.checkup.measure import CheckFailed

    if isinstance(exc, CheckFailed):
        return "wrong"
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError, ValueError, TypeError,
                        AttributeError, KeyError, IndexError, AssertionError)):
        return "local"
    return "collective"


_SOURCE_REF = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _one_line(exc: BaseException) -> str:
    """An error as one short line: c10d's source references and gloo's boilerplate go."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = _SOURCE_REF.sub("", text).split(" This is typically caused by")[0]
    return text if len(text) < 400 else text[:397] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, then run the checkup on this rank."""
    try:
        options = parse_options(argv, os.environ)
        place = parse_dist_env(os.environ)
    except UserError as exc:
        print(f"checkup: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # c10d logs every retry and failure with a C++ stack; the checkup reports each failure in
    # one line of its own, so keep those out of the ranks' logs (TORCH_CPP_LOG_LEVEL=INFO to
    # see them).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    node = node_name(options.names, place.group_rank, os.environ.get("SLURMD_NODENAME") or None)
    if options.node_tiers and place.local_rank == 0:
        from orchestrate.doctor.checkup import leader

        leader.run(options.tiers, node=node, group_rank=place.group_rank or 0, rank=place.rank,
                   nodes=node_count(options, place), master_addr=place.master_addr,
                   master_port=place.master_port, window_s=options.window_s,
                   environ=os.environ)
        print(f"checkup: node tiers ({', '.join(t for t in options.tiers if t in NODE_TIERS)})"
              f" done on {node}", flush=True)
    if not options.rank_tiers:
        return EXIT_OK
    try:
        checkup = Checkup(options, place, os.environ)
    except UserError as exc:
        print(f"checkup: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as exc:  # no torch for this python: say so where the doctor looks
        detail = f"rank {place.rank} ({node}) cannot import torch: {_one_line(exc)}"
        failure = Failure(tier="smoke", step="start", detail=detail, ranks=(place.rank,),
                          nodes=(node,), per_rank={place.rank: _one_line(exc)})
        transcript.emit({"kind": "rank", "rank": place.rank, "node": node, "ok": False,
                         "tiers": [t for t in options.tiers if t in RANK_TIERS],
                         "world_size": place.world_size, "nodes": [node],
                         "failure": failure.to_json()})
        print(f"checkup: {detail}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    status = checkup.run()
    if status != EXIT_OK:
        # Skip the process group's teardown: after a failure it can block on dead peers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


__all__ = ["main", "parse_options", "parse_size"]
