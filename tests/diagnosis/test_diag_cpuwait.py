"""A rank computing on an overloaded machine is computing: the kernel's run-queue wait.

Timing run T1 (2026-12-05, load 16 on 2 cores) killed a healthy job as stalled: its rank, in
one long CPU step, got 12% of a core, below the stall rule's bar. Here six real spinning
processes share one core: each uses a sixth of it, yet its time on the CPU plus its time
runnable but waiting (``/proc/PID/task/TID/schedstat``) is the whole wall time, and the stall
rule calls it computing from those two numbers, as the sidecar's heartbeats carry them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrate.diagnosis.diagfiles import Heartbeat
from orchestrate.diagnosis.stallrule import BUSY_CPU, activity
from orchestrate.diagnosis.threadstate import read_thread, run_wait

pytestmark = [pytest.mark.process, pytest.mark.timing]

SPINNERS = 6  # one core shared six ways: a sixth each, below BUSY_CPU


def _beat(pid: int, n: int, with_wait: bool = True) -> Heartbeat:
    cpu, _ = read_thread(str(pid), pid)
    wait = run_wait(str(pid), pid) if with_wait else None
    return Heartbeat(pid=pid, beat=n, t=time.time(), phase="running", main_cpu_s=cpu,
                     main_wait_s=wait)


def test_processes_sharing_one_core_are_computing_though_each_gets_a_sixth() -> None:
    if run_wait("self", int(os.getpid())) is None:
        pytest.skip("this kernel keeps no scheduler statistics (/proc/self/schedstat)")
    core = min(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(SPINNERS)]
    try:
        time.sleep(1.0)  # all pinned and spinning
        first = {p.pid: (_beat(p.pid, 1), _beat(p.pid, 1, with_wait=False)) for p in spinners}
        time.sleep(4.0)
        for p in spinners:
            before, before_cpu_only = first[p.pid]
            now = _beat(p.pid, 2)
            span = float(now.t or 0) - float(before.t or 0)
            used = (float(now.main_cpu_s or 0) - float(before.main_cpu_s or 0)) / span
            wanted = used + (float(now.main_wait_s or 0) - float(before.main_wait_s or 0)) / span
            assert used < BUSY_CPU, (used, "the core was not shared")
            assert wanted > 0.8, (used, wanted)
            assert activity(now, before) == "computing"
            # the CPU time alone would have said it waits
            assert activity(_beat(p.pid, 2, with_wait=False), before_cpu_only) is None
    finally:
        for p in spinners:
            p.kill()
            p.wait()
