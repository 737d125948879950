"""The shared lease book under load (issue 20): submit-to-running with 50 live leases of
several users against an empty book (ratio), and the time from GPUs freeing to a waiting job's
rank running (target under 3 s).

Local backend, the lab server of issue 20 (2x A100 + 6x A6000) replayed by the stand-in
nvidia-smi. The 50 leases are files of 5 users (as root they are written and handed to uids
1001-1005, as those users' own claims would be) held by a live process, so every claim reads,
parses and checks the liveness of all of them. The waiting case: job A holds both A100s for
3 s, job B (``--wait``) wants them; measured from A's lease leaving the book to B's rank's first
statement (it writes ``time.time()``).

    python bench/shared_book.py [--runs 5]
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


def _fill(book: Path, holder: int, count: int = 50) -> None:
    host = book / os.uname().nodename
    host.mkdir(parents=True, exist_ok=True)
    start = int(Path(f"/proc/{holder}/stat").read_text().rsplit(")", 1)[1].split()[19])
    for n in range(count):
        uid = 1001 + n % 5
        path = host / f"other-{n}@{uid}.json"
        path.write_text(json.dumps({
            "job_id": f"other-{n}", "node": "localhost", "user": f"user{uid}", "uid": uid,
            "gpus": [], "slots": 0, "port": None, "holders": [[holder, start]],
            "since": time.time(), "left": []}))
        os.chown(path, uid, uid)


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


def free_to_running(env: dict[str, str], work: Path, runs: int) -> list[float]:
    book = Path(env["ORCHESTRATE_LEASES"]) / os.uname().nodename
    took = []
    for n in range(runs):
        holder, waiter = f"fa-{n}-{os.getpid()}", f"fb-{n}-{os.getpid()}"
        stamp = work / f"{waiter}.t"
        hold = work / "hold.yaml"
        hold.write_text("name: hold\nresources: {nodes: 1, gpus_per_node: 2, gpu_model: "
                        "A100-80GB}\ncommand: [sleep, '3']\n")
        wait = work / "wait.yaml"
        wait.write_text("name: wait\nresources: {nodes: 1, gpus_per_node: 2, gpu_model: "
                        f"A100-80GB}}\ncommand: [python3, -c, 'import time; open(\"{stamp}\", "
                        "\"w\").write(repr(time.time()))']\n")
        _cli(env, "submit", str(hold), "--detach", "--job-id", holder)
        _cli(env, "submit", str(wait), "--detach", "--job-id", waiter, "--wait")
        lease = next(book.glob(f"{holder}@*.json"))
        while lease.exists():
            time.sleep(0.005)
        freed = time.time()
        while not stamp.exists() or not stamp.read_text():
            time.sleep(0.01)
        took.append(float(stamp.read_text()) - freed)
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    bin_dir = fake_nvidia_smi(work / "bin", LAB)
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"), WORK=str(work),
               ORCHESTRATE_RUNS=str(work / "runs"), PATH=f"{bin_dir}:{os.environ['PATH']}")
    job = work / "job.yaml"
    job.write_text("name: s\nresources: {nodes: 1, gpus_per_node: 1}\ncommand: [sleep, '60']\n")
    holder = subprocess.Popen(["sleep", "3600"])
    try:
        empty = dict(env, ORCHESTRATE_LEASES=str(work / "empty"))
        full = dict(env, ORCHESTRATE_LEASES=str(work / "full"))
        _fill(work / "full", holder.pid)
        submit_to_running(empty, job, "warm", 1)
        a = submit_to_running(empty, job, "empty", args.runs)
        b = submit_to_running(full, job, "full", args.runs)
        c = free_to_running(empty, work, args.runs)
    finally:
        holder.kill()
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"runs each: {args.runs}")
    print(f"submit to running, empty book       median {ma:.3f} s (min {min(a):.3f}, "
          f"max {max(a):.3f})")
    print(f"submit to running, 50 live leases   median {mb:.3f} s (min {min(b):.3f}, "
          f"max {max(b):.3f})")
    print(f"ratio 50 leases / empty             {mb / ma:.3f}")
    print(f"GPUs freed to waiting rank running  median {statistics.median(c):.3f} s "
          f"(min {min(c):.3f}, max {max(c):.3f}; target < 3 s)")


if __name__ == "__main__":
    main()
