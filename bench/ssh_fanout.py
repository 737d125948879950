"""SSH fan-out: preflight plus the start of a trivial command on 1-16 hosts, against pdsh.

For each host count N (1, 2, 4, 8, 16 by default) it submits an SSH job whose command is
``true``, one rank per host, to hosts h1..hN of ``tests/clusters/sshhosts.sh`` (brought up
here if fewer are running), and measures, from the moment ``orchestrate submit --detach`` is
started:

- ``submit``: until the CLI returns (preflight done on every host, scripts copied);
- ``started``: until the last rank has started (its remote pid is known; from the job store);
- ``done``: until the job is COMPLETED (includes the final kill-by-tag sweep on every host).

and the wall time of ``pdsh -S -R ssh -w h[1-N]`` through the same ssh_config running bare
``true`` and running the same work as orchestrate's preflight and launch (PDSH_SAME_WORK). Runs are
interleaved (orchestrate and pdsh alternate, host counts in turn) so machine noise hits all
alike; medians of ``--runs`` (at least 5). Targets: ``started`` on 16 hosts at most 1.5x that on
1 host, and no longer than pdsh doing the same on 16 hosts.

    python bench/ssh_fanout.py [--runs 7] [--hosts 1 2 4 8 16] [--keep-hosts]

Root only (the test hosts are network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/ (this script's folder) is on sys.path
from testbeds import ROOT, ssh_hosts_down, ssh_hosts_up, ssh_inventory
from testbeds import SSH_STATE as STATE

sys.path.insert(0, str(ROOT))

from orchestrate.run.store import Store


def write_job(work: Path, count: int) -> Path:
    (work / f"inv{count}.json").write_text(json.dumps(ssh_inventory(count)))
    job = work / f"job{count}.yaml"
    job.write_text(f"name: fan{count}\nbackend: ssh\ninventory: inv{count}.json\n"
                   f"resources: {{nodes: {count}, gpus_per_node: 1}}\ncommand: [\"true\"]\n")
    return job


def run_orchestrate(work: Path, env: dict[str, str], job: Path, job_id: str
                    ) -> tuple[float, float, float]:
    store = Store(Path(env["ORCHESTRATE_HOME"]) / "jobs.db")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate", "submit", str(job), "--detach", "--job-id", job_id],
        cwd=work, env=env, capture_output=True, text=True,
    )
    submitted = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"submit {job_id} failed:\n{proc.stdout}\n{proc.stderr}")
    deadline = time.monotonic() + 120
    while True:
        record = store.get(job_id)
        if record is not None and record.terminal:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{job_id} did not finish: {record}")
        time.sleep(0.02)
    if record.state != "COMPLETED":
        raise SystemExit(f"{job_id} {record.state}: {record.reason}")
    started = max(r.started_at or 0.0 for r in record.ranks) - t0
    done = (record.finished_at or 0.0) - t0
    return submitted, started, done


#: What orchestrate's preflight does on every host before it starts the rank, as one command:
#: the interpreter starts, the working directory is checked, the master port is bind-tested and
#: the route towards the master looked up; then the trivial command runs. ``pdsh`` running this
#: is "pdsh doing the same"; ``pdsh ... true`` alone is the stricter floor.
PDSH_SAME_WORK = (
    f"{sys.executable} -S -c 'import os,socket,subprocess; assert os.path.isdir(\"/tmp\"); "
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
    "s.bind((\"\",29999)); s.close(); "
    "subprocess.run([\"ip\",\"-o\",\"route\",\"get\",\"198.18.8.11\"],"
    "stdout=subprocess.DEVNULL)' && bash -c true"
)


def run_pdsh(count: int, command: str = "true") -> float:
    env = dict(os.environ, PDSH_SSH_ARGS_APPEND=f"-F {STATE / 'ssh_config'}")
    hosts = f"h[1-{count}]" if count > 1 else "h1"
    start = time.perf_counter()
    proc = subprocess.run(["pdsh", "-S", "-R", "ssh", "-w", hosts, command], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"pdsh on {hosts} failed: {proc.stderr}")
    return took


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--keep-hosts", action="store_true", help="leave the hosts running")
    parser.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    args = parser.parse_args()
    runs = max(5, args.runs)
    started_hosts = ssh_hosts_up(max(args.hosts))
    work = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"))
    jobs = {n: write_job(work, n) for n in args.hosts}
    figures: dict[int, dict[str, list[float]]] = {
        n: {"submit": [], "started": [], "done": [], "pdsh": [], "pdsh_same": []}
        for n in args.hosts}
    try:
        for n in args.hosts:  # warm caches and the hosts' sshd once
            run_orchestrate(work, env, jobs[n], f"warm{n}")
            run_pdsh(n)
            run_pdsh(n, PDSH_SAME_WORK)
        for rep in range(runs):
            for n in args.hosts:
                pair = [("orchestrate", None), ("pdsh", None), ("pdsh_same", None)]
                if rep % 2:
                    pair.reverse()
                for kind, _ in pair:
                    if kind == "pdsh":
                        figures[n]["pdsh"].append(run_pdsh(n))
                    elif kind == "pdsh_same":
                        figures[n]["pdsh_same"].append(run_pdsh(n, PDSH_SAME_WORK))
                    else:
                        s, st, d = run_orchestrate(work, env, jobs[n], f"fan{n}-{rep}")
                        figures[n]["submit"].append(s)
                        figures[n]["started"].append(st)
                        figures[n]["done"].append(d)
            print(f"round {rep + 1}/{runs} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started_hosts and not args.keep_hosts:
            ssh_hosts_down()
    print(f"| hosts | submit returns | all ranks started | COMPLETED | pdsh -R ssh true "
          f"| started / pdsh | pdsh, same work | started / same |"
          f"   ({runs} runs, medians (min–max))")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.hosts:
        f = figures[n]
        ratio = statistics.median(f["started"]) / statistics.median(f["pdsh"])
        same = statistics.median(f["started"]) / statistics.median(f["pdsh_same"])
        print(f"| {n} | {median(f['submit'])} | {median(f['started'])} | {median(f['done'])} "
              f"| {median(f['pdsh'])} | {ratio:.2f} | {median(f['pdsh_same'])} | {same:.2f} |")
    first, last = min(args.hosts), max(args.hosts)
    scale = statistics.median(figures[last]["started"]) / statistics.median(
        figures[first]["started"])
    versus = statistics.median(figures[last]["started"]) / statistics.median(
        figures[last]["pdsh"])
    same_work = statistics.median(figures[last]["started"]) / statistics.median(
        figures[last]["pdsh_same"])
    print(f"\nstarted({last}) / started({first}) = {scale:.2f} (target <= 1.5); "
          f"started({last}) / pdsh true({last}) = {versus:.2f}; "
          f"started({last}) / pdsh same work({last}) = {same_work:.2f} (target <= 1.0)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
