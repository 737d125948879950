"""``inventory probe`` over SSH: wall time for 1, 4 and 16 hosts (issue 15), ratio 16/1.

Hosts h1..hN of ``tests/clusters/sshhosts.sh`` (brought up here if fewer are running; root
only). For each host count it measures, interleaved (host counts in turn, round after round, so
machine noise hits all alike), medians of ``--runs``:

- ``cli``: ``orchestrate inventory probe h1 ... hN --ssh-config ... --python ...`` printing the
  inventory, from start to exit (interpreter start, imports, logins, the facts program on every
  host, parsing and writing);
- ``gather``: :func:`orchestrate.backends.ssh.probe.gather_over_ssh` alone, in this process
  (logins plus the program on every host): the part that grows with the host count;
- ``pdsh``: ``pdsh -R ssh`` running the same program on the same hosts through the same
  ssh_config: the floor for "every host at once" on this machine.

Hosts are probed concurrently, so 16 should take about as long as 1 (ratio near 1) where each
host has its own CPUs. Here all test hosts share this machine's CPUs: each host's gathering
costs ~0.3 CPU-seconds (interpreters, ``ip``, the torch lookup), so 16 hosts queue for the
cores; the pdsh column shows how much of the growth is that, and not the transport.

    python bench/probe_ssh.py [--runs 5] [--hosts 1 4 16] [--no-torch] [--keep-hosts]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# bench/ (this script's folder) is on sys.path
from testbeds import ROOT, ssh_hosts, ssh_hosts_down, ssh_hosts_up, ssh_settings
from testbeds import SSH_STATE as STATE

sys.path.insert(0, str(ROOT))

from orchestrate.backends.ssh.connections import Target, preload
from orchestrate.backends.ssh.probe import gather_over_ssh
from orchestrate.probe.gathering import (
    Unreachable,
    facts_argv,
    peers_of,
    shell_command,
)


def ssh_flags() -> list[str]:
    return ["--ssh-config", str(STATE / "ssh_config"), "--known-hosts",
            str(STATE / "known_hosts"), "--identity", str(STATE / "id_ed25519"),
            "--python", sys.executable]


def run_cli(names: list[str], torch: bool) -> float:
    argv = [sys.executable, "-m", "orchestrate", "inventory", "probe", *names, *ssh_flags()]
    if not torch:
        argv.append("--no-torch")
    start = time.perf_counter()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"probe of {len(names)} host(s) exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    return took


def run_gather(names: list[str], torch: bool) -> float:
    targets = [Target(name=n, address=n, python=sys.executable, **ssh_settings())
               for n in names]
    start = time.perf_counter()
    found = gather_over_ssh(targets, bound_s=120, torch=torch)
    took = time.perf_counter() - start
    failed = {n: g.reason for n, g in found.items() if isinstance(g, Unreachable)}
    if failed:
        raise SystemExit(f"hosts not probed: {failed}")
    return took


def run_pdsh(names: list[str], addresses: list[str], torch: bool) -> float:
    """The same program on the same hosts, through pdsh (peers: the first hosts' addresses)."""
    argv = facts_argv(sys.executable, peers_of(addresses[:len(names)], None), bound_s=120,
                      torch=torch)
    env = dict(os.environ, PDSH_SSH_ARGS_APPEND=f"-F {STATE / 'ssh_config'}")
    start = time.perf_counter()
    proc = subprocess.run(["pdsh", "-S", "-R", "ssh", "-w", ",".join(names),
                           shell_command(argv)], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    took = time.perf_counter() - start
    answered = [line for line in proc.stdout.splitlines() if '"hostname": ' in line]
    if proc.returncode != 0 or len(answered) != len(names):
        raise SystemExit(f"pdsh on {len(names)} host(s) failed: {proc.stderr[-2000:]}")
    return took


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--no-torch", action="store_true", help="do not look for torch")
    parser.add_argument("--keep-hosts", action="store_true", help="leave the hosts running")
    parser.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    args = parser.parse_args()
    torch = not args.no_torch
    started_hosts = ssh_hosts_up(max(args.hosts))
    hosts = ssh_hosts()
    names = [name for name, _ in hosts]
    addresses = [address for _, address in hosts]
    kinds = ("cli", "gather", "pdsh")
    figures: dict[int, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in args.hosts}
    load = os.getloadavg()[0]
    preload()
    try:
        for n in args.hosts:  # warm the hosts' sshd and the page cache once
            run_cli(names[:n], torch)
            run_gather(names[:n], torch)
            run_pdsh(names[:n], addresses, torch)
        for rep in range(args.runs):
            order = args.hosts if rep % 2 == 0 else list(reversed(args.hosts))
            for n in order:
                figures[n]["cli"].append(run_cli(names[:n], torch))
                figures[n]["gather"].append(run_gather(names[:n], torch))
                figures[n]["pdsh"].append(run_pdsh(names[:n], addresses, torch))
            print(f"round {rep + 1}/{args.runs} done", file=sys.stderr)
    finally:
        if started_hosts and not args.keep_hosts:
            ssh_hosts_down()
    print(f"| hosts | inventory probe (CLI) | gathering only | pdsh, same program |   "
          f"({args.runs} runs, medians (min–max), torch {'looked up' if torch else 'skipped'}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f} -> {os.getloadavg()[0]:.1f})")
    print("|---|---|---|---|")
    for n in args.hosts:
        print(f"| {n} | " + " | ".join(median(figures[n][k]) for k in kinds) + " |")
    first, last = min(args.hosts), max(args.hosts)
    for kind in kinds:
        ratio = statistics.median(figures[last][kind]) / statistics.median(figures[first][kind])
        print(f"{kind}: {last} hosts / {first} host = {ratio:.2f}")
    versus = statistics.median(figures[last]["gather"]) / statistics.median(
        figures[last]["pdsh"])
    print(f"gather / pdsh on {last} hosts = {versus:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
