"""Busy ranks, the DataLoader's wait and slow I/O as pure functions: the stall rule's
``activity`` and ``busy_s``, the kernel's view of a thread, the workers' sections of a stacks
file, and the sentences that name them."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrate.diagnosis.diagfiles import Answer, Heartbeat
from orchestrate.diagnosis.hangwatch import held_off
from orchestrate.diagnosis.kernelstate import KernelState
from orchestrate.diagnosis.stacks import parse_stacks, waits_for_loader_worker, worker_stacks
from orchestrate.diagnosis.stall import classify
from orchestrate.diagnosis.stallrule import Stall, StallWatch, activity
from orchestrate.diagnosis.threadstate import syscall_of

pytestmark = pytest.mark.unit

READING = {"state": "S", "wchan": "pipe_read", "syscall": "read", "target": "/ckpt/x.pt"}


def beat(n: int, t: float | None, *, phase: str = "running", cpu: float = 0.0, done: int = 9,
         enqueued: int = 9, proc: dict[str, Any] | None = None, pid: int = 7,
         **fields: Any) -> Heartbeat:
    """A made-up heartbeat: ``n``-th beat at rank clock ``t``, one process group."""
    found = Heartbeat.from_json({
        "pid": pid, "beat": n, "t": t, "phase": phase, "main_cpu_s": cpu,
        "pgs": [{"pg": "0", "enqueued": enqueued, "completed": done}], "proc": proc, **fields})
    assert found is not None
    return found


# --- the kernel's view --------------------------------------------------------------------


def test_file_io_is_a_file_system_call_on_a_file_or_an_uninterruptible_wait() -> None:
    assert KernelState("S", "pipe_read", "read", "/data/shard.bin").file_io()
    assert KernelState("S", "fuse_wait", "openat", None).file_io()  # by path: no descriptor
    assert KernelState("D", "nfs_wait_bit", None, None).file_io()
    assert not KernelState("S", "sk_wait_data", "read", "socket:[77]").file_io()
    assert not KernelState("S", "pipe_read", "read", "pipe:[12]").file_io()  # another process
    assert not KernelState("S", "pipe_read", "read", "fd 9").file_io()  # unknown: not I/O
    assert not KernelState("S", "futex_wait", "futex", None).file_io()
    assert not KernelState("S", "hrtimer_nanosleep", "clock_nanosleep", None).file_io()
    assert not KernelState("R").file_io()
    assert KernelState("S", "pipe_read", "read", "/ckpt/x.pt").io_text() == (
        "read of /ckpt/x.pt (pipe_read)")
    assert KernelState("D", "nfs_wait_bit").io_text() == "disk wait (nfs_wait_bit)"
    state = KernelState("S", "pipe_read", "read", "/x")
    assert KernelState.from_json(state.to_json()) == state
    assert KernelState.from_json({"state": "S", "wchan": None}) == KernelState("S")


def test_syscall_files_are_named_and_their_descriptor_resolved() -> None:
    assert syscall_of("running") == (None, None)
    assert syscall_of("-1 0x7ffd 0x7f00") == (None, None)
    assert syscall_of(None) == (None, None)
    name, target = syscall_of("0 0x0 0x7fa1 0x1 0x0 0x0 0x0 0x7ffe 0x7fa1")  # read(0, ...)
    assert name == "read" and target is not None  # fd 0 of this test process
    assert syscall_of("230 0x1 0x0 0x7ffe 0x0 0x0 0x0 0x7ffe 0x7f")[0] == "clock_nanosleep"
    assert syscall_of("999 0x1")[0] == "#999"


# --- activity and the rule ------------------------------------------------------------------


def test_activity_names_what_keeps_a_rank_busy() -> None:
    before = beat(1, 100.0, cpu=5.0, done=9)
    assert activity(beat(2, 101.0, cpu=5.9, done=9), before) == "computing"
    assert activity(beat(2, 101.0, cpu=5.1, done=9), before) is None  # 10% of a core: waits
    assert activity(beat(2, 101.0, cpu=5.9, done=8), before) is None  # a collective in flight
    assert activity(beat(2, 101.0, cpu=5.9, pid=8), before) is None  # another process
    assert activity(beat(2, 101.0, proc=READING), before) == "in slow I/O"
    assert activity(beat(2, 101.0, phase="checkpoint", done=8), before) == "in checkpoint"
    assert activity(beat(2, 101.0, phase="eval"), None) == "in eval"
    assert activity(beat(2, 101.0, phase="init_process_group", cpu=9.0), before) is None
    # without the ranks' clocks, the watch's
    assert activity(beat(2, None, cpu=6.0), beat(1, None), 1.0) == "computing"


def _watch_until(watch: StallWatch, beats_at: Any, end: int, alive: Any = None) -> list[Any]:
    found = []
    for t in range(end):
        stall = watch.observe(float(t), beats_at(t), alive or {0: True, 1: True})
        if stall is not None:
            found.append((t, stall))
    return found


def test_waiting_for_a_cpu_is_computing_on_an_overloaded_machine() -> None:
    """At load 16 on 2 cores a rank in one long CPU step gets 12% of a core (timing run T1 of
    2026-12-05 killed such a job as stalled): its time runnable on the run queue counts."""
    before = beat(1, 100.0, cpu=5.0, main_wait_s=40.0)
    assert activity(beat(2, 101.0, cpu=5.12, main_wait_s=40.85), before) == "computing"
    assert activity(beat(2, 101.0, cpu=5.12, main_wait_s=40.0), before) is None  # sleeps
    # the wait counts only when both beats carry it (a kernel without schedstat, an old file)
    assert activity(beat(2, 101.0, cpu=5.12, main_wait_s=40.85), beat(1, 100.0, cpu=5.0)) is None
    assert activity(beat(2, 101.0, cpu=5.12, main_wait_s=40.85, done=8), before) is None


def test_the_hold_names_the_rank_that_kept_the_job_active_even_if_its_last_beat_was_idle() -> None:
    """The notice used to read "but not stalled:  (" when the busy rank's latest beat happened
    to show no CPU: it names the rank busy within the bound."""
    watch = StallWatch(10, 1, busy_s=100)
    holds = []
    for t in range(30):
        cpu = 0.5 * t if t < 9 else 4.0  # computes until t=8, then one idle beat at the hold
        beats = {0: beat(t, float(t), cpu=cpu), 1: beat(t, float(t), done=8)}
        assert watch.observe(float(t), beats, {0: True, 1: True}) is None or t >= 18
        hold = watch.take_hold()
        if hold is not None:
            holds.append(hold)
    assert holds and holds[0].busy == {0: "computing"}, holds


def test_busy_ranks_hold_the_stall_until_busy_s() -> None:
    """Rank 0 checkpoints (no activity: it sleeps in I/O), rank 1 waits in its collective:
    not a stall at stall_s; one at busy_s, with the busy rank named."""
    watch = StallWatch(10, 1, busy_s=30)

    def beats_at(t: int) -> dict[int, Heartbeat]:
        return {0: beat(t, float(t), phase="checkpoint", proc=READING),
                1: beat(t, float(t), done=8)}

    found = _watch_until(watch, beats_at, 40)
    assert [t for t, _ in found] == [30]
    stall = found[0][1]
    assert (stall.reason, stall.threshold_s, stall.busy) == ("busy", 30.0, {0: "in slow I/O"})
    assert stall.describe() == ("no rank made progress for 30 s, busy longer than "
                                "distributed.busy_s (30 s): rank 0 in slow I/O")
    assert Stall.from_json(stall.to_json()) == stall


def test_the_hold_is_said_once_per_stretch() -> None:
    watch = StallWatch(10, 1, busy_s=100)
    holds = []
    for t in range(60):
        done = 8 if t < 30 else 9  # rank 0 finishes at 30: progress, a new stretch
        beats = {0: beat(t, float(t), cpu=0.5 * t, done=9 if t < 30 else 10,
                         enqueued=9 if t < 30 else 10), 1: beat(t, float(t), done=done)}
        assert watch.observe(float(t), beats, {0: True, 1: True}) is None
        hold = watch.take_hold()
        if hold is not None:
            holds.append((t, hold))
    assert [t for t, _ in holds] == [10, 40]
    hold = holds[0][1]
    assert hold.busy == {0: "computing"} and hold.busy_s == 100
    beats = {0: beat(9, 9.0, stack=[["/w/prog.py", 12, "work"]]), 1: beat(9, 9.0)}
    assert held_off(hold, beats, {0: "a", 1: "b"}) == (
        "no progress for 10 s, but not stalled: rank 0 (node a) computing at prog.py:12 `work` "
        "(a stall only after distributed.busy_s, 100 s without progress)")


def test_a_busy_rank_that_stops_being_busy_stalls_at_stall_s() -> None:
    """Slow I/O that ends in a sleep: the stall comes stall_s after the last busy look."""
    watch = StallWatch(10, 1, busy_s=1000)

    def beats_at(t: int) -> dict[int, Heartbeat]:
        proc = READING if t < 20 else {"state": "S", "wchan": "hrtimer_nanosleep"}
        return {0: beat(t, float(t), proc=proc), 1: beat(t, float(t), done=8)}

    found = _watch_until(watch, beats_at, 40)
    assert [t for t, _ in found] == [29] and found[0][1].reason == "no_progress"


def test_a_stale_busy_beat_proves_nothing() -> None:
    """A heartbeat that stopped changing (its sidecar stuck) keeps nobody busy: the stall comes
    at stall_s (and the silent rule names the rank)."""
    watch = StallWatch(10, 1, busy_s=1000, silent_s=100)
    stuck = beat(1, 1.0, phase="checkpoint", proc=READING)
    found = _watch_until(watch, lambda t: {0: stuck, 1: beat(t, float(t), done=8)}, 30)
    assert [t for t, _ in found] == [10] and found[0][1].reason == "no_progress"


def test_busy_s_is_never_below_the_stall_bound() -> None:
    assert StallWatch(10, 1).busy_s == 1800 and StallWatch(3600, 1).busy_s == 3600
    watch = StallWatch(10, 1, busy_s=10, step_factor=5)
    for step in range(6):
        watch.observe(4.0 * step, {0: beat(step, 4.0 * step, step=step)}, {0: True})
    assert watch.threshold() == 20.0 and watch.busy_bound() == 20.0


# --- the DataLoader's wait and its worker ---------------------------------------------------


LOADER = "/py/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
RANK_STACKS = f"""# orchestrate sidecar: rank 1 pid 500 host b at 1.0
# main thread 0x00000000000000aa; sidecar thread 0x00000000000000bb
# stdlib /py/lib/python3.11
Thread 0x00000000000000bb (most recent call first):
  File "/run/sidecar/_orchestrate_rank/sidecar.py", line 250 in answer

Current thread 0x00000000000000aa (most recent call first):
  File "/py/lib/python3.11/multiprocessing/connection.py", line 1136 in wait
  File "/py/lib/python3.11/queue.py", line 180 in get
  File "{LOADER}", line 1133 in _try_get_data
  File "{LOADER}", line 1295 in _get_data
  File "{LOADER}", line 1333 in _next_data
  File "/w/orchestrate/train/trainer.py", line 160 in _train_epoch

# worker pid 601: state S, wchan do_sys_poll, syscall poll, target -
# orchestrate worker of rank 1: pid 601 parent 500
# main thread 0x00000000000000c1
# stdlib /py/lib/python3.11
Current thread 0x00000000000000c1 (most recent call first):
  File "/py/lib/python3.11/multiprocessing/queues.py", line 113 in get
  File "/py/site-packages/torch/utils/data/_utils/worker.py", line 351 in _worker_loop

# worker pid 602: state S, wchan hrtimer_nanosleep, syscall clock_nanosleep, target -
# orchestrate worker of rank 1: pid 602 parent 500
# main thread 0x00000000000000c2
# stdlib /py/lib/python3.11
Current thread 0x00000000000000c2 (most recent call first):
  File "/w/stuck_data.py", line 32 in __getitem__
  File "/py/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", line 52 in fetch
"""


def test_the_workers_sections_are_not_the_rank_s_own_stack() -> None:
    frames, stdlib = parse_stacks(RANK_STACKS)
    assert [f.function for f in frames][:3] == ["wait", "get", "_try_get_data"]
    assert stdlib == "/py/lib/python3.11" and waits_for_loader_worker(frames)
    workers = worker_stacks(RANK_STACKS)
    assert [w.pid for w in workers] == [601, 602]
    assert workers[1].frames[0].text() == "stuck_data.py:32 `__getitem__`"
    assert workers[1].kernel == KernelState("S", "hrtimer_nanosleep", "clock_nanosleep", None)
    assert worker_stacks("no workers here") == []


def test_a_rank_waiting_for_its_dataloader_worker_names_the_worker() -> None:
    waiting = beat(9, 9.0, done=56, enqueued=56)
    ahead = beat(9, 9.0, done=56, enqueued=57)
    answers = {0: Answer(ahead, "", (), None), 1: Answer(waiting, RANK_STACKS, (), None)}
    found = classify({0: ahead, 1: waiting}, answers, 20.0, {0: "a", 1: "b"}, "a:29500")
    assert found.kind == "laggard" and found.ranks == (1,)
    assert found.summary.startswith(
        "rank 1 (node b) has not reached collective #57: it is in trainer.py:160 "
        "`_train_epoch`, waiting for a DataLoader worker (worker pid 602 is in "
        "stuck_data.py:32 `__getitem__`, sleeping: hrtimer_nanosleep); rank 0 waits in "
    ), found.summary


def test_slow_io_is_named_in_the_diagnosis() -> None:
    stuck = beat(9, 9.0, done=56, enqueued=56, proc=READING)
    ahead = beat(9, 9.0, done=56, enqueued=57)
    stacks = ('# main thread 0x00000000000000aa\nCurrent thread 0x00000000000000aa (most '
              'recent call first):\n  File "/w/ckpt.py", line 40 in save\n')
    answers = {0: Answer(ahead, "", (), None), 1: Answer(stuck, stacks, (), None)}
    found = classify({0: ahead, 1: stuck}, answers, 20.0, {0: "a", 1: "b"}, "a:29500")
    assert found.summary.startswith(
        "rank 1 (node b) has not reached collective #57: it is in ckpt.py:40 `save` (slow I/O: "
        "read of /ckpt/x.pt (pipe_read)); rank 0 waits in collective #57"), found.summary
