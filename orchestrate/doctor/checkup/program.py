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
step passed (the node tiers are judged by the doctor, not here), 1 when one failed, 2 for bad
arguments or a bad environment.

What to run and the bounds are :mod:`orchestrate.doctor.checkup.options`; what a rank does when
a step fails, and how rank 0 decides whom to blame, :mod:`orchestrate.doctor.checkup.failing`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orchestrate.core import layout
from orchestrate.core.errors import UserError
from orchestrate.doctor.checkup import transcript
from orchestrate.doctor.checkup.blame import Member, kind_of, locate, never_joined, one_line
from orchestrate.doctor.checkup.failing import GRACE_S, FailurePath
from orchestrate.doctor.checkup.options import (
    CPU_PAIR,
    CPU_SIZES,
    GPU_PAIR,
    GPU_SIZES,
    NODE_TIERS,
    RANK_TIERS,
    Options,
    deadline_s,
    human,
    node_count,
    node_name,
    parse_options,
    parse_size,
    round_bound,
)
from orchestrate.doctor.checkup.result import CheckupFailure, CheckupResult, figures_of, summary
from orchestrate.doctor.checkup.schedule import pair_rounds
from orchestrate.train.env import DistEnv, parse_dist_env

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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
        self.failures = FailurePath(self.control, self.rank, self.node, options.tiers,
                                    lambda failure, own: self._write(self._result(failure),
                                                                     rank_file=own))
        self.watchdog = Watchdog(self.failures.expired, self._deadline(),
                                 backstop_s=GRACE_S + 15)

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
            kind = kind_of(exc)
            if kind == "local":  # not a peer's doing: the traceback helps whoever fixes it
                traceback.print_exc()
            self.failures.fail(name, kind, one_line(exc))
            raise _Stop(EXIT_FAILED) from None
        self.steps_s[name] = time.monotonic() - began

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

    def _result(self, failure: CheckupFailure | None, **figures: Any) -> CheckupResult:
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
        """``join``: every rank reaches rank 0's store; rank 0 waits for them all and publishes
        the roster (or who never joined), the others read it."""
        o = self.options
        # Other ranks start joining while rank 0's node leader is still in the node tiers.
        wait_s = o.join_timeout_s + (0.0 if self.rank == 0 else o.join_allowance_s)
        self.watchdog.arm("join", wait_s + (5 if self.rank == 0 else 10))
        began = time.monotonic()
        try:
            self.control.connect(wait_s)
        except Exception as exc:
            detail = (f"could not reach rank 0's store at {self.control.master} within "
                      f"{wait_s:g} s: {one_line(exc)}")
            if self.rank == 0:
                detail = (f"could not listen on MASTER_PORT {self.place.master_port} "
                          f"({self.control.master}): {one_line(exc)}")
            self.failures.alone("join", detail)
            raise _Stop(EXIT_FAILED) from None
        self.control.announce(self._info())
        self.watchdog.polling(self.failures.poll)
        self.roster = self._gather_roster(began) if self.rank == 0 else self._read_roster(wait_s)
        self.failures.node_of = {int(m["rank"]): str(m["node"]) for m in self.roster}
        self.steps_s["join"] = time.monotonic() - began

    def _gather_roster(self, began: float) -> list[dict[str, Any]]:
        """Rank 0: wait (at most the join timeout) for every rank, then publish who joined, or
        fail naming the ranks that never did."""
        o, world_size = self.options, self.place.world_size
        while (self.control.joined_count() < world_size
               and time.monotonic() < began + o.join_timeout_s):
            time.sleep(0.02)
        joined = self.control.joined()
        members = self.control.members(joined)
        missing = [r for r in range(world_size) if r not in joined]
        if not missing:
            self.control.publish_roster({"ok": True, "ranks": members})
            return members
        self.roster = members
        node_of = {int(m["rank"]): str(m["node"]) for m in members}
        where = locate(missing, [
            Member(int(m["rank"]), str(m["node"]),
                   int(m["rank"]) - int(m["local_rank"]), int(m["local_world_size"]))
            for m in members
        ], o.names)
        failure = never_joined(missing, {**node_of, **where}, world_size, o.join_timeout_s,
                               self.control.master)
        self.failures.failing = True
        # Written (and printed) before the others are told: they exit at once, and a launcher
        # stops rank 0 at the first non-zero exit.
        self._write(self._result(failure))
        print(f"checkup: FAILED in join: {failure.detail}", file=sys.stderr, flush=True)
        self.control.publish_roster({"ok": False, "failure": failure.to_json()})
        self.control.wait_roster_read(len(joined) - 1, GRACE_S)
        raise _Stop(EXIT_FAILED)

    def _read_roster(self, wait_s: float) -> list[dict[str, Any]]:
        """A rank other than 0: the roster rank 0 published (or its verdict on the join)."""
        try:
            roster = self.control.roster(wait_s + 5)
        except Exception as exc:
            self.failures.alone("join", f"rank 0 did not answer within {wait_s + 5:g} s: "
                                f"{one_line(exc)}")
            raise _Stop(EXIT_FAILED) from None
        if not roster.get("ok"):
            failure = CheckupFailure.from_json(roster["failure"])
            self.failures.failing = True
            print(f"checkup: rank {self.rank} ({self.node}) stopped: {failure.detail}",
                  file=sys.stderr, flush=True)
            raise _Stop(EXIT_FAILED)
        return list(roster["ranks"])

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
            figures = figures_of(parts, self.roster, self.place.world_size,
                                 self.pair_bytes) if "bandwidth" in o.tiers else {}
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
                   environ=os.environ, names=options.names)
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
        detail = f"rank {place.rank} ({node}) cannot import torch: {one_line(exc)}"
        failure = CheckupFailure(tier="smoke", step="start", detail=detail, ranks=(place.rank,),
                          nodes=(node,), per_rank={place.rank: one_line(exc)})
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


__all__ = ["main"]
