"""One machine's fair-share queue as one JSON-able answer: who runs (and until when, where a time
limit says), who waits in the order they will start and why, each user's decayed use and share.

``orchestrate queue`` shows it for this machine, and the SSH agent answers it for each host of
an inventory (``agent queue [LEASE_DIR]``), so one function reads the book, under its lock like a
claim: what it shows is what the next claim will see. It claims nothing. Standard library only,
Python 3.8+ (shipped with the SSH agent).
"""

from __future__ import annotations

import os
import time

from orchestrate.hostside.containment import user_name
from orchestrate.hostside.fairshare import fold, shares, why_late
from orchestrate.hostside.fairshare import use as fair_use
from orchestrate.hostside.leases import LeaseBook, conflicts, describe, held

TYPE_CHECKING = False  # typing costs milliseconds per start; the agent starts once per rank
if TYPE_CHECKING:
    from typing import Any

    from orchestrate.hostside.leaserecord import Lease, Ticket


def machine_queue(lease_dir: str | None, account: bool = False) -> dict[str, Any]:
    """The queue of this machine's book (``lease_dir``: its folder; None: the default);
    ``account``: fold the use into root's ledger first. Raises
    :class:`~orchestrate.hostside.leases.BookError`."""
    book = LeaseBook(lease_dir)
    with book.locked():
        leases = book.live()
        if account:
            fold(book)
        tickets = book.tickets()
        use = fair_use(book)
    now = time.time()
    holding = held(leases)
    waiting = []
    for place, ticket in enumerate(tickets, 1):
        ahead = [t for t in tickets[:place - 1] if conflicts(t, ticket)]
        late = why_late(ticket, tickets, book.policy)
        waiting.append({
            "place": place, "job_id": ticket.job_id, "user": ticket.user, "uid": ticket.uid,
            "gpus": ticket.gpus, "slots": ticket.slots, "submitted_at": ticket.submitted_at,
            "waited_s": round(max(0.0, now - ticket.submitted_at), 1),
            "use": round(use.get(ticket.uid, 0.0), 1), "ahead": len(ahead), "late": bool(late),
            "why": late or _why(ticket, ahead, holding),
        })
    return {"host": os.path.basename(book.directory), "now": now,
            "policy": book.policy.to_dict(),
            "running": [{"job_id": x.job_id, "user": x.user, "uid": x.uid, "gpus": x.gpus,
                         "slots": x.slots, "since": x.since, "until": x.until} for x in leases],
            "waiting": waiting, "users": _users(use, leases, tickets),
            "problems": book.problems}


def _why(ticket: Ticket, ahead: list[Ticket], holding: dict[str, Any]) -> str:
    """What one waiting job waits for, in words."""
    if ahead:
        return (f"behind {len(ahead)} job(s) that want the same GPUs or slots, first "
                f"{describe(ahead[0])}")
    busy = sorted(set(ticket.gpus) & set(holding["gpus"]))
    if busy and set(ticket.gpus) <= set(holding["gpus"]):
        who = sorted({holding["who"][str(g)] for g in busy})
        return "next: every GPU it may use is held, by " + ", ".join(who[:3])
    return "next: starts at its supervisor's next try (within a second)"


def _users(use: dict[int, float], leases: list[Lease], tickets: list[Ticket]
           ) -> list[dict[str, Any]]:
    part = shares(use)
    uids = sorted(set(use) | {x.uid for x in leases} | {t.uid for t in tickets},
                  key=lambda uid: (use.get(uid, 0.0), uid))
    return [{"uid": uid, "user": user_name(uid),
             "use_gpu_hours": round(use.get(uid, 0.0) / 3600, 3),
             "share": round(part.get(uid, 0.0), 4),
             "running": sum(x.uid == uid for x in leases),
             "waiting": sum(t.uid == uid for t in tickets)} for uid in uids]


__all__ = ["machine_queue"]
