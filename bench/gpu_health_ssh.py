"""What the GPU health check adds to an SSH ``submit`` on 1, 4 and 16 hosts (issue #35): flat
with hosts, side by side with the check off.

Each SSH host gathers its GPUs' health inside the preflight the agent already runs (one
bounded ``nvidia-smi`` health query, then the kernel log), and the controller asks every host
at once (``ssh.fanout``), so the check should cost what it costs on one host, whatever the host
count. For each host count N it submits an N-node job (one GPU per node, gloo, command
``true``) to hosts h1..hN of ``tests/clusters/sshhosts.sh`` (brought up here if fewer run, and
taken down again when done: only those this script started), and times:

- ``submit --follow`` with ``ORCHESTRATE_GPU_HEALTH`` unset and ``=off`` (the check in every
  host's preflight, before the lease);
- with ``--doctor``, also ``doctor --tier health`` against ``--tier static`` on the same nodes
  (the doctor's tier, the other half of ``submit --preflight``; its exit status is not asked,
  as in bench/gpu_health.py: a CPU-only torch fails the static tier's GPU row, same timing).
  The static tier imports torch on every host: slow on a small machine, hence optional.

Interleaved (on, off, on, ... and the host counts in turn) so machine noise hits all alike;
medians (min, max) of ``--runs``; then the difference per host count (target: at most 0.3 s
added on one host, flat with hosts). Last, the gathering alone, on every host at once: the
longest a host took (gather() times itself) and the wall time until all had answered.

Without GPUs every host replays the lab server (tests/hostside/gpuhealth/healthy) through the
inventory's python wrapper, which puts the stand-in ``nvidia-smi``, ``dmesg`` and
``journalctl`` on PATH (each call starts a Python interpreter, ~30-60 ms, about a real query on
an 8-GPU box). With ``--real`` the hosts (network namespaces on this machine: they share its
GPUs and /dev) ask this machine's own ``nvidia-smi``, one GPU per node is GPU 0, and the
inventory names the model nvidia-smi reports. Root only (the test hosts are namespaces).

    python bench/gpu_health_ssh.py [--hosts 1 4 16] [--runs 5] [--doctor] [--real]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/ (this script's folder) is on sys.path
from testbeds import (
    ROOT,
    SSH_SCRIPT,
    SSH_STATE,
    ssh_hosts,
    ssh_hosts_down,
    ssh_hosts_up,
    ssh_settings,
)

sys.path.insert(0, str(ROOT))

from tests.support.fakesmi import replay_health
from tests.support.labserver import GPU_INVENTORY_NODE

SIDES = ("check on", "check off")


def real_gpus() -> list[dict[str, Any]]:
    """This machine's GPUs as an inventory node's ``gpus:`` (models named as jobs name them)."""
    from orchestrate.hostside.smi import query
    from orchestrate.hostside.smicsv import number, rows
    from orchestrate.probe.facts import normalise_model

    answer = query("gpu", ["index", "name", "memory.total"], 20.0)
    if answer["status"] != "ok":
        raise SystemExit(f"--real: nvidia-smi did not answer: {answer['error']}")
    models: dict[str, list[int]] = {}
    for row in rows(answer["text"] or "", ["index", "name", "memory.total"]):
        mib = number(row.get("memory.total"))
        model = normalise_model(row["name"], mib / 1024 if mib else None)
        models.setdefault(model, []).append(int(row["index"]))
    return [{"model": model, "indices": indices} for model, indices in models.items()]


def host_python(work: Path, real: bool) -> tuple[str, list[dict[str, Any]]]:
    """The hosts' python (without GPUs here: a wrapper putting the stand-ins on PATH) and the
    GPUs an inventory node lists."""
    if real:
        return sys.executable, real_gpus()
    bin_dir = replay_health(work / "sickbin", "healthy")
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper), GPU_INVENTORY_NODE["gpus"]


def write_jobs(work: Path, counts: list[int], python: str, gpus: list[dict[str, Any]]
               ) -> dict[int, Path]:
    """An inventory of the first N test hosts (each with its own lease book: they share this
    machine's /var/tmp) and a job using one GPU on each, per host count."""
    model = gpus[0]["model"]
    jobs = {}
    for count in counts:
        nodes = [{"name": name, "address": address, "gpus": gpus,
                  "lease_dir": str(work / "book" / name)}
                 for name, address in ssh_hosts(count)]
        inventory = {"name": "bench", "defaults": {"python": python, "ssh": ssh_settings()},
                     "nodes": nodes}
        (work / f"inv{count}.json").write_text(json.dumps(inventory))
        jobs[count] = work / f"job{count}.yaml"
        jobs[count].write_text(
            f"name: health{count}\nbackend: ssh\ninventory: inv{count}.json\n"
            f"resources: {{nodes: {count}, gpus_per_node: 1, gpu_model: {model}}}\n"
            "distributed: {backend: gloo}\ncommand: [\"true\"]\n")
    return jobs


def timed(argv: list[str], cwd: Path, env: dict[str, str], check: bool) -> float:
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return took


def submit(job: Path, work: Path, env: dict[str, str], tag: str) -> float:
    argv = [sys.executable, "-m", "orchestrate", "submit", str(job), "--follow",
            "--job-id", f"{tag}-{time.time_ns()}"]
    return timed(argv, work, env, check=True)


def doctor(job: Path, work: Path, env: dict[str, str], tier: str) -> float:
    argv = [sys.executable, "-m", "orchestrate", "doctor", str(job), "--tier", tier, "--json"]
    return timed(argv, work, env, check=False)


Figures = dict[str, dict[int, dict[str, list[float]]]]

#: What each host runs to time its own gathering (``seconds``: gather() times itself).
GATHER = ("import sys; sys.path.insert(0, {root!r}); "
          "from orchestrate.hostside.gpuhealth import gather; print(gather()['seconds'])")


def gather_everywhere(count: int, python: str) -> tuple[float, float]:
    """Every one of the first ``count`` hosts gathers its GPUs' health at once (one ssh each):
    the longest gathering a host timed, and the wall time until all had answered."""
    config = str(SSH_STATE / "ssh_config")
    command = f"{python} -S -c {shlex.quote(GATHER.format(root=str(ROOT)))}"
    started = time.monotonic()
    procs = [subprocess.Popen(["ssh", "-F", config, "-n", name, command], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, _ in ssh_hosts(count)]
    seconds = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"gathering over ssh failed: {err[-1000:]}")
        seconds.append(float(out.strip().splitlines()[-1]))
    return max(seconds), time.monotonic() - started


def measure(args: argparse.Namespace, work: Path, jobs: dict[int, Path],
            env: dict[str, str]) -> Figures:
    off = {**env, "ORCHESTRATE_GPU_HEALTH": "off"}
    parts: dict[str, Any] = {"submit --follow": lambda job, side, tag: submit(
        job, work, env if side == SIDES[0] else off, tag)}
    if args.doctor:
        parts["doctor (--tier health vs static)"] = lambda job, side, tag: doctor(
            job, work, env, "health" if side == SIDES[0] else "static")
    figures: Figures = {part: {n: {s: [] for s in SIDES} for n in args.hosts} for part in parts}
    for run in range(-1, args.runs):  # run -1 warms the page cache and every host's sshd
        for n in args.hosts:
            for part, call in parts.items():
                order = SIDES if run % 2 else SIDES[::-1]
                for side in order:
                    took = call(jobs[n], side, f"h{n}-{run + 1}")
                    if run >= 0:
                        figures[part][n][side].append(took)
        print(f"round {run + 2}/{args.runs + 1} done", file=sys.stderr)
    return figures


def report(figures: Figures, counts: list[int]) -> None:
    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    added = dict.fromkeys(counts, 0.0)
    for part, by_count in figures.items():
        print(f"\n{part}\n| hosts | check on | check off | added |\n|---|---|---|---|")
        for n in counts:
            on, off = by_count[n][SIDES[0]], by_count[n][SIDES[1]]
            diff = statistics.median(on) - statistics.median(off)
            added[n] += diff
            print(f"| {n} | {median(on)} | {median(off)} | {diff:+.2f} s |")
    first, last = min(counts), max(counts)
    print("\nadded by the check: " + ", ".join(f"{n} host(s) {added[n]:+.2f} s" for n in counts)
          + f" (target: <= 0.3 s on {first}, flat to {last})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--doctor", action="store_true", help="the doctor's tier too (slow)")
    parser.add_argument("--real", action="store_true", help="this machine's own nvidia-smi")
    parser.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    args = parser.parse_args()
    before = len(ssh_hosts())  # hosts someone else started stay up, as they were
    started_hosts = ssh_hosts_up(max(args.hosts))
    work = Path(tempfile.mkdtemp(prefix="bench-health-ssh-"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    load = os.getloadavg()[0]
    try:
        python, gpus = host_python(work, args.real)
        jobs = write_jobs(work, args.hosts, python, gpus)
        figures = measure(args, work, jobs, env)
        alone: dict[int, list[tuple[float, float]]] = {
            n: [gather_everywhere(n, python) for _ in range(args.runs)] for n in args.hosts}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started_hosts and before:
            subprocess.run(["bash", str(SSH_SCRIPT), "up", str(before)], check=False,
                           capture_output=True)  # h(before+1).. go, the rest stay
        elif started_hosts:
            ssh_hosts_down()
    print(f"{args.runs} runs each (interleaved), {os.cpu_count()} CPUs, load average "
          f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end, "
          f"{'real' if args.real else 'stand-in'} nvidia-smi")
    report(figures, args.hosts)
    print("\nthe gathering alone, on every host at once (one ssh each)\n"
          "| hosts | longest gathering on a host | all answered (ssh included) |\n|---|---|---|")
    for n, runs in alone.items():
        longest, wall = zip(*runs, strict=True)
        print(f"| {n} | {statistics.median(longest) * 1000:.0f} ms "
              f"({min(longest) * 1000:.0f}-{max(longest) * 1000:.0f}) "
              f"| {statistics.median(wall):.2f} s ({min(wall):.2f}-{max(wall):.2f}) |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
