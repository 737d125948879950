"""When a waiting job can be expected to start, and the queues of several hosts as one: pure
functions on the queue answers (:func:`orchestrate.hostside.queueview.machine_queue`).

A labmate whose job waits asks "when?". A running job's end is known only where it has a time
limit (``resources.time``: its lease's ``until``), so a start is promised only where every job
in the way has one, and only for a job whose turn is next: an upper bound ("<=", since a job
may end early), which holds unless a job that goes before it in the fair order is submitted
meanwhile. Elsewhere the answer says why it is unknown. A job that spans several SSH hosts
waits in the queue of each; ``orchestrate queue --inventory`` shows it once, with its hosts,
and says where two hosts order jobs differently (which the gang claim means to rule out).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

#: Added to a time limit for a lease's ``until``: the launch after the claim and the stop's
#: grace after the limit.
END_SLACK_S = 120.0


def ends_within_s(time_limit: str | None) -> float:
    """How long after its claim a job with this ``resources.time`` is over at the latest
    (0: not known, no limit)."""
    if not time_limit:
        return 0.0
    from orchestrate.core.spec.job import time_limit_seconds

    return time_limit_seconds(time_limit) + END_SLACK_S


def _clock(at: float) -> str:
    return time.strftime("%H:%M", time.localtime(at))


def _blockers(job: dict[str, Any], running: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The running jobs that hold what ``job`` may take (a CPU job: every slot holder)."""
    if job["gpus"]:
        return [r for r in running if set(r["gpus"]) & set(job["gpus"])]
    return [r for r in running if r["slots"] or not r["gpus"]]


def expected_start(job: dict[str, Any], running: list[dict[str, Any]], now: float
                   ) -> dict[str, Any]:
    """A waiting job's expected start on one host: ``{"at": seconds or None, "line": words}``.
    Known only when its turn is next (no waiting job ahead wants the same, no policy rule
    holds it) and every running job in its way has a time limit: then at the latest when the
    last of them reaches it."""
    if job.get("late"):
        return {"at": None, "line": "unknown (a policy rule puts it behind others)"}
    if job.get("ahead"):
        return {"at": None, "line": f"unknown ({job['ahead']} waiting job(s) go before it)"}
    blockers = _blockers(job, running)
    if not blockers:
        return {"at": now, "line": "now (nothing it may take is held by a job)"}
    open_ended = sorted(r["job_id"] for r in blockers if not r.get("until"))
    if open_ended:
        return {"at": None, "line": "unknown (jobs ahead have no time limit: "
                                    + ", ".join(open_ended[:3]) + ")"}
    last = max(blockers, key=lambda r: (r["until"], r["job_id"]))
    at = max(now, float(last["until"]))
    return {"at": at, "line": f"expected start <= {_clock(at)} (when job {last['job_id']} "
                              "reaches its time limit)"}


def with_expected(answer: dict[str, Any]) -> dict[str, Any]:
    """One host's queue answer with each waiting job's ``expected`` start."""
    now = float(answer.get("now") or 0.0)
    waiting = [{**job, "expected": expected_start(job, answer["running"], now)}
               for job in answer["waiting"]]
    return {**answer, "waiting": waiting}


def _key(job: dict[str, Any]) -> str:
    return f"{job['job_id']}@{job['uid']}"


def _gather(hosts: list[dict[str, Any]], part: str) -> dict[str, dict[str, Any]]:
    """Each job of ``part`` ("running", "waiting") once, with the hosts it is on."""
    jobs: dict[str, dict[str, Any]] = {}
    for host in hosts:
        for job in host.get(part) or []:
            merged = jobs.setdefault(_key(job), {"job_id": job["job_id"], "user": job["user"],
                                                 "uid": job["uid"], "hosts": {}})
            merged["hosts"][host["host"]] = job
    return jobs


def _expected(per_host: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A multi-host job starts when its last host frees: the latest host's expectation, and
    unknown where any host's is."""
    found = [job["expected"] for job in per_host.values() if "expected" in job]
    unknown = [e for e in found if e["at"] is None]
    if unknown or not found:
        return unknown[0] if unknown else {"at": None, "line": "unknown"}
    return max(found, key=lambda e: float(e["at"]))


def disagreements(hosts: list[dict[str, Any]]) -> list[str]:
    """Each pair of hosts that order two waiting jobs both wait on the other way round."""
    lines = []
    orders = [(h["host"], [_key(j) for j in h.get("waiting") or []]) for h in hosts]
    for index, (name, order) in enumerate(orders):
        for other, theirs in orders[index + 1:]:
            common = [k for k in order if k in theirs]
            their_order = [k for k in theirs if k in common]
            for first, second in itertools.pairwise(common):
                if their_order.index(first) > their_order.index(second):
                    lines.append(f"{name} puts {first} before {second}; {other} the other "
                                 "way round")
                    break
    return lines


def merge(hosts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several hosts' answers (each :func:`with_expected`; an unreachable one
    ``{"host", "node", "no_answer"}``) as one queue: each job once with its hosts, the
    waiting ones in the order of their places (first by their latest place on any host), and
    where hosts disagree."""
    answered = [h for h in hosts if not h.get("no_answer")]
    running = [{**job, "hosts": sorted(job["hosts"]),
                "until": max((j.get("until") or 0.0 for j in job["hosts"].values()), default=0.0)
                if all(j.get("until") for j in job["hosts"].values()) else 0.0}
               for job in _gather(answered, "running").values()]
    waiting = []
    for job in _gather(answered, "waiting").values():
        per_host = job["hosts"]
        waiting.append({**job, "hosts": sorted(per_host),
                        "places": {h: j["place"] for h, j in sorted(per_host.items())},
                        "why": {h: j["why"] for h, j in sorted(per_host.items())},
                        "expected": _expected(per_host)})
    waiting.sort(key=lambda j: (max(j["places"].values()), min(j["places"].values()),
                                j["uid"], j["job_id"]))
    return {"hosts": [{"host": h["host"], "node": h.get("node", h["host"]),
                       "no_answer": h.get("no_answer", ""),
                       "policy": h.get("policy"), "users": h.get("users", []),
                       "problems": h.get("problems", [])} for h in hosts],
            "running": sorted(running, key=lambda j: (j["job_id"], j["uid"])),
            "waiting": waiting, "disagree": disagreements(answered)}


__all__ = ["END_SLACK_S", "disagreements", "ends_within_s", "expected_start", "merge",
           "with_expected"]
