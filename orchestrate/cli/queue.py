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
from typing import Any

import click

from orchestrate.cli.tables import console
from orchestrate.core.errors import UserError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--account", is_flag=True,
              help="(root) fold this machine's use into root's ledger first: run it every "
                   "minute from root's crontab")
def queue(as_json: bool, account: bool) -> None:
    """This machine's queue: running jobs, waiting jobs in the order they will start (each
    with its place and what it waits for), each user's decayed use and share, and the policy
    in force."""
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
    """The queue of this machine's book (``lease_dir``: its folder; None: the default)."""
    from orchestrate.hostside import fairshare
    from orchestrate.hostside.leases import BookError, LeaseBook, conflicts, held

    try:
        book = LeaseBook(lease_dir)
        with book.locked():
            leases = book.live()
            if account:
                fairshare.fold(book)
            tickets = book.tickets()
            use = fairshare.use(book)
    except BookError as exc:
        raise UserError.single(str(exc), source="lease book", field="leases",
                               hint=exc.hint or "see docs/shared-servers.md", setup=True) \
            from None
    now = time.time()
    holding = held(leases)
    waiting = []
    for place, ticket in enumerate(tickets, 1):
        ahead = [t for t in tickets[:place - 1] if conflicts(t, ticket)]
        waiting.append({
            "place": place, "job_id": ticket.job_id, "user": ticket.user, "uid": ticket.uid,
            "gpus": ticket.gpus, "slots": ticket.slots, "submitted_at": ticket.submitted_at,
            "waited_s": round(max(0.0, now - ticket.submitted_at), 1),
            "use": round(use.get(ticket.uid, 0.0), 1),
            "why": _why(ticket, ahead, holding, tickets, book.policy),
        })
    return {"host": os.path.basename(book.directory), "policy": book.policy.to_dict(),
            "running": [{"job_id": x.job_id, "user": x.user, "uid": x.uid, "gpus": x.gpus,
                         "slots": x.slots, "since": x.since} for x in leases],
            "waiting": waiting, "users": _users(use, leases, tickets),
            "problems": book.problems}


def _why(ticket: Any, ahead: list[Any], holding: dict[str, Any], tickets: list[Any],
         policy: Any) -> str:
    """What one waiting job waits for, in words."""
    from orchestrate.hostside.fairshare import why_late
    from orchestrate.hostside.leases import describe

    late = why_late(ticket, tickets, policy)
    if late:
        return late
    if ahead:
        return (f"behind {len(ahead)} job(s) that want the same GPUs or slots, first "
                f"{describe(ahead[0])}")
    busy = sorted(set(ticket.gpus) & set(holding["gpus"]))
    if busy and set(ticket.gpus) <= set(holding["gpus"]):
        who = sorted({holding["who"][str(g)] for g in busy})
        return "next: every GPU it may use is held, by " + ", ".join(who[:3])
    return "next: starts at its supervisor's next try (within a second)"


def _users(use: dict[int, float], leases: list[Any], tickets: list[Any]) -> list[dict[str, Any]]:
    from orchestrate.hostside.containment import user_name
    from orchestrate.hostside.fairshare import shares

    part = shares(use)
    uids = sorted(set(use) | {x.uid for x in leases} | {t.uid for t in tickets},
                  key=lambda uid: (use.get(uid, 0.0), uid))
    return [{"uid": uid, "user": user_name(uid), "use_gpu_hours": round(use.get(uid, 0.0) / 3600,
                                                                          3),
             "share": round(part.get(uid, 0.0), 4),
             "running": sum(x.uid == uid for x in leases),
             "waiting": sum(t.uid == uid for t in tickets)} for uid in uids]


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
                  f"{job['waited_s']:.0f}s: {job['why']}")
    for line in answer["problems"]:
        out.print(f"  problem: {line}")
