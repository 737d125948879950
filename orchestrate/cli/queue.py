"""``orchestrate queue``: this machine's fair-share queue -- who runs, who waits and why, each
user's decayed use and share -- and, for root, the ledger that keeps that use.

A labmate whose job waits wants to know why, and when it will start; the admin wants to see
that the policy does what it says. Everything comes from the lease book
(:mod:`orchestrate.hostside.leases`) and its order (:mod:`orchestrate.hostside.fairshare`), read
under the book's lock like a claim, so what it shows is what the next claim will see. It
claims nothing. ``--account`` (root, from cron every minute) folds the machine's use into
root's ledger, which users cannot lower.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from orchestrate.cli.tables import console
from orchestrate.core.errors import UserError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--account", is_flag=True,
              help="(root) fold this machine's use into root's ledger first: run it every "
                   "minute from root's crontab")
@click.option("--inventory", "inventory_file", type=click.Path(path_type=Path), default=None,
              help="the queues of this inventory's SSH nodes, merged, instead of this machine's")
def queue(as_json: bool, account: bool, inventory_file: Path | None) -> None:
    """This machine's queue: running jobs, waiting jobs in the order they will start (each
    with its place and what it waits for), each user's decayed use and share, and the policy
    in force. Each waiting job's expected start is given where it can be known.

    With --inventory: every SSH node's queue, asked in parallel (a node that does not answer
    is named), merged: a multi-host job once, with its hosts and its place on each."""
    if inventory_file is not None:
        from orchestrate.core.queueing import merge

        merged = merge(over_ssh(inventory_file))
        if as_json:
            click.echo(json.dumps(merged, indent=2))
        else:
            show_merged(merged)
        return
    if account and os.geteuid() != 0:
        raise UserError.single("only root keeps the ledger (users could lower their own use)",
                               source="orchestrate queue", field="--account",
                               got=str(os.geteuid()),
                               hint="run it from root's crontab: * * * * * root orchestrate "
                                    "queue --account")
    answer = machine_queue(None, account)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    show(answer)


def machine_queue(lease_dir: str | None, account: bool = False) -> dict[str, Any]:
    """The queue of this machine's book (``lease_dir``: its folder; None: the default), each
    waiting job with its expected start."""
    from orchestrate.core.queueing import with_expected
    from orchestrate.hostside.leases import BookError
    from orchestrate.hostside.queueview import machine_queue as read

    try:
        return with_expected(read(lease_dir, account))
    except BookError as exc:
        raise UserError.single(str(exc), source="lease book", field="leases",
                               hint=exc.hint or "see docs/shared-servers.md", setup=True) \
            from None


def over_ssh(inventory_file: Path) -> list[dict[str, Any]]:
    """Each SSH node's queue, asked through its agent, in parallel, each bounded like any SSH
    step; a host that does not answer is ``{"host", "node", "no_answer": why}``."""
    from orchestrate.backends.ssh.probe import ask_agents
    from orchestrate.core.queueing import with_expected
    from orchestrate.core.spec.inventory import load_inventory

    if not inventory_file.exists():
        raise UserError.single("inventory file not found", source=str(inventory_file),
                               field="--inventory")
    hosts = []
    for told in ask_agents(load_inventory(inventory_file).nodes, "queue"):
        if told.value is not None and not told.value.get("no_answer"):
            hosts.append({**with_expected(told.value), "node": told.node})
            continue
        why = told.value["no_answer"] if told.value is not None else told.why
        hosts.append({"host": told.host, "node": told.node, "no_answer": why})
    return hosts


def show(answer: dict[str, Any]) -> None:
    """The queue as a person reads it."""
    out = console()
    policy = answer["policy"]
    out.print(f"{answer['host']}: order {policy['order']}, use halves every "
              f"{policy['half_life_s'] / 3600:g} h ({policy['source']})")
    if policy["problem"]:
        out.print(f"  {policy['problem']}")
    out.print("users (least use first):")
    for user in answer["users"]:
        out.print(f"  {user['user']:12} {user['use_gpu_hours']:10.2f} GPU-h  "
                  f"{user['share'] * 100:5.1f}%  running {user['running']}, "
                  f"waiting {user['waiting']}")
    out.print("running:" if answer["running"] else "running: none")
    for job in answer["running"]:
        since = time.strftime("%H:%M:%S", time.localtime(job["since"])) if job["since"] else "?"
        what = f"GPUs {job['gpus']}" if job["gpus"] else f"{job['slots']} CPU slots"
        out.print(f"  {job['job_id']:24} {job['user']:12} {what}, since {since}")
    out.print("waiting (in the order they start):" if answer["waiting"] else "waiting: none")
    for job in answer["waiting"]:
        out.print(f"  {job['place']:3}. {job['job_id']:24} {job['user']:12} waited "
                  f"{job['waited_s']:.0f}s: {job['why']}; {job['expected']['line']}",
                  markup=False, soft_wrap=True)
    for line in answer["problems"]:
        out.print(f"  problem: {line}")


def show_merged(merged: dict[str, Any]) -> None:
    """Several hosts' queues as one: each job once, with its hosts."""
    out = console()
    for host in merged["hosts"]:
        if host["no_answer"]:
            out.print(f"{host['node']}: no answer: {host['no_answer']}", markup=False,
                      soft_wrap=True)
            continue
        policy = host["policy"] or {}
        users = ", ".join(f"{u['user']} {u['use_gpu_hours']:.2f} GPU-h" for u in host["users"])
        out.print(f"{host['host']}: order {policy.get('order')} ({policy.get('source')}); "
                  f"use: {users or 'none'}", markup=False, soft_wrap=True)
        for line in [*([policy["problem"]] if policy.get("problem") else []),
                     *host["problems"]]:
            out.print(f"  problem: {line}", markup=False, soft_wrap=True)
    out.print("running:" if merged["running"] else "running: none")
    for job in merged["running"]:
        until = f", until {time.strftime('%H:%M', time.localtime(job['until']))}" \
            if job["until"] else ""
        out.print(f"  {job['job_id']:24} {job['user']:12} on {', '.join(job['hosts'])}{until}",
                  markup=False, soft_wrap=True)
    out.print("waiting (in the order they start):" if merged["waiting"] else "waiting: none")
    for job in merged["waiting"]:
        places = ", ".join(f"{h} #{p}" for h, p in job["places"].items())
        whys = sorted(set(job["why"].values()))
        out.print(f"  {job['job_id']:24} {job['user']:12} place {places}: {'; '.join(whys)}; "
                  f"{job['expected']['line']}", markup=False, soft_wrap=True)
    for line in merged["disagree"]:
        out.print(f"  hosts disagree: {line}", markup=False, soft_wrap=True)
