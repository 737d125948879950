"""A rendezvous that cannot form is named within 60 s of submit (issue 33, item 2).

Before, a two-node SSH job whose nodes could not reach MASTER_ADDR passed every check, and its
ranks waited in the rendezvous until the job's timeout (the issue's newcomer cancelled at
631 s). Now preflight names it before anything starts. On the SSH test hosts
(``tests/clusters/sshhosts.sh``, brought up here if fewer than two run; root only), for each
case, ``--runs`` times (cases in turn, round after round), the seconds from ``submit`` to its
exit, and the line that names the cause:

- ``alias``: the inventory names the nodes by ssh_config aliases with no ``address:`` (what
  ``inventory probe`` wrote before), so MASTER_ADDR is a name no node resolves;
- ``wrong address``: ``distributed.master_addr`` is an address in the hosts' network that no
  host has (it resolves; nothing answers there);
- ``ok``: the same job with the probed addresses, to COMPLETED (the cost of the new check is
  inside its figure; ``reach_s`` in the job's timings is the check alone).

    python bench/rendezvous_named.py [--runs 3] [--keep-hosts]
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
from testbeds import ROOT, ssh_hosts, ssh_hosts_down, ssh_hosts_up
from testbeds import SSH_STATE as STATE

TARGET_S = 60.0
#: In the hosts' /24, held by no host (tests/backends/ssh/test_inventory_probe.py's NO_HOST).
NO_HOST = "198.18.8.99"

PROGRAM = """
import datetime, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
dist.barrier()
dist.destroy_process_group()
"""


def write_files(work: Path) -> dict[str, Path]:
    """The ssh_config with aliases, the inventories with and without addresses, the jobs."""
    (_, a1), (_, a2) = ssh_hosts(2)
    config = work / "ssh_config"
    config.write_text(
        f"Host gpu-a\n    HostName {a1}\nHost gpu-b\n    HostName {a2}\n"
        f"Host *\n    User root\n    IdentityFile {STATE / 'id_ed25519'}\n"
        f"    IdentitiesOnly yes\n    UserKnownHostsFile {STATE / 'known_hosts'}\n"
        "    GlobalKnownHostsFile /dev/null\n")
    (work / "ranks.py").write_text(PROGRAM)

    def inventory(name: str, addresses: bool) -> Path:
        nodes = [{"name": "gpu-a", "slots": 1}, {"name": "gpu-b", "slots": 1}]
        if addresses:
            nodes[0]["address"], nodes[1]["address"] = a1, a2
        data = {"name": name, "defaults": {"python": sys.executable,
                                           "ssh": {"config_file": str(config)}},
                "nodes": nodes}
        path = work / f"{name}.yaml"
        path.write_text(json.dumps(data))
        return path

    def job(name: str, inv: Path, extra: str = "") -> Path:
        path = work / f"job-{name}.yaml"
        path.write_text(f"name: {name}\nbackend: ssh\ninventory: {inv.name}\n"
                        "resources: {nodes: 2, gpus_per_node: all}\n"
                        f"command: [python, ranks.py]\n{extra}")
        return path

    with_addresses = inventory("probed", True)
    return {
        "alias": job("alias", inventory("aliases", False)),
        "wrong address": job("wrong", with_addresses, f"distributed: {{master_addr: {NO_HOST}}}\n"),
        "ok": job("ok", with_addresses),
    }


def submit(work: Path, env: dict[str, str], job: Path, job_id: str) -> tuple[float, int, str]:
    """Seconds from submit to its exit, its exit status, and the line naming the cause."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "submit", str(job), "--follow",
                           "--job-id", job_id], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    said = [line.strip() for line in (proc.stdout + proc.stderr).splitlines()
            if "master:" in line and line.strip().startswith("error:")]
    return took, proc.returncode, said[0] if said else ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep-hosts", action="store_true", help="leave the hosts running")
    args = parser.parse_args()
    started_hosts = ssh_hosts_up(2)
    work = Path(tempfile.mkdtemp(prefix="bench-rendezvous-"))
    env = dict(os.environ, ORCHESTRATE_HOME=str(work / "home"),
               ORCHESTRATE_RUNS=str(work / "runs"), PYTHONPATH=str(ROOT))
    jobs = write_files(work)
    times: dict[str, list[float]] = {case: [] for case in jobs}
    named: dict[str, str] = {}
    codes: dict[str, set[int]] = {case: set() for case in jobs}
    try:
        for rep in range(args.runs):
            for case, job in jobs.items():
                took, code, line = submit(work, env, job, f"rdv-{rep}-{len(times[case])}-"
                                          f"{case.replace(' ', '-')}")
                times[case].append(took)
                codes[case].add(code)
                named.setdefault(case, line)
            print(f"round {rep + 1}/{args.runs} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started_hosts and not args.keep_hosts:
            ssh_hosts_down()
    print(f"| case | submit to exit | exit | named as |   ({args.runs} runs, median (min-max))")
    print("|---|---|---|---|")
    for case, values in times.items():
        print(f"| {case} | {statistics.median(values):.1f} s ({min(values):.1f}-"
              f"{max(values):.1f}) | {sorted(codes[case])} | {named.get(case) or '-'} |")
    worst = max(max(times["alias"]), max(times["wrong address"]))
    print(f"\nslowest named failure: {worst:.1f} s (target <= {TARGET_S:.0f} s; before: the "
          "job's distributed timeout, 600 s by default)")


if __name__ == "__main__":
    main()
