"""The shared lease book under load (issues 20 and 32): submit-to-running with many live leases
of several users against an empty book (ratio; issue 32's target: 1,000 leases within 1.2x),
submit-to-running with this checkout's checks (ancestors, owners, typed records) against an
older checkout's (``--before``; target within 1.05x), and the time from GPUs freeing to a
waiting job's rank running (target under 3 s). Fair share (issue 36): the same with 50 waiting
tickets of 5 users ahead in the book (the freed GPUs go to the next fair job; target under
1 s), and the queue's order computed for 1,000 waiting jobs (target under 10 ms).

Local backend, the lab server of issue 20 (2x A100 + 6x A6000) replayed by the stand-in
nvidia-smi. The leases are files of 5 users (as root they are written and handed to uids
1001-1005, as those users' own claims would be), each held by a live process of its user, so
every claim reads, validates and checks the liveness of all of them. The sides run interleaved,
rotated, so that machine noise hits each alike. The waiting case: job A holds both A100s until
it is cancelled, job B (``--wait``) wants them; measured from A's lease leaving the book to B's
rank's first statement (it writes ``time.time()``).

    python bench/shared_book.py [--runs 5] [--leases 1000] [--before /work/main]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.fakesmi import fake_nvidia_smi  # noqa: E402
from tests.support.labserver import LAB  # noqa: E402


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "orchestrate", *args], env=env,
                          capture_output=True, text=True, cwd=env["WORK"])
    if proc.returncode != 0:
        raise SystemExit(f"orchestrate {args} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def _running(env: dict[str, str], job: str) -> None:
    while True:
        status = json.loads(_cli(env, "status", job, "--json").stdout)
        if status["state"] == "RUNNING" and all(r["pid"] for r in status["ranks"]):
            return
        time.sleep(0.01)


def _fill(book: Path, holders: dict[int, int], count: int) -> None:
    host = book / os.uname().nodename
    host.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        uid = 1001 + n % 5
        holder = holders[uid]
        start = int(Path(f"/proc/{holder}/stat").read_text().rsplit(")", 1)[1].split()[19])
        path = host / f"other-{n}@{uid}.json"
        path.write_text(json.dumps({
            "job_id": f"other-{n}", "node": "localhost", "user": f"user{uid}", "uid": uid,
            "gpus": [], "slots": 0, "port": None, "holders": [[holder, start]],
            "since": time.time(), "left": []}))
        os.chown(path, uid, uid)


def _sleepers() -> dict[int, subprocess.Popen[bytes]]:
    """A live process of each of the 5 users: the holder of that user's leases."""
    return {uid: subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}",
                                   "--clear-groups", "sleep", "3600"])
            for uid in range(1001, 1006)}


def submit_to_running(env: dict[str, str], job: Path, tag: str, runs: int) -> list[float]:
    took = []
    for n in range(runs):
        job_id = f"s-{tag}-{n}-{os.getpid()}"
        start = time.perf_counter()
        _cli(env, "submit", str(job), "--detach", "--job-id", job_id)
        _running(env, job_id)
        took.append(time.perf_counter() - start)
        _cli(env, "cancel", job_id)
    return took


def free_to_running(env: dict[str, str], work: Path, runs: int, tag: str = "") -> list[float]:
    book = Path(env["ORCHESTRATE_LEASES"]) / os.uname().nodename
    took = []
    for n in range(runs):
        holder, waiter = f"fa{tag}-{n}-{os.getpid()}", f"fb{tag}-{n}-{os.getpid()}"
        stamp = work / f"{waiter}.t"
        hold = work / "hold.yaml"
        hold.write_text("name: hold\nresources: {nodes: 1, gpus_per_node: 2, gpu_model: "
                        "A100-80GB}\ncommand: [sleep, '600']\n")
        wait = work / "wait.yaml"
        wait.write_text("name: wait\nresources: {nodes: 1, gpus_per_node: 2, gpu_model: "
                        f"A100-80GB}}\ncommand: [python3, -c, 'import time; open(\"{stamp}\", "
                        "\"w\").write(repr(time.time()))']\n")
        _cli(env, "submit", str(hold), "--detach", "--job-id", holder)
        _cli(env, "submit", str(wait), "--detach", "--job-id", waiter, "--wait")
        lease = next(book.glob(f"{holder}@*.json"))
        cancel = subprocess.Popen([sys.executable, "-m", "orchestrate", "cancel", holder],
                                  env=env, cwd=env["WORK"], stdout=subprocess.DEVNULL)
        while lease.exists():
            time.sleep(0.005)
        freed = time.time()
        while not stamp.exists() or not stamp.read_text():
            time.sleep(0.01)
        took.append(float(stamp.read_text()) - freed)
        cancel.wait()
    return took


def _queue_of(host: Path, holders: dict[int, int], count: int, gpus: list[int]) -> None:
    """``count`` waiting tickets of 5 users for ``gpus`` (none of the bench's own GPUs), each
    held by a live process of its user, and each user's use of the last hours."""
    host.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for n in range(count):
        uid = 1001 + n % 5
        path = host / f"q-{n}@{uid}.ticket"
        path.write_text(json.dumps({
            "job_id": f"q-{n}", "uid": uid, "submitted_at": now - 60 + n * 0.1, "gpus": gpus,
            "holders": [[holders[uid], None]], "since": now}))
        os.chown(path, uid, uid)
    for uid in range(1001, 1006):
        used = host / f"old@{uid}.{os.urandom(8).hex()}.used"
        used.write_text(json.dumps({"units": uid - 1000, "start": now - 7200, "end": now - 60}))
        os.chown(used, uid, uid)


def queue_order(count: int = 1000, runs: int = 20) -> list[float]:
    """The fair order of ``count`` waiting jobs of 5 users (the pure code every claim runs)."""
    from orchestrate.hostside.fairshare import QueuePolicy, ordered
    from orchestrate.hostside.leaserecord import Ticket

    now = time.time()
    tickets = [Ticket(f"j{n}", 1001 + n % 5, now - n, gpus=[n % 8]) for n in range(count)]
    use = {1001 + n: 3600.0 * n for n in range(5)}
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        ordered(tickets, use, QueuePolicy(), now)
        took.append(time.perf_counter() - start)
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--before", type=Path, default=None,
                        help="an older checkout, run side by side with this one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    bin_dir = fake_nvidia_smi(work / "bin", LAB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), WORK=str(work),
               ORCHESTRATE_RUNS=str(work / "runs"), PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT))
    job = work / "job.yaml"
    job.write_text("name: s\nresources: {nodes: 1, gpus_per_node: 1}\ncommand: [sleep, '60']\n")
    sleepers = _sleepers()
    sides = {"empty book": dict(env, ORCHESTRATE_LEASES=str(work / "empty")),
             f"{args.leases} live leases": dict(env, ORCHESTRATE_LEASES=str(work / "full"))}
    if args.before is not None:
        sides["empty book, --before"] = dict(env, ORCHESTRATE_LEASES=str(work / "before"),
                                             PYTHONPATH=str(args.before.resolve()))
    try:
        _fill(work / "full", {uid: p.pid for uid, p in sleepers.items()}, args.leases)
        for n, side in enumerate(sides.values()):
            submit_to_running(side, job, f"warm{n}", 1)
        took: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for run in range(args.runs):
            for name in names[run % len(names):] + names[:run % len(names)]:
                took[name] += submit_to_running(sides[name], job,
                                                f"r{run}-{names.index(name)}", 1)
        freed = free_to_running(sides["empty book"], work, args.runs)
        fair = dict(env, ORCHESTRATE_LEASES=str(work / "fair"))
        _queue_of(work / "fair" / os.uname().nodename,
                  {uid: p.pid for uid, p in sleepers.items()}, 50, [2, 3, 4, 5, 6, 7])
        fair_freed = free_to_running(fair, work, args.runs, "fair")
    finally:
        for proc in sleepers.values():
            proc.kill()
    print(f"runs each: {args.runs} (interleaved); load average {os.getloadavg()[0]:.1f}")
    base = statistics.median(took["empty book"])
    for name, values in took.items():
        median = statistics.median(values)
        print(f"submit to running, {name:26} median {median:.3f} s (min {min(values):.3f}, "
              f"max {max(values):.3f})  x{median / base:.3f} the empty book")
    if args.before is not None:
        before = statistics.median(took["empty book, --before"])
        print(f"ratio this checkout / --before (empty book)   {base / before:.3f} "
              "(target within 1.05)")
    print(f"ratio {args.leases} leases / empty book            "
          f"{statistics.median(took[names[1]]) / base:.3f} (target within 1.2)")
    print(f"GPUs freed to waiting rank running  median {statistics.median(freed):.3f} s "
          f"(min {min(freed):.3f}, max {max(freed):.3f}; target < 3 s)")
    print(f"... with 50 waiting jobs of 5 users     median {statistics.median(fair_freed):.3f} s "
          f"(min {min(fair_freed):.3f}, max {max(fair_freed):.3f}; target < 1 s)")
    order = queue_order()
    print(f"queue order of 1,000 waiting jobs      median {statistics.median(order) * 1e3:.2f} ms"
          f" (max {max(order) * 1e3:.2f}; target < 10 ms)")


if __name__ == "__main__":
    main()
